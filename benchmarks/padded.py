"""The trainer benchmark's baseline layout: the micro-batching the learner used before packing.

Consecutive chunks of a fixed number of sequences, each left-padded to its longest sequence, SDPA
with a mask. Every row then ends at the last column, so the completion positions of all rows fall in
the last `max completion` columns: the model returns [B * keep, V] logits and `MicroBatch.row_index`
picks the N completion rows out of them.

`PaddedLearner` trains on that layout while `padded_batch` > 0 and on the learner's own packing
otherwise, so one model (built once: a 7B build is slow) serves every variant of a benchmark run.
"""
from __future__ import annotations

import torch

from colocate.data import TrajectoryBatch
from colocate.learner.learner import Learner
from colocate.learner.packing import MicroBatch, set_attention


def chunk_sequences(num_sequences: int, per_micro_batch: int) -> list[list[int]]:
    """Consecutive groups of `per_micro_batch` sequence indices (the last one may be shorter)."""
    return [list(range(i, min(i + per_micro_batch, num_sequences)))
            for i in range(0, num_sequences, per_micro_batch)]


def padded_micro_batch(mb: TrajectoryBatch, pad_id: int, device) -> MicroBatch:
    """[B, W] left-padded to the longest sequence; SDPA with a [B, 1, W, W] mask.

    The padding of a row is a segment of its own (position ids restart at the first real token), so
    transformers builds a causal mask within segments: real tokens see only their sequence, and no
    padding row is fully masked (some CUDA SDPA kernels return NaN for those, which would then
    leak through the zero attention weights into real tokens)."""
    lens = mb.seq_lens.tolist()
    comp = (mb.seq_lens - mb.prompt_lens).tolist()
    width, keep = max(lens), max(comp)
    input_ids = torch.full((len(lens), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(lens), width), dtype=torch.long)
    offset, targets, seq_ids, row_index = 0, [], [], []
    for r, (n, c) in enumerate(zip(lens, comp)):
        input_ids[r, width - n:] = mb.tokens[offset:offset + n].long()
        position_ids[r, :width - n] = torch.arange(width - n)
        position_ids[r, width - n:] = torch.arange(n)
        offset += n
        targets.append(input_ids[r, width - c:])
        seq_ids += [r] * c
        # the model returns rows [B * keep] (columns width-1-keep .. width-2 of each row)
        row_index += [r * keep + keep - c + j for j in range(c)]
    inputs = {"input_ids": input_ids.to(device), "position_ids": position_ids.to(device),
              "logits_to_keep": torch.arange(width - 1 - keep, width - 1, device=device)}
    return MicroBatch(inputs=inputs, targets=torch.cat(targets).to(device),
                      seq_ids=torch.tensor(seq_ids, dtype=torch.long, device=device),
                      row_index=torch.tensor(row_index, dtype=torch.long, device=device),
                      attention="sdpa", num_tokens=sum(lens))


class PaddedLearner(Learner):
    """A `Learner` whose micro-batches are padded chunks of `padded_batch` sequences while that is
    > 0 (the baseline), and its own packed micro-batches otherwise."""

    padded_batch: int = 0

    def use_layout(self, padded_batch: int, attention: str) -> None:
        """padded_batch > 0: padded chunks of that many sequences, SDPA with a mask (the padded
        layout needs it); 0: packing, with `attention` (sdpa or a varlen name)."""
        self.padded_batch = padded_batch
        self.attention = "sdpa" if padded_batch else attention
        set_attention(self.model, self.attention)

    def micro_batches(self, batch: TrajectoryBatch,
                      rider: list[int] | None = None) -> list[tuple[TrajectoryBatch, MicroBatch]]:
        if not self.padded_batch:
            return super().micro_batches(batch, rider)
        if rider:
            raise ValueError("padded micro-batches carry no canary probe (the trainer benchmark scores none)")
        chunks = chunk_sequences(batch.num_sequences, self.padded_batch)
        return [(sub, padded_micro_batch(sub, self.pad_id, self.device)) for sub in (batch.select(c) for c in chunks)]
