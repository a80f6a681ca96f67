"""How a run ends on a signal through `colocate train`: SIGINT, SIGTERM and SIGHUP (a closed
terminal) stop every rank after the same step with what checkpoints allow (a checkpoint when they
are on, else only the adapter; the summary either way), and the lines say what was written. A
signal during start-up is one line, without a traceback from the middle of an import."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO

TINY = ["--config", "configs/cpu-tiny.yaml", "--learner.num_steps=300", "--metrics.nvml_interval_s=0"]


def start_train(args: list[str], tmp_path, env: dict | None = None, terminal: int | None = None) -> subprocess.Popen:
    """`colocate train` on cpu-tiny in its own session (as a terminal's foreground job), stdout and
    stderr apart, or both on `terminal` (a pty's fd); `args` name the run directory."""
    cmd = [sys.executable, "-m", "colocate.cli", "train", *TINY, f"--model.cache_dir={tmp_path / 'cache'}", *args]
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    out = subprocess.PIPE if terminal is None else terminal
    return subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=out, text=True, env=env, start_new_session=True)


def read_until(proc: subprocess.Popen, pattern: str) -> str:
    """The job's stdout up to the first line matching `pattern` (the job must get there)."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if re.search(pattern, line):
            return "".join(lines)
    pytest.fail(f"the job ended before {pattern!r}: {''.join(lines)[-3000:]}{proc.stderr.read()[-3000:]}")


def finish(proc: subprocess.Popen, seen: str = "") -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=180)
    return proc.returncode, seen + out, err


@pytest.mark.slow
def test_ctrl_c_with_checkpoints_off_claims_none_and_keeps_the_adapter(tmp_path):
    run = tmp_path / "run"
    proc = start_train([f"--metrics.run_dir={run}"], tmp_path)  # cpu-tiny: checkpoints off
    seen = read_until(proc, r"\] step 6/300 ")
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
    code, out, err = finish(proc, seen)
    assert code == 130, (code, out[-3000:], err)
    stop = [line for line in out.splitlines() if "stop requested" in line]
    assert len(stop) == 1, out[-3000:]
    step = int(re.search(r"of step (\d+) ", stop[0]).group(1))
    assert stop[0].endswith(f"stop requested (SIGINT): no checkpoint (checkpoint.enabled is false), the adapter of "
                            f"step {step} is in {run / 'adapter'}; exiting"), stop
    assert "checkpoint at step" not in out and not (run / "checkpoints").exists(), out[-3000:]
    assert (run / "adapter").is_dir() and json.loads((run / "summary.json").read_text())["steps"] == step
    assert err == "colocate: stopped by SIGINT; last checkpoint: none (checkpoint.enabled is false)\n"


@pytest.mark.slow
def test_a_closed_terminal_stops_the_run_like_ctrl_c(tmp_path):
    """The job's terminal goes away (every write to it fails from then on) and SIGHUP follows: the
    ranks stop after the same step with a checkpoint, the adapter and the summary, exit 129."""
    import pty
    run = tmp_path / "run"
    terminal, job_side = pty.openpty()
    proc = start_train([f"--metrics.run_dir={run}", "--checkpoint.enabled=true"], tmp_path, terminal=job_side)
    os.close(job_side)
    shown = b""
    while b"] step 6/300 " not in shown:
        shown += os.read(terminal, 65536)  # an OSError here: the job ended before step 6
    os.close(terminal)  # the window closes
    os.killpg(proc.pid, signal.SIGHUP)
    assert proc.wait(timeout=180) == 129
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] >= 6 and (run / "checkpoints" / f"step-{summary['steps']:06d}").is_dir()
    assert (run / "adapter").is_dir()


def catches_sighup(pid: int) -> bool:
    """Whether process `pid` has a handler for SIGHUP (Linux: the SigCgt mask of /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(line for line in f if line.startswith("SigCgt:")).split()[1]
    except (OSError, StopIteration):
        return False
    return bool(int(caught, 16) >> (signal.SIGHUP - 1) & 1)


def cmdline(process) -> list[str]:
    """A process's command line; [] for one that has ended meanwhile (the launcher's forked checks
    end as a zombie until reaped)."""
    import psutil
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def ranks_starting(proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Wait until both ranks of `proc` run colocate's code: a rank's first act (`lifecycle.quiet_start`)
    takes over the stop signals, SIGHUP among them, before it imports torch. (A signal in the
    interpreter's own start, before any of colocate runs, still gets Python's traceback.)"""
    import psutil
    deadline = time.time() + timeout
    while time.time() < deadline:
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if "colocate.train" in cmdline(p)]
        if len(ranks) >= 2 and all(catches_sighup(p.pid) for p in ranks):
            return
        time.sleep(0.01)
    pytest.fail("the ranks did not start")


def launcher_checking(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Wait until `colocate train` loads torch: it starts torchrun there, beside its checks (the
    checking child loads its own)."""
    import psutil
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any("libtorch" in m.path for m in psutil.Process(proc.pid).memory_maps()):
            return
        time.sleep(0.01)
    pytest.fail("the launcher never loaded torch")


@pytest.mark.slow
@pytest.mark.parametrize("when", ["launcher", "ranks"])
def test_ctrl_c_during_start_up_is_one_line(tmp_path, when):
    """Ctrl-C while `colocate train` starts torchrun beside its checks, or while the ranks import and
    wait for the checks or build (torchrun passes it on): one line, exit 130, no traceback. Which
    line depends on how far the launch got: before torchrun took the signals over, before the checks
    passed (the ranks waiting for them), or after."""
    proc = start_train([f"--metrics.run_dir={tmp_path / 'run'}"], tmp_path)
    if when == "ranks":
        ranks_starting(proc)
    else:
        launcher_checking(proc)
    os.killpg(proc.pid, signal.SIGINT)
    code, out, err = finish(proc)
    assert code == 130, (code, out[-3000:], err)
    lines = err.splitlines()
    waiting = "colocate: stopped by SIGINT before the checks passed; no rank had started its work"
    expected = ({"colocate: train interrupted by SIGINT; no rank had started", waiting} if when == "launcher" else
                {waiting, "colocate: stopped by SIGINT; last checkpoint: none (checkpoint.enabled is false)"})
    assert len(lines) == 1 and lines[0] in expected, err
    assert "step 1/" not in out, out[-3000:]


def test_under_nohup_torchrun_leaves_sighup_alone(monkeypatch):
    """`nohup colocate train ...`: SIGHUP ignored in the launcher, so torchrun is not told to stop the
    job on it (it handles SIGHUP by default); otherwise torchrun's default set stands."""
    from colocate.launcher import launch_env
    monkeypatch.delenv("TORCHELASTIC_SIGNALS_TO_HANDLE", raising=False)
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert launch_env(2)["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGQUIT"
    finally:
        signal.signal(signal.SIGHUP, before)
    assert "TORCHELASTIC_SIGNALS_TO_HANDLE" not in launch_env(2)
