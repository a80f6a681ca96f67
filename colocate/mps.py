"""CUDA MPS for ranks that share a GPU (`topology.mps`).

Two processes on one GPU (the one-GPU presets: an inference rank and a learner rank) get time
slices of it by default: while one runs a kernel the other waits, even when neither fills the SMs.
Under MPS (NVIDIA's Multi-Process Service) their kernels run side by side. `colocate train` starts a
private MPS control daemon before torchrun, hands its pipe directory to every rank (and so to vLLM's
engine core), and stops it when torchrun returns:

    with launch(mode, processes_per_gpu) as env:   # {} when MPS is off or unavailable (`auto`)
        run torchrun with {**os.environ, **env}

A job already under MPS (CUDA_MPS_PIPE_DIRECTORY set, or the system daemon's pipe at /tmp/nvidia-mps)
is left as it is. A daemon that starts but serves no client is stopped again: `probe` creates a
context with the daemon's environment and asks the daemon for its server. `auto` then says why in
one line and runs without MPS; `on` stops with MpsError (exit 2 from `colocate train`).
A job started by torchrun directly gets no daemon: start one yourself (NVIDIA's MPS guide).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile

CONTROL = "nvidia-cuda-mps-control"
SYSTEM_PIPE = "/tmp/nvidia-mps"

# Run in a fresh interpreter with the daemon's environment: a CUDA context (the driver API, no torch),
# then the daemon's list of servers, which is empty unless the context was served by MPS.
PROBE = r"""
import ctypes, subprocess, sys
cuda = ctypes.CDLL("libcuda.so.1")
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
for name, call in (("cuInit", lambda: cuda.cuInit(0)), ("cuDeviceGet", lambda: cuda.cuDeviceGet(ctypes.byref(dev), 0)),
                   ("cuDevicePrimaryCtxRetain", lambda: cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)),
                   ("cuCtxSetCurrent", lambda: cuda.cuCtxSetCurrent(ctx)),
                   ("cuMemAlloc", lambda: cuda.cuMemAlloc_v2(ctypes.byref(ptr), 1 << 20))):
    code = call()
    if code:
        sys.exit(f"{name} failed with CUDA error {code}")
servers = subprocess.run([sys.argv[1]], input="get_server_list\n", capture_output=True, text=True, timeout=30).stdout
if not servers.strip():
    sys.exit("a CUDA context was created but no MPS server serves it")
"""


class MpsError(RuntimeError):
    """MPS was asked for (`topology.mps: on`) and cannot run here; the message says why."""


def wanted(mode: str, processes_per_gpu: int) -> bool:
    """`on` always; `auto` where ranks share a GPU."""
    return mode == "on" or (mode == "auto" and processes_per_gpu > 1)


def running_pipe(environ: dict) -> str | None:
    """The pipe directory of an MPS daemon this job already runs under, else None."""
    if environ.get("CUDA_MPS_PIPE_DIRECTORY"):
        return environ["CUDA_MPS_PIPE_DIRECTORY"]
    return SYSTEM_PIPE if os.path.exists(os.path.join(SYSTEM_PIPE, "control")) else None


def control(command: str, env: dict, timeout_s: float = 60) -> str:
    """One command to the control daemon of `env`'s pipe directory -> its answer."""
    done = subprocess.run([CONTROL], input=command + "\n", capture_output=True, text=True, env=env, timeout=timeout_s)
    return done.stdout


def probe(env: dict, binary: str) -> str | None:
    """None when a CUDA context created with `env` is served by MPS, else the reason."""
    try:
        done = subprocess.run([sys.executable, "-c", PROBE, binary], capture_output=True, text=True, env=env,
                              timeout=120)
    except subprocess.TimeoutExpired:
        return "a CUDA context under MPS took over 120 s"
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["the probe failed"])[-1]


def start() -> tuple[dict, str]:
    """A private daemon, verified -> (the clients' environment, its root directory); MpsError if it
    cannot start or serve a client."""
    path = shutil.which(CONTROL)
    if path is None:
        raise MpsError(f"{CONTROL} is not on PATH (it comes with the NVIDIA driver's utilities)")
    root = tempfile.mkdtemp(prefix="colocate-mps-")
    env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(root, "pipe"), "CUDA_MPS_LOG_DIRECTORY": os.path.join(root, "log")}
    for d in env.values():
        os.makedirs(d)
    full = {**os.environ, **env}
    done = subprocess.run([path, "-d"], capture_output=True, text=True, env=full, timeout=60)
    if done.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        raise MpsError(f"{CONTROL} -d exited with {done.returncode}: {(done.stderr or done.stdout).strip()}")
    reason = probe(full, path)
    if reason is not None:
        stop(env, root)
        raise MpsError(reason)
    return env, root


def stop(env: dict, root: str) -> None:
    """Quit the daemon (it waits for its clients to end) and remove its directory."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        control("quit", {**os.environ, **env})
    shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def launch(mode: str, processes_per_gpu: int):
    """The ranks' extra environment for the length of the job: a private daemon's pipe directory,
    or {} (off, not needed, already under MPS, or unavailable with `auto`: one line says why)."""
    if not wanted(mode, processes_per_gpu):
        yield {}
        return
    pipe = running_pipe(os.environ)
    if pipe is not None:
        print(f"colocate: topology.mps={mode}: the job runs under the MPS daemon at {pipe}", flush=True)
        yield {}
        return
    try:
        env, root = start()
    except MpsError as e:
        if mode == "on":
            raise
        print(f"colocate: topology.mps=auto: MPS did not start ({e}); the ranks sharing a GPU take turns on it",
              flush=True)
        yield {}
        return
    print(f"colocate: MPS on ({processes_per_gpu} processes per GPU): daemon at {env['CUDA_MPS_PIPE_DIRECTORY']}",
          flush=True)
    try:
        yield env
    finally:
        stop(env, root)
