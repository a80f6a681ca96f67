"""Metrics: TensorBoard scalars per role, progress lines, system sampling, alerts, profiler windows.

Names are namespaced `rollout/…`, `engine/…`, `learner/…`, `sync/…`, `system/…`, `alerts/…`. Only
a role's first rank writes (`MetricsWriter(enabled=...)`), so a role logs once whatever its size.
Background helpers are threads owned by the role loop that starts them:
  * `SystemSampler` - GPU utilization, SM clock and memory from NVML (when a GPU is present) and
    process/host CPU % from psutil, every `metrics.nvml_interval_s`;
  * `StallWatchdog` - a loud alert when a role makes no progress for `metrics.stall_timeout_s`.
`make_profiler` records a torch.profiler window (wait/warm-up/active steps) into
`<profile_dir>/<run name>/<role>-rank<r>.*.pt.trace.json`, which Perfetto and the TensorBoard
profiler plugin open.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass

from colocate.nvml import device_handle as nvml_device
from colocate.nvml import memory as nvml_memory


class MetricsWriter:
    """A role's scalars into `<run_dir>/tb/<role>` (and the trackers), its progress lines.

    A resumed run passes `first_step` (the checkpoint's step): the killed run's events at that step
    and later are purged (TensorBoard's `purge_step`), so every step shows once, with the values of
    the run that went on."""

    def __init__(self, run_dir: str, role: str, *, enabled: bool, tensorboard: bool = True, first_step: int = 0):
        self.enabled = enabled
        self.role = role
        self._tb = None
        self.trackers: list = []  # W&B / MLflow / trackio (`colocate.trackers`): the same scalars
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(log_dir=os.path.join(run_dir, "tb", role), purge_step=first_step or None)

    def scalars(self, namespace: str, values: dict[str, float], step: int, *, trackers: bool = True) -> None:
        """`values` at `step` into TensorBoard, and into the trackers unless `trackers` is False: a
        tracker takes steps in order (W&B drops a smaller step than the last), so only the training
        step may index what reaches them."""
        for tracker in self.trackers if trackers else ():
            tracker.log({f"{namespace}/{k}": float(v) for k, v in values.items()}, step)
        if self._tb is None:
            return
        for key, value in values.items():
            self._tb.add_scalar(f"{namespace}/{key}", float(value), step)

    def histogram(self, tag: str, values, step: int) -> None:
        if self._tb is not None and len(values):
            self._tb.add_histogram(tag, values, step)

    def print(self, message: str) -> None:
        if self.enabled:
            print(f"[{time.strftime('%H:%M:%S')} {self.role}] {message}", file=sys.stdout, flush=True)

    def alert(self, name: str, message: str, step: int) -> None:
        """Loud on the console (every rank) and counted in TensorBoard (`alerts/<name>`)."""
        print(f"[{time.strftime('%H:%M:%S')} {self.role}] ALERT {name}: {message}", file=sys.stderr, flush=True)
        self.scalars("alerts", {name: 1.0}, step)

    def flush(self) -> None:
        """Put what was logged on disk (once a step: a run killed with kill -9 keeps its curves up
        to its last step, which a resume then purges and logs again)."""
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()


def percentiles(values: list[float], prefix: str) -> dict[str, float]:
    """{prefix_p50, prefix_p95} of the values (nothing when empty)."""
    if not values:
        return {}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]
    return {f"{prefix}_p50": pick(0.50), f"{prefix}_p95": pick(0.95)}


class MonitorThread(threading.Thread):
    """A daemon thread whose failure is kept for the role loop (`RoleMonitors.check`) instead of
    dying unseen: a full disk under the TensorBoard writer must end the rank with one clear line."""

    def __init__(self, name: str):
        super().__init__(name=name, daemon=True)
        self.error: BaseException | None = None
        # Not `_stop`: `threading.Thread` calls its own `_stop()` on join and in a fork's child (a
        # reward using multiprocessing with fork), which an attribute of that name would shadow.
        self.halted = threading.Event()

    def run(self) -> None:
        try:
            self.loop()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            self.error = e

    def loop(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self.halted.set()


def memory_peaks(device: torch.device) -> dict[str, float]:
    """This rank's GPU memory in GiB: PyTorch's allocated and reserved peaks in this process, and what
    NVML says the whole GPU holds at the end of the run (`device_used_at_end`: every process on it,
    a vLLM engine core's pool, the CUDA contexts; PyTorch's cache keeps a learner's reserved peak).
    Empty on CPU. What the memory plan's estimates are checked against."""
    import torch
    if device.type != "cuda":
        return {}
    peaks = {"allocated": torch.cuda.max_memory_allocated(device) / 2**30,
             "reserved": torch.cuda.max_memory_reserved(device) / 2**30}
    used = nvml_memory(device.index or 0)
    if used is not None:
        peaks["device_used_at_end"] = used[1] / 2**30
    return {k: round(v, 2) for k, v in peaks.items()}


class SystemSampler(MonitorThread):
    """Samples NVML (GPU util %, SM clock MHz, memory used GiB) and CPU % every `interval_s`, into
    TensorBoard at the seconds since its start."""
    MAX_TRACE = 100_000

    def __init__(self, writer: MetricsWriter, interval_s: float, gpu_index: int | None):
        super().__init__("colocate-system-sampler")
        self.writer, self.interval_s, self.gpu_index = writer, interval_s, gpu_index
        self._t0 = time.time()
        self.samples = 0
        self.gpu_util: list[list[float]] = []
        """[[unix time, GPU util %], ...] (the last MAX_TRACE samples): the e2e benchmark's NVML busy %."""

    def loop(self) -> None:
        import psutil
        proc = psutil.Process()
        proc.cpu_percent(None)
        psutil.cpu_percent(None)
        # this rank's CUDA device as NVML numbers it (CUDA_VISIBLE_DEVICES mapped); None: CPU metrics only
        handle = None if self.gpu_index is None else nvml_device(self.gpu_index)
        while not self.halted.wait(self.interval_s):
            values = {"cpu_percent_process": proc.cpu_percent(None), "cpu_percent_host": psutil.cpu_percent(None),
                      "rss_gib": proc.memory_info().rss / 2**30}
            if handle is not None:
                import pynvml
                util = pynvml.nvmlDeviceGetUtilizationRates(handle)
                values.update(gpu_util_percent=util.gpu, gpu_mem_util_percent=util.memory,
                              sm_clock_mhz=pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                              gpu_mem_used_gib=pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**30)
                self.gpu_util.append([time.time(), float(util.gpu)])
                del self.gpu_util[:-self.MAX_TRACE]
            # indexed by seconds, so TensorBoard only: on a tracker the seconds would pass the training
            # steps and W&B would then drop every step's scalars (the trackers sample the system themselves)
            self.writer.scalars("system", values, int(time.time() - self._t0), trackers=False)
            self.samples += 1


class StallWatchdog(MonitorThread):
    """Alerts (once per stall) when `beat()` has not been called for `timeout_s` seconds."""

    def __init__(self, writer: MetricsWriter, timeout_s: float, what: str):
        super().__init__("colocate-stall-watchdog")
        self.writer, self.timeout_s, self.what = writer, timeout_s, what
        self._last = time.monotonic()
        self._alerted = False
        self.step = 0

    def beat(self, step: int) -> None:
        self._last, self._alerted, self.step = time.monotonic(), False, step

    def loop(self) -> None:
        while not self.halted.wait(min(self.timeout_s / 4, 5.0)):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s and not self._alerted:
                self._alerted = True
                self.writer.alert("stalled", f"no {self.what} for {idle:.0f}s (step {self.step})", self.step)


@dataclass
class RoleMonitors:
    watchdog: StallWatchdog
    sampler: SystemSampler | None

    def gpu_util(self) -> list[list[float]]:
        """NVML samples [[unix time, util %], ...] so far (empty without a GPU or a sampler)."""
        return list(self.sampler.gpu_util) if self.sampler is not None else []

    def check(self) -> None:
        """Raise, in the role loop, the error a monitor thread died of."""
        for thread in (self.watchdog, self.sampler):
            if thread is not None and thread.error is not None:
                raise RuntimeError(f"{thread.name} failed: {type(thread.error).__name__}: {thread.error}") \
                    from thread.error


@contextlib.contextmanager
def role_monitors(metrics_cfg, writer: MetricsWriter, *, gpu_index: int | None, what: str):
    """Start the system sampler and stall watchdog for a role loop; stop them on exit."""
    threads: list = []
    sampler = None
    if writer.enabled and metrics_cfg.nvml_interval_s > 0:
        sampler = SystemSampler(writer, metrics_cfg.nvml_interval_s, gpu_index)
        threads.append(sampler)
    # With the watchdog off, a never-started one still takes beats.
    watchdog = StallWatchdog(writer, metrics_cfg.stall_timeout_s, what)
    if metrics_cfg.stall_timeout_s > 0:
        threads.append(watchdog)
    for t in threads:
        t.start()
    try:
        yield RoleMonitors(watchdog, sampler)
    finally:
        for t in threads:
            t.stop()


class NullProfiler:
    def step(self) -> None:
        pass

    def stop(self) -> None:
        pass


def profile_out_dir(metrics_cfg) -> str:
    """<profile_dir>/<run name>: where a run's profiler traces go."""
    return os.path.join(metrics_cfg.profile_dir, os.path.basename(os.path.normpath(metrics_cfg.run_dir)))


def engine_profile_dir(metrics_cfg) -> str:
    """Where an engine's own trace goes (vLLM's engine core), or "" when none is wanted."""
    if not (metrics_cfg.profile and metrics_cfg.profile_engine_steps > 0):
        return ""
    return os.path.abspath(os.path.join(profile_out_dir(metrics_cfg), "inference-engine"))


class EngineProfileWindow:
    """Starts an engine's own profiler (`engine.start_profile`) over the steps the role profiler
    records (after profile_wait + profile_warmup steps, for profile_active steps), with the same
    `.step()` / `.stop()` calls. A no-op for engines without one (`can_profile`: vLLM built with a
    profile_dir; the HF engine runs in the role's process, where the role profiler sees its kernels)."""

    def __init__(self, metrics_cfg, engine):
        self.engine = engine if engine.can_profile else None
        self.first = metrics_cfg.profile_wait + metrics_cfg.profile_warmup
        self.last = self.first + metrics_cfg.profile_active
        self.steps, self.running = 0, False
        self._at(0)

    def _at(self, steps: int) -> None:
        if self.engine is None:
            return
        if steps == self.first and not self.running:
            self.engine.start_profile()
            self.running = True
        elif steps >= self.last:
            self.stop()

    def step(self) -> None:
        self.steps += 1
        self._at(self.steps)

    def stop(self) -> None:
        if self.running:
            self.running = False
            self.engine.stop_profile()
        self.engine = None


class Profilers:
    """Several profilers driven as one (`.step()`, `.stop()`)."""

    def __init__(self, *profilers):
        self.profilers = profilers

    def step(self) -> None:
        for p in self.profilers:
            p.step()

    def stop(self) -> None:
        """Stop them all, even if one fails (the first error is raised after)."""
        error = None
        for p in self.profilers:
            try:
                p.stop()
            except Exception as e:  # noqa: BLE001 - re-raised below, once every profiler had its stop
                error = error or e
        if error is not None:
            raise error


def make_profiler(metrics_cfg, role: str, rank: int, *, enabled: bool):
    """A started torch.profiler recording one window of steps, or a no-op. Call `.step()` per step."""
    if not (metrics_cfg.profile and enabled):
        return NullProfiler()
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler
    out_dir = profile_out_dir(metrics_cfg)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities,
                   schedule=schedule(wait=metrics_cfg.profile_wait, warmup=metrics_cfg.profile_warmup,
                                     active=metrics_cfg.profile_active, repeat=1),
                   on_trace_ready=tensorboard_trace_handler(out_dir, worker_name=f"{role}-rank{rank}"),
                   record_shapes=False, profile_memory=False, with_stack=False)
    prof.start()
    return prof


class CollapseMonitor:
    """The learner's per-step health checks (docs/design.md: a policy collapse after convergence)
    -> alerts, each `(name, message)` once when its condition starts (it re-arms when it ends):

      * reward_drop: the mean reward of the last `alert_window` steps fell more than
        `reward_drop_alert` below its running best;
      * entropy_collapse: the window's mean entropy fell below `entropy_alert` times the window
        before it;
      * grad_norm_spike: a gradient norm (before clipping) above `grad_norm_alert` times the
        median of the previous window.

    `good_step` is the last step whose reward window ended a full window before the last healthy
    one: nothing trained after it shows in a window that was still healthy (stop_on_collapse keeps
    the newest checkpoint at or before it)."""

    def __init__(self, metrics_cfg):
        m = metrics_cfg
        self.window, self.reward_drop, self.entropy_drop, self.grad_factor = (
            m.alert_window, m.reward_drop_alert, m.entropy_alert, m.grad_norm_alert)
        self.rewards: list[float] = []
        self.entropies: list[float] = []
        self.grad_norms: list[float] = []
        self.best: float | None = None
        self.healthy_step = 0
        self.active: set[str] = set()
        self.collapsed = False  # reward_drop started at the last update

    @property
    def good_step(self) -> int:
        return max(0, self.healthy_step - self.window)

    def _edge(self, name: str, on: bool) -> bool:
        """Whether alert `name` starts now (on, and was not on at the last update)."""
        started = on and name not in self.active
        (self.active.add if on else self.active.discard)(name)
        return started

    def update(self, step: int, reward: float, entropy: float, grad_norm: float) -> list[tuple[str, str]]:
        """One step's stats (step counted from 1) -> the alerts that start at it."""
        w, alerts = self.window, []
        self.rewards = (self.rewards + [reward])[-w:]
        self.entropies = (self.entropies + [entropy])[-2 * w:]
        history = self.grad_norms[-w:]
        self.grad_norms = (self.grad_norms + [grad_norm])[-w - 1:]
        self.collapsed = False
        if self.reward_drop > 0 and len(self.rewards) == w:
            mean = sum(self.rewards) / w
            self.best = mean if self.best is None else max(self.best, mean)
            dropped = mean < (1.0 - self.reward_drop) * self.best
            if not dropped:
                self.healthy_step = step
            if self._edge("reward_drop", dropped):
                self.collapsed = True
                alerts.append(("reward_drop", f"mean reward of the last {w} steps {mean:.3f} is more than "
                               f"{self.reward_drop:.0%} below its best {self.best:.3f} (step {step})"))
        if self.entropy_drop > 0 and len(self.entropies) == 2 * w:
            prev, cur = sum(self.entropies[:w]) / w, sum(self.entropies[w:]) / w
            if self._edge("entropy_collapse", cur < self.entropy_drop * prev):
                alerts.append(("entropy_collapse", f"mean entropy of the last {w} steps {cur:.4f} is below "
                               f"{self.entropy_drop} x the {w} steps before ({prev:.4f}) (step {step})"))
        if self.grad_factor > 0 and len(history) == w:
            median = sorted(history)[w // 2]
            if self._edge("grad_norm_spike", grad_norm > self.grad_factor * median):
                alerts.append(("grad_norm_spike", f"gradient norm {grad_norm:.4g} is over {self.grad_factor:g} x "
                               f"the median {median:.4g} of the last {w} steps (step {step})"))
        return alerts
