"""topology.mps: when `colocate train` runs a job under a private MPS daemon, how it verifies the
daemon serves a client, and that it always stops it. On the CPU the daemon is a stand-in script that
logs what it is told; the real one runs in tests/test_mps_gpu.py."""
import os
import subprocess
import sys

import pytest

from colocate import cli, mps
from tests.test_cli import TINY, no_torchrun_env

FAKE_CONTROL = """#!/usr/bin/env bash
# nvidia-cuda-mps-control's stand-in: `-d` starts, stdin commands are answered; each logged with the pipe.
log="$CUDA_MPS_PIPE_DIRECTORY/../calls.log"
if [ "${1:-}" = "-d" ]; then echo "start $CUDA_MPS_PIPE_DIRECTORY" >> "$log"; touch "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0; fi
read -r command
echo "$command $CUDA_MPS_PIPE_DIRECTORY" >> "$log"
cp "$log" "$CALLS_COPY"
"""


@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    """A stand-in control binary on PATH -> the file its calls are copied to (the daemon's own
    directory is removed when it stops)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / mps.CONTROL
    script.write_text(FAKE_CONTROL)
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setattr(mps, "SYSTEM_PIPE", str(tmp_path / "no-system-daemon"))
    monkeypatch.setenv("CALLS_COPY", str(tmp_path / "calls.log"))
    return tmp_path / "calls.log"


def test_which_jobs_want_mps():
    assert [mps.wanted(m, 2) for m in ("off", "auto", "on")] == [False, True, True]
    assert [mps.wanted(m, 1) for m in ("off", "auto", "on")] == [False, False, True]


def test_off_or_one_process_per_gpu_starts_nothing(fake_control):
    for mode, per_gpu in (("off", 2), ("auto", 1)):
        with mps.launch(mode, per_gpu) as env:
            assert env == {}
    assert not fake_control.exists()


def test_a_job_already_under_mps_is_left_to_its_daemon(fake_control, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/somewhere/mps")
    with mps.launch("on", 2) as env:
        assert env == {}
    assert "runs under the MPS daemon at /somewhere/mps" in capsys.readouterr().out
    assert not fake_control.exists()


def test_without_the_control_binary_auto_says_why_and_on_refuses(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setattr(mps, "SYSTEM_PIPE", str(tmp_path / "none"))
    with mps.launch("auto", 2) as env:
        assert env == {}
    assert "MPS did not start (nvidia-cuda-mps-control is not on PATH" in capsys.readouterr().out
    with pytest.raises(mps.MpsError, match="not on PATH"), mps.launch("on", 2):
        pass


def test_a_daemon_that_serves_no_client_is_stopped_again(fake_control, capsys):
    """The real probe: here no CUDA driver answers it, so the daemon is told to quit and the job
    runs without MPS (auto)."""
    with mps.launch("auto", 2) as env:
        assert env == {}
    calls = fake_control.read_text().splitlines()
    assert [c.split()[0] for c in calls] == ["start", "quit"] and calls[0].split()[1] == calls[1].split()[1]
    assert not os.path.exists(calls[0].split()[1])  # its directory is gone
    assert "MPS did not start" in capsys.readouterr().out


def test_a_served_daemon_hands_its_pipe_to_the_job_and_quits_after(fake_control, monkeypatch):
    monkeypatch.setattr(mps, "probe", lambda env, binary: None)
    with mps.launch("on", 2) as env:
        pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
        assert os.path.exists(os.path.join(pipe, "control")) and os.path.isdir(env["CUDA_MPS_LOG_DIRECTORY"])
        assert not fake_control.exists()  # nothing but the start so far
    assert fake_control.read_text().splitlines() == [f"start {pipe}", f"quit {pipe}"]
    assert not os.path.exists(pipe)
    with pytest.raises(KeyError), mps.launch("on", 2):  # a job that fails stops its daemon too
        raise KeyError("rank failed")
    assert fake_control.read_text().splitlines()[-1].startswith("quit")


def test_colocate_train_runs_torchrun_under_the_daemon(fake_control, monkeypatch, tmp_path):
    no_torchrun_env(monkeypatch)
    monkeypatch.setattr(mps, "probe", lambda env, binary: None)
    seen, popen = [], subprocess.Popen

    class Torchrun:  # stands in for subprocess.Popen(torchrun): records what the ranks would get
        def __init__(self, cmd, env):
            seen.append((cmd, env, fake_control.exists()))

        def wait(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", lambda cmd, **kw: Torchrun(cmd, **kw) if "torch.distributed.run" in cmd
                        else popen(cmd, **kw))
    args = ["--config", TINY, f"--metrics.run_dir={tmp_path / 'run'}", "--topology.mps=on"]
    assert cli.main(["train", *args]) == 0
    (cmd, env, quit_before), = seen
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and not quit_before
    assert fake_control.read_text().splitlines() == [f"start {env['CUDA_MPS_PIPE_DIRECTORY']}",
                                                     f"quit {env['CUDA_MPS_PIPE_DIRECTORY']}"]


def test_colocate_train_with_mps_on_and_no_daemon_is_one_line_and_exit_2(monkeypatch, tmp_path, capsys):
    no_torchrun_env(monkeypatch)
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setattr(mps, "SYSTEM_PIPE", str(tmp_path / "none"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(cli.os, "execvpe", lambda *a: pytest.fail("torchrun started without MPS"))
    code = cli.main(["train", "--config", TINY, f"--metrics.run_dir={tmp_path / 'run'}", "--topology.mps=on"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "topology.mps=on: MPS cannot run here" in err[0], err


def test_the_probe_reports_why_a_context_failed(tmp_path):
    """Without a CUDA driver (this CPU machine) or with one (a GPU machine without a daemon at that
    pipe), the probe names a reason instead of passing."""
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "no-daemon")}
    reason = mps.probe(env, sys.executable)  # `python` as the control binary lists no server
    assert reason and ("libcuda" in reason or "CUDA error" in reason or "no MPS server" in reason), reason


@pytest.mark.gpu
def test_both_roles_on_one_gpu_train_under_mps(tmp_path):
    """The real daemon: `colocate train --topology.mps=on` runs 2 processes on one GPU (the HF engine)
    for 3 steps with every adapter checked bit for bit on the engine (CUDA IPC between MPS clients),
    then the daemon is gone."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from tests.conftest import REPO
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
    env.pop("CUDA_MPS_PIPE_DIRECTORY", None)
    cmd = [sys.executable, "-m", "colocate.cli", "train", "--nproc=2", "--config", "configs/cpu-tiny.yaml",
           "--engine.kind=hf", "--learner.num_steps=3", "--sync.check_checksum=true", "--topology.mps=on",
           f"--metrics.run_dir={tmp_path / 'run'}", f"--model.cache_dir={tmp_path / 'cache'}"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("colocate: MPS on (2 processes per GPU)"))
    pipe = line.rpartition("daemon at ")[2]
    assert not os.path.exists(pipe)
    assert os.path.exists(tmp_path / "run" / "summary.json")
