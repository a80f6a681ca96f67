"""Tree attention over a prefix-tree micro-batch (`prefix_tree.TreeLayout`), as transformers attention
implementations.

Rule: query i sees key j iff j <= i < kv_end[j]. The layout puts every segment's subtree in one
token range after it, so this is "causal within the node, and every token of every ancestor", and
nothing of siblings or cousins. Flat packing is the special case of one segment per sequence.

Two implementations, chosen per micro-batch by the name the learner set (`packing.resolve_attention`):
  * TREE_SDPA - the reference: a dense [1, 1, T, T] boolean mask built once per micro-batch, SDPA
                with it in every layer. O(T^2) memory; CPU, tests, and the GPU fallback.
  * TREE_FLEX - FlexAttention with a BlockMask built once per micro-batch from kv_end (compiled on
                CUDA: only the blocks the tree touches are computed). FlexAttention has no CPU
                backward in this torch, so CPU runs it forward-only (the parity test).
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


def flex_tree_mask(kv_end: torch.Tensor):
    """[T] kv_end (on the compute device) -> FlexAttention BlockMask of the same rule."""
    from torch.nn.attention.flex_attention import create_block_mask

    def tree_rule(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < kv_end[kv_idx])
    t = kv_end.numel()
    # compiled on CUDA: the eager path materializes the whole [T, T] rule first
    return create_block_mask(tree_rule, None, None, t, t, device=kv_end.device, _compile=kv_end.is_cuda)


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


def tree_flex_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *,
                        tree_mask=None, flex=None, **kwargs):
    """FlexAttention: query [1, Hq, T, D], key/value [1, Hkv, T, D], tree_mask a BlockMask -> [1, T, Hq, D].
    `flex` is bound at registration (`_flex`): nothing is compiled or imported inside a compiled block."""
    _check(query, tree_mask, TREE_FLEX)
    out = flex(query, key, value, block_mask=tree_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register_tree_attention() -> None:
    """Make TREE_SDPA and TREE_FLEX valid transformers attention implementations."""
    from transformers import AttentionInterface
    AttentionInterface.register(TREE_SDPA, tree_sdpa_attention)
    AttentionInterface.register(TREE_FLEX, functools.partial(tree_flex_attention,
                                                             flex=_flex(torch.cuda.is_available())))
