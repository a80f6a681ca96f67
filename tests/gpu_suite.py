"""How the GPU suite shares one GPU: the vLLM runs its tests read, started together, and the check
that every GPU test leaves the card as it found it.

**The runs.** Each vLLM test (tests/test_vllm_gpu.py, tests/test_agent_gpu.py) asserts on what one
subprocess run wrote: a training under torchrun or a benchmark. Run one after another they take
most of the suite's time, and most of that is each run's own start-up and its host-bound steps
(tiny models), not the GPU. So the tests name their run (`@pytest.mark.gpu_job("NAME")`), the
session starts every selected run at its start (`GpuJobs`: at most `slots()` at a time, longest
first, beside the in-process GPU tests), and each test waits for its own. Each run:
  * takes a small share of GPU 0 (`engine.gpu_memory_utilization` = `SHARE_GIB` of the card: what
    vLLM wants free at start, and what merged mode's copy is taken from) with a fixed KV cache
    (`engine.kv_cache_gib`): vLLM's memory profile would count the other runs' memory as its own;
  * has its own vLLM compile cache (two runs writing one cache at once is not something vLLM
    promises to survive);
  * carries a marker in its environment (`RUN_MARKER`) that every process of it inherits: what is
    left of it when it ends is killed (no stray engine core keeps memory) and named.
`COLOCATE_GPU_JOBS=N` caps the runs at a time (1: one after another).

**The card as found.** `held_bytes` is what this (pytest's) process holds in CUDA's caching
allocator once everything it can drop is dropped; `gpu_processes` the processes on the GPU outside
the runs. A GPU test that leaves more of either than it found is named (tests/conftest.py).
"""
from __future__ import annotations

import dataclasses
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARE_GIB = 12.0
"""Each run's share of the card: vLLM checks it is free at start; merged mode's copy of the adapted
weights and 1 GiB of headroom come out of it (`vllm_settings.merged_memory_share` wants > 0.05
of the card left)."""
KV_CACHE_GIB = 1.0
"""Each run's KV cache: the tiny models' longest batches need a few MiB of it."""
IN_PROCESS_GIB = 32.0
"""What the in-process GPU tests beside the runs hold at once, at most (about 32 GiB was seen held
by them on an H200, issue 61): kept free of runs."""
CPUS_PER_RUN = 4
"""A run keeps three processes busy (learner rank, inference rank, vLLM engine core) and a few threads."""
MAX_SLOTS = 4
RUN_MARKER = "COLOCATE_GPU_SUITE_RUN"
"""Set in a run's environment (its directory): every process of the run inherits it."""


@dataclasses.dataclass(frozen=True)
class Job:
    name: str
    cmd: list
    timeout_s: int
    env: dict = dataclasses.field(default_factory=dict)
    expected_s: int = 60
    """Roughly how long it runs alone: the longest start first."""


@dataclasses.dataclass(frozen=True)
class Finished:
    name: str
    returncode: int
    output: str
    dir: Path
    wall_s: float
    stray: list
    """Processes of the run still alive when its command ended (killed then)."""

    def tail(self, n: int = 6000) -> str:
        return self.output[-n:]


def share_overrides(total_bytes: int, engines: int = 1) -> list[str]:
    """The config overrides that size one run's engines to its share of a card of `total_bytes`
    (`engines` of them in the run: a part each)."""
    share = min(0.9, SHARE_GIB / engines * 2**30 / total_bytes)
    return [f"--engine.gpu_memory_utilization={share:.3f}", f"--engine.kv_cache_gib={KV_CACHE_GIB}"]


def torchrun_train(config: str, run: Path, *overrides, nproc: int = 2) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "colocate.train", "--config", config, "--engine.kind=vllm",
            f"--model.cache_dir={run / 'cache'}", f"--metrics.run_dir={run / 'run'}", *overrides]


def job_table(root: Path, total_bytes: int) -> dict:
    """Every run a GPU test reads, by name (the tests say what each one's run shows)."""
    share = share_overrides(total_bytes)
    faults = os.path.join(REPO, "tests", "canary_faults")
    jobs = [Job("agent-learn", torchrun_train("configs/cpu-calculator-agent.yaml", root / "agent-learn",
                                              "--learner.num_steps=300", *share), 900, expected_s=420)]
    for update, masks in (("drain", "vllm"), ("inflight", "vllm"), ("drain", "ours")):
        name = f"learn-{update}-{masks}"
        jobs.append(Job(name, torchrun_train("configs/cpu-tiny.yaml", root / name, f"--rollout.update={update}",
                                             f"--engine.constraint_masks={masks}", *share), 900, expected_s=260))
    fp8 = ["--engine.quantization=fp8", "--loss.tis_cap=2.0"]  # vLLM's online FP8, corrected by TIS
    fp8_merged = [*fp8, "--engine.lora_mode=merged"]  # the adapter requantized into the FP8 weights
    for name, engine in (("learn-fp8", fp8), ("learn-fp8-merged", fp8_merged)):
        jobs.append(Job(name, torchrun_train("configs/cpu-tiny.yaml", root / name, *engine, *share), 900,
                        expected_s=260))
    jobs.append(Job("agent-parity", torchrun_train(
        "configs/cpu-calculator-agent.yaml", root / "agent-parity", "--learner.updates_per_batch=2",
        "--learner.max_policy_lag=0", "--learner.num_steps=8", *share), 480, expected_s=150))
    for mode in ("slot", "merged", "fp8", "fp8-merged"):
        name = f"canary-{mode}"
        engine = {"fp8": fp8, "fp8-merged": fp8_merged}.get(mode, [f"--engine.lora_mode={mode}"])  # fp8: slot mode
        cmd = [sys.executable, "-m", "colocate.cli", "train", "--config", "configs/cpu-tiny.yaml", "--nproc", "2",
               "--engine.kind=vllm", *engine, "--learner.num_steps=200",
               f"--model.cache_dir={root / name / 'cache'}", f"--metrics.run_dir={root / name / 'run'}", *share]
        jobs.append(Job(name, cmd, 900, expected_s=120, env={
            "CANARY_TEST_FAULT": "vllm-skip",
            "PYTHONPATH": os.pathsep.join([faults, REPO, os.environ.get("PYTHONPATH", "")])}))
    jobs.append(Job("two-engines", torchrun_train(  # 2 engines + the learner on GPU 0, the adapter by CUDA IPC
        "configs/cpu-tiny.yaml", root / "two-engines", "--topology.num_inference=2", "--topology.num_learners=1",
        "--learner.num_steps=40", "--learner.max_policy_lag=2", "--sync.check_checksum=true",
        *share_overrides(total_bytes, engines=2), nproc=3), 600, expected_s=120))
    variant = "share:" + ",".join(o.removeprefix("--") for o in share)
    jobs.append(Job("logprob-calls", [sys.executable, "scripts/benchmark.py", "--profile", "dataset_rollout",
                                      "--shape", "tiny", "--sides", "ours+share", "--variant", variant,
                                      "--rounds", "1", "--out", str(root / "logprob-calls" / "dsroll.json")],
                    600, expected_s=90))
    return {j.name: j for j in jobs}


def slots(free_bytes: int) -> int:
    """Runs at a time: by free memory (a share each, beside the in-process tests' `IN_PROCESS_GIB`),
    cores, `COLOCATE_GPU_JOBS`."""
    by_memory = int((free_bytes - IN_PROCESS_GIB * 2**30) // (SHARE_GIB * 2**30))
    by_cpus = (os.cpu_count() or 1) // CPUS_PER_RUN
    cap = int(os.environ.get("COLOCATE_GPU_JOBS", MAX_SLOTS))
    return max(0, min(by_memory, by_cpus, cap, MAX_SLOTS))


class GpuJobs:
    """Runs `jobs` (longest first), at most `num_slots` at a time, on a thread; `result` waits for one."""

    def __init__(self, jobs: list, num_slots: int, root: Path, grace_s: float = 20.0):
        self.jobs = sorted(jobs, key=lambda j: -j.expected_s)
        self.grace_s = grace_s  # how long a run's processes may outlive its command
        self.num_slots, self.root = num_slots, root
        self.done: dict[str, Finished] = {}
        self.running: set[str] = set()  # the markers of the runs in flight
        self.cond = threading.Condition()
        self.closed = False
        self.start_error = ""
        self.thread = threading.Thread(target=self._run_all, name="gpu-jobs", daemon=True)
        self.thread.start()

    def _run_all(self) -> None:
        try:
            self._start_all()
        except Exception as e:  # noqa: BLE001 - a run that cannot start: its reader says why
            self.start_error = f"{type(e).__name__}: {e}"
        finally:  # every reader is woken (a run never started then reads as such)
            with self.cond:
                self.closed = True
                self.cond.notify_all()

    def _start_all(self) -> None:
        pending = list(self.jobs)
        workers = []
        while pending and not self.closed:
            with self.cond:
                self.cond.wait_for(lambda: self.closed or len(self.running) < self.num_slots)
                if self.closed:
                    break
                job = pending.pop(0)
                proc = self._start(job)
                self.running.add(str(self.root / job.name))
            worker = threading.Thread(target=self._finish, args=(job, proc, time.perf_counter()), daemon=True)
            worker.start()
            workers.append(worker)
        for worker in workers:
            worker.join()

    def _start(self, job: Job) -> subprocess.Popen:
        out = self.root / job.name
        out.mkdir(parents=True, exist_ok=True)
        gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "NCCL_CUMEM_ENABLE": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0",
               "CUDA_VISIBLE_DEVICES": gpu, "VLLM_CACHE_ROOT": str(out / "vllm-cache"), RUN_MARKER: str(out), **job.env}
        log = open(out / "output.log", "w")
        proc = subprocess.Popen(job.cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return proc

    def _finish(self, job: Job, proc: subprocess.Popen, t0: float) -> None:
        returncode, stray, output = -1, [], ""
        try:
            returncode = watch(proc, str(self.root / job.name), job.timeout_s)
            stray = kill_run(str(self.root / job.name), self.grace_s)
            proc.wait()  # reaped, also after its limit
            output = (self.root / job.name / "output.log").read_text(errors="replace")
            if returncode is None:
                output += f"\n[gpu_suite] {job.name}: killed at its {job.timeout_s} s limit"
        except Exception as e:  # noqa: BLE001 - the run's reader gets the reason instead of waiting forever
            output += f"\n[gpu_suite] {job.name}: {type(e).__name__}: {e}"
        self._record(job, returncode, output, stray, t0)

    def _record(self, job: Job, returncode, output: str, stray: list, t0: float) -> None:
        with self.cond:
            self.running.discard(str(self.root / job.name))
            self.done[job.name] = Finished(job.name, -9 if returncode is None else returncode, output,
                                           self.root / job.name, time.perf_counter() - t0, stray)
            self.cond.notify_all()

    def result(self, name: str) -> Finished:
        with self.cond:
            if not any(j.name == name for j in self.jobs):
                raise KeyError(f"no GPU run named {name!r} was started (is the test marked gpu_job({name!r})?)")
            self.cond.wait_for(lambda: name in self.done or (self.closed and not self.running))
            if name not in self.done:
                raise RuntimeError(f"the GPU run {name} never started: {self.start_error or 'the runner was closed'}")
            return self.done[name]

    def close(self) -> None:
        with self.cond:
            self.closed = True
            running = set(self.running)
            self.cond.notify_all()
        for marker in running:
            kill_run(marker)


SEEN: dict[int, tuple[str, str]] = {}
"""{pid: (its start time, run marker)} of every process `watch` saw in a run: a process that lost both
its marker and its marked parent (`run_of`) is still known as the run's."""


def _start_time(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def watch(proc: subprocess.Popen, marker: str, timeout_s: float):
    """Wait for the run's command (None past `timeout_s`), noting its processes in `SEEN` meanwhile."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pid in run_pids(marker):
            SEEN.setdefault(pid, (_start_time(pid), marker))
        try:
            return proc.wait(timeout=min(2.0, max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            pass
    return None


def run_pids(marker: str) -> list[int]:
    """Live processes of the run `marker` (`run_of`): also those that left its process tree or
    session (torchrun starts each rank in a session of its own)."""
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) != os.getpid() and run_of(int(e)) == marker]


def kill_run(marker: str, grace_s: float = 0.0) -> list[int]:
    """SIGKILL every process of the run `marker` still alive `grace_s` after its command ended (an
    engine core may take a few seconds to see its client gone) -> their pids (none for a clean end)."""
    deadline = time.monotonic() + grace_s
    while (left := run_pids(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10.0  # SIGKILL lands asynchronously; the memory is free once they are gone
    while run_pids(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _own_marker(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(RUN_MARKER.encode() + b"="):
                    return item.split(b"=", 1)[1].decode()
    except OSError:
        pass
    return ""


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:  # "pid (comm) state ppid ...": comm may hold spaces
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def run_of(pid: int) -> str:
    """The run marker of process `pid` ("" for none, or a process we cannot read): in its own
    environment, else in its nearest marked ancestor's, else as `watch` saw it. A process may
    overwrite the memory its environment is read from (setproctitle does, for a longer title: vLLM's
    engine core); its parent, or what was seen while the parent lived, still tells whose it is."""
    if pid in SEEN and SEEN[pid][0] == _start_time(pid):
        return SEEN[pid][1]
    for _ in range(32):
        if pid <= 1:
            return ""
        marker = _own_marker(pid)
        if marker:
            return marker
        pid = _parent(pid)
    return ""


def describe(pid: int) -> str:
    """`pid` with its command line (its first 120 characters), for a message naming a process."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        return f"{pid} ({command[:120]})"
    except OSError:
        return str(pid)


def held_bytes() -> int:
    """What this process holds in CUDA's caching allocator after dropping what it can: garbage,
    compiled graphs (they keep their constants), cuBLAS workspaces, cached blocks."""
    import torch
    gc.collect()
    torch._dynamo.reset()
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def gpu_processes() -> dict:
    """{pid: bytes} of the processes on the GPUs (NVML) but this one and the suite's runs (each
    cleaned up by its own end); {} where NVML lists none (some containers hide them)."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:
        return {}
    found = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i)):
            if p.pid != os.getpid() and os.access(f"/proc/{p.pid}/environ", os.R_OK) and not run_of(p.pid):
                found[p.pid] = p.usedGpuMemory or 0  # (a pid we cannot read is gone, or not in this container)
    return found


def gpu_run(gpu_jobs, name: str) -> Finished:
    """The finished run `name` (`gpu_jobs`: the session's `GpuJobs`), or a one-line skip when none
    could start."""
    import pytest
    import torch
    if gpu_jobs is None:
        free, total = torch.cuda.mem_get_info(0)
        pytest.skip(f"no vLLM run could start: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free on GPU 0 (a run "
                    f"takes {SHARE_GIB:.0f} GiB beside {IN_PROCESS_GIB:.0f} for the in-process tests), "
                    f"{os.cpu_count()} CPUs ({CPUS_PER_RUN} a run), COLOCATE_GPU_JOBS="
                    f"{os.environ.get('COLOCATE_GPU_JOBS', 'unset')} (tests/gpu_suite.py)")
    return gpu_jobs.result(name)
