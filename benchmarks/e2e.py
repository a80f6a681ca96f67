"""End-to-end profile: the same training job asynchronous (max_policy_lag L) and synchronous
(max_policy_lag=0), back to back in one benchmark run; seconds per step, steps/hour, learner and
inference busy fractions, NVML GPU utilization, out tokens/s per engine and in all, policy lag.

Steady state only: the first `--warmup` steps of each job (engine start-up is before step 0; step 0
also waits for the first rollout, which no overlap can hide) are left out. From the per-step
timeline of learner rank 0 (`summary.json`) and the per-batch records of each inference rank
(`inference-rank<r>.json`), in unix seconds:
  window            end of step warmup-1 -> end of the last step (learner rank 0's clock)
  seconds_per_step  window / (steps - warmup)
  learner busy      time inside `train_step` in the window / window
  inference busy    time inside `collect` (playing games) in the window / window, mean over ranks
  NVML busy         mean `nvmlDeviceGetUtilizationRates().gpu` sampled every `metrics.nvml_interval_s`
                    in the window, on the first GPU of each role (a pending NCCL send spins and
                    counts as busy: the learner's figure is the timeline's)
  adapter ms        learner rank 0's gather of the full adapter and its send, per step
  rollout_*         means over the batches collected inside the window (both inference ranks):
                    engine polls, requests per poll, poll and request latency, generate fraction, the time
                    a rank waited for an adapter version (`wait_version_s`) or for its sends
  rollout_step_ms   collect time per engine step (vLLM counts its steps), and rollout_tokens_per_step
                    the answer tokens one step decoded: at 0.5B a step's host time grows with it, so
                    more games in play at once do not shorten a batch (profiles/README.md)
  queue_batches_*   batches the inference ranks had finished and the learners not yet trained, at the
                    window's start and end (mean over ranks). Equal in a steady state; a drop means the
                    window drained a backlog built before it (with `config.sampling_lag` >= 2 the
                    inference ranks can run ahead during warm-up), and seconds_per_step is then faster
                    than the steady state.
  canary_*          the sync canary's own cost in the window (`canary_figures`): the probes the learner
                    scored (riding a step's first forward, `canary_rode`: no time of their own; with LoRA
                    dropout a forward of their own), and mean and median ms of each side's time on one
                    probe, the learner's forward of its own
                    (`sync/canary_learner_ms`, the timeline's canary_s: host time to queue the forward;
                    on a GPU its kernels run later, in the next step's time; learner_device: their
                    device time, CUDA events read a step later, `canary_device_ms`) and the engines'
                    (`sync/canary_ms`, kept in the record of the batch that read it: the window's
                    batches, as for rollout_*; queueing and waiting for it); only the counts (0) when
                    it is off.

Parity figures (`parity_figures`): a cost paid every other step, measured inside one job, free of the
job-to-job noise (each job starts its own vLLM): with `sync.canary_every=2` only even versions are probed.
Over the measured steps, per quantity X: the means of its even and odd values (X_even_mean, X_odd_mean,
with counts _n), their difference X_even_minus_odd with Welch's standard error sqrt(var_e/n_e + var_o/n_o)
(_se), and X_parity_gap_frac: that difference (and its SE) over X's mean over all of them. X is
  step_s            each measured step's seconds, from the step before's step_end to its own (their mean is
                    seconds_per_step), by the version the step probes: timeline row s starts from version s,
                    whose probe rides its first forward (`canary_rode`), and sends s+1 (with LoRA dropout
                    the probe of s+1 gets a forward of its own after the send): even = probed
  train_s           each measured step's train time (the timeline's train_end - train_start), keyed as
                    step_s: a probe riding the first forward costs the learner its gap here, apart from
                    the wait for the batch that pays a longer step back on one GPU
  rollout_collect_s each window batch's collect seconds, and rollout_step_ms its ms per engine step, by the
                    version that sampled it (the batch record's `version`): even = probed (vLLM runs the
                    probe beside the batch; an engine that scores at once, HF's, before it: only step_s sees it)
Arithmetic: a cost c at each probed step and none at the others makes that parity's mean c larger; every=1
pays c at every step, so |gap_frac| = c / mean step is its cost fraction f (low by a relative f/2: the every=2
mean holds c/2; f as on/off - 1). Caveat: which parity pays depends on the side (the learner's probe of version
v is in the step that starts from v; the engine's lengthens batch v, trained at step v + `config.sampling_lag`, which
sends v + lag + 1: even for lag 1, as on gpu-1-gsm8k) and on one GPU's overlap, and costs on opposite parities
cancel: compare the signed gap with a canary_every=0 job's (0 within its SE). The SE takes steps as
independent; a step that ends late shortens the next, so it understates.
Every counted job's JOB_X_parity_gap_frac and _se go into the figures, e.g. from --order async+two,async+zero
--variant two:sync.canary_every=2 zero:sync.canary_every=0.

A job ending in @warm (put first) runs to warm the machine (vLLM's and inductor's compile caches, the GPU's
clocks) and is left out of the figures, the ratios and the pairs: its record is under "warm".

Paired ratios (`paired_figures`), for a close comparison of two jobs (the canary on and off): when the
counted jobs of --order are two jobs alternating, e.g. A,B,B,A,A,B, the runs pair up in order, two by
two: (A1,B1), (B2,A2), (A3,B3); each pair's seconds_per_step A over B, their mean and standard error,
and the pooled ratio (mean over A's paired runs over mean over B's) go into the figures. A pair whose
other run failed is left out; an odd last run has no pair. Adjacent runs share the machine's drift.
CPU smoke: python scripts/benchmark.py --profile e2e --config configs/cpu-tiny.yaml --nproc 2 --steps 30
GPU (4 GPUs, 2 + 2): python3 scripts/benchmark.py --profile e2e --config configs/gpu-4.yaml --nproc 4 \
    --steps 6 --warmup 2 --partial $OUT/e2e-partial.json
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import tempfile
import time

from benchmarks.common import job_env, train_command
from colocate.learner.step_report import TimelineRow


def add_args(parser) -> None:
    parser.add_argument("--config", default="configs/cpu-tiny.yaml")
    parser.add_argument("--nproc", type=int, default=0,
                        help="processes per job; 0: what `colocate train` starts for the job's config (inference + "
                             "learner ranks where it fixes both, so a variant may set topology.num_inference; "
                             "else this machine's GPU count, at least 2)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=2, help="steps of each job left out of the figures")
    parser.add_argument("--lag", type=int, default=None,
                        help="max_policy_lag of the async jobs (default: the config's; the GPU presets oversample, "
                             "which needs >= 2)")
    parser.add_argument("--order", default="async,sync",
                        help="which jobs run, in this order: async, sync, each optionally -stream or -barrier "
                             "(rollout.stream on / off; plain: the config's), then any +VARIANT (see --variant), "
                             "e.g. async-stream,async-stream+nocheck; a job may repeat (A,B,B,A: its later "
                             "runs are keyed JOB#2, ...; two jobs alternating are also compared pair by pair); "
                             "a job ending in @warm (e.g. async+on@warm first) warms the machine: compile "
                             "caches, GPU clocks; it is left out of the figures, ratios and pairs")
    parser.add_argument("--baseline-tree", default="",
                        help="a source tree of another commit (e.g. `git archive`); a job ending in @base runs "
                             "from it, so the same job compares two versions of the code in one run")
    parser.add_argument("--job-timeout-s", type=float, default=3600.0, help="a job running longer is killed")
    parser.add_argument("--partial", default="", help="also write the record here after each job")
    parser.add_argument("--set", nargs="*", default=[],
                        help="extra config overrides, section.key=value (the leading -- may be left out)")
    parser.add_argument("--stream-set", nargs="*", default=[],
                        help="overrides for the -stream jobs only (e.g. engine.max_num_batched_tokens=1024)")
    parser.add_argument("--variant", nargs="*", default=[],
                        help="named overrides for jobs ending in +NAME: NAME:section.key=value[,section.key=value], "
                             "e.g. nocheck:engine.validate_grammars=false")


def parse_variants(specs: list[str]) -> dict[str, list[str]]:
    """['name:a.b=1,c.d=2', ...] -> {'name': ['a.b=1', 'c.d=2']}."""
    out = {}
    for spec in specs:
        name, sep, settings = spec.partition(":")
        items = [s.strip() for s in settings.split(",") if s.strip()]
        if not sep or not name or not items or not all("=" in s for s in items):
            raise SystemExit(f"--variant: {spec!r} is not NAME:section.key=value[,section.key=value]")
        out[name] = items
    return out


def job_settings(job: str, async_lag: int | None, stream_set: list[str] = (),
                 variants: dict[str, list[str]] | None = None) -> tuple[int | None, list[str]]:
    """'async' | 'sync', optionally '-stream' / '-barrier', then '+NAME'... -> (max_policy_lag, extra
    settings); lag None keeps the config's. A sync job also turns oversampling off (a group carried
    to the next batch would be one version too old). A variant's settings come last, so they may
    override the lag too."""
    head, *names = job.partition("@")[0].split("+")
    base, _, variant = head.partition("-")
    if base not in ("async", "sync") or variant not in ("", "stream", "barrier"):
        raise SystemExit(f"--order: unknown job {job!r}; choose from async, sync, each optionally -stream or -barrier")
    unknown = [n for n in names if n not in (variants or {})]
    if unknown:
        raise SystemExit(f"--order: job {job!r} names variant(s) {unknown} that no --variant defines")
    # a barrier job gets vLLM's default prefill chunk: the presets' small one is tuned for streaming
    extra = {"": [], "stream": ["rollout.stream=true", *stream_set],
             "barrier": ["rollout.stream=false", "engine.max_num_batched_tokens=0"]}[variant]
    if base == "sync":
        extra = [*extra, "rollout.oversample_groups=0"]
    for n in names:
        extra = [*extra, *variants[n]]
    return (async_lag if base == "async" else 0), extra


def job_command(args, lag: int | None, run_dir: str, extra: list[str] = ()) -> list[str]:
    """`colocate train` for one job (`train_command`): the job's steps, lag, run directory and
    overrides, the variant's last."""
    return train_command(args.config, args.nproc, [f"learner.num_steps={args.steps}",
                                                   *([] if lag is None else [f"learner.max_policy_lag={lag}"]),
                                                   f"metrics.run_dir={run_dir}", *args.set, *extra])


def run_job(args, lag: int | None, run_dir: str, extra: list[str] = (), tree: str = "") -> dict:
    """One job of the config as a user starts it (`colocate train`: the checks, then torchrun);
    `tree`: run another source tree's code (cwd and PYTHONPATH)."""
    env = job_env(tree)
    cmd = job_command(args, lag, run_dir, extra)
    t0 = time.time()
    log_path = os.path.join(os.path.dirname(run_dir), f"{os.path.basename(run_dir)}.log")
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.job_timeout_s,
                              cwd=os.path.abspath(tree) if tree else None, env=env)
    if proc.returncode != 0:
        with open(log_path) as f:
            raise RuntimeError(f"e2e run (lag {lag}) failed, log {log_path}:\n{f.read()[-3000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    inference = []
    for name in sorted(os.listdir(run_dir)):
        if name.startswith("inference-rank") and name.endswith(".json"):
            with open(os.path.join(run_dir, name)) as f:
                inference.append(json.load(f))
    return {**steady_state(summary, inference, args.warmup), "job_wall_s": time.time() - t0,
            "dropped_stale": summary["dropped_stale"], "reward_end": summary["reward_end"],
            "world_size": summary.get("world_size"), "num_inference": summary.get("num_inference")}


def overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def steady_state(summary: dict, inference: list[dict], warmup: int) -> dict:
    """The module docstring's figures from the role loops' timelines."""
    rows = [TimelineRow(**row) for row in summary["timeline"]]
    if len(rows) <= warmup:
        raise ValueError(f"{len(rows)} steps ran; need more than --warmup {warmup}")
    t0 = rows[warmup - 1].step_end if warmup > 0 else rows[0].wait_start
    t1 = rows[-1].step_end
    window = max(t1 - t0, 1e-9)
    measured = rows[warmup:]

    def nvml_mean(samples: list) -> float | None:
        inside = [u for t, u in samples if t0 <= t <= t1]
        return sum(inside) / len(inside) / 100 if inside else None

    def inside(b: dict) -> float:
        return overlap(b["collect_start"], b["collect_end"], t0, t1)

    batches = window_batches(inference, t0, t1)
    means = rollout_means(batches)
    busy = [sum(inside(b) for b in r["batches"]) / window for r in inference]
    tokens = [sum(b["out_tokens"] * inside(b) / max(b["collect_end"] - b["collect_start"], 1e-9)
                  for b in r["batches"]) / window for r in inference]
    return {
        "seconds_per_step": window / len(measured),
        "steps_per_hour": 3600 * len(measured) / window,
        "measured_steps": len(measured),
        "learner_busy_fraction": sum(r.train_end - r.train_start for r in measured) / window,
        "learner_train_s_mean": sum(r.train_end - r.train_start for r in measured) / len(measured),
        "learner_wait_s_mean": sum(r.train_start - r.wait_start for r in measured) / len(measured),
        "inference_busy_fraction": sum(busy) / max(len(busy), 1),
        "rollout_out_tokens_per_s_per_engine": sum(tokens) / max(len(tokens), 1),
        "rollout_out_tokens_per_s_all_engines": sum(tokens),  # rollout_out_tokens_per_s: the batches' own
        "learner_nvml_busy": nvml_mean(summary.get("gpu_util", [])),
        "inference_nvml_busy": next((v for v in (nvml_mean(r.get("gpu_util", [])) for r in inference)
                                     if v is not None), None),
        "policy_lag_mean": sum(r.policy_lag for r in measured) / len(measured),
        "adapter_gather_ms_mean": 1e3 * sum(r.gather_s for r in measured) / len(measured),
        "adapter_send_ms_mean": 1e3 * sum(r.send_s for r in measured) / len(measured),
        "queue_batches_start": queued(rows, inference, t0),
        "queue_batches_end": queued(rows, inference, t1),
        **means,
        **per_engine_step(means),
        **canary_figures(measured, batches),
        **parity_figures("step_s", step_seconds(rows, warmup, t0)),
        **parity_figures("train_s", [(v, r.train_end - r.train_start)
                                     for (v, _), r in zip(step_seconds(rows, warmup, t0), rows[warmup:])]),
        **batch_parity(batches),
    }


def step_seconds(rows: list[TimelineRow], warmup: int, t0: float) -> list[tuple[int, float]]:
    """(the version the step probes, seconds) of each measured step, from the end of the step before
    (t0 for the first): timeline row s starts from version s and sends s + 1; the probe rides its
    forward (version s) or, in a run with LoRA dropout (no row rode), follows the send (s + 1)."""
    ends = [t0, *(r.step_end for r in rows[warmup:])]
    after = 0 if any(r.canary_rode for r in rows) else 1
    return [(warmup + i + after, b - a) for i, (a, b) in enumerate(zip(ends, ends[1:]))]


def batch_parity(batches: list[dict]) -> dict:
    """The window batches' parity figures by the version that sampled them (none from records that
    keep no version: a baseline tree's)."""
    kept = [b for b in batches if "version" in b and "collect_s" in b]
    return {**parity_figures("rollout_collect_s", [(b["version"], b["collect_s"]) for b in kept]),
            **parity_figures("rollout_step_ms", [(b["version"], 1e3 * b["collect_s"] / b["steps"])
                                                 for b in kept if b.get("steps")])}


def parity_figures(name: str, keyed: list[tuple[int, float]]) -> dict:
    """(step or version, value) pairs -> the module docstring's parity figures for `name`; {} with
    fewer than two values of either parity (no variance)."""
    even = [v for k, v in keyed if k % 2 == 0]
    odd = [v for k, v in keyed if k % 2 == 1]
    if len(even) < 2 or len(odd) < 2:
        return {}
    gap = statistics.fmean(even) - statistics.fmean(odd)
    se = math.sqrt(statistics.variance(even) / len(even) + statistics.variance(odd) / len(odd))
    mean = statistics.fmean(even + odd)
    return {f"{name}_even_mean": statistics.fmean(even), f"{name}_odd_mean": statistics.fmean(odd),
            f"{name}_even_n": len(even), f"{name}_odd_n": len(odd),
            f"{name}_even_minus_odd": gap, f"{name}_even_minus_odd_se": se,
            f"{name}_parity_gap_frac": gap / mean, f"{name}_parity_gap_frac_se": se / mean}


def canary_figures(measured: list[TimelineRow], batches: list[dict]) -> dict:
    """The canary's probes in the window, the learner's (`canary_probes`, one per version it scored)
    and the engines' (`canary_engine_probes`, every inference rank's), and the mean and median ms
    of each side's own time on one probe; no ms without a probe (the canary off, or a baseline
    tree's run that kept no such figures)."""
    sides = {"learner": [1e3 * r.canary_s for r in measured if r.canary_s > 0],
             "learner_device": [r.canary_device_ms for r in measured if r.canary_device_ms > 0],
             "engine": [b["canary_ms"] for b in batches if "canary_ms" in b]}
    out = {"canary_probes": len(sides["learner"]) + sum(r.canary_rode for r in measured),
           "canary_engine_probes": len(sides["engine"])}
    for side, ms in sides.items():
        if ms:
            out.update({f"canary_{side}_ms_mean": statistics.fmean(ms), f"canary_{side}_ms_median": statistics.median(ms)})
    return out


def per_engine_step(means: dict) -> dict:
    """Collect ms and answer tokens per engine step, from the window's means (a ratio of means over
    the same batches is the ratio of their sums); none when the engine counts no steps."""
    steps = means.get("rollout_steps", 0.0)
    if not steps:
        return {}
    return {"rollout_step_ms": 1e3 * means["rollout_collect_s"] / steps,
            "rollout_tokens_per_step": means["rollout_out_tokens"] / steps}


def queued(rows: list[TimelineRow], inference: list[dict], t: float) -> float:
    """Batches finished by the inference ranks (mean over ranks) minus steps finished, at time t.
    Each learner step trains one batch from every inference rank."""
    if not inference:
        return 0.0
    produced = sum(sum(b["collect_end"] <= t for b in r["batches"]) for r in inference) / len(inference)
    return produced - sum(row.step_end <= t for row in rows)


def window_batches(inference: list[dict], t0: float, t1: float) -> list[dict]:
    """The inference ranks' batches collected inside the window [t0, t1]."""
    return [b for r in inference for b in r["batches"] if b["collect_start"] >= t0 and b["collect_end"] <= t1]


def rollout_means(batches: list[dict]) -> dict:
    """Means over the window's batches, `rollout_<stat>` (the canary's ms: `canary_figures`, per probe;
    the version: `batch_parity`)."""
    keys = sorted({k for b in batches for k in b} - {"collect_start", "collect_end", "canary_ms", "version"})
    return {f"rollout_{k}": sum(b.get(k, 0.0) for b in batches) / len(batches) for k in keys}


def job_keys(order: str) -> list[tuple[str, str]]:
    """--order -> [(record key, job)]: a job named again (to alternate A, B, B, A against drift
    within a machine) gets '#2', '#3', ... in its key, so no run overwrites another."""
    seen: dict[str, int] = {}
    out = []
    for job in (j.strip() for j in order.split(",")):
        if job:
            seen[job] = seen.get(job, 0) + 1
            out.append((job if seen[job] == 1 else f"{job}#{seen[job]}", job))
    return out


def marked(job: str, mark: str) -> bool:
    """Whether a job's --order entry ends in @mark (@base, @warm), its #N left aside."""
    return job.partition("#")[0].endswith(f"@{mark}")


def paired_figures(runs: dict, keyed: list[tuple[str, str]]) -> dict:
    """Two jobs alternating (module docstring) -> each pair's seconds_per_step A over B (A: the job
    named first), their mean and standard error, and the pooled ratio; {} for any other order.
    `keyed`: the counted jobs as `job_keys` gives them, in order; `runs`: those that finished."""
    names = list(dict.fromkeys(job for _, job in keyed))
    plan = [keyed[i:i + 2] for i in range(0, len(keyed) - 1, 2)]
    if len(names) != 2 or any({job for _, job in pair} != set(names) for pair in plan):
        return {}
    a, b = names
    pairs = [{job: runs[key]["seconds_per_step"] for key, job in pair} for pair in plan
             if all(key in runs for key, _ in pair)]
    if not pairs:
        return {}
    ratios = [p[a] / p[b] for p in pairs]
    se = statistics.stdev(ratios) / math.sqrt(len(ratios)) if len(ratios) > 1 else None
    name = f"seconds_per_step_{a}_over_{b}"
    return {f"{name}_pairs": [round(r, 4) for r in ratios], f"{name}_pair_mean": statistics.fmean(ratios),
            f"{name}_pair_se": se,
            f"{name}_pooled": statistics.fmean(p[a] for p in pairs) / statistics.fmean(p[b] for p in pairs)}


def named_ratios(runs: dict) -> dict:
    """steps_per_hour of named pairs of jobs: async over sync, stream over barrier, a job over the
    same job from the baseline tree (@base), a variant over its plain job."""
    ratios = {}
    for fast, slow in (("async", "sync"), ("async-stream", "sync-stream"), ("async-barrier", "sync-barrier"),
                       ("async-stream", "async-barrier"), ("sync-stream", "sync-barrier")):
        if fast in runs and slow in runs:
            ratios[f"steps_per_hour_{fast}_over_{slow}"] = runs[fast]["steps_per_hour"] / runs[slow]["steps_per_hour"]
    for job in runs:  # each job against the same job run from the baseline tree
        if f"{job}@base" in runs:
            ratios[f"steps_per_hour_{job}_over_{job}@base"] = runs[job]["steps_per_hour"] / runs[f"{job}@base"]["steps_per_hour"]
    for job in runs:  # each variant against the same job without it
        plain = job.split("+")[0]
        if "+" in job and plain in runs:
            ratios[f"steps_per_hour_{job}_over_{plain}"] = runs[job]["steps_per_hour"] / runs[plain]["steps_per_hour"]
    return ratios


def run_one(args, record: dict, job: str, settings: tuple[int | None, list[str]], root: str) -> None:
    """One job into `record`: its figures under "runs" ("warm" for a warm-up job), or its error
    under "failed" (the other jobs still run)."""
    lag, extra = settings
    run_dir = os.path.join(root, job.replace("+", "_").replace("#", "_"))
    tree = args.baseline_tree if marked(job, "base") else ""
    try:
        result = {**run_job(args, lag, run_dir, extra, tree), "settings": extra}
    except (RuntimeError, subprocess.TimeoutExpired) as e:  # the record says why
        record.setdefault("failed", {})[job] = {"error": str(e)[-2000:], "settings": extra}
        print(f"[e2e] {job} failed: {str(e)[-2000:]}", flush=True)
        return
    (record.setdefault("warm", {}) if marked(job, "warm") else record["runs"])[job] = result
    print(f"[e2e] {job}: " + json.dumps(result), flush=True)
    if args.partial:
        with open(args.partial, "w") as f:
            json.dump(record, f, indent=1)


def run(args) -> dict:
    root = tempfile.mkdtemp(prefix="colocate-e2e-")
    keyed = job_keys(args.order)
    variants = parse_variants(args.variant)
    settings = {key: job_settings(job, args.lag, args.stream_set, variants) for key, job in keyed}  # all checked first
    for key, job in keyed:
        if marked(job, "base") and not args.baseline_tree:
            raise SystemExit(f"--order: job {key!r} runs from --baseline-tree, which is not given")
    record: dict = {"config": args.config, "nproc": args.nproc, "steps": args.steps, "warmup": args.warmup,
                    "lag": args.lag, "runs": {}}
    for key, _ in keyed:
        run_one(args, record, key, settings[key], root)
    runs = record["runs"]
    first_async = next((j for j in runs if j.startswith("async")), None)  # figures: ours
    first_sync = next((j for j in runs if j.startswith("sync")), None)    # baseline
    figures = {f"{first_async}_{k}": v for k, v in runs[first_async].items()} if first_async else {}
    figures.update(paired_figures(runs, [(key, job) for key, job in keyed if not marked(job, "warm")]))
    figures.update({f"{job}_{k}": v for job, r in runs.items() for k, v in r.items()
                    if k.endswith(("_parity_gap_frac", "_parity_gap_frac_se"))})  # every job's, as the pairs
    if figures:
        record["figures"] = figures
    if first_sync:
        record["baseline"] = {f"{first_sync}_{k}": v for k, v in runs[first_sync].items()}
    ratios = named_ratios(runs)
    if ratios:
        record["ratios"] = ratios
    return record
