"""The sync canary (`colocate.canary`): the probe, the bound from rounding arithmetic, the learner's
check, the HF engine's and the learner's scores of one adapter, and whole CPU runs in which a sync
fault injected from outside the code (`tests/canary_faults/sitecustomize.py`) is caught at the first
step that would train on the faulty engine's samples, with ALERT and exit 3."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from colocate.canary import PROBE_TOKENS, CanaryCheck, canary_bound, compute_dtype, fp8_roundings, probe_ids
from colocate.wire import ProbeScore
from tests.conftest import LEARNING_STEPS, REPO

FAULTS_DIR = os.path.join(REPO, "tests", "canary_faults")


def test_probe_is_fixed_length_and_the_same_from_the_same_tokenizer(tiny_tokenizer):
    ids = probe_ids(tiny_tokenizer)
    assert len(ids) == PROBE_TOKENS and ids == probe_ids(tiny_tokenizer)
    assert len(set(ids)) > 10  # words and digits, not one repeated byte

    class Empty:
        def encode(self, text, add_special_tokens=False):
            return []
    with pytest.raises(ValueError, match="probe text"):
        probe_ids(Empty())


def test_bound_is_the_rounding_arithmetic():
    """4 (u + sqrt(K) 2^-24) sqrt(L) x logit RMS: the CPU's fp32 tiny model is tight (a few 1e-6 at a
    logit RMS of 1), bf16 at 7B is a few 1e-2 per unit of logit RMS, above the measured parity of
    profiles/README.md (0.0064-0.0131 nats on sampled tokens) at any RMS of 1 or more."""
    fp32 = canary_bound(torch.float32, reduction=128, num_layers=2, logit_scale=1.0)
    assert fp32 == pytest.approx(4 * 2.0 ** -24 * (1 + math.sqrt(128)) * math.sqrt(2))
    assert 1e-6 < fp32 < 1e-5
    bf16 = canary_bound(torch.bfloat16, reduction=18944, num_layers=28, logit_scale=1.0)
    assert 0.05 < bf16 < 0.1 and bf16 > 0.0131
    assert canary_bound(torch.bfloat16, reduction=18944, num_layers=28, logit_scale=3.0) == pytest.approx(3 * bf16)
    assert compute_dtype("float32", on_gpu=False) == torch.float32
    assert compute_dtype("float32", on_gpu=True) == compute_dtype("bfloat16", on_gpu=False) == torch.bfloat16


def test_an_fp8_engines_bound_adds_e4m3s_rounding_of_weights_and_inputs():
    """Each FP8 rounding of a product's operands (weights, inputs; merged mode's second rounding of
    the weights) adds u_e4m3 (u = 2^-4, 3 mantissa bits) to the engine's side only:
    + 2 u_e4m3 sqrt(L) x logit RMS each, about 17 times the bf16 bound at 7B for FP8 weights in slot mode."""
    from colocate.canary import UNIT_ROUNDOFF
    assert UNIT_ROUNDOFF[torch.float8_e4m3fn] == 2.0 ** -4 and UNIT_ROUNDOFF[torch.bfloat16] == 2.0 ** -8
    shape = dict(reduction=18944, num_layers=28, logit_scale=2.0)
    bf16 = canary_bound(torch.bfloat16, **shape)
    assert canary_bound(torch.bfloat16, **shape, fp8_roundings=2) == pytest.approx(bf16 + 4 * 2.0 ** -4 * math.sqrt(28) * 2)
    assert canary_bound(torch.bfloat16, **shape, fp8_roundings=3) == pytest.approx(bf16 + 6 * 2.0 ** -4 * math.sqrt(28) * 2)
    assert 16 < canary_bound(torch.bfloat16, **shape, fp8_roundings=2) / bf16 < 18
    cases = [("none", "slot"), ("none", "merged"), ("fp8", "slot"), ("fp8", "merged")]
    assert [fp8_roundings(*c) for c in cases] == [0, 0, 2, 3]


def test_check_takes_the_worst_engine_and_drops_older_references():
    check = CanaryCheck(torch.float32, reduction=128, num_layers=2, every=2)
    assert check.due(0) and check.due(4) and not check.due(3)
    assert not CanaryCheck(torch.float32, reduction=1, num_layers=1, every=0).due(0)
    ref = torch.tensor([-1.0, -2.0, -3.0])
    check.record(2, ref, 1.0)
    check.record(4, ref, 1.0)
    assert check.check([]) is None
    result = check.check([ProbeScore(2, ref), ProbeScore(2, ref + torch.tensor([0.0, 0.3, 0.0]))])
    assert result.version == 2 and result.gap == pytest.approx(0.1) and result.failed
    assert sorted(check.references) == [4]  # version 2 checked, 4 still to come
    assert not check.check([ProbeScore(4, ref.clone())]).failed
    check.record(6, ref, 1.0)
    assert check.check([ProbeScore(6, torch.full((3,), float("nan")))]).failed  # NaN is a failure
    with pytest.raises(RuntimeError, match="canary"):
        check.check([ProbeScore(8, ref)])  # no reference for it


def _learner_and_engine(tiny_cfg, tiny_tokenizer):
    from colocate.config import load_config
    from colocate.engine.hf import HFEngine
    from colocate.learner.learner import Learner
    from colocate.topology import Topology
    from colocate.train import build_policy
    from tests.test_packing import randomize_adapter
    cfg = load_config(os.path.join(REPO, "configs", "cpu-tiny.yaml"),
                      {"model": {"cache_dir": tiny_cfg.model.cache_dir}, "learner": {"fsdp": False}})
    topo = Topology(rank=0, world_size=1, local_rank=0, num_inference=0, num_learners=1,
                    device=torch.device("cpu"), backend="gloo")
    learner = Learner(cfg, topo, build_policy(cfg, tiny_tokenizer, "meta"), tiny_tokenizer)
    randomize_adapter(learner.model)
    engine = HFEngine(build_policy(cfg, tiny_tokenizer, torch.device("cpu")), tiny_tokenizer)
    return learner, engine


def test_engine_and_learner_agree_on_one_adapter_and_every_fault_shows(tiny_cfg, tiny_tokenizer):
    """The HF engine's forward and the learner's (its packed layout) on the same adapter agree within
    the fp32 bound; the engine after a skipped update (even one Adam-sized step of 1e-3 per entry),
    with layer 0's and 1's tensors swapped, or with lora_B doubled is far outside it."""
    sys.path.insert(0, FAULTS_DIR)
    try:
        from sitecustomize import faulty_tensors  # the torchrun tests' fault injection, here by hand
    finally:
        sys.path.remove(FAULTS_DIR)
    learner, engine = _learner_and_engine(tiny_cfg, tiny_tokenizer)
    probe = probe_ids(tiny_tokenizer)
    shape = learner.model.config
    check = CanaryCheck(torch.float32, reduction=max(shape.hidden_size, shape.intermediate_size),
                        num_layers=shape.num_hidden_layers, every=1)
    adapter = {n: t.clone() for n, t in learner.lora_state().items()}

    def canary(tensors: dict):
        check.record(1, *learner.score_probe(probe))
        engine.load_lora(1, tensors)
        return check.check([ProbeScore(1, engine.score(probe))])

    healthy = canary(adapter)
    assert not healthy.failed and healthy.gap < healthy.bound / 10, healthy
    for fault in ("slot", "scale"):
        assert canary(faulty_tensors(fault, adapter)).gap > 10 * healthy.bound, fault
    stale = {n: t - 1e-3 * torch.sign(t) for n, t in adapter.items()}  # the version before one step
    assert canary(stale).gap > 10 * healthy.bound


def test_the_learner_lays_the_probe_out_once_and_scores_each_version_afresh(tiny_cfg, tiny_tokenizer, monkeypatch):
    """The probe's inputs are laid out and moved to the device once (a layout per version costs a
    stream-synchronizing copy per tensor); a new adapter still gives new log-probs, and other ids a
    new layout."""
    from colocate.learner import learner as learner_module
    learner, _ = _learner_and_engine(tiny_cfg, tiny_tokenizer)
    calls = []
    real = learner_module.layout
    monkeypatch.setattr(learner_module, "layout", lambda *a, **k: calls.append(1) or real(*a, **k))
    probe = probe_ids(tiny_tokenizer)
    first, _ = learner.score_probe(probe)
    again, _ = learner.score_probe(probe)
    assert len(calls) == 1 and torch.equal(first, again)
    with torch.no_grad():
        for p in learner.params:
            p.add_(0.05)
    moved, _ = learner.score_probe(probe)
    assert len(calls) == 1 and not torch.allclose(moved, first)
    learner.score_probe(probe[:-1])
    assert len(calls) == 2


def fp8_run(tiny_cfg, tiny_tokenizer, steps: int, fault: str = "", after_failure: int = 0,
            lora_mode: str = "slot") -> tuple[list, list[float]]:
    """cpu-tiny in one process, synchronous (lag 0), with an FP8 HF engine (the adapter beside the
    FP8 base, or merged into it at each load: `lora_mode`) and TIS (tis_cap 2): per
    version, the canary's check (the learner's probe against the engine's), then a batch sampled
    and trained, then the adapter loaded into the engine -> (results, mean reward per batch); with
    `after_failure` it ends that many versions after the first failed check. `fault` is a
    tests/canary_faults fault installed on the engine's class (the torchrun tests' own)."""
    from colocate.config import load_config
    from colocate.engine.hf import HFEngine
    from colocate.envs import make_env
    from colocate.learner.learner import Learner
    from colocate.rollout.worker import RolloutSettings, RolloutWorker
    from colocate.topology import Topology
    from colocate.train import build_policy
    cfg = load_config(os.path.join(REPO, "configs", "cpu-tiny.yaml"),
                      {"model": {"cache_dir": tiny_cfg.model.cache_dir},
                       "engine": {"quantization": "fp8", "lora_mode": lora_mode},
                       "loss": {"tis_cap": 2.0}, "learner": {"fsdp": False, "max_policy_lag": 0}})
    topo = Topology(rank=0, world_size=1, local_rank=0, num_inference=0, num_learners=1,
                    device=torch.device("cpu"), backend="gloo")
    learner = Learner(cfg, topo, build_policy(cfg, tiny_tokenizer, "meta"), tiny_tokenizer)
    engine = HFEngine(build_policy(cfg, tiny_tokenizer, torch.device("cpu")), tiny_tokenizer,
                      quantization=cfg.engine.quantization, lora_mode=cfg.engine.lora_mode)
    if fault:
        sys.path.insert(0, FAULTS_DIR)
        try:
            from sitecustomize import install_hf
        finally:
            sys.path.remove(FAULTS_DIR)
        install_hf(fault)  # on the class: the caller's monkeypatch puts the method back
    worker = RolloutWorker(make_env(cfg, tiny_tokenizer, seed=0), engine,
                           RolloutSettings(groups_per_batch=cfg.rollout.groups_per_step,
                                           max_new_tokens=cfg.engine.max_new_tokens))
    shape, probe = learner.model.config, probe_ids(tiny_tokenizer)
    check = CanaryCheck(compute_dtype(cfg.model.dtype, on_gpu=False), every=1,
                        fp8_roundings=fp8_roundings("fp8", lora_mode),
                        reduction=max(shape.hidden_size, shape.intermediate_size), num_layers=shape.num_hidden_layers)
    results, rewards = [], []
    for version in range(steps):
        check.record(version, *learner.score_probe(probe))
        results.append(check.check([ProbeScore(version, engine.score(probe))]))
        failed = [r.version for r in results if r.failed]
        if after_failure and failed and version - failed[0] >= after_failure:
            break
        batch, _, _ = worker.collect()
        rewards.append(float(batch.rewards.mean()))
        learner.train_step(batch)
        engine.load_lora(version + 1, {n: t.detach().clone() for n, t in learner.lora_state().items()})
    return results, rewards


@pytest.mark.parametrize("lora_mode", ["slot", "merged"])
def test_a_healthy_fp8_run_with_tis_stays_under_its_bound_and_learns(tiny_cfg, tiny_tokenizer, lora_mode):
    """FP8 sampling corrected by TIS: every version's gap is FP8's rounding (far above fp32's bound,
    so the emulation is on) and under the FP8 bound, by a margin; the reward rises as without FP8.
    merged: the adapter requantized into the FP8 weights at each load (vLLM's merged FP8)."""
    results, rewards = fp8_run(tiny_cfg, tiny_tokenizer, steps=20, lora_mode=lora_mode)
    # the same check's bound without the FP8 term (its logit scale cancels): what fp32 arithmetic
    # alone can explain, which an FP8 engine's gap must pass
    without = canary_bound(torch.float32, reduction=128, num_layers=2, logit_scale=1.0) / \
        canary_bound(torch.float32, reduction=128, num_layers=2, logit_scale=1.0,
                     fp8_roundings=fp8_roundings("fp8", lora_mode))
    assert all(not r.failed and r.gap > without * r.bound for r in results), results
    # learning: the last 5 batches' mean reward above the first 5's by more than 3 standard errors of
    # that difference (rewards in [0, 1]: a standard deviation of at most 1/2 per sample)
    from colocate.config import load_config
    rollout = load_config(os.path.join(REPO, "configs", "cpu-tiny.yaml")).rollout
    n = 5 * rollout.groups_per_step * rollout.group_size  # samples in 5 batches
    assert sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5 > 3 * 0.5 * (2 / n) ** 0.5, rewards


@pytest.mark.parametrize("lora_mode", ["slot", "merged"])
def test_an_fp8_engine_that_skips_updates_is_still_caught(tiny_cfg, tiny_tokenizer, monkeypatch, lora_mode):
    """The engine takes no update from version 1 on (tests/canary_faults' skip): its gap grows with
    every step the learner moves away, past the FP8 bound within 30 versions (one stale version
    alone hides in FP8's rounding: colocate/canary.py), the adapter beside or merged into the weights."""
    from colocate.engine.hf import HFEngine
    monkeypatch.setattr(HFEngine, "load_lora", HFEngine.load_lora)
    results, _ = fp8_run(tiny_cfg, tiny_tokenizer, steps=30, fault="skip", after_failure=3, lora_mode=lora_mode)
    failed = [r.version for r in results if r.failed]
    assert failed, results
    assert failed == list(range(failed[0], failed[0] + 4))  # once past the bound it stays past it


def colocate_train(tmp_path, *args, fault: str = "", steps: int = 4, timeout: int = 600):
    """`colocate train` on cpu-tiny with `fault` injected in every process of the run."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([FAULTS_DIR, REPO, os.environ.get("PYTHONPATH", "")])}
    if fault:
        env["CANARY_TEST_FAULT"] = fault
    cmd = [sys.executable, "-m", "colocate.cli", "train", "--config", "configs/cpu-tiny.yaml", "--nproc", "2",
           f"--learner.num_steps={steps}", f"--metrics.run_dir={tmp_path / 'run'}",
           f"--model.cache_dir={tmp_path / 'cache'}", "--metrics.nvml_interval_s=0", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("dropout", [0.0, 0.05], ids=["probe_rides_the_step", "probe_apart_with_dropout"])
def test_a_sync_fault_stops_the_run_before_its_samples_train_further(tmp_path, dropout):
    """From version 1 on the engine skips each update. cpu-tiny (lag 1) samples batch 2 with
    version 1: that batch's canary fails, the learner alerts at step 3, checkpoints, names step 2
    (trained only on version 0's samples, which passed) as the last good checkpoint although
    checkpoint.keep=1, and `colocate train` exits 3. One fault is enough here: the learner's check,
    alert and stop are the same code whatever the engine got wrong, and that the slot and scale
    faults (written by the same `faulty_tensors`) move the gap far past the bound is
    test_engine_and_learner_agree_on_one_adapter_and_every_fault_shows's claim. Both ways the learner
    scores the probe: riding each step's first forward, and (LoRA dropout) a forward of its own after
    each send."""
    proc = colocate_train(tmp_path, "--checkpoint.enabled=true", "--checkpoint.every=1", "--checkpoint.keep=1",
                          f"--lora.dropout={dropout}", fault="skip", steps=6)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-4000:]
    assert out.count("ALERT canary_mismatch: adapter version 1:") == 1, out[-4000:]
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["mismatch_step"] == 3 and summary["steps"] == 3 and summary["collapse_step"] is None
    good = json.loads((run / "checkpoints" / "last_good.json").read_text())
    assert good["step"] == 2 and good["mismatch_step"] == 3 and os.path.isdir(good["path"])
    assert sorted(os.listdir(run / "checkpoints")) == ["last_good.json", "step-000002", "step-000003"]


@pytest.mark.slow
def test_a_healthy_run_never_alerts_and_its_gap_stays_under_the_bound(learning_run):
    """The shared cpu-tiny learning run (conftest, `LEARNING_STEPS`, the reward improving): a canary at
    every batch from the version's first one (every version but the last), never an alert. In fp32
    on the CPU both sides run the same kernels (a 300-step run measured a gap of exactly 0 at every
    version), so the gap does not grow with training: the bound scales with the logits' RMS and the
    claim needs versions with a trained adapter, not a long run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = learning_run.stdout + learning_run.stderr
    assert "ALERT" not in out, out[-4000:]
    acc = EventAccumulator(str(learning_run.run_dir / "tb" / "learner"))
    acc.Reload()
    gaps = [e.value for e in acc.Scalars("sync/canary_gap")]
    bounds = [e.value for e in acc.Scalars("sync/canary_bound")]
    assert len(gaps) == LEARNING_STEPS - 1 and all(g <= b for g, b in zip(gaps, bounds))
    assert max(bounds) < 1e-4
    # each side's time on a probe, where the e2e benchmark reads them: every version the learner
    # scored, every probe the engine read (one inference rank: one per check)
    summary = json.loads((learning_run.run_dir / "summary.json").read_text())
    assert all(row["canary_rode"] and row["canary_s"] == 0 for row in summary["timeline"])  # no forward of its own
    batches = json.loads((learning_run.run_dir / "inference-rank0.json").read_text())["batches"]
    assert sum(b.get("canary_ms", 0) > 0 for b in batches) == len(gaps)
    # each batch's record names the version that sampled it (lag 1: batch k, version k - 1), which
    # the e2e benchmark's parity figures key the batches by
    assert [b["version"] for b in batches] == [max(0, k - 1) for k in range(LEARNING_STEPS)]
    from benchmarks.e2e import steady_state
    out = steady_state(summary, [{"batches": batches}], warmup=2)
    assert {f"{x}_parity_gap_frac{se}" for x in ("step_s", "rollout_collect_s") for se in ("", "_se")} <= set(out)


def test_the_probes_device_time_is_read_once_its_kernels_are_done(monkeypatch):
    """`DeviceTimer`: CUDA events around the probe, read later without waiting (None while the end
    event is pending), each reading taken once; off the GPU there is nothing to read."""
    from colocate.learner.rank_canary import DeviceTimer

    class FakeEvent:
        clock = {"now": 0.0, "done": False}

        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self):
            self.at = FakeEvent.clock["now"]

        def query(self):
            return FakeEvent.clock["done"]

        def elapsed_time(self, end):
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    timer = DeviceTimer(torch.device("cuda", 0))

    def work():
        FakeEvent.clock["now"] += 4.5
        return "scores"
    assert timer.done_ms() is None and timer.around(work) == "scores"
    assert timer.done_ms() is None  # its kernels still queued
    FakeEvent.clock["done"] = True
    assert timer.done_ms() == 4.5 and timer.done_ms() is None
    cpu = DeviceTimer(torch.device("cpu"))
    assert cpu.around(work) == "scores" and cpu.done_ms() is None
