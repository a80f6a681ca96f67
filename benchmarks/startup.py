"""Start-up profile: one preset launched twice as a user launches it (`colocate train`), first with a
fresh compile cache directory (`model.compile_cache_dir`: vLLM's, inductor's and Triton's caches),
then again with the cache the first run left; both runs' start-up timelines (`startup.json`:
seconds since the launch, each mark at the last rank to reach it) side by side, and the phases of
the step-1 line (checks, engine, learner warm-up, waiting for the first batch, step 1).

CPU: python scripts/benchmark.py --profile startup --config configs/cpu-tiny.yaml --steps 2
GPU: python scripts/benchmark.py --profile startup --config configs/gpu-1-gsm8k.yaml --nproc 2 --steps 3
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from colocate.startup import MARKS

RUNS = ("cold", "warm")


def add_args(parser) -> None:
    parser.add_argument("--config", default="configs/cpu-tiny.yaml")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="learner.num_steps of each run")
    parser.add_argument("--cache-dir", default="", help="the compile cache directory (default: a fresh temporary one)")
    parser.add_argument("--set", nargs="*", default=[],
                        help="extra config overrides, section.key=value (the leading -- may be left out)")
    parser.add_argument("--job-timeout-s", type=float, default=1800.0, help="a run taking longer is killed")


def launch(args, run_dir: str, cache_dir: str) -> dict:
    """One `colocate train` run -> its startup.json record, with the command's wall time."""
    cmd = [sys.executable, "-m", "colocate.cli", "train", f"--nproc={args.nproc}", "--config", args.config,
           f"--learner.num_steps={args.steps}", f"--metrics.run_dir={run_dir}",
           f"--model.compile_cache_dir={cache_dir}", *("--" + o.removeprefix("--") for o in args.set)]
    log_path = f"{run_dir}.log"
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.job_timeout_s)
    wall = time.time() - t0
    if proc.returncode != 0:
        with open(log_path) as f:
            raise RuntimeError(f"startup run failed (exit {proc.returncode}), log {log_path}:\n{f.read()[-3000:]}")
    with open(os.path.join(run_dir, "startup.json")) as f:
        record = json.load(f)
    with open(os.path.join(run_dir, "summary.json")) as f:
        record["phases"].update(step_figures(json.load(f)["timeline"], record["phases"]["step_1"]))
    return {**record, "command_wall_s": round(wall, 2), "log": log_path}


def step_figures(timeline: list[dict], step_1: float) -> dict:
    """The steady steps beside step 1: each later step's seconds (one step end to the next, as the
    step lines count), their median, and step 1's own time over it (the issue's "<= 2x")."""
    ends = [row["step_end"] for row in timeline]
    steady = sorted(b - a for a, b in zip(ends, ends[1:]))
    if not steady:
        return {}
    median = steady[len(steady) // 2] if len(steady) % 2 else (steady[len(steady) // 2 - 1] + steady[len(steady) // 2]) / 2
    return {"median_step": round(median, 3), "step_1_over_median": round(step_1 / median, 2)}


def side_by_side(records: dict[str, dict]) -> list[str]:
    """The table: one row per mark and per phase, one column per run."""
    rows = [f"{'':26s}" + "".join(f"{name:>10s}" for name in records)]
    for section, keys in (("marks", MARKS), ("phases", ("checks", "engine", "learner_warmup", "first_batch_wait",
                                                        "step_1", "first_step", "median_step",
                                                        "step_1_over_median"))):
        for key in keys:
            values = [records[name][section].get(key) for name in records]
            if all(v is None for v in values):
                continue
            rows.append(f"{section[:-1] + ' ' + key:26s}" + "".join(
                f"{v:>10.2f}" if isinstance(v, (int, float)) else f"{'-':>10s}" for v in values))
    return rows


def run(args) -> dict:
    root = tempfile.mkdtemp(prefix="colocate-startup-")
    cache_dir = args.cache_dir or os.path.join(root, "cache")
    records = {name: launch(args, os.path.join(root, name), cache_dir) for name in RUNS}
    for line in side_by_side(records):
        print(line)
    figures = {f"{name}_{key}": value for name, record in records.items()
               for key, value in record["phases"].items()}
    figures.update({f"{name}_command_wall_s": record["command_wall_s"] for name, record in records.items()})
    return {"config": args.config, "nproc": args.nproc, "steps": args.steps, "cache_dir": cache_dir,
            "figures": figures, "timelines": records}
