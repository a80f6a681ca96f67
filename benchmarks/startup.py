"""Start-up profile: one preset launched twice as a user launches it (`colocate train`), first with a
fresh compile cache directory (`model.compile_cache_dir`: vLLM's, inductor's and Triton's caches),
then again with the cache the first run left; both runs' start-up timelines (`startup.json`:
seconds since the launch, each mark at the last rank to reach it) side by side, the phases of
the step-1 line (checks, engine, learner warm-up, waiting for the first batch, step 1), and the
launcher's own, launch -> `launch_checked` (`launcher_phases`: `startup.CHECK_PHASES`).

With `--baseline-tree DIR` (another commit's source tree: `git worktree add DIR COMMIT`, or an
export) the same preset runs from both trees, alternately, in one benchmark run: each tree cold (a
fresh cache of its own), then `--pairs` rounds of warm runs in the order base, ours, ours, base
(drift on the machine falls on both alike); the timelines side by side and ours over the base for
launch -> checks_done and launch -> end of step 1 (cold, and the median of the warm runs). A tree's
run starts in that tree (its own copy of the preset, relative paths from there) with that tree first
on PYTHONPATH. Without `--nproc` each run starts the processes its tree's preset fixes, so across a
change of topology the A/B compares the two presets as shipped: the record's `processes` says each
run's count, and a line says when the trees differ.

`--importtime` runs every process under `python -X importtime` (torchrun keeps each rank's stderr in a
file) and the record keeps each process's heaviest top-level imports: evidence of where a start's
imports go, not figures (the listing slows every import).

CPU: python scripts/benchmark.py --profile startup --config configs/cpu-tiny.yaml --steps 2
GPU: python scripts/benchmark.py --profile startup --config configs/gpu-1-gsm8k.yaml --steps 3
A/B: python scripts/benchmark.py --profile startup --config configs/cpu-tiny.yaml --steps 2 --baseline-tree /tmp/base
"""
from __future__ import annotations

import glob
import json
import os
import statistics
import subprocess
import tempfile
import time

from benchmarks.common import job_env, train_command
from colocate.startup import CHECK_PHASES, MARKS

RUNS = ("cold", "warm")
COMPARED = ("checks_done", "first_step_end")
"""The marks `--baseline-tree` compares (`since_command`): the launcher's checks, torchrun's start and
a rank's own start; and the whole start-up to the end of step 1."""
CLOCKED = tuple(m for m in MARKS if m != "rank_start")
"""The marks taken by a clock (`time.time`: the ranks', the launcher's `launch_checked`); `rank_start`
is the process's start as the tree computes it (an older tree: psutil's create_time, up to 1 s early), not comparable across trees."""


def add_args(parser) -> None:
    parser.add_argument("--config", default="configs/cpu-tiny.yaml")
    parser.add_argument("--nproc", type=int, default=0,
                        help="processes per run (default 0: the config's own count, as `colocate train` starts)")
    parser.add_argument("--steps", type=int, default=2, help="learner.num_steps of each run")
    parser.add_argument("--cache-dir", default="", help="the compile cache directory (default: a fresh temporary one)")
    parser.add_argument("--set", nargs="*", default=[],
                        help="extra config overrides, section.key=value (the leading -- may be left out)")
    parser.add_argument("--job-timeout-s", type=float, default=1800.0, help="a run taking longer is killed")
    parser.add_argument("--baseline-tree", default="",
                        help="a source tree of another commit (`git worktree add DIR COMMIT`); its runs alternate "
                             "with this tree's, and the record sets ours over it")
    parser.add_argument("--pairs", type=int, default=1,
                        help="with --baseline-tree: rounds of warm runs, each base, ours, ours, base")
    parser.add_argument("--importtime", action="store_true",
                        help="every process of each run under `python -X importtime` (slower: evidence, not "
                             "figures); the record keeps each one's heaviest top-level imports")


def launch(args, run_dir: str, cache_dir: str, tree: str = "") -> dict:
    """One `colocate train` run -> its startup.json record, with the command's wall time; `tree`:
    run another source tree's code (cwd and PYTHONPATH)."""
    cmd = train_command(args.config, args.nproc, [f"learner.num_steps={args.steps}", f"metrics.run_dir={run_dir}",
                                                  f"model.compile_cache_dir={cache_dir}", *args.set])
    log_path = f"{run_dir}.log"
    env = job_env(tree)
    if args.importtime:  # each rank's stderr (its import times) in a file of its own, under the run's -ranks/
        env["PYTHONPROFILEIMPORTTIME"] = "1"
        cmd += ["--log-dir", f"{run_dir}-ranks", "--redirects", "2"]
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.job_timeout_s,
                              cwd=os.path.abspath(tree) if tree else None, env=env)
    wall = time.time() - t0
    if proc.returncode != 0:
        with open(log_path) as f:
            raise RuntimeError(f"startup run failed (exit {proc.returncode}), log {log_path}:\n{f.read()[-3000:]}")
    with open(os.path.join(run_dir, "startup.json")) as f:
        record = json.load(f)
    with open(os.path.join(run_dir, "summary.json")) as f:
        record["phases"].update(step_figures(json.load(f)["timeline"], record["phases"]["step_1"]))
    if args.importtime:
        record["imports"] = {"launcher": heaviest_imports(log_path), **{
            f"local rank {os.path.basename(os.path.dirname(path))}": heaviest_imports(path)
            for path in sorted(glob.glob(os.path.join(f"{run_dir}-ranks", "*", "attempt_0", "*", "stderr.log")))}}
    return {**record, "since_command": since_command(record, t0), "command_wall_s": round(wall, 2), "log": log_path}


def heaviest_imports(path: str, top: int = 10) -> dict:
    """A `-X importtime` log -> its top-level imports' total and the `top` heaviest, cumulative ms
    (what a process imported at the top level, with everything each brought along; in the launcher's
    log its checking child's too, which it relays)."""
    cumulative = {}
    with open(path, errors="replace") as f:
        for line in f:
            fields = line.split("|")
            if line.startswith("import time:") and len(fields) == 3 and not fields[2].startswith("  "):
                if fields[1].strip().isdigit():  # the header's "cumulative" is not
                    cumulative[fields[2].strip()] = int(fields[1]) / 1000
    heaviest = sorted(cumulative.items(), key=lambda kv: -kv[1])[:top]
    return {"total_ms": round(sum(cumulative.values())), "heaviest_ms": {k: round(v) for k, v in heaviest}}


def since_command(record: dict, started: float) -> dict[str, float]:
    """Each clocked mark in seconds since this process started the command (`started`, unix): the
    same clock for any tree, whatever origin its own timeline counts from."""
    return {m: round(record["origin_unix"] + record["marks"][m] - started, 3) for m in CLOCKED if m in record["marks"]}


def step_figures(timeline: list[dict], step_1: float) -> dict:
    """The steady steps beside step 1: each later step's seconds (one step end to the next, as the
    step lines count), their median, and step 1's own time over it (the issue's "<= 2x")."""
    ends = [row["step_end"] for row in timeline]
    steady = [b - a for a, b in zip(ends, ends[1:])]
    if not steady:
        return {}
    median = statistics.median(steady)
    return {"median_step": round(median, 3), "step_1_over_median": round(step_1 / median, 2)}


def side_by_side(records: dict[str, dict]) -> list[str]:
    """The table: one row per mark and per phase, one column per run."""
    rows = [f"{'':28s}" + "".join(f"{name:>12s}" for name in records)]
    for section, label, keys in (("marks", "mark", MARKS), ("since_command", "command ->", CLOCKED),
                                 ("launcher_phases", "launcher", CHECK_PHASES),
                                 ("phases", "phase", ("checks", "engine", "learner_warmup", "first_batch_wait",
                                                      "step_1", "first_step", "median_step", "step_1_over_median"))):
        for key in keys:
            values = [records[name].get(section, {}).get(key) for name in records]
            if all(v is None for v in values):
                continue
            rows.append(f"{label + ' ' + key:28s}" + "".join(
                f"{v:>12.2f}" if isinstance(v, (int, float)) else f"{'-':>12s}" for v in values))
    return rows


def import_lines(records: dict[str, dict], top: int = 5) -> list[str]:
    """With --importtime: per run and process, its imports' total and the heaviest, in seconds."""
    return [f"[imports] {name} {who}: {got['total_ms'] / 1000:.2f} s; " + ", ".join(
                f"{module} {ms / 1000:.2f}" for module, ms in list(got["heaviest_ms"].items())[:top])
            for name, record in records.items() for who, got in record.get("imports", {}).items()]


def plan_runs(baseline_tree: str, pairs: int) -> list[tuple[str, str, str]]:
    """The runs in order -> [(record key, tree: "" for this one, cache name)]. Alone: cold, warm.
    With a baseline tree: each tree cold in its own fresh cache, then `pairs` rounds of warm runs
    base, ours, ours, base (a tree's warm runs reuse its cold run's cache); a repeated key gets #2, ..."""
    if not baseline_tree:
        return [("cold", "", "cache"), ("warm", "", "cache")]
    if pairs < 1:
        raise SystemExit(f"--pairs={pairs}: expected at least 1 round of warm runs")
    if not os.path.isfile(os.path.join(baseline_tree, "colocate", "cli.py")):
        raise SystemExit(f"--baseline-tree={baseline_tree}: no colocate/cli.py there (a source tree of this project "
                         "is expected: git worktree add DIR COMMIT)")
    order = [("base", "cold"), ("ours", "cold")] + [(who, "warm") for _ in range(pairs)
                                                    for who in ("base", "ours", "ours", "base")]
    seen: dict[str, int] = {}
    runs = []
    for who, kind in order:
        key = f"{who} {kind}"
        seen[key] = seen.get(key, 0) + 1
        runs.append((key if seen[key] == 1 else f"{key}#{seen[key]}", baseline_tree if who == "base" else "",
                     f"cache-{who}"))
    return runs


def compare(records: dict[str, dict]) -> dict[str, float]:
    """Ours over the base for each of `COMPARED`, in seconds since the command (below 1: ours starts
    faster): cold, and the median of each tree's warm runs; with the seconds they come from."""
    out = {}
    for kind in ("cold", "warm"):
        for mark in COMPARED:
            seconds = {}
            for who in ("ours", "base"):
                values = [r["since_command"][mark] for key, r in records.items()
                          if key.partition("#")[0] == f"{who} {kind}" and mark in r["since_command"]]
                if values:
                    seconds[who] = statistics.median(values)
            if len(seconds) == 2:
                out.update({f"{kind}_{mark}_{who}_s": round(v, 3) for who, v in seconds.items()})
                out[f"{kind}_{mark}_ours_over_base"] = round(seconds["ours"] / seconds["base"], 3)
    return out


def run(args) -> dict:
    root = tempfile.mkdtemp(prefix="colocate-startup-")
    runs = plan_runs(args.baseline_tree, args.pairs)
    # alone: the given cache directory as it is; beside a baseline, one folder in it per tree
    caches = {cache: (os.path.join(args.cache_dir or root, cache) if args.baseline_tree else
                      args.cache_dir or os.path.join(root, cache)) for _, _, cache in runs}
    records = {}
    for key, tree, cache in runs:
        cache_dir = caches[cache]
        records[key] = launch(args, os.path.join(root, key.replace(" ", "-").replace("#", "_")), cache_dir, tree)
        print(f"[startup] {key}: checks_done {records[key]['marks'].get('checks_done')} s, first_step_end "
              f"{records[key]['marks'].get('first_step_end')} s", flush=True)
    for line in side_by_side(records):
        print(line)
    for line in import_lines(records):
        print(line)
    figures = {f"{name.replace(' ', '_')}_{key}": value for name, record in records.items()
               for key, value in record["phases"].items()}
    figures.update({f"{name.replace(' ', '_')}_launcher_{key}": value for name, record in records.items()
                    for key, value in record.get("launcher_phases", {}).items()})
    figures.update({f"{name.replace(' ', '_')}_command_wall_s": record["command_wall_s"]
                    for name, record in records.items()})
    processes = {name: len(record.get("ranks", {})) for name, record in records.items()}
    if len(set(processes.values())) > 1:
        print(f"[startup] the runs started different process counts (each tree's preset): {processes}", flush=True)
    result = {"config": args.config, "nproc": args.nproc, "steps": args.steps, "cache_dir": ", ".join(caches.values()),
              "baseline_tree": args.baseline_tree, "processes": processes, "figures": figures, "timelines": records}
    if args.baseline_tree:
        result["ratios"] = compare(records)
    return result
