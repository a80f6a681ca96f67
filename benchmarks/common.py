"""Shared benchmark helpers: machine description, timing, the printed table, trace summaries, and a
second CUDA context kept busy beside the measured work (`Cotenant`)."""
from __future__ import annotations

import contextlib
import os
import platform
import statistics
import sys
import time

import torch


def machine_info() -> dict:
    info = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["num_gpus"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
    return info


def job_env(tree: str) -> dict:
    """A launched job's environment: this one, with `tree` (another commit's source tree, or "")
    first on PYTHONPATH, ahead of what the caller's path holds (the GPU bundle's packages must stay
    importable for the baseline's code too)."""
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(tree), env.get("PYTHONPATH")) if p)
    return env


def train_command(config: str, nproc: int, overrides: list[str]) -> list[str]:
    """`colocate train` as a user runs it: `--nproc` only when given (0: the config's own count, so a
    variant's topology sets it), then the overrides (section.key=value, the leading -- optional)."""
    return [sys.executable, "-m", "colocate.cli", "train", *([f"--nproc={nproc}"] if nproc else []),
            "--config", config, *("--" + o.removeprefix("--") for o in overrides)]


def median_time(fn, *, warmup: int = 3, iters: int = 10, setup=None) -> float:
    """Median seconds of `fn()`; `setup()` runs untimed before each call (e.g. fresh in-place inputs)."""
    cuda = torch.cuda.is_available()
    times = []
    for i in range(warmup + iters):
        if setup is not None:
            setup()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gpu_time_ms(step, setup, iters: int, calls: int = 1) -> float:
    """Median device ms of `step()` between two CUDA events, with the host running ahead as in a
    training step: `setup()` (the untimed restore copy) is enqueued without a sync, so the Python
    launch overhead of `step` overlaps that copy instead of leaving the GPU idle inside the events.
    `calls` > 1 runs `step` that many times between the events and divides (for steps so short
    that one event pair's overhead would show)."""
    times = []
    for i in range(iters + 3):
        setup()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            step()
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / calls)
    return round(sorted(times)[len(times) // 2], 3)


def print_table(record: dict) -> None:
    rows = []
    for section in ("figures", "baseline", "ratios"):
        for k, v in (record.get(section) or {}).items():
            rows.append((section, k, f"{v:.4g}" if isinstance(v, float) else str(v)))
    width = max((len(r[1]) for r in rows), default=10)
    for section, k, v in rows:
        print(f"{section:9s} {k:{width}s} {v}")


# Kernel-name families for `kernel_summary`, first match wins (our loss kernels before inductor's
# generic "triton_" names).
KERNEL_FAMILIES = (
    ("nccl", ("nccl",)),
    ("grpo_loss", ("_grpo_rows_kernel", "grpo_rows_bulk", "_scale_rows_kernel")),
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "wgmma", "matmul", "splitk")),
    ("inductor_triton", ("triton_",)),
)


def kernel_family(name: str) -> str:
    low = name.lower()
    for family, needles in KERNEL_FAMILIES:
        if any(n in low for n in needles):
            return family
    return "other"  # elementwise, reductions, copies, memsets, optimizer


def idle_gaps(kernels: list[tuple[str, float, float]]) -> tuple[float, list[tuple[float, float, str, str]]]:
    """GPU kernels (name, start_us, end_us), any streams -> (busy us: the union of their intervals,
    idle gaps [(start_us, end_us, the kernel that ended last before it, the one that started it)]
    in time order)."""
    spans = sorted((s, e, name) for name, s, e in kernels if e > s)
    busy, cur_s, cur_e, last = 0.0, None, None, ""
    gaps: list[tuple[float, float, str, str]] = []
    for s, e, name in spans:  # union of [s, e) intervals
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
                gaps.append((cur_e, s, last, name))
            cur_s, cur_e, last = s, e, name
        elif e > cur_e:
            cur_e, last = e, name
    if cur_e is not None:
        busy += cur_e - cur_s
    return busy, gaps


def kernel_summary(kernels: list[tuple[str, float, float]], wall_us: float, top: int = 15) -> dict:
    """GPU kernels of one timed region -> where its time went.

    kernels: (name, start_us, end_us) of every GPU kernel (all streams). Returns the wall time, the
    time at least one kernel ran (the union of the intervals: overlapping streams counted once),
    what is left idle (host-bound gaps, waits), per-family kernel time (summed: overlapping streams
    count twice there), the `top` kernel names by summed time, and the longest idle gaps between
    kernels ([gap ms, the kernel that ended last before it, the one that started it]: what the GPU
    waited between; "gaps_over_100us" counts and sums those longer than 0.1 ms)."""
    busy, gaps = idle_gaps(kernels)
    lengths = [(e - s, a, b) for s, e, a, b in gaps]
    long_gaps = [g for g, _, _ in lengths if g > 100.0]
    families: dict[str, float] = {}
    names: dict[str, float] = {}
    for name, s, e in kernels:
        family, took = kernel_family(name), max(e - s, 0.0)
        families[family] = families.get(family, 0.0) + took
        names[name] = names.get(name, 0.0) + took
    top_names = sorted(names.items(), key=lambda kv: -kv[1])[:top]
    return {"wall_ms": wall_us / 1e3, "gpu_busy_ms": busy / 1e3,
            "gpu_idle_fraction": max(0.0, 1.0 - busy / wall_us) if wall_us > 0 else None,  # None: no span
            "num_kernels": len(kernels),
            "family_ms": {k: v / 1e3 for k, v in sorted(families.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms": [[n[:160], t / 1e3] for n, t in top_names],
            "gaps_over_100us": {"count": len(long_gaps), "ms": sum(long_gaps) / 1e3},
            "longest_gaps_ms": [[g / 1e3, a[:80], b[:80]] for g, a, b in sorted(lengths, key=lambda x: -x[0])[:top]]}


def gap_host_context(kernels: list[tuple[str, float, float]], host: list[tuple[str, float, float]],
                     gaps: int = 3, top: int = 8) -> list[dict]:
    """What the host was doing while the GPU idled: for each of the `gaps` longest idle gaps, the
    `top` host events (name, start_us, end_us: annotations, operators, GC pauses) by how much of
    the gap they cover ([name, ms of the gap covered, the event's own ms]). Nested events each
    count their own overlap, so an annotation and the operator inside it both show."""
    _, idle = idle_gaps(kernels)
    out = []
    for s, e, before, after in sorted(idle, key=lambda g: g[1] - g[0], reverse=True)[:gaps]:
        cover = [(name, min(e, he) - max(s, hs), he - hs) for name, hs, he in host if hs < e and he > s]
        cover.sort(key=lambda c: -c[1])
        out.append({"gap_ms": (e - s) / 1e3, "after": before[:80], "before": after[:80],
                    "host": [[n[:100], c / 1e3, d / 1e3] for n, c, d in cover[:top]]})
    return out


class GcPauses:
    """Python garbage-collector pauses while active (`gc.callbacks`): each pause is timed and, under
    a torch.profiler, annotated in its trace as "gc gen N" (a `record_function` opened at the
    collection's start and closed at its stop), so `gap_host_context` can name it."""

    def __init__(self):
        self.pauses: list[tuple[int, float]] = []  # (generation, seconds)
        self._open = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._open = (time.perf_counter(), torch.autograd.profiler.record_function(f"gc gen {info['generation']}"))
            self._open[1].__enter__()
        elif self._open is not None:
            t0, annotation = self._open
            annotation.__exit__(None, None, None)
            self.pauses.append((info["generation"], time.perf_counter() - t0))
            self._open = None

    def __enter__(self):
        import gc
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        import gc
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict:
        return {"count": len(self.pauses), "ms": sum(t for _, t in self.pauses) * 1e3,
                "longest_ms": max((t for _, t in self.pauses), default=0.0) * 1e3,
                "gen2": sum(1 for g, _ in self.pauses if g == 2)}


def profiler_gpu_work(events) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of the GPU work among torch.profiler's `prof.events()`: kernels,
    copies, memsets. Not the GPU-side spans of `record_function` annotations: with CPU activity on,
    an annotation also gets a span on the GPU's timeline that would cover the idle gaps inside it."""
    from torch.autograd import DeviceType
    return [(e.name, e.time_range.start, e.time_range.end) for e in events
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]


def trace_call(fn, cuda: bool, trace_out: str = "", host: bool = False) -> dict:
    """Run `fn()` once under torch.profiler -> `kernel_summary` of its GPU work and its GC pauses
    ("gc"). GPU kernels only by default, to keep the profiler's host overhead small; `host` adds the
    CPU side (operators, annotations, "gc gen N") and under "host_gaps" what the host did during
    the GPU's longest idle gaps (`gap_host_context`). `trace_out` (.json.gz or .json) gets the
    Chrome trace."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    if host and cuda:
        activities.append(ProfilerActivity.CPU)
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof, GcPauses() as gc_pauses:
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6
    events = prof.events()
    kernels = profiler_gpu_work(events)
    if trace_out:
        os.makedirs(os.path.dirname(trace_out) or ".", exist_ok=True)
        prof.export_chrome_trace(trace_out)  # torch gzips it when the name ends in .gz
    summary = {**kernel_summary(kernels, wall_us), "gc": gc_pauses.summary()}
    if host:  # on CPU there are no GPU gaps to explain: an empty list
        cpu = [(e.name, e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CPU]
        summary["host_gaps"] = gap_host_context(kernels, cpu)
    return summary


GPU_TRACE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def trace_events(path: str) -> list[dict]:
    """The events of a torch.profiler Chrome trace (.json or .json.gz): the role traces under
    <profile_dir>/<run>/, vLLM's engine-core traces, `--trace-dir` files."""
    import gzip
    import json
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)
    return events.get("traceEvents", []) if isinstance(events, dict) else events


def trace_kernels(events: list[dict]) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of the GPU work among a trace's events."""
    return [(e.get("name", "?"), float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events
            if e.get("ph") == "X" and e.get("cat") in GPU_TRACE_CATEGORIES and "ts" in e]


# Host-side categories worth a total: annotated regions (vLLM 0.25 names each engine step by its
# prefill and decode tokens, "execute_context_1(64)_generation_0(0)"), their GPU-side spans, and CUDA runtime calls (cudaGraphLaunch against cudaLaunchKernel says
# whether a step replayed a CUDA graph or launched kernel by kernel).
HOST_TRACE_CATEGORIES = ("user_annotation", "gpu_user_annotation", "cuda_runtime", "cuda_driver")


def host_summary(events: list[dict], top: int = 15) -> dict:
    """{category: [[name, count, summed ms], ...]}: the `top` names by summed duration in each of
    HOST_TRACE_CATEGORIES (a nested annotation counts its own full span)."""
    sums: dict[str, dict[str, list]] = {}
    for e in events:
        cat = e.get("cat")
        if e.get("ph") == "X" and cat in HOST_TRACE_CATEGORIES:
            slot = sums.setdefault(cat, {}).setdefault(e.get("name", "?"), [0, 0.0])
            slot[0] += 1
            slot[1] += float(e.get("dur", 0.0)) / 1e3
    return {cat: [[n[:120], c, ms] for n, (c, ms) in sorted(names.items(), key=lambda kv: -kv[1][1])[:top]]
            for cat, names in sums.items()}


def summarize_trace(path: str, top: int = 15) -> dict:
    """`kernel_summary` of a trace file over the span of its GPU work (first kernel start to last end;
    a trace with no GPU work, e.g. a vLLM inference role's own process, has idle fraction None), and
    under "host" what its CPU side did (`host_summary`)."""
    events = trace_events(path)
    kernels = trace_kernels(events)
    span = (max(e for _, _, e in kernels) - min(s for _, s, _ in kernels)) if kernels else 0.0
    return {"path": path, **kernel_summary(kernels, wall_us=span, top=top), "host": host_summary(events, top=top)}


def _cotenant_main(index: int, size: int, chain: int, busy, stop, ready, counter) -> None:
    """`Cotenant`'s process: a CUDA graph of `chain` [size, size] bf16 matmuls, replayed back to back
    (each waited for, as an engine reads each step's tokens) while `busy` is set, until `stop`."""
    torch.cuda.set_device(index)
    x = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(size, size, device="cuda", dtype=torch.bfloat16) / size ** 0.5 for _ in range(chain)]

    def product():
        y = x
        for w in weights:
            y = y @ w
        return y
    with torch.cuda.stream(torch.cuda.Stream()):  # cuBLAS picks its kernels and workspace before capture
        product()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        product()
    ready.set()
    while not stop.is_set():
        if busy.wait(0.05):
            graph.replay()
            torch.cuda.synchronize()
            with counter.get_lock():
                counter.value += 1


class Cotenant:
    """A second CUDA context on GPU `index`, kept busy the way an inference engine keeps a GPU it
    shares with a learner (no MPS: the two contexts time-slice): a spawned process replaying a CUDA
    graph of matmuls while `busy()` is held, counting its replays (`count`, `rate`)."""

    def __init__(self, index: int, size: int = 4096, chain: int = 16):
        import torch.multiprocessing as mp
        ctx = mp.get_context("spawn")
        self.flag, self.stop, ready, self.counter = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Value("q", 0)
        self.proc = ctx.Process(target=_cotenant_main, args=(index, size, chain, self.flag, self.stop, ready,
                                                             self.counter), daemon=True)
        self.proc.start()
        while not ready.wait(1.0):
            if not self.proc.is_alive():
                raise RuntimeError(f"the cotenant process ended at its start (exit code {self.proc.exitcode})")

    def count(self) -> int:
        return self.counter.value

    @contextlib.contextmanager
    def busy(self):
        self.flag.set()
        try:
            yield
        finally:
            self.flag.clear()

    def rate(self, seconds: float) -> float:
        """Its replays per second over `seconds` busy, with nothing else of ours on the GPU."""
        with self.busy():
            time.sleep(0.2)
            count, t0 = self.count(), time.perf_counter()
            time.sleep(seconds)
            return (self.count() - count) / (time.perf_counter() - t0)

    def close(self) -> None:
        self.stop.set()
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join()
