"""The LoRA adapter as one tensor-parallel rank of a vLLM engine holds it (no vLLM import).

A TP engine of size k shards each base linear layer over its k GPUs, and vLLM 0.25's default LoRA
wrappers (not `fully_sharded_loras`) slice the adapter the same way (`vllm/lora/layers/`):

  column-parallel layers, q/k/v (packed into `qkv_proj`) and gate/up (packed into `gate_up_proj`):
      A is replicated [r, in]; B keeps the rank's output rows of its own projection [out/k, r];
  row-parallel layers, o_proj and down_proj:
      A keeps the rank's input columns [r, in/k]; B is replicated [out, r].

The rank's LoRA output then sits where its base output does: a column layer's rows are this rank's
part of the output, a row layer's partial sum rides on the base layer's all-reduce. So merged mode
needs the same slices: the rank's weight is W_t + s * B_t @ A_t, its shard of W + s * B @ A.

The learner still sends the whole adapter to every TP worker (one broadcast, one checksum over all
of it); each worker takes narrow views of what it received (`TpShard.views`), so no bytes are
copied and the checksum of the received buffer covers every shard. `TpShard.spec` has the rank's
shapes: what `slot_views` checks the slot against, and what `merge_plan` derives the rank's row
offsets in a fused weight from (q rows, then k, then v, each the rank's share).

GQA: q heads are split over the ranks; k/v heads too while k <= num_kv_heads, else each rank holds
one kv head and k / num_kv_heads consecutive ranks share it (vLLM's `num_kv_head_replicas`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from colocate.engine.adapter_targets import lora_module_name
from colocate.wire import LoraSpec

HEAD_ROWS = ("q_proj", "k_proj", "v_proj")
"""Column-parallel, packed into `QKVParallelLinear`: B rows by whole heads."""
EVEN_ROWS = ("gate_proj", "up_proj")
"""Column-parallel, packed into `MergedColumnParallelLinear`: B rows in k equal parts."""
INPUT_COLUMNS = ("o_proj", "down_proj")
"""Row-parallel (`RowParallelLinear`): A columns in k equal parts."""


@dataclass(frozen=True)
class Heads:
    """The attention shape the qkv split needs."""
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @staticmethod
    def of(config) -> "Heads":
        """From an HF config (Qwen2 / Llama): head_dim when given, else hidden / heads."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return Heads(config.num_attention_heads, config.num_key_value_heads, head_dim)


@dataclass(frozen=True)
class KvSplit:
    """How k/v heads sit on the TP ranks (vLLM `QKVParallelLinear.__init__`, `model_executor/layers/linear.py`)."""
    heads_per_rank: int
    replicas: int
    """Consecutive ranks holding the same kv heads (1 unless k > num_kv_heads)."""


def kv_split(heads: Heads, tp_size: int) -> KvSplit:
    """vLLM's rule, with its `divide` assertions as ValueErrors naming the shape."""
    if heads.num_heads % tp_size:
        raise ValueError(f"tensor-parallel size {tp_size} does not divide the model's {heads.num_heads} attention heads")
    if tp_size >= heads.num_kv_heads:
        if tp_size % heads.num_kv_heads:
            raise ValueError(f"tensor-parallel size {tp_size} is not a multiple of the model's {heads.num_kv_heads} "
                             "key/value heads (vLLM replicates kv heads only a whole number of times)")
        return KvSplit(1, tp_size // heads.num_kv_heads)
    if heads.num_kv_heads % tp_size:
        raise ValueError(f"tensor-parallel size {tp_size} does not divide the model's {heads.num_kv_heads} key/value heads")
    return KvSplit(heads.num_kv_heads // tp_size, 1)


@dataclass(frozen=True)
class ShardSlice:
    """One adapter tensor on one TP rank: rows (dim 0) or columns (dim 1) [start, start + length)."""
    name: str
    dim: int
    start: int
    length: int
    full_shape: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.length if d == self.dim else n for d, n in enumerate(self.full_shape))


def even_part(name: str, size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    if size % tp_size:
        raise ValueError(f"adapter tensor {name!r}: {size} rows/columns do not split over {tp_size} ranks")
    return tp_rank * (size // tp_size), size // tp_size


def shard_slice(name: str, shape: tuple[int, ...], heads: Heads, tp_size: int, tp_rank: int) -> ShardSlice:
    """Rank `tp_rank`'s part of one peft adapter tensor (lora_A [r, in] or lora_B [out, r]).

    q B rows: `MergedQKVParallelLinearWithLoRA.slice_lora_b` (`vllm/lora/layers/column_parallel_linear.py`,
    shard id tp_rank); k/v B rows: the same, shard id tp_rank // num_kv_head_replicas; gate/up B rows:
    `MergedColumnParallelLinearWithLoRA.slice_lora_b` (output_size / tp per slice); their A:
    `slice_lora_a` returns it whole. o/down A columns: `RowParallelLinearWithLoRA.slice_lora_a`
    (`vllm/lora/layers/row_parallel_linear.py`, input_size_per_partition); their B whole."""
    module, is_a = lora_module_name(name)
    projection = module.rpartition(".")[2]
    whole = ShardSlice(name, 0, 0, shape[0], tuple(shape))
    if projection in HEAD_ROWS + EVEN_ROWS:
        if is_a:
            return whole
        if projection in EVEN_ROWS:
            start, rows = even_part(name, shape[0], tp_size, tp_rank)
            return ShardSlice(name, 0, start, rows, tuple(shape))
        split = kv_split(heads, tp_size)
        is_q = projection == "q_proj"
        if shape[0] != (heads.num_heads if is_q else heads.num_kv_heads) * heads.head_dim:
            raise ValueError(f"adapter tensor {name!r}: {shape[0]} rows do not match the model's {heads}")
        rows = (heads.num_heads // tp_size if is_q else split.heads_per_rank) * heads.head_dim
        return ShardSlice(name, 0, (tp_rank if is_q else tp_rank // split.replicas) * rows, rows, tuple(shape))
    if projection in INPUT_COLUMNS:
        if not is_a:
            return whole
        start, cols = even_part(name, shape[1], tp_size, tp_rank)
        return ShardSlice(name, 1, start, cols, tuple(shape))
    raise ValueError(f"adapter tensor {name!r}: no tensor-parallel rule for {projection!r} (LoRA on "
                     f"{', '.join(HEAD_ROWS + EVEN_ROWS + INPUT_COLUMNS)} only)")


@dataclass(frozen=True)
class TpShard:
    """What TP rank `tp_rank` of `tp_size` holds of an adapter laid out by `full` (the wire's spec)."""
    full: LoraSpec
    tp_size: int
    tp_rank: int
    slices: tuple[ShardSlice, ...]
    """In `full.names` order."""

    @staticmethod
    def of(full: LoraSpec, heads: Heads, tp_size: int, tp_rank: int) -> "TpShard":
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tensor-parallel rank {tp_rank} is not in [0, {tp_size})")
        kv_split(heads, tp_size)  # the model's heads first: the one line names the shape, not a tensor
        slices = tuple(shard_slice(n, s, heads, tp_size, tp_rank) for n, s in zip(full.names, full.shapes))
        return TpShard(full, tp_size, tp_rank, slices)

    @property
    def spec(self) -> LoraSpec:
        """The rank's shapes, same names and dtype (for `slot_views` and `merge_plan`)."""
        return LoraSpec(self.full.names, tuple(s.shape for s in self.slices), self.full.dtype)

    def views(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full tensors by name (`unflatten_lora` of the received buffer) -> the rank's parts, as views."""
        return {s.name: tensors[s.name].narrow(s.dim, s.start, s.length) for s in self.slices}
