"""The trainer benchmark's padded baseline (benchmarks/padded.py): its log-probs equal the
right-padded reference, it refuses a model set up for varlen, and `PaddedLearner` switches between
padded chunks and the learner's packing (CPU, fp32)."""
import pytest
import torch

from benchmarks.padded import PaddedLearner, chunk_sequences, padded_micro_batch
from colocate.kernels.reference import per_token_logprobs
from colocate.learner.packing import (VARLEN, VARLEN_GROUPED, completion_logits, packed_micro_batch,
                                      register_varlen_attention, set_attention)
from tests.conftest import CompletionView, right_padded_logits
from tests.test_packing import LAYOUT_SHAPES, random_batch, randomize_adapter


def test_chunk_sequences_makes_consecutive_groups():
    assert chunk_sequences(7, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert chunk_sequences(0, 3) == []


def test_padded_logprobs_equal_right_padded_reference(tiny_policy, tiny_tokenizer):
    randomize_adapter(tiny_policy)
    batch = random_batch(len(tiny_tokenizer), LAYOUT_SHAPES)
    tiny_policy.eval()
    with torch.no_grad():
        set_attention(tiny_policy, "sdpa")
        left = padded_micro_batch(batch, tiny_tokenizer.pad_token_id, "cpu")
        logits_left = completion_logits(tiny_policy, left)
        view = CompletionView(batch, tiny_tokenizer.pad_token_id, "cpu")
        logits_right = right_padded_logits(tiny_policy.get_base_model(), view)
    assert torch.equal(left.targets, view.targets) and torch.equal(left.seq_ids, view.seq_ids)
    lp_left = per_token_logprobs(logits_left, left.targets, 1.0)
    lp_right = per_token_logprobs(logits_right, view.targets, 1.0)
    torch.testing.assert_close(lp_left, lp_right, atol=1e-5, rtol=0)
    register_varlen_attention()
    for name in (VARLEN, VARLEN_GROUPED):  # the padded layout needs the mask that varlen would ignore
        set_attention(tiny_policy, name)
        with pytest.raises(ValueError, match="needs attention"):
            completion_logits(tiny_policy, left)


def test_padded_learner_switches_between_padded_chunks_and_packing(tiny_cfg, tiny_tokenizer):
    import dataclasses
    from colocate.topology import Topology
    from colocate.models import build_policy
    cfg = dataclasses.replace(tiny_cfg, learner=dataclasses.replace(tiny_cfg.learner, fsdp=False,
                                                                    micro_batch_tokens=32))
    topo = Topology(rank=0, world_size=1, local_rank=0, num_inference=0, num_learners=1,
                    device=torch.device("cpu"), backend="gloo")
    learner = PaddedLearner(cfg, topo, build_policy(cfg, tiny_tokenizer, "meta"), tiny_tokenizer)
    batch = random_batch(len(tiny_tokenizer), LAYOUT_SHAPES)
    learner.use_layout(2, VARLEN)
    padded = learner.micro_batches(batch)
    assert learner.attention == "sdpa" and learner.model.config._attn_implementation == "sdpa"
    assert [sub.num_sequences for sub, _ in padded] == [2, 2, 1]
    assert all(mb.row_index is not None and mb.inputs["input_ids"].shape[0] == sub.num_sequences
               for sub, mb in padded)
    learner.use_layout(0, register_varlen_attention())
    packed = learner.micro_batches(batch)
    assert learner.model.config._attn_implementation == VARLEN
    assert all(mb.row_index is None and mb.inputs["input_ids"].shape[0] == 1 for _, mb in packed)
    assert len(packed) > 1  # the 32-token budget splits the 62 tokens
    assert sum(mb.num_tokens for _, mb in packed) == sum(mb.num_tokens for _, mb in padded)
    whole = packed_micro_batch(batch, "cpu", VARLEN)
    assert sum(mb.num_tokens for _, mb in packed) == whole.num_tokens
    batch.versions[:] = learner.version
    learner.use_layout(2, VARLEN)
    stats = learner.train_step(batch)  # the padded layout trains end to end
    assert stats["micro_batches"] == 3 and stats["tokens"] == batch.num_completion_tokens
