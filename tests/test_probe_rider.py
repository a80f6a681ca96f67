"""The canary's probe rides the step's first forward (`Learner.train_step`, `packing.with_rider`): it
scores what a forward of its own scores, at the version the step started from, and the step trains
as it would without it."""
import math

import pytest
import torch

from colocate.canary import canary_bound
from colocate.learner.passes import forward_backward
from colocate.topology import Topology
from tests.test_packing import random_batch
from tests.test_startup import SHAPES, _learner

PROBE = list(range(2, 40))  # 38 ids: a length no sequence of SHAPES has
LAYOUTS = [{"learner": {"prefix_sharing": "off"}}, {"learner": {"prefix_sharing": "tree"}},
           {"learner": {"prefix_sharing": "tree", "updates_per_batch": 2}, "loss": {"beta": 0.04}}]
IDS = ["flat", "tree", "tree_two_updates_kl"]


def cpu_learner(cache_dir: str, extra: dict):
    topo = Topology(rank=0, world_size=1, local_rank=0, num_inference=0, num_learners=1,
                    device=torch.device("cpu"), backend="gloo")
    torch.manual_seed(7)
    return _learner(cache_dir, extra, topo)


def bound_of(learner, scale: float) -> float:
    """The canary's own fp32 bound (two implementations, same dtype) at the probe's logit scale: what
    another layout of the same forward may move a mean log-prob by."""
    shape = learner.model.config
    return canary_bound(torch.float32, reduction=max(shape.hidden_size, shape.intermediate_size),
                        num_layers=shape.num_hidden_layers, logit_scale=scale)


@pytest.mark.parametrize("extra", LAYOUTS, ids=IDS)
def test_the_riding_probe_scores_the_version_the_step_started_from(tiny_cfg, extra):
    learner, vocab = cpu_learner(tiny_cfg.model.cache_dir, extra)
    for seed in range(2):
        own, own_scale = learner.score_probe(PROBE)  # its own forward, before the step
        version = learner.version
        batch = random_batch(vocab, SHAPES, seed=seed)
        batch.versions[:] = version
        learner.train_step(batch, PROBE)
        scored_version, logp, scale = learner.probe_scored
        assert scored_version == version and learner.version == version + 1
        assert logp.shape == own.shape and float(scale) == pytest.approx(float(own_scale), rel=1e-5)
        assert float((logp - own).abs().mean()) <= bound_of(learner, float(own_scale))
    learner.train_step(batch)  # no probe asked: nothing scored
    assert learner.probe_scored is None


@pytest.mark.parametrize("extra", LAYOUTS, ids=IDS)
def test_a_step_with_the_riding_probe_trains_as_one_without(tiny_cfg, extra):
    """The loss sees the same rows; only the forward's float roundings may differ (other shapes):
    per layer a K-term fp32 sum's relative error, over L layers (the canary bound's arithmetic)."""
    runs = []
    for rider in (None, PROBE):
        learner, vocab = cpu_learner(tiny_cfg.model.cache_dir, extra)
        batch = random_batch(vocab, SHAPES, seed=3)
        batch.versions[:] = learner.version
        stats = learner.train_step(batch, rider)
        runs.append((stats, learner.lora_state()))
    (plain, adapter), (ridden, adapter_ridden) = runs
    shape = learner.model.config
    rel = 4 * (1 + math.sqrt(max(shape.hidden_size, shape.intermediate_size))) * 2 ** -24 \
        * math.sqrt(shape.num_hidden_layers)
    for key in ("loss", "entropy", "ratio", "kl", "tokens"):
        assert ridden[key] == pytest.approx(plain[key], rel=rel, abs=1e-12), key
    assert ridden["model_tokens"] == plain["model_tokens"]  # the rider is not trained on
    if extra["learner"]["prefix_sharing"] == "off":  # packed: rows grouped by length, each computed alone
        assert all(torch.equal(adapter[n], adapter_ridden[n]) for n in adapter)


def test_a_rank_without_work_carries_the_probe_in_its_dummy_pass_or_scores_it_alone(tiny_cfg):
    """A rank whose share is empty still runs the busiest rank's passes (dummies): the first carries the
    probe. With no pass at all anywhere, the probe gets a forward of its own, before the update."""
    learner, vocab = cpu_learner(tiny_cfg.model.cache_dir, LAYOUTS[1])
    own, scale = learner.score_probe(PROBE)
    forward_backward(learner, [], 1, 1, 1.0, PROBE)
    version, logp, _ = learner.probe_scored
    assert version == learner.version and float((logp - own).abs().mean()) <= bound_of(learner, float(scale))
    learner.optimizer.zero_grad(set_to_none=True)
    stale = random_batch(vocab, SHAPES, seed=0)
    stale.versions[:] = learner.version - learner.cfg.learner.max_policy_lag - 1  # every sequence dropped
    learner.train_step(stale, PROBE)
    version, logp, _ = learner.probe_scored
    assert version == learner.version - 1 and torch.equal(logp, own)


def test_a_probe_whose_first_token_opens_the_prompts_adds_only_what_it_forwards(tiny_cfg):
    """In a prefix tree the probe's one-token prompt merges into a node the prompts already hold (tree
    mode: a common first token; group mode: a whole one-token prompt): the step's forwarded-token count
    still matches the step without it."""
    for mode in ("tree", "group"):
        counts = []
        for rider in (None, PROBE):
            learner, vocab = cpu_learner(tiny_cfg.model.cache_dir, {"learner": {"prefix_sharing": mode}})
            batch = random_batch(vocab, [(1, 4), *SHAPES], seed=5)  # one prompt of one token
            starts = torch.cumsum(batch.seq_lens, 0) - batch.seq_lens
            batch.tokens[starts.long()] = PROBE[0]  # every prompt opens with the probe's first token
            batch.versions[:] = learner.version
            counts.append(learner.train_step(batch, rider)["model_tokens"])
        assert counts[0] == counts[1], mode


def test_models_that_transform_their_logits_after_the_head_score_the_probe_apart():
    from types import SimpleNamespace

    from colocate.learner.learner import head_is_last
    assert head_is_last(SimpleNamespace(model_type="qwen2"))
    assert head_is_last(SimpleNamespace(final_logit_softcapping=None, logits_scaling=1.0))
    assert not head_is_last(SimpleNamespace(final_logit_softcapping=30.0))  # Gemma 2
    assert not head_is_last(SimpleNamespace(logit_scale=0.0625))  # Cohere
    nested = SimpleNamespace(get_text_config=lambda: SimpleNamespace(final_logit_softcapping=30.0))
    assert not head_is_last(nested)  # Gemma 3: the text model's config


def _verdict_worker(rank: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist

    from colocate.canary import CanaryResult
    from colocate.learner.rank_canary import RankCanary
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    topo = Topology(rank=rank, world_size=2, local_rank=rank, num_inference=0, num_learners=2,
                    device=torch.device("cpu"), backend="gloo", learner_group=dist.new_group([0, 1]))
    rank_state = RankCanary.__new__(RankCanary)  # only the collective is under test
    rank_state.topo = topo
    mine = [CanaryResult(3, 0.010, 0.012), CanaryResult(3, float("nan"), 0.011)][rank]
    got = rank_state.one_verdict(mine)
    with open(f"{out}.{rank}", "w") as f:
        f.write(f"{got.gap} {got.bound} {got.failed}")
    dist.destroy_process_group()


def test_learners_whose_references_differ_reach_one_verdict(tmp_path):
    """Each learner's reference rode its own first pass: the gap is the largest over the learners (a
    NaN, infinite), the bound the smallest, the same on every rank."""
    import torch.multiprocessing as mp

    from tests.conftest import free_port
    out = str(tmp_path / "verdict")
    mp.start_processes(_verdict_worker, args=(free_port(), out), nprocs=2, join=True, start_method="fork")
    assert [open(f"{out}.{r}").read() for r in (0, 1)] == ["inf 0.011 True"] * 2
