"""Tree attention over a prefix-tree micro-batch (`prefix_tree.TreeLayout`), as transformers attention
implementations.

Rule: query i sees key j iff j <= i < kv_end[j]. The layout puts every segment's subtree in one
token range after it, so this is "causal within the node, and every token of every ancestor", and
nothing of siblings or cousins. Flat packing is the special case of one segment per sequence.

Two implementations, chosen per micro-batch by the name the learner set (`packing.resolve_attention`):
  * TREE_SDPA - the reference: a dense [1, 1, T, T] boolean mask built once per micro-batch, SDPA
                with it in every layer. O(T^2) memory; CPU, tests, and the GPU fallback.
  * TREE_FLEX - FlexAttention with a BlockMask built once per micro-batch from kv_end's per-block
                bounds (`flex_tree_mask`): only the blocks the tree touches are computed.
                FlexAttention has no CPU backward in this torch, so CPU runs it forward-only (the
                parity test).
The model receives the mask as the `tree_mask` keyword of its forward; transformers passes unknown
keywords through every decoder layer to the attention function, and builds no mask itself for a
registered custom implementation.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

TREE_SDPA = "colocate_tree_sdpa"
TREE_FLEX = "colocate_tree_flex"
TREE_ATTENTIONS = (TREE_SDPA, TREE_FLEX)


def dense_tree_mask(kv_end: torch.Tensor) -> torch.Tensor:
    """[T] kv_end -> [1, 1, T, T] bool, True where query i may see key j."""
    idx = torch.arange(kv_end.numel(), device=kv_end.device)
    return ((idx[None, :] <= idx[:, None]) & (idx[:, None] < kv_end[None, :]))[None, None]


FLEX_BLOCK = 128  # FlexAttention's default tile: the block mask's granularity


def flex_tree_mask(kv_end: torch.Tensor, block: int = FLEX_BLOCK):
    """[T] kv_end (on the compute device) -> FlexAttention BlockMask of the same rule, built from
    per-block bounds of kv_end with a few [nb, nb] tensor ops (nb = T / block): no [T, T] rule is
    evaluated and nothing is compiled, so a new length per micro-batch triggers no recompilation.

    A (query block, key block) pair is full where every pair in it is allowed (the key block lies
    before the query block and every key's subtree reaches past the last query), skipped where none
    can be (the key block after the query block, or every key's subtree ending before the first
    query), partial otherwise (the rule is applied per element there; counting too many pairs as
    partial costs time, never exactness)."""
    from torch.nn.attention.flex_attention import BlockMask
    t, dev = kv_end.numel(), kv_end.device
    nb = -(-t // block)
    # padded keys end at 0: never seen; the rule reads this padded copy, so no index leaves it
    end = F.pad(kv_end, (0, nb * block - t), value=0)
    per_block = end.view(nb, block)
    q_lo = torch.arange(nb, device=dev) * block                        # [nb] first query of each block
    q_hi = q_lo + block - 1                                             # [nb] last query
    kb, qb = torch.arange(nb, device=dev)[None, :], torch.arange(nb, device=dev)[:, None]
    # a query block cut by the end of the row is never full (as create_block_mask has it)
    whole = (q_lo + block <= t)[:, None]
    full = (kb < qb) & (per_block.amin(1)[None, :] > q_hi[:, None]) & whole  # [nb q, nb kv]
    partial = (kb <= qb) & (per_block.amax(1)[None, :] > q_lo[:, None]) & ~full

    def tree_rule(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < end[kv_idx])

    def ordered(mask):  # [nb, nb] bool -> ([1, 1, nb] counts, [1, 1, nb, nb] block indices, used first)
        indices = torch.argsort(mask.to(torch.int8), dim=-1, descending=True, stable=True)
        return mask.sum(-1).to(torch.int32)[None, None], indices.to(torch.int32)[None, None]
    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=block, mask_mod=tree_rule,
                                    seq_lengths=(t, t))


def build_tree_mask(kv_end: torch.Tensor, attention: str):
    """The `tree_mask` model keyword for `attention` (TREE_SDPA: dense bool tensor; TREE_FLEX: BlockMask)."""
    if attention == TREE_SDPA:
        return dense_tree_mask(kv_end)
    if attention == TREE_FLEX:
        return flex_tree_mask(kv_end)
    raise ValueError(f"not a tree attention: {attention!r} (one of {TREE_ATTENTIONS})")


def _check(query, tree_mask, name: str) -> None:
    if tree_mask is None:
        raise ValueError(f"{name} attention needs the tree_mask keyword (packing.tree_micro_batch)")
    if query.shape[0] != 1:
        raise ValueError(f"{name} attention expects one packed row")


def tree_sdpa_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *,
                        tree_mask=None, **kwargs):
    """Reference: query [1, Hq, T, D], key/value [1, Hkv, T, D], tree_mask [1, 1, T, T] -> [1, T, Hq, D]."""
    _check(query, tree_mask, TREE_SDPA)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=tree_mask, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def _flex(compiled: bool):
    """flex_attention, compiled on CUDA (dynamic: every micro-batch has another length); eager
    elsewhere (CPU: forward only, and it materializes the scores)."""
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=True) if compiled else flex_attention


@torch.compiler.disable
def tree_flex_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *,
                        tree_mask=None, flex=None, **kwargs):
    """FlexAttention: query [1, Hq, T, D], key/value [1, Hkv, T, D], tree_mask a BlockMask -> [1, T, Hq, D].
    `flex` is bound at registration (`_flex`): nothing is compiled or imported inside a compiled block.

    A decoder block compiled whole (`learner.compile`) breaks its graph at this call and runs it
    eagerly, the separately compiled `flex` inside: inductor fails to lower the tree's mask_mod
    inside a dynamic-shape block graph (profiles/HISTORY.md). The whole function, not its kernel call
    alone: a break inside it left two small graphs of its own (the checks, the transpose)."""
    _check(query, tree_mask, TREE_FLEX)
    out = flex(query, key, value, block_mask=tree_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register_tree_attention() -> None:
    """Make TREE_SDPA and TREE_FLEX valid transformers attention implementations."""
    from transformers import AttentionInterface
    AttentionInterface.register(TREE_SDPA, tree_sdpa_attention)
    AttentionInterface.register(TREE_FLEX, functools.partial(tree_flex_attention,
                                                             flex=_flex(torch.cuda.is_available())))
