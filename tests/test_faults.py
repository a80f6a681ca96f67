"""The failure tests' hooks (`lifecycle.Faults`): a run gets the null object, which does nothing;
COLOCATE_FAULT, read only at the composition root, selects the injected ones."""
import pytest
import torch

from colocate.lifecycle import NO_FAULTS, InjectedFaults, faults_from_env


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
