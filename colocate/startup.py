"""A run's start-up: its timeline (where the seconds before the end of step 1 went) and the compile
caches that make the next start faster.

Timeline: every rank keeps one `Timeline` per process (`process_timeline`), marked by the
composition root and the role loops with unix times (`MARKS`, in the order a rank passes them).
Learner rank 0 collects every other rank's as one JSON control message (`wire.send_json`): an
inference rank sends its marks right after it queued its first batch, a learner at the end of its
first step; learner rank 0 receives the inference ranks' right after their first shards (before
it trains: its adapter send would wait on them) and the learners' at the end of its first step.
It then writes `<run_dir>/startup.json` (`merge`: seconds since the launch per rank, and per mark
the last rank to reach it), puts the same record into `summary.json` and prints
`first_step_line`. The launch is the `colocate train` command's start (`LAUNCH_ENV`, which it sets
for its ranks); a rank started by plain torchrun counts from the earliest process start of the job.

Caches: `compile_cache_env` puts vLLM's compile cache, inductor's and Triton's under one directory
(`model.compile_cache_dir`), set in each rank's environment before any of them compiles (vLLM
reads its variable when its engine core starts), so a second launch finds what the first one
compiled. A variable the user set already is kept.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

LAUNCH_ENV = "COLOCATE_LAUNCH_TIME"
"""Unix time the `colocate train` command started, for its ranks (launcher.py sets it)."""

MARKS = ("rank_start", "engine_prestart", "launch_checked", "checks_done", "ranks_up", "model_ready",
         "engine_core_started", "engine_constructed", "engine_warm", "learner_probe_warm", "learner_warm",
         "first_batch", "first_step_end")
"""What a rank marks, in the order it passes them (each role marks a subsequence):
rank_start          the rank's process started (`colocate train` starts torchrun once the config is
                    parsed: the rank's imports overlap the launcher's checks)
engine_prestart     (inference, `engine.prestart`) the engine core's forkserver started as the rank's
                    first act, before its imports (`colocate train`'s ranks; engine/headstart.py)
launch_checked      `colocate train` handed its ranks the config it checked (`handover`; its ranks
                    only; they wait for it after their imports)
checks_done         the rank's config checks passed (`rank_config.configure`)
ranks_up            the process groups are formed (`build_topology`)
model_ready         tokenizer and model built; a learner's sharded and materialized (`Learner`)
engine_core_started (inference, `engine.prestart`) vLLM's engine core forked from that server: its
                    imports done, its own start-up begins
engine_constructed  (inference) the engine is built, with the engine's own warm-up (vLLM: compile,
                    KV cache, CUDA graphs) and our kernels' (engine/vllm_*.py)
engine_warm         (inference) the adapter channel (which waits for learner rank 0) and the env
                    are up too: the first rollout starts
learner_probe_warm  (learner) the warm-up's canary probe forward is done (with the canary on and LoRA
                    dropout: its compile, apart from the update's; without dropout the probe rides the
                    update, as it rides each step's first forward, and this mark is not made)
learner_warm        (learner) the synthetic warm-up update is done (`learner.prewarm`)
first_batch         (inference) its first batch is queued; (learner) its first shards arrived
first_step_end      (learner) the end of its first step (step 1, or the first after a resume)"""

CHECK_PHASES = ("launcher_imports", "parse", "child_imports", "check_imports", "gpu_count", "paths", "env", "engine",
                "meta_model", "memory_plan", "claim", "resume", "resolved_config", "handover")
"""The launcher's work from the launch to `launch_checked`, in order; each phase ends where the next begins:
launcher_imports  the interpreter's start and `colocate train`'s imports
parse             the config parsed over the world (a world from the GPUs: torch), the handover's directory
child_imports     the checking child's fork and the meta model's imports (transformers, torch)
check_imports     the checks' imports: the envs and the engine table
gpu_count         the GPUs counted through NVML (`preflight.gpu_count`)
paths             the placement, the run directory and the model directory checked
env               the env's checks (the dataset env loads its files; the user's code it names)
engine            the engine's keys and packages
meta_model        the model built on the meta device, its LoRA targets and positions checked
memory_plan       each GPU's memory plan (NVML's memory), or the host's on CPUs
claim             the loggers, the run directory claimed, memory_plan.json written
resume            the checkpoint to resume found and validated
resolved_config   the resolved config's YAML, the child's result
handover          the launcher: the result read, the job described, the run directory held, the record
                  written (`handover.hand_over`)
Only `colocate train` passes them (plain torchrun has no launcher): startup.json's `launcher_phases`."""

_CHECKS: dict[str, float] = {}


def begin_checks() -> None:
    """`colocate train` starts its checks: the phases' ends so far forgotten, `launcher_imports` ends now."""
    _CHECKS.clear()
    check_phase("launcher_imports")


def check_phase(name: str) -> None:
    """The launcher's checks (or its forked child, which inherits the ends before the fork) end `name` now."""
    if name not in CHECK_PHASES:
        raise ValueError(f"unknown check phase {name!r}; phases: {', '.join(CHECK_PHASES)}")
    _CHECKS[name] = time.time()


def check_phase_ends() -> dict[str, float]:
    """{phase: its end, unix seconds} so far, in the order they ended."""
    return dict(_CHECKS)


def check_seconds(ends: dict[str, float], origin: float) -> dict[str, float]:
    """The phases' ends (unix) -> each phase's seconds, in order, the first counted from `origin` (the launch)."""
    out, start = {}, origin
    for name, end in ends.items():
        out[name], start = round(end - start, 3), end
    return out


CACHE_VARIABLES = (("VLLM_CACHE_ROOT", "vllm"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton"))
"""The libraries' cache variables and their folder under `model.compile_cache_dir`."""


def process_start() -> float:
    """This process's start, unix seconds, to a clock tick: the kernel's start tick over the boot time
    from /proc/uptime. psutil's `create_time` takes the boot time from /proc/stat in whole seconds,
    so it is up to 1 s early, and every mark measured against it by `time.time` that much late."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            booted = time.time() - float(f.read().split()[0])
        return booted + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):  # not Linux
        import psutil
        return psutil.Process().create_time()


def launch_time(environ=os.environ) -> float:
    """The launch's unix time: `colocate train`'s start, else this process's start (plain torchrun)."""
    if environ.get(LAUNCH_ENV):
        return float(environ[LAUNCH_ENV])
    return process_start()


@dataclass
class Timeline:
    """One rank's start-up marks, unix seconds; `origin` is the launch as this rank knows it."""
    origin: float
    marks: dict[str, float] = field(default_factory=dict)
    checks: dict[str, float] = field(default_factory=dict)
    """The launcher's check phases' ends, unix seconds (`CHECK_PHASES`, from its handover; {}: no launcher)."""

    def mark(self, name: str, at: float | None = None) -> None:
        """Record `name` now (or `at`); a mark keeps its first time."""
        if name not in MARKS:
            raise ValueError(f"unknown start-up mark {name!r}; marks: {', '.join(MARKS)}")
        self.marks.setdefault(name, time.time() if at is None else at)

    def to_json(self) -> dict:
        return {"origin": self.origin, "marks": dict(self.marks), "checks": dict(self.checks)}

    @classmethod
    def from_json(cls, data: dict) -> "Timeline":
        return cls(float(data["origin"]), {k: float(v) for k, v in data["marks"].items()},
                   {k: float(v) for k, v in data.get("checks", {}).items()})


_PROCESS: Timeline | None = None
_BEFORE: dict[str, float] = {}
"""Marks made before this process had a timeline (the rank's head start, before its imports and
`main`): its first timeline keeps them."""


def begin(environ=os.environ) -> Timeline:
    """A fresh timeline for this process (a rank's `main`), marked `rank_start` at its process start,
    with the marks made before the process had one."""
    global _PROCESS
    _PROCESS = Timeline(launch_time(environ))
    _PROCESS.mark("rank_start", process_start())
    for name, at in _BEFORE.items():
        _PROCESS.mark(name, at)
    _BEFORE.clear()
    return _PROCESS


def process_timeline() -> Timeline:
    """This process's timeline: one per rank, like the process start it counts from."""
    return _PROCESS if _PROCESS is not None else begin()


def mark(name: str) -> None:
    """`name` now, on this process's timeline; before it has one, kept for it (`begin`)."""
    if _PROCESS is None:
        Timeline(0.0, _BEFORE).mark(name)  # checked and kept as a timeline keeps it, into `_BEFORE`
    else:
        _PROCESS.mark(name)


# ---------------------------------------------------------------------------------- the record

def merge(ranks: dict[int, tuple[str, Timeline]]) -> dict:
    """{global rank: (role, timeline)} -> startup.json's record: the origin (the earliest launch any
    rank knows), each rank's marks in seconds since it, each mark's latest rank (the one the run
    waited for), the phases of `first_step_line`, and where a rank had them the launcher's check
    phases in seconds (`launcher_phases`: `colocate train` only)."""
    origin = min(t.origin for _, t in ranks.values())
    per_rank = {str(r): {"role": role, **{m: round(t.marks[m] - origin, 3) for m in MARKS if m in t.marks}}
                for r, (role, t) in sorted(ranks.items())}
    latest = {m: max(row[m] for row in per_rank.values() if m in row) for m in MARKS
              if any(m in row for row in per_rank.values())}
    checks = next((t.checks for _, t in ranks.values() if t.checks), {})  # the same handover on every rank
    return {"launch": "colocate train" if os.environ.get(LAUNCH_ENV) else "first process start",
            "origin_unix": origin, "marks": latest, "ranks": per_rank, "phases": phases(per_rank),
            **({"launcher_phases": check_seconds(checks, origin)} if checks else {})}


def _longest(rows: list[dict], end: str, start: str) -> float:
    """The longest `end - start` over the rows that hold both marks (nan: none does)."""
    spans = [row[end] - row[start] for row in rows if end in row and start in row]
    return max(spans) if spans else math.nan


def phases(per_rank: dict[str, dict]) -> dict[str, float]:
    """The step-1 line's parts, in seconds: checks (launch -> the last rank's checks done), engine
    (the slowest inference rank's model -> engine constructed), learner warm-up (model -> warm), waiting
    for the first batch (warm, or model without a warm-up -> first shards), step 1's own time; on
    learner rank 0 where a learner's mark is meant (the line's rank)."""
    rows = list(per_rank.values())
    inference = [r for r in rows if r["role"] == "inference"]
    learner0 = [next(r for r in rows if r["role"] == "learner")]  # the lowest global rank of its role
    warm = "learner_warm" in learner0[0]
    return {"first_step": learner0[0].get("first_step_end", math.nan),
            "checks": max(r.get("checks_done", math.nan) for r in rows),
            "engine": _longest(inference, "engine_constructed", "model_ready"),
            "learner_warmup": _longest(learner0, "learner_warm", "model_ready") if warm else 0.0,
            "first_batch_wait": _longest(learner0, "first_batch", "learner_warm" if warm else "model_ready"),
            "step_1": _longest(learner0, "first_step_end", "first_batch")}


def first_step_line(record: dict) -> str:
    p = record["phases"]
    return (f"colocate: first step after {p['first_step']:.1f} s (checks {p['checks']:.1f}, engine {p['engine']:.1f}, "
            f"learner warm-up {p['learner_warmup']:.1f}, waiting for the first batch {p['first_batch_wait']:.1f})")


COMPILE_PHASES = ("backend_compile", "inductor_compile", "code_gen", "async_compile.wait")
"""Dynamo's compile phases `compile_record` keeps: AOTAutograd and inductor (backend), inductor alone,
its code generation, and the wait for its kernel compiles (Triton's on a GPU)."""


def compile_record() -> dict:
    """This process's torch.compile so far (learner rank 0 at the end of step 1): graphs compiled,
    seconds in Dynamo's frame compiles (inductor's included), the hits and misses of inductor's
    FX graph cache and AOTAutograd's cache, the two that make a warm start's compile cheap, and the
    AOTAutograd traces abandoned. {} when nothing was compiled (torch._dynamo not imported, or no
    frame)."""
    import sys
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return {}
    counters = utils.counters
    graphs = int(counters["stats"].get("unique_graphs", 0))
    if not graphs:
        return {}
    try:
        spent = dict(utils.calculate_time_spent())
    except Exception:  # a private helper: its name or shape may change across torch versions
        spent = {}
    inductor, aot = counters["inductor"], counters["aot_autograd"]
    # the seconds where torch counted them (no NaN in the record): the whole frame compiles, and of
    # them the backend's share; Dynamo's tracing is what that leaves of the whole
    seconds = {"compile_s": spent["entire_frame_compile"]} if "entire_frame_compile" in spent else {}
    seconds.update({f"{k}_s": spent[k] for k in COMPILE_PHASES if k in spent})
    return {"graphs": graphs, "frames": int(counters["frames"].get("total", 0)),
            **{k: round(float(v), 3) for k, v in seconds.items()},
            "fx_cache_hit": int(inductor.get("fxgraph_cache_hit", 0)),
            "fx_cache_miss": int(inductor.get("fxgraph_cache_miss", 0)),
            "aot_cache_hit": int(aot.get("autograd_cache_hit", 0)),
            "aot_cache_miss": int(aot.get("autograd_cache_miss", 0)),
            # AOTAutograd traces begun and not finished: Dynamo restarted the frame (traced it again),
            # and the abandoned trace's cache entry was never saved
            "aot_abandoned": int(aot.get("total", 0)) - int(aot.get("ok", 0))}


def compile_line(record: dict) -> str:
    total, backend = record.get("compile_s"), record.get("backend_compile_s")
    took = "" if total is None else f", {total:.1f} s"
    if total is not None and backend is not None:
        took += f", {total - backend:.1f} s tracing"
    return (f"colocate: learner compile: {record['graphs']} graphs{took} (inductor cache "
            f"{record['fx_cache_hit']} hit / {record['fx_cache_miss']} miss, AOTAutograd cache "
            f"{record['aot_cache_hit']} hit / {record['aot_cache_miss']} miss, {record['aot_abandoned']} traces "
            f"abandoned)")


# ---------------------------------------------------------------------------------- the exchange

def send_marks(topo) -> None:
    """A rank other than learner rank 0: its timeline to learner rank 0 (one JSON control message)."""
    from colocate.wire import send_json
    send_json(process_timeline().to_json(), topo.sync_src, topo.transport_group)


def receive_marks(topo, ranks: list[int]) -> dict[int, Timeline]:
    """Learner rank 0: the timelines `ranks` sent (`send_marks`), in that order."""
    from colocate.wire import recv_json
    return {r: Timeline.from_json(recv_json(r, topo.transport_group)) for r in ranks}


# ---------------------------------------------------------------------------------- caches

def torch_default(name: str, value: str) -> bool:
    """Whether `value` is what torch itself put in the variable: importing torch._dynamo writes
    inductor's default cache directory into TORCHINDUCTOR_CACHE_DIR, before any config is read."""
    if name != "TORCHINDUCTOR_CACHE_DIR":
        return False
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return False
    return value == default_cache_dir()


def compile_cache_env(cache_dir: str, environ=os.environ) -> dict[str, str]:
    """Point vLLM's, inductor's and Triton's caches under `cache_dir` (`~` expanded), in `environ`,
    unless the user set one already -> the three variables as they now are. "" leaves every
    library's own default. Inductor and Triton read theirs when they compile, vLLM's engine process
    when it starts; only dynamo's own package cache took its path at import."""
    if cache_dir:
        root = os.path.abspath(os.path.expanduser(cache_dir))
        for name, folder in CACHE_VARIABLES:
            if not environ.get(name) or torch_default(name, environ[name]):
                environ[name] = os.path.join(root, folder)
    return {name: environ.get(name, "") for name, _ in CACHE_VARIABLES}


def cache_line(cache_dir: str, variables: dict[str, str]) -> str:
    """The start line naming where the compile caches are."""
    root = os.path.abspath(os.path.expanduser(cache_dir)) if cache_dir else ""
    if root and all(v == os.path.join(root, folder) for (_, folder), v in zip(CACHE_VARIABLES, variables.values())):
        return f"colocate: compile caches in {root} (vllm/, inductor/, triton/; model.compile_cache_dir)"
    shown = ", ".join(f"{k}={v or '(library default)'}" for k, v in variables.items())
    return f"colocate: compile caches: {shown}"
