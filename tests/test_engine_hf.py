"""HF reference engine: constraint semantics, log-probs equal to the learner's, in-place adapter loads."""
import torch

from colocate.constraint import Constraint, ConstraintState
from colocate.data import Request, build_batch, group_advantages, Sample
from colocate.engine.hf import HFEngine
from colocate.envs import make_env
from colocate.kernels import restrict_to_allowed
from colocate.kernels.reference import per_token_logprobs
from colocate.learner.packing import completion_logits, packed_micro_batch, set_attention
from colocate.models import lora_state

import pytest


def test_constraint_state_handles_prefix_choices():
    c = Constraint(slots=[[[5], [5, 6]], [[7]]], eos_id=1)
    s = ConstraintState(c)
    assert s.allowed() == [5]
    s.advance(5)
    assert s.allowed() == [6, 7]  # either finish slot 0 and start slot 1, or continue "5 6"
    s.advance(6)
    assert s.allowed() == [7]
    s.advance(7)
    assert s.allowed() == [1]
    s.advance(1)
    assert s.done
    with pytest.raises(ValueError, match="not allowed"):
        ConstraintState(c).advance(9)


def test_constrained_samples_are_valid_and_logprobs_match_learner(tiny_cfg, tiny_tokenizer, tiny_policy):
    torch.manual_seed(0)
    with torch.no_grad():  # a non-zero adapter, so the check covers the LoRA path too
        for p in lora_state(tiny_policy).values():
            p.normal_(0, 0.05)
    engine = HFEngine(tiny_policy, tiny_tokenizer, seed=3)
    env = make_env(tiny_cfg, tiny_tokenizer, seed=0)
    for g in range(4):
        env.start_group(g)
    keyed = env.requests()
    completions = engine.generate([r for _, r in keyed])
    answers = {tuple(s) for s in keyed[0][1].constraint.slots[0]}
    for c in completions:
        assert tuple(c.token_ids[:-1]) in answers and c.token_ids[-1] == tiny_tokenizer.eos_token_id
        assert c.finish_reason == "stop" and len(c.allowed_ids) == len(c.token_ids)
        assert c.logprobs[-1] == pytest.approx(0.0, abs=1e-6)  # EOS is forced once the slot is filled
    env.step({k: c for (k, _), c in zip(keyed, completions)})
    samples = env.pop_finished()
    batch = build_batch(samples, group_advantages(samples))
    mb = packed_micro_batch(batch, "cpu", "sdpa")  # the learner's own layout (packed rows)
    set_attention(tiny_policy, "sdpa")
    with torch.no_grad():
        logits = completion_logits(tiny_policy, mb)
    sub, targets = restrict_to_allowed(logits, mb.targets, batch.allowed_ids)
    learner_logp = per_token_logprobs(sub, targets, tiny_cfg.engine.temperature)
    torch.testing.assert_close(learner_logp, batch.behaviour_logprobs, atol=1e-5, rtol=0)


def test_unconstrained_generation_stops_at_eos_or_length(tiny_tokenizer, tiny_policy):
    engine = HFEngine(tiny_policy, tiny_tokenizer, seed=0)
    reqs = [Request(prompt_ids=tiny_tokenizer.encode("add 1 and 2 ; answer :"), max_new_tokens=n) for n in (1, 3, 6)]
    out = engine.generate(reqs)
    for r, c in zip(reqs, out):
        assert 1 <= len(c.token_ids) <= r.max_new_tokens and c.allowed_ids is None
        assert (c.finish_reason == "stop") == (c.token_ids[-1] == tiny_tokenizer.eos_token_id)
        assert all(lp <= 0 for lp in c.logprobs)


def test_load_lora_in_place_sets_version(tiny_tokenizer, tiny_policy):
    engine = HFEngine(tiny_policy, tiny_tokenizer)
    before = {n: p.data_ptr() for n, p in engine.lora_state().items()}
    new = {n: torch.full_like(p, 0.5) for n, p in engine.lora_state().items()}
    engine.load_lora(7, new)
    assert engine.version == 7
    for n, p in engine.lora_state().items():
        assert p.data_ptr() == before[n] and torch.equal(p, new[n])
    with pytest.raises(KeyError, match="lacks"):
        engine.load_lora(8, {})


def test_group_advantages_normalize_per_key():
    from colocate.data import Completion
    c = Completion([1], [0.0], None, 0)
    samples = [Sample([1], c, r, key) for r, key in [(1, "a"), (0, "a"), (5, "b"), (5, "b")]]
    samples.append(Sample([1], c, 0, "a", is_anchor=False))  # receives A's stats, does not shift them
    adv = group_advantages(samples)
    assert adv[0] == pytest.approx(1.0, abs=1e-4) and adv[1] == pytest.approx(-1.0, abs=1e-4)
    assert adv[2] == adv[3] == 0.0 and adv[4] == pytest.approx(-1.0, abs=1e-4)
    # a uniform group of a reward that binary floating point cannot hold: still exactly 0
    assert sum(0.7 for _ in range(6)) / 6 != 0.7
    assert group_advantages([Sample([1], c, 0.7, "c") for _ in range(6)]) == [0.0] * 6
    # a key without anchors: each sample is its own group's mean
    assert group_advantages([Sample([1], c, 3.0, "d", is_anchor=False), Sample([1], c, 1.0, "a")]) == [0.0, 0.0]


def test_host_tensor_is_torch_tensor():
    """A batch's host lists become tensors through numpy: same dtype and values as torch.tensor."""
    import numpy as np

    from colocate.data import host_tensor
    for values, np_dtype, dtype in (([5, 151_000, 0], np.int32, torch.int32), ([], np.int32, torch.int32),
                                    ([-0.5, -12.25, 0.0], np.float32, torch.float32),
                                    ([True, False, True], np.bool_, torch.bool)):
        got, want = host_tensor(values, np_dtype), torch.tensor(values, dtype=dtype)
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_temperature_zero_is_greedy_and_ignores_the_seed(tiny_tokenizer, tiny_policy):
    """Evaluation samples at temperature 0: each step takes the most likely allowed token."""
    prompt = tiny_tokenizer.encode("add 1 and 2 ; answer :")
    reqs = [Request(prompt_ids=prompt, max_new_tokens=5, temperature=0.0),
            Request(prompt_ids=prompt, max_new_tokens=5, temperature=1.0)]
    a, b = HFEngine(tiny_policy, tiny_tokenizer, seed=1).generate(reqs), HFEngine(tiny_policy, tiny_tokenizer, seed=2).generate(reqs)
    assert a[0].token_ids == b[0].token_ids
    ids = list(prompt)
    with torch.no_grad():
        for tok in a[0].token_ids:
            assert tok == int(tiny_policy(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(tok)
    assert all(lp <= 0 and lp == lp for c in a for lp in c.logprobs)


def _learner_logprobs(policy, samples, temperature):
    """Every completion token's log-prob under `policy`'s live adapter, in the learner's own packed
    layout (as `test_constrained_samples_are_valid_and_logprobs_match_learner`)."""
    batch = build_batch(samples, [0.0] * len(samples))
    mb = packed_micro_batch(batch, "cpu", "sdpa")
    set_attention(policy, "sdpa")
    with torch.no_grad():
        logits = completion_logits(policy, mb)
    return per_token_logprobs(logits, mb.targets, temperature), batch


def test_inflight_updates_keep_every_behaviour_logprob_exact(tiny_tokenizer, tiny_policy):
    """Requests decode in chunks across polls; two adapter updates land while some run. Each token's
    recorded log-prob is its sampler's: recomputed by the learner's forward under the version the
    engine recorded for that token, it agrees to fp32 rounding (the tolerance of the test above)."""
    torch.manual_seed(1)
    adapters = []
    for _ in range(3):
        adapters.append({n: torch.randn_like(p) * 0.05 for n, p in lora_state(tiny_policy).items()})
    engine = HFEngine(tiny_policy, tiny_tokenizer, seed=5, decode_chunk=2)
    engine.load_lora(0, adapters[0])
    prompts = ["add 1 and 2 ; answer :", "add 3 and 0 ; answer :", "add 4 and 4 ; answer :"]
    requests = [Request(prompt_ids=tiny_tokenizer.encode(prompts[i % 3]), max_new_tokens=3 + 2 * i) for i in range(6)]
    tickets = engine.submit(requests[:4])
    got = dict(engine.poll())
    assert 0 < len(got) < 4  # some finished, the rest are still in flight
    engine.load_lora(1, adapters[1])  # lands between two chunks of the running cohort
    tickets += engine.submit(requests[4:])  # a second cohort, started under version 1
    got.update(engine.poll())
    engine.load_lora(2, adapters[2])
    got.update(engine.poll(wait_all=True))
    assert sorted(got) == tickets and not engine._cohorts
    completions = [got[t] for t in tickets]
    assert any(c.version < c.last_version for c in completions)  # updates landed mid-request
    assert engine.stats()["reprefills"] >= 2
    samples = [Sample(r.prompt_ids, c, 0.0, 0) for r, c in zip(requests, completions)]
    versions = torch.tensor([v for c in completions for v in c.token_versions])
    assert versions.numel() == sum(len(c.token_ids) for c in completions)
    for c in completions:
        assert c.token_versions == sorted(c.token_versions)
        assert (c.version, c.last_version) == (c.token_versions[0], c.token_versions[-1])
    expected = torch.zeros(versions.numel())
    for v, adapter in enumerate(adapters):
        engine.load_lora(v, adapter)
        logp, batch = _learner_logprobs(tiny_policy, samples, 1.0)
        expected = torch.where(versions == v, logp, expected)
    assert set(versions.tolist()) == {0, 1, 2}
    torch.testing.assert_close(batch.behaviour_logprobs, expected, atol=1e-5, rtol=0)


def test_a_streamed_poll_returns_after_a_chunk_once_woken(tiny_tokenizer, tiny_policy):
    """`wake` (the env has new work) ends a streamed poll after the chunk it is in, even with
    nothing finished; unwoken, the poll runs until a request finishes."""
    from colocate.constraint import Constraint
    engine = HFEngine(tiny_policy, tiny_tokenizer, seed=0, decode_chunk=2)
    ids = tiny_tokenizer.encode("add 1 and 2 ; answer :")
    forced = Constraint(slots=[[ids[:6]]], eos_id=tiny_tokenizer.eos_token_id)  # 6 tokens, then EOS
    engine.submit([Request(prompt_ids=ids, max_new_tokens=16, constraint=forced)])
    calls = []
    assert engine.poll(wake=lambda: calls.append(1) or True) == [] and len(calls) == 1
    ((_, completion),) = engine.poll(wake=lambda: False)
    assert completion.token_ids == ids[:6] + [tiny_tokenizer.eos_token_id]
