"""Benchmark profile `probe`: what the sync canary's learner-side probe costs, and why: riding the
step's first forward, as a run scores it (`Learner.train_step`), and as a forward of its own
(`Learner.score_probe`, LoRA dropout's path). The learner is built as a run of `--config` builds it,
as one learner (world 1 in this process), and warmed up with the probe (`Learner.warm_up`). Per
variant: `--iters` probes of their own after `--warmup` untimed ones, the GPU idle before each
(`probe_device_ms_<v>`: CUDA events around the call; `probe_host_ms_<v>`: the call's own time;
median, and `_mean_`); one probe under torch.profiler (`traces`: GPU busy time, idle gaps, what the
host did in them); `--train-steps` steps of the warm-up's synthetic batch, alternated with the same
step carrying the probe in ABBA order (`train_step_ms_<v>`, `train_step_rider_ms_<v>`; `rider_ms_<v>`
and `rider_ms_se_<v>`: the pairs' mean difference, what the riding probe costs the learner's step;
on a GPU `rider_gpu_busy_ms_<v>`, the GPU work it adds over 3 traced pairs of steps; put back after,
so every variant scores the same adapter); the probe's mean |log-prob - as_run's| (`probe_gap_<v>`) beside the
canary's bound.
Variants (`--variants`):
  as_run      the config as it is;
  eager       as_run's learner, compiled blocks run eagerly (compiler stance force_eager), the probe
              on score_probe's no-grad path (its config copy has learner.compile false); no train step;
  no_compile, no_fsdp, flat   learners built with learner.compile=false, learner.fsdp=false,
              learner.prefix_sharing=off (a setting the config already has: skipped).
No build starts past `--time-limit-s`; `--partial` gets the record after each build.
`--queued-ms` (GPU): the probes again, each issued behind that much GPU work on its stream, as the
run issues it after a step (`_queued` figures: host ms that grow with it mean the probe waits for it).
`--cotenant` (default on a GPU): each variant again beside `common.Cotenant`, a second CUDA context
busy as an engine keeps it (`_cotenant` figures; its replays/s during the probes and idle; the
engine time each probe costs it, `cotenant_ms_lost_per_probe_<v>`).
GPU: python scripts/benchmark.py --profile probe [--set model.path=DIR]   (configs/gpu-1-gsm8k.yaml)
CPU: python scripts/benchmark.py --profile probe --quick   (configs/cpu-tiny.yaml; host ms only)
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import time
from dataclasses import dataclass, field, replace

import torch

from benchmarks.common import Cotenant, trace_call
from colocate.jsonfile import write_atomic

BUILDS = {"as_run": {}, "no_compile": {"compile": False}, "no_fsdp": {"fsdp": False}, "flat": {"prefix_sharing": "off"}}
"""Learner builds in run order (the cheapest answers first): variant -> learner settings beyond the config's."""
VARIANTS = ("as_run", "eager", "no_compile", "no_fsdp", "flat")
COMPARED = ("probe_device_ms", "probe_host_ms", "train_step_ms", "train_step_host_ms", "train_step_rider_ms")
TRACED_PAIRS = 3
"""Pairs of traced train steps (plain, ridden) per variant on a GPU: the rider's GPU work, their median difference."""
TRACE_KEYS = ("wall_ms", "gpu_busy_ms", "num_kernels", "family_ms", "gaps_over_100us", "longest_gaps_ms", "host_gaps", "gc")


def add_args(parser) -> None:
    parser.add_argument("--config", default="", help="default configs/gpu-1-gsm8k.yaml (--quick: configs/cpu-tiny.yaml)")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides, section.key=value")
    parser.add_argument("--variants", default=",".join(VARIANTS), type=variant_list,
                        help="comma separated, of " + ", ".join(VARIANTS))
    parser.add_argument("--iters", type=int, default=0, help="timed probes per variant (default 30, --quick 3)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed probes before them")
    parser.add_argument("--train-steps", type=int, default=0, help="pairs of timed train steps (plain, with the probe riding) per variant (default 20, --quick 1)")
    parser.add_argument("--cotenant", action=argparse.BooleanOptionalAction, default=None,
                        help="each variant again beside a busy second CUDA context (default: on a GPU)")
    parser.add_argument("--cotenant-chain", type=int, default=16, help="4096^2 bf16 matmuls per cotenant replay")
    parser.add_argument("--queued-ms", type=float, default=50.0,
                        help="GPU: the probes again, each behind this much GPU work queued on its stream (0: not)")
    parser.add_argument("--trace-dir", default="", help="also write each traced probe's Chrome trace here")
    parser.add_argument("--time-limit-s", type=float, default=420.0,
                        help="no learner build starts after this many seconds (the rest noted as skipped)")
    parser.add_argument("--partial", default="", help="also write the record here after every build")


def variant_list(text: str) -> list[str]:
    names = [v for v in text.split(",") if v]
    if not names or any(v not in VARIANTS for v in names):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma separated list of {', '.join(VARIANTS)}")
    return names


@dataclass
class _Bench:
    """What every variant of one run shares."""
    args: argparse.Namespace
    cfg: object
    tokenizer: object
    probe: list[int]
    topo: object
    cotenant: Cotenant | None
    record: dict
    outputs: dict = field(default_factory=dict)  # variant -> (probe log-probs on the CPU, logits RMS)
    t_start: float = field(default_factory=time.perf_counter)
    queue: object = None  # GPU: a callable queueing --queued-ms of work on the current stream (`spin`)

    @property
    def cuda(self) -> bool:
        return self.topo.device.type == "cuda"


def run(args) -> dict:
    from colocate.canary import probe_ids
    from colocate.envs import env_corpus
    from colocate.models import load_tokenizer
    args.iters, args.train_steps = args.iters or (3 if args.quick else 30), args.train_steps or (1 if args.quick else 20)
    cfg = load(args)
    key, corpus = env_corpus(cfg)
    tokenizer = load_tokenizer(cfg.model, corpus, key)
    cuda = torch.cuda.is_available() and cfg.sync.backend != "gloo"
    record = {"figures": {}, "baseline": {}, "ratios": {}, "traces": {}, "skipped": [],
              "setup": {k: getattr(cfg.learner, k) for k in ("micro_batch_tokens", "compile", "fsdp", "prefix_sharing")}}
    record["setup"].update(dtype=cfg.model.dtype, cuda=cuda, torch=torch.__version__)
    cotenant = Cotenant(torch.cuda.current_device(), chain=args.cotenant_chain) \
        if cuda and args.cotenant is not False else None
    try:
        if cotenant:
            record["figures"]["cotenant_replays_per_s_idle"] = cotenant.rate(2.0)
        with one_learner(cuda) as topo:
            bench = _Bench(args, cfg, tokenizer, probe_ids(tokenizer), topo, cotenant, record)
            bench.queue = spin(args.queued_ms) if cuda and args.queued_ms > 0 else None
            for build, settings in BUILDS.items():
                names = [v for v in args.variants if v == build or (build, v) == ("as_run", "eager")]
                if names and not skipped(bench, build, settings, names):
                    run_build(bench, build, settings, names)
                    if args.partial:
                        write_atomic(args.partial, record)
    finally:
        if cotenant:
            cotenant.close()
    summarize(bench)
    for line in record["skipped"]:
        print(f"[probe-bench] skipped {line}", flush=True)
    return record


def load(args):
    """The config as a run takes it: the file, the overrides, `micro_batch_tokens: auto` resolved by
    the run's memory plan; the run's compile caches (`model.compile_cache_dir`) and, on a GPU, the
    cores one rank of the run gets."""
    from colocate.config import load_config, parse_overrides
    from colocate.config_checks import resolve_roles
    from colocate.launch import default_world
    from colocate.preflight import gpu_count, meta_model, plan_memory
    from colocate.startup import compile_cache_env
    from colocate.topology import split_cpu_threads
    path = args.config or ("configs/cpu-tiny.yaml" if args.quick else "configs/gpu-1-gsm8k.yaml")
    cfg = load_config(path, parse_overrides(["--" + o.removeprefix("--") for o in args.set])[1])
    world = sum(resolve_roles(cfg, default_world(cfg)))  # the processes `colocate train` starts
    if cfg.learner.micro_batch_tokens == "auto":
        plan = plan_memory(cfg, meta_model(cfg), world, None, None, gpu_count(cfg), False)
        cfg.learner = replace(cfg.learner, micro_batch_tokens=plan.micro_batch_tokens)
    compile_cache_env(cfg.model.compile_cache_dir)  # before anything compiles
    if torch.cuda.is_available():
        split_cpu_threads(world)
    return cfg


@contextlib.contextmanager
def one_learner(cuda: bool):
    """A world of one process (the default group here, unless one exists) -> its learner Topology."""
    import torch.distributed as dist
    from colocate.topology import Topology
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=device if cuda else None)
    try:
        yield Topology(rank=0, world_size=1, local_rank=0, num_inference=0, num_learners=1, device=device,
                       backend="nccl" if cuda else "gloo", learner_group=dist.new_group([0]))
    finally:
        if owned:
            dist.destroy_process_group()


def skipped(bench: _Bench, build: str, settings: dict, names: list[str]) -> bool:
    """Note a build whose settings the config already has, or one past the time limit. (`eager` needs
    `torch.compiler.set_stance`: torch 2.6, the oldest setup.py allows.)"""
    if settings and all(getattr(bench.cfg.learner, k) == v for k, v in settings.items()):
        bench.record["skipped"].append(f"{build}: the config already has learner.{settings}")
        return True
    if time.perf_counter() - bench.t_start > bench.args.time_limit_s:
        bench.record["skipped"].append(f"{', '.join(names)}: out of time (--time-limit-s {bench.args.time_limit_s:g})")
        return True
    return False


def run_build(bench: _Bench, build: str, settings: dict, names: list[str]) -> None:
    """One learner (the config with `settings`), warmed up as the run warms it, then its variants;
    a failure is noted under `skipped` and the next build runs."""
    from colocate.learner.learner import Learner
    from colocate.models import build_policy
    cfg = replace(bench.cfg, learner=replace(bench.cfg.learner, **settings))
    try:
        t0 = time.perf_counter()
        learner = Learner(cfg, bench.topo, build_policy(cfg, bench.tokenizer, "meta"), bench.tokenizer)
        learner.warm_up(bench.probe)
        if bench.cuda:
            torch.cuda.synchronize()
        bench.record["figures"][f"build_s_{build}"] = time.perf_counter() - t0
        shape = learner.model.config
        bench.record["setup"]["shape"] = (max(shape.hidden_size, shape.intermediate_size), shape.num_hidden_layers)
        for name in names:
            with stance(learner, name):
                for cotenant in (None, bench.cotenant) if bench.cotenant else (None,):
                    measure(bench, learner, name, cotenant)
    except Exception as e:  # the other builds still run: one command, every answer it can give
        bench.record["skipped"].append(f"{build}: failed: {type(e).__name__}: {e}"[:400])
        print(f"[probe-bench] {build} failed: {type(e).__name__}: {e}", flush=True)
    learner = None
    gc.collect()
    if bench.cuda:
        torch.cuda.empty_cache()
    torch._dynamo.reset()  # the next build compiles afresh, as its own run would


@contextlib.contextmanager
def stance(learner, name: str):
    """`eager`: compiled blocks run eagerly and `score_probe` takes its no-grad path (it keeps
    autograd on only for compiled blocks); any other variant: the learner as built."""
    if name != "eager":
        yield
        return
    cfg = learner.cfg
    learner.cfg = replace(cfg, learner=replace(cfg.learner, compile=False))
    try:
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        learner.cfg = cfg


def measure(bench: _Bench, learner, name: str, cotenant: Cotenant | None) -> None:
    """One variant's figures: the probe timed (and the cotenant's replays meanwhile, while it is
    busy), one probe traced (GPU), the train steps with and without the rider timed (`time_rider`)."""
    figures, key, args = bench.record["figures"], name + ("_cotenant" if cotenant else ""), bench.args
    gc.collect()
    with cotenant.busy() if cotenant else contextlib.nullcontext():
        count, t0 = cotenant.count() if cotenant else 0, time.perf_counter()
        out, device, host = timed(lambda: learner.score_probe(bench.probe), args.iters, args.warmup, bench.cuda)
        window = time.perf_counter() - t0
        replays = cotenant.count() - count if cotenant else 0  # before the queued pass, outside the window
        if bench.queue:  # as in the run, the probe issued while the step's work still runs: does it wait for it?
            _, queued_device, queued_host = timed(lambda: learner.score_probe(bench.probe), args.iters, args.warmup,
                                                  bench.cuda, before=bench.queue)
            put(figures, key + "_queued", probe_device_ms=queued_device, probe_host_ms=queued_host)
        if cotenant:
            rate = replays / window
            figures[f"cotenant_replays_per_s_{name}"] = rate
            figures[f"cotenant_ms_lost_per_probe_{name}"] = max(0.0, 1 - rate / figures[
                "cotenant_replays_per_s_idle"]) * window * 1e3 / (args.iters + args.warmup)
        put(figures, key, probe_device_ms=device, probe_host_ms=host)  # kept should the trace fail
        if bench.cuda:
            trace_out = os.path.join(args.trace_dir, f"probe-{key}.json.gz") if args.trace_dir else ""
            summary = trace_call(lambda: learner.score_probe(bench.probe), True, trace_out, host=True)
            bench.record["traces"][key] = {k: summary[k] for k in TRACE_KEYS}
            figures[f"probe_gpu_busy_ms_{key}"] = summary["gpu_busy_ms"]
        if name != "eager":  # eager: the probe only
            time_rider(bench, learner, key)
    bench.outputs.setdefault(name, (out[0].float().cpu(), float(out[1])))
    print(f"[probe-bench] {key}: " + ", ".join(f"{m} {figures[f'{m}_{key}']:.2f}" for m in (*COMPARED, "probe_gpu_busy_ms")
                                               if f"{m}_{key}" in figures), flush=True)


def time_rider(bench: _Bench, learner, key: str) -> None:
    """`--train-steps` pairs of train steps, one plain and one carrying the probe, in ABBA order (a
    drift over the pairs cancels) -> the steps' medians, and what the rider adds to a step as the mean
    of the pairs' differences with its standard error (`rider_ms_<key>`, `rider_ms_se_<key>`; host
    ms the same). On a GPU `TRACED_PAIRS` pairs traced: the GPU work the rider adds
    (`rider_gpu_busy_ms`), which the timings' noise (host-bound steps) cannot resolve at a few ms."""
    figures, times = bench.record["figures"], {False: ([], []), True: ([], [])}  # rode -> (device, host) ms
    with synthetic_steps(learner) as step:
        step(None)  # untimed
        for rode in abba(bench.args.train_steps):
            for unit, got in zip(times[rode], timed(lambda: step(bench.probe if rode else None), 1, 0, bench.cuda)[1:]):
                unit.extend(got)
    put(figures, key, train_step_ms=times[False][0], train_step_host_ms=times[False][1],
        train_step_rider_ms=times[True][0], train_step_rider_host_ms=times[True][1])
    for unit, name in ((0, ""), (1, "host_")):
        diffs = [rode - plain for plain, rode in zip(times[False][unit], times[True][unit])]  # pair by pair
        if diffs:
            figures[f"rider_{name}ms_{key}"] = statistics.fmean(diffs)
            if len(diffs) > 1:
                figures[f"rider_{name}ms_se_{key}"] = statistics.stdev(diffs) / len(diffs) ** 0.5
    if bench.cuda and bench.args.train_steps:
        busy = traced_pairs(learner, bench.probe, TRACED_PAIRS, True)
        figures.update({f"train_step_gpu_busy_ms_{key}": statistics.median(busy[0]),
                        f"train_step_rider_gpu_busy_ms_{key}": statistics.median(busy[1]),
                        f"rider_gpu_busy_ms_{key}": statistics.median(r - p for p, r in zip(*busy))})


def abba(pairs: int):
    """Whether each step carries the probe, `pairs` pairs in ABBA order: F T, T F, F T, ..."""
    for i in range(pairs):
        yield from (False, True) if i % 2 == 0 else (True, False)


def traced_pairs(learner, probe: list[int], pairs: int, cuda: bool) -> tuple[list[float], list[float]]:
    """`pairs` pairs of train steps (plain, with the probe riding; ABBA) each traced -> the GPU busy
    ms of each step, plain and ridden."""
    busy = ([], [])
    with synthetic_steps(learner) as step:
        step(None)
        for rode in abba(pairs):
            busy[rode].append(trace_call(lambda: step(probe if rode else None), cuda)["gpu_busy_ms"])
    return busy


def timed(fn, iters: int, warmup: int, cuda: bool, before=None):
    """`fn()` warmup + iters times, the GPU idle before each (or running what `before()` queued) ->
    (the last result, device ms between CUDA events around each timed call, by the run's own
    instrument (`DeviceTimer`: the run's `canary_learner_device_ms`; [] off the GPU), host ms of
    each (no sync inside))."""
    from colocate.learner.rank_canary import DeviceTimer
    timer = DeviceTimer(torch.device("cuda" if cuda else "cpu"))
    device, host, out = [], [], None

    def clocked():  # the host's time on the call alone, inside the events
        t0 = time.perf_counter()
        result = fn()
        host.append((time.perf_counter() - t0) * 1e3)
        return result
    for i in range(warmup + iters):
        if before:
            before()
        out = timer.around(clocked)
        if cuda:
            torch.cuda.synchronize()
        ms = timer.done_ms()
        if i < warmup:
            host.pop()
        elif ms is not None:
            device.append(ms)
    return out, device, host


def spin(ms: float):
    """A callable queueing about `ms` of GPU work on the current stream (`torch.cuda._sleep`, a spin
    kernel; its cycles per ms measured here)."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    events[0].record()
    torch.cuda._sleep(10 ** 7)
    events[1].record()
    events[1].synchronize()
    cycles = int(ms * 10 ** 7 / events[0].elapsed_time(events[1]))
    return lambda: torch.cuda._sleep(cycles)


@contextlib.contextmanager
def synthetic_steps(learner):
    """`step(rider)`: one train step of the warm-up's synthetic batch, on policy; the adapter, AdamW,
    the RNG and the version put back after, so every variant scores the same adapter."""
    from colocate.learner.warmup import Snapshot, synthetic_batch
    cfg = learner.cfg
    batch = synthetic_batch(min(learner.vocab_size, learner.model.config.vocab_size),
                            int(cfg.learner.micro_batch_tokens), cfg.engine.max_new_tokens, cfg.rollout.group_size, 0)
    saved, version = Snapshot.capture(learner), learner.version

    def step(rider: list[int] | None):
        batch.versions[:] = learner.version  # on policy: nothing dropped as stale
        return learner.train_step(batch, rider)
    try:
        yield step
    finally:
        saved.restore(learner)
        learner.version = version


def put(figures: dict, key: str, **values: list[float]) -> None:
    for metric, got in values.items():
        if got:
            figures[f"{metric}_{key}"] = statistics.median(got)
            figures[f"{metric}_mean_{key}"] = statistics.fmean(got)


def summarize(bench: _Bench) -> None:
    """Every variant's probe against as_run's (mean |log-prob difference|; the canary's bound for the
    compute dtype at as_run's logits RMS) and its figures over as_run's."""
    from colocate.canary import canary_bound, compute_dtype
    figures, ratios = bench.record["figures"], bench.record["ratios"]
    if "as_run" in bench.outputs:
        reference, scale = bench.outputs["as_run"]
        reduction, layers = bench.record["setup"]["shape"]
        figures["probe_gap_bound"] = canary_bound(compute_dtype(bench.cfg.model.dtype, bench.cuda),
                                                  reduction=reduction, num_layers=layers, logit_scale=scale)
        for name, (logprobs, _) in bench.outputs.items():
            figures[f"probe_gap_{name}"] = float((logprobs - reference).abs().mean())
    for metric in COMPARED:
        base = figures.get(f"{metric}_as_run")
        for name in [n + c for n in VARIANTS for c in ("", "_queued", "_cotenant", "_cotenant_queued")
                     if n + c != "as_run"]:
            if base and f"{metric}_{name}" in figures:
                ratios[f"{metric}_{name}_vs_as_run"] = figures[f"{metric}_{name}"] / base
