"""The failure tests' hooks (`lifecycle.Faults`): a run gets the null object, which does nothing;
COLOCATE_FAULT, read only at the composition root, selects the injected ones."""
import subprocess
import sys

import pytest
import torch

from colocate.lifecycle import NO_FAULTS, InjectedFaults, faults_from_env
from tests.conftest import REPO


class Batch:
    def __init__(self):
        self.advantages = torch.tensor([1.0, -2.0])


def test_a_run_gets_the_null_object_and_it_does_nothing(monkeypatch):
    monkeypatch.delenv("COLOCATE_FAULT", raising=False)
    faults = faults_from_env()
    assert faults is NO_FAULTS
    batch = Batch()
    faults.before_step(1, 2)
    faults.on_batch(5, batch)
    faults.mid_checkpoint(4)
    assert batch.advantages.tolist() == [1.0, -2.0]


def test_injected_faults_fire_where_and_when_their_spec_says(monkeypatch):
    monkeypatch.setenv("COLOCATE_FAULT", "raise:rank=1:step=3")
    faults = faults_from_env()
    faults.before_step(0, 3)
    faults.before_step(1, 2)
    with pytest.raises(RuntimeError, match="injected fault"):
        faults.before_step(1, 3)
    flip, batch = InjectedFaults("flip:from=2"), Batch()
    flip.on_batch(1, batch)
    assert batch.advantages.tolist() == [1.0, -2.0]
    flip.on_batch(2, batch)
    assert batch.advantages.tolist() == [-1.0, 2.0]
    nan = Batch()
    InjectedFaults("nan:from=0").on_batch(0, nan)
    assert torch.isnan(nan.advantages).all()



LEAVE_PROBE = """
import atexit, sys, threading, time
sys.path.insert(0, {repo!r})
if {with_vllm}:
    sys.modules["vllm"] = type(sys)("vllm")  # as if an engine had been built in this process
from colocate.lifecycle import leave
atexit.register(lambda: print("teardown ran", flush=True))
if {hung_thread}:
    threading.Thread(target=time.sleep, args=(60,)).start()  # an abandoned user call: not a daemon
print("done", flush=True)
leave(3)
"""


def probe_leave(with_vllm: bool, hung_thread: bool) -> subprocess.CompletedProcess:
    code = LEAVE_PROBE.format(repo=REPO, with_vllm=with_vllm, hung_thread=hung_thread)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)


def test_leave_skips_the_teardown_unless_vllm_was_imported():
    """`lifecycle.leave`: without vLLM the process ends at once with its code and its output
    flushed, no teardown, and a non-daemon thread 60 s from its end cannot hold it open (the
    30 s timeout would fire); with vLLM imported it exits normally, so finalizers run."""
    fast = probe_leave(with_vllm=False, hung_thread=True)
    assert fast.returncode == 3 and fast.stdout == "done\n", fast
    normal = probe_leave(with_vllm=True, hung_thread=False)
    assert normal.returncode == 3 and normal.stdout == "done\nteardown ran\n", normal
