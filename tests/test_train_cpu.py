"""End-to-end CPU runs under torchrun (2 processes, gloo): the trainer learns; model.path loads."""
import glob
import json

import pytest
import torch

from tests.conftest import LEARNING_STEPS, torchrun


@pytest.mark.slow
def test_cpu_run_reward_improves(learning_run):
    run_dir = learning_run.run_dir
    assert "Warning" not in learning_run.stderr, learning_run.stderr[-2000:]  # no FutureWarnings (issue 56) or others
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == LEARNING_STEPS
    assert summary["reward_end"] >= summary["reward_start"] + 0.25, summary
    assert (run_dir / "config.yaml").exists()
    assert (run_dir / "adapter" / "adapter_model.safetensors").exists()  # the final adapter, checkpoints off
    for role in ("learner", "inference"):
        assert glob.glob(str(run_dir / "tb" / role / "events.out.tfevents.*")), role


@pytest.mark.slow
def test_two_engines_and_one_learner_learn(tmp_path):
    """gpu-1-gsm8k.yaml's layout on the CPU (`topology.num_inference=2`, 3 processes): each engine
    plays half of every batch's groups, nothing is dropped as stale, and the reward improves as much
    as with one engine (test_cpu_run_reward_improves's margin)."""
    run_dir = tmp_path / "run"
    torchrun(["--config", "configs/cpu-tiny.yaml", f"--learner.num_steps={LEARNING_STEPS}",
              "--topology.num_inference=2", "--topology.num_learners=1", f"--metrics.run_dir={run_dir}"], nproc=3)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["steps"], summary["num_inference"], summary["dropped_stale"]) == (LEARNING_STEPS, 2, 0), summary
    assert summary["reward_end"] >= summary["reward_start"] + 0.25, summary
    half = 16 * 8 // 2  # cpu-tiny: 16 groups x 8 samples a batch
    for rank in (0, 1):
        batches = json.loads((run_dir / f"inference-rank{rank}.json").read_text())["batches"]
        assert len(batches) >= LEARNING_STEPS and {b["samples"] for b in batches} == {half}, rank


@pytest.fixture(scope="module")
def local_model(tmp_path_factory, tiny_cfg, tiny_tokenizer):
    """The embedded tiny model and tokenizer saved as a local model directory -> (dir, model)."""
    from colocate.models import build_model, save_tiny_model
    model = build_model(tiny_cfg.model, tiny_tokenizer)
    model_dir = tmp_path_factory.mktemp("local") / "model"
    save_tiny_model(str(model_dir), model, tiny_tokenizer)
    return model_dir, model


@pytest.mark.slow
def test_oversampled_groups_carried_over_fit_the_lag_budget(tmp_path, local_model):
    """Trained from the local model directory (`model.path`): the run is also
    test_local_model_path_loads_and_trains's proof that such a directory trains."""
    # 2 extra groups in play: the HF engine finishes all 18 per poll, the batch takes 16 and the other
    # 2 wait for the next batch, one step later. The batch starts one version fresher than the budget
    # (config.sampling_lag), so those carried groups are trained at lag 2 exactly, not dropped at 3.
    run_dir = tmp_path / "run"
    torchrun(["--config", "configs/cpu-tiny.yaml", "--learner.num_steps=4", "--learner.max_policy_lag=2",
              "--rollout.oversample_groups=2", f"--metrics.run_dir={run_dir}", f"--model.path={local_model[0]}"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["dropped_stale"] == 0, summary
    lags = [row["policy_lag"] for row in summary["timeline"]]  # per step: mean policy lag of the trained sequences
    # step 0: version 0, nothing carried; from step 2: 14 fresh groups at lag 1, 2 carried at lag 2
    assert lags[0] == 0 and lags[2:] == [pytest.approx(1.125)] * 2, lags


def test_local_model_path_loads_and_trains(local_model, tiny_cfg, tiny_tokenizer):
    """A saved model directory loads as the same model and tokenizer; the oversampled run above
    trains from it under torchrun."""
    from colocate.models import build_model, load_tokenizer
    model_dir, model = local_model
    cfg = tiny_cfg.model.__class__(path=str(model_dir))
    tok2 = load_tokenizer(cfg, None, "")
    model2 = build_model(cfg, tok2)
    ids = torch.tensor([tiny_tokenizer.encode("add 1 and 2 ; answer :")])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, model2(ids).logits)
    assert tok2.encode("add 4 and 4") == tiny_tokenizer.encode("add 4 and 4")


GAME_TAGS = ("rollout/reward", "rollout/invalid_order_rate", "rollout/sc_delta_mean", "rollout/prompt_tokens_mean")


@pytest.mark.slow
def test_diplomacy_config_trains_and_logs_game_metrics_from_env_processes(tmp_path):
    """In two env worker processes (env.processes, which needs oversampling: the sample order then
    follows timing); the env in the inference rank's own process is the inflight test's run below."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run_dir = tmp_path / "dip"
    torchrun(["--config", "configs/cpu-diplomacy-tiny.yaml", "--learner.num_steps=2", f"--metrics.run_dir={run_dir}",
              f"--model.cache_dir={tmp_path / 'cache'}", "--env.processes=2", "--rollout.oversample_groups=1",
              "--learner.max_policy_lag=2"])
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
    acc = EventAccumulator(str(run_dir / "tb" / "inference"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in GAME_TAGS:
        assert tag in tags, tag


@pytest.mark.slow
def test_inflight_updates_land_under_running_diplomacy_requests(tmp_path):
    """rollout.update=inflight on Diplomacy (order sets of different lengths, so a poll hands back some
    answers while others decode): batches ship with requests in flight, adapters land under them
    (the HF engine prefills those again under the new version), every step trains, and the game's
    metrics are logged from the env in the inference rank's own process."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run_dir = tmp_path / "run"
    torchrun(["--config", "configs/cpu-diplomacy-tiny.yaml", "--rollout.update=inflight", "--learner.max_policy_lag=1",
              "--learner.num_steps=4", f"--metrics.run_dir={run_dir}", f"--model.cache_dir={tmp_path / 'cache'}"])
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 4
    acc = EventAccumulator(str(run_dir / "tb" / "inference"))
    acc.Reload()
    top = {tag: max(e.value for e in acc.Scalars(tag)) for tag in acc.Tags()["scalars"]}
    for tag in GAME_TAGS:  # the game's metrics, from the env in the inference rank's process
        assert tag in top, tag
    assert top["rollout/requests_in_flight"] > 0  # carried across a batch boundary
    assert top["rollout/version_span_max"] >= 1 and top["rollout/tokens_after_update"] > 0
    assert top["engine/reprefills"] >= 1
