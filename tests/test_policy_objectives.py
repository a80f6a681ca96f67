"""Policy objectives beyond GRPO: GSPO, the decoupled clip of several updates per batch, truncated
and masked importance sampling.

  * the reference (`impl="torch"`) against the float64 oracle of `tests/loss_oracle.py`,
    loss and d(logits), every objective (the fused kernel's parity runs under the Triton
    interpreter in `test_kernel_triton.py`);
  * GSPO against a two-sequence example worked out here by hand;
  * the per-row scale deferred to the lm_head's input (`kernels.deferred`): d(hidden) through a
    frozen head against the float64 chain rule, and a learner step with it against one without;
  * `learner.updates_per_batch: 2` against two single-batch steps written out by hand on the tiny
    model (start-of-batch log-probs, shuffled mini-batches, one AdamW step each, the sampler weight
    truncated at the default cap), and K = 1 running no extra forward.
"""
import math

import pytest
import torch

from colocate.kernels import LossBatch, LossRows, LossSpec, Objective, grpo_loss
from tests.loss_oracle import loss_float64, objective_inputs


def oracle(logits, b, old, spec):
    """The float64 oracle over `objective_inputs`' rows -> (loss, d(logits))."""
    rows = LossRows(b["targets"], b["weights"], b["behaviour"], b["advantages"], b["ref"], b["seq_ids"], old)
    out = loss_float64(logits, rows, spec)
    return out.loss, out.grad

OBJECTIVES = {
    "gspo": (dict(ratio_level="sequence"), False),
    "gspo-decoupled": (dict(ratio_level="sequence"), True),
    "decoupled": ({}, True),
    "tis": (dict(tis_cap=1.5), False),
    "tis-decoupled": (dict(tis_cap=1.5), True),
    "mis": (dict(mis_threshold=0.2), False),
    "mis-decoupled": (dict(mis_threshold=0.2), True),
    "gspo-tis-mis": (dict(ratio_level="sequence", tis_cap=1.5, mis_threshold=0.2), False),
    # dual clip at 1.5 (valid: > 1): the odd sequences' sampler drift puts ratios on both sides of it
    "dual-clip": (dict(clip_ratio_c=1.5), False),
    "dual-clip-decoupled-tis": (dict(clip_ratio_c=1.5, tis_cap=1.5), True),
}


# A value of each objective field away from its default, valid as its loss.* key (DEVELOPERS.md's loss recipe)
VARIANT_VALUES = {"ratio_level": "sequence", "tis_cap": 1.5, "mis_threshold": 0.2, "clip_ratio_c": 1.5}


def test_every_objective_field_is_a_key_the_oracle_and_a_case():
    """DEVELOPERS.md's loss recipe, checked: every field of `Objective` is a `loss.*` key with its
    check, reaches the run's `LossSpec` through `loss_spec`, is written out in the float64 oracle,
    and has a case here and in the kernel's tests."""
    import dataclasses
    import os

    from colocate.config import load_config
    from colocate.config_checks import _CHOICES, _RANGES
    from colocate.learner.loss import loss_spec
    from tests.conftest import REPO
    from tests.test_kernel_triton import OBJECTIVE_CASES
    oracle_source = open(os.path.join(REPO, "tests", "loss_oracle.py")).read()
    fields = [f.name for f in dataclasses.fields(Objective)]
    assert sorted(fields) == sorted(VARIANT_VALUES), "a new objective field: give it a value above"
    for name in fields:
        assert ("loss", name) in _RANGES or ("loss", name) in _CHOICES, name
        cfg = load_config(os.path.join(REPO, "configs", "cpu-tiny.yaml"), {"loss": {name: VARIANT_VALUES[name]}})
        assert getattr(loss_spec(cfg).objective, name) == VARIANT_VALUES[name], name
        assert f"objective.{name}" in oracle_source, name
        assert any(name in kw for kw, _ in OBJECTIVES.values()), name
        assert any(name in case[3] for case in OBJECTIVE_CASES), name


@pytest.mark.parametrize("name", list(OBJECTIVES))
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_reference_objectives_match_float64(name, beta):
    kw, with_old = OBJECTIVES[name]
    b = objective_inputs(31, 23, torch.float32, seed=len(name) + int(beta * 100), temperature=0.8)
    eps = (3e-2, 4e-2) if kw.get("ratio_level") == "sequence" else (0.2, 0.28)
    old = b["old"] if with_old else None
    spec = LossSpec(Objective(**kw), "dapo", eps[0], eps[1], beta, 0.8, impl="torch")
    ref_loss, ref_grad = oracle(b["logits"], b, old, spec)
    x = b["logits"].clone().requires_grad_()
    batch = LossBatch(b["targets"], b["weights"] > 0, b["behaviour"], b["advantages"], b["ref"], seq_ids=b["seq_ids"],
                      old_logprobs=old)
    loss, stats = grpo_loss(x, batch, spec)
    loss.backward()
    assert abs(loss.item() - float(ref_loss)) <= 1e-5 * max(1.0, abs(float(ref_loss)))
    assert float((x.grad.double() - ref_grad).norm()) <= 1e-5 * max(float(ref_grad.norm()), 1e-3)
    if "mis" in name:  # the odd sequences drift past the threshold: some, not all, are masked
        assert 0 < float(stats["mis_masked_seqs"]) < len(set(b["seq_ids"].tolist()))
    if "tis" in name or with_old:
        assert float(stats["is_weight"]) != 1.0


@pytest.mark.parametrize("name", ["gspo", "gspo-decoupled", "gspo-tis-mis", "tis", "decoupled"])
def test_deferred_row_scale_gives_the_hidden_gradient(name):
    """h [N, H] -> frozen head W [V, H] -> logits: the loss's unscaled gradient, scaled at h by the
    returned row scale, equals d(h) = d(logits)_float64 @ W."""
    from colocate.kernels import scale_grad_rows
    kw, with_old = OBJECTIVES[name]
    b = objective_inputs(31, 23, torch.float32, seed=7, temperature=0.8)
    g = torch.Generator().manual_seed(1)
    weight, h0 = torch.randn(23, 5, generator=g), torch.randn(31, 5, generator=g)
    eps = (3e-2, 4e-2) if kw.get("ratio_level") == "sequence" else (0.2, 0.28)
    old = b["old"] if with_old else None
    spec = LossSpec(Objective(**kw), "dapo", temperature=0.8, eps_low=eps[0], eps_high=eps[1], beta=0.04, impl="torch")
    ref_loss, ref_grad = oracle(h0 @ weight.T, b, old, spec)
    h = h0.clone().requires_grad_()
    scale = torch.full((31,), float("nan"))
    batch = LossBatch(b["targets"], b["weights"] > 0, b["behaviour"], b["advantages"], b["ref"], seq_ids=b["seq_ids"],
                      old_logprobs=old)
    loss, _ = grpo_loss(scale_grad_rows(h, scale) @ weight.T, batch, spec, row_scale=scale)
    loss.backward()
    want = ref_grad @ weight.double()
    assert abs(loss.item() - float(ref_loss)) <= 1e-5 * max(1.0, abs(float(ref_loss)))
    assert float((h.grad.double() - want).norm()) <= 1e-5 * float(want.norm())
    assert not torch.isnan(scale).any()
    with pytest.raises(ValueError, match="has 31 rows, the row scale 30"):  # rows must map one to one
        scale_grad_rows(h0, scale[:30])


def test_gspo_two_sequences_by_hand():
    """Sequence A (two tokens) has a mean log-ratio inside GSPO's clip, sequence B (one token) far
    above it with a positive advantage: B's gradient is zero, A's tokens share one coefficient."""
    logits = torch.tensor([[1.0, 0.0, -1.0], [0.5, 0.5, 0.0], [2.0, 0.0, 0.0]])
    targets = torch.tensor([0, 2, 1])
    seq_ids = torch.tensor([0, 0, 1])
    adv = torch.tensor([-1.5, -1.5, 2.0])
    eps_low, eps_high = 3e-4, 4e-4

    def logp_of(row, t):
        return row[t] - math.log(sum(math.exp(v) for v in row))

    rows = logits.tolist()
    logp = [logp_of(rows[i], int(targets[i])) for i in range(3)]
    behaviour = torch.tensor([logp[0] - 1e-4, logp[1] + 5e-5, logp[2] - 0.01])
    # By hand: s_A = exp(mean(1e-4, -5e-5)) = exp(2.5e-5), inside [1 - 3e-4, 1 + 4e-4]; s_B = exp(0.01),
    # above 1 + 4e-4 with A_B > 0: clipped. grpo normalization: w = 1 / (2 sequences * length).
    s_a, s_b = math.exp(2.5e-5), math.exp(0.01)
    w = [1 / 4, 1 / 4, 1 / 2]
    want_loss = w[0] * (-s_a * -1.5) + w[1] * (-s_a * -1.5) + w[2] * (-(1 + eps_high) * 2.0)
    # dL/dlogp_u for u in A: sum_t w_t * (-A s_A) / |A| = -(-1.5) s_A (1/4 + 1/4) / 2; zero for B.
    g_a = 1.5 * s_a * 0.5 / 2
    want_grad = torch.zeros(3, 3, dtype=torch.float64)
    for i, g in ((0, g_a), (1, g_a)):
        p = [math.exp(v) / sum(math.exp(u) for u in rows[i]) for v in rows[i]]
        want_grad[i] = torch.tensor([g * ((j == int(targets[i])) - p[j]) for j in range(3)], dtype=torch.float64)

    x = logits.clone().requires_grad_()
    loss, stats = grpo_loss(x, LossBatch(targets, torch.ones(3), behaviour, adv, seq_ids=seq_ids),
                            LossSpec(Objective(ratio_level="sequence"), "grpo", eps_low, eps_high, impl="torch"))
    loss.backward()
    assert loss.item() == pytest.approx(want_loss, rel=1e-5)
    torch.testing.assert_close(x.grad.double(), want_grad, rtol=1e-4, atol=1e-8)
    assert float(stats["clip_fraction"]) == pytest.approx(1 / 3)  # B's one token
    assert float(stats["ratio"]) == pytest.approx((2 * s_a + s_b) / 3, rel=1e-5)


def test_dual_clip_bounds_negative_advantage_tokens_only():
    """The inputs hold tokens with A < 0 and a ratio past c = 1.5 (the dual clip holds them: no
    gradient, loss -c A each) and tokens with A > 0 past it (the plain clip's business). Against
    GRPO without it, only the first kind change, and the loss drops by exactly their excess."""
    b = objective_inputs(31, 23, torch.float32, seed=4, temperature=1.0)  # a seed with both kinds
    c = 1.5
    logp = torch.log_softmax(b["logits"].double(), -1).gather(1, b["targets"][:, None]).squeeze(1)
    ratio = torch.exp(logp - b["behaviour"].double())
    trained = b["weights"] > 0
    held = trained & (b["advantages"] < 0) & (ratio > c)
    assert held.any() and (trained & (b["advantages"] > 0) & (ratio > c)).any()  # the example has both kinds
    grads, losses = {}, {}
    for cc in (0.0, c):
        x = b["logits"].clone().requires_grad_()
        loss, stats = grpo_loss(x, LossBatch(b["targets"], trained, b["behaviour"], b["advantages"]),
                                LossSpec(Objective(clip_ratio_c=cc), "dapo", impl="torch"))
        loss.backward()
        grads[cc], losses[cc] = x.grad, loss.item()
    assert float(grads[c][held].abs().max()) == 0.0 and float(grads[0.0][held].abs().min()) > 0
    assert torch.equal(grads[c][~held], grads[0.0][~held])
    a = b["advantages"].double()
    excess = float(((-a * ratio - (-a * c)) * held / trained.sum()).sum())  # what the bound removes, dapo-weighted
    assert abs((losses[0.0] - losses[c]) - excess) <= 1e-5 * max(1.0, abs(excess))


def test_entropy_stat_is_the_mean_negative_logprob_of_the_trained_tokens():
    """Every path reports the entropy as the trained tokens' mean -logp under the sampling
    distribution (softmax(logits / T) over the allowed ids): on the sampler's own tokens its
    expectation is the entropy, and the fused kernels have it from the log-prob column they already
    write (no second pass over the logits). Checked against float64; the bound is a few float32 ulps
    of values near log(V)."""
    g = torch.Generator().manual_seed(3)
    logits, targets = torch.randn(6, 10, generator=g), torch.tensor([0, 1, 2, 3, 4, 5])
    mask = torch.tensor([1, 1, 1, 1, 1, 0], dtype=torch.bool)
    allowed = torch.tensor([[0, 1, 7, -1], [1, 2, 3, 4], [2, 9, -1, -1], [3, 0, -1, -1], [4, 5, 6, 7], [5, -1, -1, -1]])
    _, stats = grpo_loss(logits, LossBatch(targets, mask, torch.zeros(6), torch.ones(6), allowed_ids=allowed),
                         LossSpec(temperature=0.7, impl="torch"))
    want = []
    for i in range(5):
        ids = [int(a) for a in allowed[i] if a >= 0]
        logp = torch.log_softmax(logits[i, ids].double() / 0.7, -1)
        want.append(float(-logp[ids.index(int(targets[i]))]))
    assert abs(float(stats["entropy"]) - sum(want) / 5) <= 1e-5 * max(1.0, sum(want) / 5)


def test_objective_config_keys_reach_the_loss():
    from colocate.config import load_config
    from colocate.learner.loss import loss_spec
    from tests.conftest import REPO
    import os
    cfg = load_config(os.path.join(REPO, "configs/cpu-tiny.yaml"),
                      {"loss": {"ratio_level": "sequence", "tis_cap": "2", "mis_threshold": "0.1",
                                "clip_ratio_c": "3"}})
    spec = loss_spec(cfg)
    assert spec.objective == Objective("sequence", 2.0, 0.1, 3.0)
    assert (spec.eps_low, spec.eps_high) == (cfg.loss.seq_eps_low, cfg.loss.seq_eps_high)
    spec = loss_spec(load_config(os.path.join(REPO, "configs/cpu-tiny.yaml")))
    assert (spec.eps_low, spec.eps_high) == (0.2, 0.28)
    assert (spec.norm, spec.beta, spec.temperature, spec.max_len, spec.impl) == (
        cfg.loss.norm, cfg.loss.beta, cfg.engine.temperature, cfg.engine.max_new_tokens, cfg.loss.impl)


def test_several_updates_cap_the_decoupled_weight_by_default():
    """K > 1 truncates exp(old - behaviour) at DECOUPLED_TIS_CAP unless loss.tis_cap is set; K = 1
    keeps the plain GRPO objective (no weight, no cap)."""
    from colocate.config import load_config
    from colocate.learner.loss import DECOUPLED_TIS_CAP, loss_spec
    from tests.conftest import REPO
    import os
    path = os.path.join(REPO, "configs/cpu-tiny.yaml")
    k2 = {"learner": {"updates_per_batch": "2"}}
    assert loss_spec(load_config(path, {"learner": {"updates_per_batch": "1"}})).objective == Objective()
    assert DECOUPLED_TIS_CAP == 2.0
    assert loss_spec(load_config(path, k2)).objective == Objective(tis_cap=2.0)
    assert loss_spec(load_config(path, {**k2, "loss": {"tis_cap": "5"}})).objective == Objective(tis_cap=5.0)


# ----------------------------------------------------------------------------- several updates per batch

SHAPES = [(9, 3), (14, 1), (5, 6), (11, 4), (7, 2), (12, 5)]


def _learner(tiny_cfg, tiny_tokenizer, k, device="cpu"):
    from colocate.config import load_config
    from colocate.learner.learner import Learner
    from colocate.topology import Topology
    from colocate.models import build_policy
    from tests.conftest import REPO
    import os
    cfg = load_config(os.path.join(REPO, "configs/cpu-tiny.yaml"), {
        "model": {"cache_dir": tiny_cfg.model.cache_dir}, "lora": {"rank": 3, "alpha": 6.0},
        "learner": {"lr": 1e-2, "micro_batch_tokens": 32, "max_grad_norm": 1.0, "fsdp": False,
                    "updates_per_batch": k},
        "loss": {"norm": "dapo", "impl": "torch" if device == "cpu" else "auto"}})
    topo = Topology(rank=0, world_size=1, local_rank=0, num_inference=0, num_learners=1,
                    device=torch.device(device), backend="gloo")
    return cfg, Learner(cfg, topo, build_policy(cfg, tiny_tokenizer, "meta"), tiny_tokenizer)


def _hand_logp(learner, batch, temperature):
    """[N] log-probs of the completion tokens: the whole batch as one packed forward, log-softmax by hand."""
    from colocate.learner.packing import completion_logits, packed_micro_batch
    mb = packed_micro_batch(batch, learner.device, learner.attention)
    logits = completion_logits(learner.model, mb).float() / temperature
    return torch.log_softmax(logits, -1).gather(1, mb.targets[:, None]).squeeze(1)


def test_two_updates_per_batch_equal_two_single_steps_by_hand(tiny_cfg, tiny_tokenizer):
    """Each of the learner's two AdamW steps is checked on its own, so no tolerance has to absorb
    Adam's amplification of rounding (its first step is lr * g / |g|: an element whose gradient is
    rounding noise may move by +-lr whichever order the sums ran in, which a comparison of final
    weights against an independent fp32 replay cannot tell from a bug):

      * the gradient of mini-batch t, recorded when the learner steps, equals the hand formula's
        gradient at the learner's own weights before step t. Both are fp32 sums over the mini-batch's
        tokens in different orders (micro-batches of 32 tokens against one packed forward); a sum of
        n terms is off by at most n * eps relative (Higham's bound, taken in norm), so the bound is
        num_completion_tokens * eps * |g|;
      * the weights after step t equal torch's AdamW applied to the recorded gradient: the same
        operations on the same fp32 values, so within one ulp (rtol = eps)."""
    from colocate.learner.schedule import mini_batch_indices, mini_batch_seed
    from tests.test_packing import random_batch
    cfg, learner = _learner(tiny_cfg, tiny_tokenizer, 2)
    _, hand = _learner(tiny_cfg, tiny_tokenizer, 1)  # the same seeded adapter, its gradient taken by hand
    batch = random_batch(len(tiny_tokenizer), SHAPES, seed=3)
    with torch.no_grad():  # sampler log-probs near the model's, so ratios and weights are not extreme,
        batch.behaviour_logprobs = _hand_logp(hand, batch, 1.0) + 0.1 * torch.randn(
            batch.num_completion_tokens, generator=torch.Generator().manual_seed(0))
        batch.behaviour_logprobs[::4] -= 1.5  # but every 4th token's weight exp(1.5) is over the default cap
        old = _hand_logp(hand, batch, cfg.engine.temperature)  # the policy at the start of the batch
    seed = mini_batch_seed(cfg.rollout.seed, learner.version)
    steps, real_step = [], learner.optimizer.step

    def recording_step(*args, **kwargs):  # the test's wrapper: (weights before, gradient) of each step
        steps.append(([p.detach().clone() for p in learner.params], [p.grad.clone() for p in learner.params]))
        return real_step(*args, **kwargs)
    learner.optimizer.step = recording_step
    initial = [p.detach().clone() for p in learner.params]
    batch.old_logprobs = None
    stats = learner.train_step(batch)
    assert stats["updates"] == 2 and learner.version == 1 and len(steps) == 2

    batch.old_logprobs = old  # the hand's own start-of-batch policy (the learner wrote its own there)
    eps = torch.finfo(torch.float32).eps
    replay = [w.clone().requires_grad_() for w in initial]
    adamw = torch.optim.AdamW(replay, lr=cfg.learner.lr, weight_decay=cfg.learner.weight_decay)
    for t, idx in enumerate(mini_batch_indices(batch.num_sequences, 2, seed)):
        weights, got_grad = steps[t]
        with torch.no_grad():
            for p, w in zip(hand.params, weights):
                p.copy_(w)
        mini = batch.select(idx)
        logp = _hand_logp(hand, mini, cfg.engine.temperature)
        adv = torch.repeat_interleave(mini.advantages, mini.completion_lens.long())
        r = torch.exp(logp - mini.old_logprobs)
        iw = torch.exp(mini.old_logprobs - mini.behaviour_logprobs)
        assert (iw > 2.0).any()
        iw = iw.clamp(max=2.0)  # the default cap at K > 1 (loss.tis_cap unset)
        per_token = -iw * torch.minimum(r * adv, torch.clamp(r, 1 - cfg.loss.eps_low, 1 + cfg.loss.eps_high) * adv)
        hand.optimizer.zero_grad()
        (per_token.sum() / mini.num_completion_tokens).backward()  # dapo: the mini-batch's tokens
        torch.nn.utils.clip_grad_norm_(hand.params, cfg.learner.max_grad_norm)
        want = torch.cat([p.grad.flatten() for p in hand.params])
        got = torch.cat([g.flatten() for g in got_grad])
        assert float((got - want).norm()) <= mini.num_completion_tokens * eps * float(want.norm()), t
        with torch.no_grad():  # AdamW on the recorded gradient, from the replay's own weights
            for p, w, g in zip(replay, weights, got_grad):
                assert torch.equal(p, w) or torch.allclose(p, w, rtol=eps, atol=0), t
                p.grad = g.clone()
        adamw.step()
    for p, final in zip(replay, learner.params):
        torch.testing.assert_close(final.detach(), p.detach(), rtol=eps, atol=0)
    assert any(not torch.equal(p, w) for p, w in zip(learner.params, initial))  # the steps moved the adapter


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.timeout(300), pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("ratio_level,tis_cap", [("sequence", 0.0), ("token", 1.5)])
def test_learner_defers_the_row_scale_exactly(tiny_cfg, tiny_tokenizer, monkeypatch, ratio_level, tis_cap, device):
    """GSPO / TIS at K = 1: a learner step with the row scale deferred to the lm_head's input moves
    the adapter as one whose loss writes the whole d(logits) (the lm_head is frozen: deferral on).
    CPU: the reference loss; CUDA: the fused kernel (one unit pass against two passes)."""
    from dataclasses import replace

    from colocate.learner import passes
    from tests.test_packing import random_batch
    steps, real = {}, passes.grpo_loss
    for defer in (True, False):
        cfg, learner = _learner(tiny_cfg, tiny_tokenizer, 1, device)
        eps_low, eps_high = (0.05, 0.06) if ratio_level == "sequence" else (0.2, 0.28)
        learner.spec = replace(learner.spec, objective=Objective(ratio_level=ratio_level, tis_cap=tis_cap),
                               eps_low=eps_low, eps_high=eps_high)
        assert learner.defer_row_scale
        learner.defer_row_scale = defer
        # SGD: the step is the gradient itself (Adam's first step, g / |g|, amplifies rounding in g ~ 0)
        learner.optimizer = torch.optim.SGD(learner.params, lr=1.0)
        seen = []
        monkeypatch.setattr(passes, "grpo_loss", lambda *a, **k: seen.append(k["row_scale"] is not None)
                            or real(*a, **k))
        batch = random_batch(len(tiny_tokenizer), SHAPES, seed=5)
        with torch.no_grad():
            batch.behaviour_logprobs = _hand_logp(learner, batch, 1.0).cpu() + 0.1 * torch.randn(
                batch.num_completion_tokens, generator=torch.Generator().manual_seed(0))
        learner.train_step(batch)
        assert seen and all(s == defer for s in seen)
        steps[defer] = {n: t.cpu() for n, t in learner.lora_state().items()}
    for name in steps[True]:
        torch.testing.assert_close(steps[True][name], steps[False][name], rtol=1e-5, atol=1e-6, msg=name)


def test_one_update_per_batch_runs_no_extra_forward(tiny_cfg, tiny_tokenizer, monkeypatch):
    from colocate.learner import learner as learner_mod
    from tests.test_packing import random_batch
    _, learner = _learner(tiny_cfg, tiny_tokenizer, 1)
    calls = []
    monkeypatch.setattr(learner_mod, "start_logprobs", lambda learner, b: calls.append(b))
    forwards = []
    learner.model.register_forward_hook(lambda *a: forwards.append(1))
    stats = learner.train_step(random_batch(len(tiny_tokenizer), SHAPES, seed=1))
    assert calls == [] and stats["updates"] == 1
    assert len(forwards) == stats["micro_batches"]  # one forward per micro-batch, nothing before them
