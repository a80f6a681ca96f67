"""Packed micro-batches: budget packing, and packed log-probs equal to the right-padded reference
(CPU, fp32)."""
import pytest
import torch

from colocate.data import TrajectoryBatch
from colocate.kernels.reference import per_token_logprobs
from tests.conftest import CompletionView, right_padded_logits
from colocate.learner.packing import (VARLEN, VARLEN_GROUPED, check_varlen_kernel, completion_logits, pack_by_budget,
                                      packed_micro_batch, register_varlen_attention, set_attention)
from colocate.models import lora_state


def random_batch(vocab: int, seq_shapes: list[tuple[int, int]], seed: int = 0) -> TrajectoryBatch:
    """Sequences of (prompt_len, completion_len) with random ids; prompts share a common prefix."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(2, vocab, (min(p for p, _ in seq_shapes) // 2,), generator=g)
    tokens, seq_lens, prompt_lens = [], [], []
    for p, c in seq_shapes:
        own = torch.randint(2, vocab, (p + c - len(prefix),), generator=g)
        tokens.append(torch.cat([prefix, own]))
        seq_lens.append(p + c)
        prompt_lens.append(p)
    n = sum(c for _, c in seq_shapes)
    b = len(seq_shapes)
    return TrajectoryBatch(tokens=torch.cat(tokens).int(), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                           prompt_lens=torch.tensor(prompt_lens, dtype=torch.int32),
                           behaviour_logprobs=-torch.rand(n, generator=g), advantages=torch.randn(b, generator=g),
                           rewards=torch.rand(b, generator=g), versions=torch.zeros(b, dtype=torch.int32))


def test_pack_by_budget_respects_budget_and_keeps_every_sequence():
    lens = [500, 30, 470, 260, 700, 90, 1200, 410, 410]
    groups = pack_by_budget(lens, 1024)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:
        assert sum(lens[i] for i in g) <= 1024 or len(g) == 1  # 1200 > budget: alone
        assert g == sorted(g)
    assert len(groups) == 4  # first-fit decreasing: 1200 | 700+260+30 | 500+470 | 410+410+90 (the lower bound)
    assert pack_by_budget([], 10) == []


def randomize_adapter(policy) -> None:
    """A non-zero adapter (seeded), so the LoRA path is covered too."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in lora_state(policy).values():
            p.normal_(0, 0.05)


LAYOUT_SHAPES = [(9, 3), (14, 1), (5, 6), (11, 4), (7, 2)]


@pytest.mark.parametrize("attention", ["sdpa", "varlen", "grouped"])
def test_packed_logprobs_equal_right_padded_reference(tiny_policy, tiny_tokenizer, attention):
    randomize_adapter(tiny_policy)
    batch = random_batch(len(tiny_tokenizer), LAYOUT_SHAPES)
    register_varlen_attention()
    name = {"sdpa": "sdpa", "varlen": VARLEN, "grouped": VARLEN_GROUPED}[attention]
    tiny_policy.eval()
    with torch.no_grad():
        set_attention(tiny_policy, name)
        packed = packed_micro_batch(batch, "cpu", name)
        logits_packed = completion_logits(tiny_policy, packed)
        set_attention(tiny_policy, "sdpa")  # the reference masks its padding
        view = CompletionView(batch, tiny_tokenizer.pad_token_id, "cpu")  # the old right-padded path
        logits_right = right_padded_logits(tiny_policy.get_base_model(), view)
    n = sum(c for _, c in LAYOUT_SHAPES)
    assert logits_packed.shape[0] == n and torch.equal(packed.targets, view.targets)
    assert torch.equal(packed.seq_ids, view.seq_ids)
    lp_packed = per_token_logprobs(logits_packed, packed.targets, 1.0)
    lp_right = per_token_logprobs(logits_right, view.targets, 1.0)
    torch.testing.assert_close(lp_packed, lp_right, atol=1e-5, rtol=0)


def test_packed_sequences_do_not_see_each_other(tiny_policy, tiny_tokenizer):
    """Changing one sequence leaves the other sequences' logits in the same packed row unchanged."""
    shapes = [(8, 3), (10, 2), (6, 4)]
    a = random_batch(len(tiny_tokenizer), shapes, seed=1)
    b = random_batch(len(tiny_tokenizer), shapes, seed=1)
    b.tokens[: 11] = torch.randint(2, len(tiny_tokenizer), (11,)).int()  # rewrite sequence 0
    for name in ("sdpa", register_varlen_attention()):
        set_attention(tiny_policy, name)
        with torch.no_grad():
            la = completion_logits(tiny_policy, packed_micro_batch(a, "cpu", name))
            lb = completion_logits(tiny_policy, packed_micro_batch(b, "cpu", name))
        torch.testing.assert_close(la[3:], lb[3:], atol=1e-6, rtol=0)
        assert not torch.allclose(la[:3], lb[:3])
    assert VARLEN == "colocate_varlen"


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_varlen_kernel_matches_grouped_sdpa():
    """torch's flash varlen kernel (what learner.attention=varlen uses on GPU) against grouped SDPA."""
    got = check_varlen_kernel("cuda")
    if not got["kernel"]:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    assert got["out_rel_err"] < 1e-2 and got["grad_rel_err"] < 1e-2, got
