"""Micro-batch layouts for the learner's forward, and the attention that respects them.

Packed: whole sequences, first-fit-decreasing into micro-batches of at most `token_budget` tokens,
concatenated into one row [1, T] with position ids restarting at 0 for each sequence. No padding.
Sequence boundaries reach the attention in one of two ways:
  * varlen - `cu_seqlens` [B+1] go to a flash-attention varlen kernel (`torch.nn.attention.varlen`,
             registered with transformers as the attention implementation "colocate_varlen"); no mask
             is built and no work is spent across sequences. Without that kernel (CPU) the same
             function runs causal SDPA on the sequences grouped by length, one batched call per
             distinct length. The default (learner.attention auto).
  * sdpa   - transformers detects the restarting position ids and builds a block-diagonal causal
             mask [1, 1, T, T] for SDPA: correct everywhere, but O(T^2) memory and compute
             (profiles/trainer.md compares the layouts).
Prefix trees (`learner.prefix_sharing` tree or group, `prefix_tree.py`): the same row [1, T], but
shared prompt prefixes appear once and each completion is a leaf; the attention is a tree mask
(`tree_attention.py`) passed as the `tree_mask` model keyword, and trees that do not fit the budget
are split at node boundaries.

The lm_head runs only on rows whose hidden state predicts a completion token (HF's `logits_to_keep`
with an index tensor): logits [N, V], N = completion tokens.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from colocate.data import TrajectoryBatch
from colocate.kernels import scale_grad_rows
from colocate.learner.prefix_tree import split_by_budget, split_prompts, tree_layout
from colocate.learner.tree_attention import (TREE_ATTENTIONS, TREE_FLEX, TREE_SDPA, build_tree_mask,
                                             register_tree_attention)

VARLEN = "colocate_varlen"  # name of the varlen attention in transformers' AttentionInterface


def pack_by_budget(seq_lens: list[int], token_budget: int) -> list[list[int]]:
    """Sequence indices grouped first-fit-decreasing so each group's total length <= budget.

    A sequence longer than the budget gets a group of its own. Groups list indices in input order."""
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i]):
        n = seq_lens[i]
        for b, room in enumerate(free):
            if n <= room:
                bins[b].append(i)
                free[b] -= n
                break
        else:
            bins.append([i])
            free.append(token_budget - n)
    return [sorted(b) for b in bins]


@dataclass
class MicroBatch:
    """Model inputs of one micro-batch plus what the loss needs, on the learner's device."""
    inputs: dict
    """Keyword arguments of the model's forward (input_ids, position_ids, logits_to_keep, ...)."""
    targets: torch.Tensor
    """[N] int64 completion token ids."""
    seq_ids: torch.Tensor
    """[N] int64 index of each completion token's sequence within the micro-batch."""
    row_index: torch.Tensor | None = None
    """[N] int64 rows of the [R, V] logits the model returns that hold the completion logits, for a
    layout whose model output has more rows than completion tokens (a padded one: every row keeps the
    same columns); None when the model returns exactly the N rows in order (packed)."""
    attention: str = "sdpa"
    """Attention implementation the layout needs (VARLEN or sdpa)."""
    num_tokens: int = 0
    """Real (non-padding) tokens in the micro-batch, a rider's not counted."""
    rider: torch.Tensor | None = None
    """[R] int64 targets of a rider: a sequence outside the loss (the canary's probe) forwarded as
    this micro-batch's last (`with_rider`). Its R rows follow the N completion rows at the lm_head's
    input, where `completion_logits` splits them off: the loss sees the same N rows as without it."""


def packed_micro_batch(mb: TrajectoryBatch, device, attention: str) -> MicroBatch:
    """One row [1, T] of concatenated sequences; `attention` VARLEN passes cu_seqlens, sdpa a mask."""
    lens = mb.seq_lens.long()
    prompt = mb.prompt_lens.long()
    comp = lens - prompt
    starts = torch.cumsum(lens, 0) - lens
    total, num_completion = int(lens.sum()), int(comp.sum())
    position_ids = torch.arange(total) - torch.repeat_interleave(starts, lens)
    seq_ids = torch.repeat_interleave(torch.arange(len(lens)), comp)
    comp_starts = torch.cumsum(comp, 0) - comp
    within = torch.arange(num_completion) - torch.repeat_interleave(comp_starts, comp)
    token_pos = starts[seq_ids] + prompt[seq_ids] + within  # [N] where each completion token sits
    tokens = mb.tokens.long()
    inputs = {
        "input_ids": tokens.unsqueeze(0).to(device),
        "position_ids": position_ids.unsqueeze(0).to(device),
        # the token at t is predicted by the hidden state at t - 1
        "logits_to_keep": (token_pos - 1).to(device),
    }
    if attention.startswith(VARLEN):  # VARLEN or VARLEN_GROUPED: boundaries as cu_seqlens
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lens, 0)
        cu = cu.to(device)
        longest = int(lens.max())
        inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    return MicroBatch(inputs=inputs, targets=tokens[token_pos].to(device), seq_ids=seq_ids.to(device),
                      attention=attention, num_tokens=total)


def tree_micro_batch(mb: TrajectoryBatch, device, attention: str, mode: str) -> MicroBatch:
    """One row [1, T] holding the prefix tree of the sub-batch (`prefix_tree.tree_layout`, mode tree or
    group): shared prompt tokens once, each completion a leaf; `attention` TREE_SDPA or TREE_FLEX,
    its mask passed as the `tree_mask` model keyword. Targets and seq_ids in the flat layout's order,
    so the loss sees the same [N] problem as with `packed_micro_batch`."""
    return _tree_micro_batch(*split_prompts(mb), device, attention, mode)


def _tree_micro_batch(prompts: list[list[int]], completions: list[list[int]], device, attention: str,
                      mode: str) -> MicroBatch:
    layout = tree_layout(prompts, completions, mode)
    inputs = {
        "input_ids": layout.tokens.unsqueeze(0).to(device),
        "position_ids": layout.position_ids.unsqueeze(0).to(device),
        "logits_to_keep": layout.keep.to(device),  # [N] with repeats: one prompt end feeds G leaves
        "tree_mask": build_tree_mask(layout.kv_end.to(device), attention),
    }
    return MicroBatch(inputs=inputs, targets=layout.targets.to(device), seq_ids=layout.seq_ids.to(device),
                      attention=attention, num_tokens=layout.num_tokens)


def layout(batch: TrajectoryBatch, token_budget: int, prefix_sharing: str, device, attention: str,
           rider: list[int] | None = None) -> list[tuple[list[int], TrajectoryBatch, MicroBatch]]:
    """A batch -> (its sequence indices, sub-batch, model inputs) per micro-batch of at most
    `token_budget` forwarded tokens. prefix_sharing off: whole sequences first-fit-decreasing
    (`pack_by_budget`); tree or group: prefix trees split at node boundaries
    (`prefix_tree.split_by_budget`). Either way a micro-batch's N completion rows come in the flat
    layout's order, so they map back to the batch by sequence. A `rider` (token ids) rides in the
    first micro-batch's inputs (`with_rider`), outside the budget and the sub-batch."""
    if not batch.num_sequences:
        return []
    if prefix_sharing == "off":
        groups = pack_by_budget(batch.seq_lens.tolist(), token_budget)
        subs = [batch.select(g) for g in groups]
        return [(g, sub, with_rider(sub, rider if i == 0 else None, device, attention, prefix_sharing))
                for i, (g, sub) in enumerate(zip(groups, subs))]
    prompts, completions = split_prompts(batch)  # host lists, split once for every micro-batch
    groups = split_by_budget(prompts, [len(c) for c in completions], prefix_sharing, token_budget)
    return [(g, batch.select(g), _tree_with_rider([prompts[j] for j in g], [completions[j] for j in g],
                                                  rider if i == 0 else None, device, attention, prefix_sharing))
            for i, g in enumerate(groups)]


def with_rider(sub: TrajectoryBatch, rider: list[int] | None, device, attention: str,
               prefix_sharing: str = "off") -> MicroBatch:
    """`sub`'s model inputs in its layout (packed, or one prefix tree per `prefix_sharing`) with the
    `rider` token ids forwarded as one more sequence after its own (None: none). Attention keeps
    the rider to itself, so `sub`'s rows compute what they would without it, up to the order of
    float roundings (other shapes); the loss's view (targets, seq_ids, num_tokens) is `sub`'s."""
    if prefix_sharing == "off":
        both = TrajectoryBatch.concat([sub, one_sequence(rider)]) if rider else sub
        return _carrying(packed_micro_batch(both, device, attention), rider)
    return _tree_with_rider(*split_prompts(sub), rider, device, attention, prefix_sharing)


def _tree_with_rider(prompts: list[list[int]], completions: list[list[int]], rider: list[int] | None, device,
                     attention: str, mode: str) -> MicroBatch:
    """The prefix tree (`mode` tree or group) of these sequences with the rider as one more, its
    first token its prompt. That one-token prompt merges into a node the others already hold (tree
    mode: any common first token; group mode: a whole one-token prompt); its completion is a leaf."""
    if not rider:
        return _tree_micro_batch(prompts, completions, device, attention, mode)
    shared = any(p[:1] == rider[:1] for p in prompts) if mode == "tree" else any(p == rider[:1] for p in prompts)
    tree = _tree_micro_batch(prompts + [rider[:1]], completions + [rider[1:]], device, attention, mode)
    return _carrying(tree, rider, shared)


def _carrying(mb: MicroBatch, rider: list[int] | None, shared: bool = False) -> MicroBatch:
    """A micro-batch built with `rider` as its last sequence -> the loss's view of it: the rider's
    R = len(rider) - 1 rows, last in the flat order, split off its targets and seq_ids, and the
    tokens it added (its prompt's one token only where no node of the others already held it) off
    the forwarded count."""
    if not rider:
        return mb
    r = len(rider) - 1
    return replace(mb, targets=mb.targets[:-r], seq_ids=mb.seq_ids[:-r], rider=mb.targets[-r:],
                   num_tokens=mb.num_tokens - len(rider) + shared)


def layout_micro_batches(batch: TrajectoryBatch, token_budget: int, prefix_sharing: str, device,
                         attention: str, rider: list[int] | None = None) -> list[tuple[TrajectoryBatch, MicroBatch]]:
    """A batch -> (sub-batch, its model inputs) per micro-batch (`layout`)."""
    return [(sub, mb) for _, sub, mb in layout(batch, token_budget, prefix_sharing, device, attention, rider)]


def one_sequence(tokens: list[int]) -> TrajectoryBatch:
    """A batch of one sequence whose first token is its prompt (version 0, nothing to train on): the
    canary's probe (`Learner.score_probe`), and the dummy that lets a rank join FSDP's collectives."""
    n = len(tokens)
    ints = functools.partial(torch.tensor, dtype=torch.int32)
    return TrajectoryBatch(tokens=ints(tokens), seq_lens=ints([n]), prompt_lens=ints([1]),
                           behaviour_logprobs=torch.zeros(n - 1), advantages=torch.zeros(1), rewards=torch.zeros(1),
                           versions=ints([0]))


def dummy_micro_batch(device, attention: str, rider: list[int] | None = None) -> MicroBatch:
    """Two tokens, one completion token: lets a rank with fewer micro-batches join FSDP's collectives
    (and carries a `rider` when its pass is the step's first)."""
    mb = with_rider(one_sequence([0, 0]), rider, device, attention, "tree" if attention in TREE_ATTENTIONS else "off")
    return replace(mb, num_tokens=0)


_REGISTERED: set[str] = set()  # our attentions registered with transformers in this process (`set_attention`)


def set_attention(model, name: str) -> None:
    """Select the model's attention implementation (sdpa, VARLEN or a tree attention) for all later
    forwards; ours are registered with transformers first.

    Set once per layout, not around each forward: activation checkpointing recomputes the forward
    during backward and must find the same implementation."""
    if name in TREE_ATTENTIONS and not _REGISTERED & set(TREE_ATTENTIONS):
        register_tree_attention()
        _REGISTERED.update(TREE_ATTENTIONS)
    elif name in (VARLEN, VARLEN_GROUPED) and VARLEN not in _REGISTERED:
        register_varlen_attention()
        _REGISTERED.update((VARLEN, VARLEN_GROUPED))
    model.config._attn_implementation = name


def completion_logits(model, mb: MicroBatch, grad_row_scale: torch.Tensor | None = None,
                      rider_logits: list | None = None) -> torch.Tensor:
    """[N, V] logits at completion positions; the lm_head runs on (about) those rows only.
    `grad_row_scale` [N]: the lm_head input's gradient rows are multiplied by it in backward (the
    loss's deferred per-row scale, `colocate.kernels.deferred`; the lm_head's rows are the N rows).
    A rider's rows (`mb.rider`) are split off the lm_head's input before it runs: their [R, V]
    logits, computed without gradient, are appended to `rider_logits` (None: dropped)."""
    current = model.config._attn_implementation
    if current != mb.attention:
        raise ValueError(f"this micro-batch needs attention {mb.attention!r}, the model uses {current!r} "
                         f"(packing.set_attention)")
    head, hooks = model.get_output_embeddings(), []
    if mb.rider is not None:  # registered first: the row scale below sees the N rows only
        hooks.append(head.register_forward_pre_hook(_rider_split(mb.rider.numel(), rider_logits)))
    if grad_row_scale is not None:
        if mb.row_index is not None:
            raise ValueError("a deferred row scale needs the lm_head's rows to be the completion rows (row_index None)")
        hooks.append(head.register_forward_pre_hook(
            lambda _module, args: (scale_grad_rows(args[0], grad_row_scale), *args[1:])))
    try:
        logits = model(**mb.inputs, use_cache=False).logits
    finally:
        for hook in hooks:
            hook.remove()
    logits = logits.reshape(-1, logits.shape[-1])  # [R, V]
    return logits if mb.row_index is None else logits[mb.row_index]


def _rider_split(rows: int, out: list | None):
    """A forward pre-hook for the lm_head: its input's last `rows` rows (a rider's) go through the
    head's own forward without gradient (no hooks: the parameters are already gathered), into
    `out`; the head then runs on the others, so no [N + R, V] logits or gradient is ever formed."""
    def split(module, args):
        hidden = args[0]
        if out is not None:
            with torch.no_grad():
                out.append(module.forward(hidden[..., -rows:, :].detach()).reshape(rows, -1))
        return (hidden[..., :-rows, :], *args[1:])
    return split


# ---- varlen attention -------------------------------------------------------------------------

def _varlen_kernel():
    """torch's flash-attention varlen entry and how this torch spells causal / GQA (it changed)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, set()
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *,
                     cu_seq_lens_q=None, max_length_q=None, use_kernel: bool = True, flash=None, **kwargs):
    """transformers attention function: query [1, Hq, T, D], key/value [1, Hkv, T, D] -> [1, T, Hq, D].

    Sequence boundaries come from `cu_seq_lens_q` [B+1] (int32); causal within each sequence. The
    flash varlen kernel serves CUDA bf16/fp16; anything else (or use_kernel False) runs grouped SDPA."""
    if cu_seq_lens_q is None:
        raise ValueError("colocate_varlen attention needs cu_seq_lens_q (use packed_micro_batch)")
    if query.shape[0] != 1:
        raise ValueError("colocate_varlen attention expects one packed row")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    num_groups = q.shape[1] // k.shape[1]
    flash_ok = use_kernel and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
    # `flash` is _varlen_kernel(), bound at registration: no import or inspect inside a compiled region
    kernel, params = (flash or _varlen_kernel()) if flash_ok else (None, set())
    if kernel is not None:
        kw = {"scale": scaling} if "scale" in params else {}
        if "is_causal" in params:
            kw["is_causal"] = True
        else:
            kw["window_size"] = (-1, 0)
        if num_groups > 1:
            if "enable_gqa" in params:
                kw["enable_gqa"] = True
            else:  # older torch: expand the KV heads ([T, Hkv, D] -> [T, Hq, D]; small next to the GEMMs)
                k, v = k.repeat_interleave(num_groups, 1), v.repeat_interleave(num_groups, 1)
        out = kernel(q.contiguous(), k.contiguous(), v.contiguous(), cu_seq_lens_q, cu_seq_lens_q,
                     max_length_q, max_length_q, **kw)
    else:
        out = _sdpa_by_length(q, k, v, cu_seq_lens_q, scaling, num_groups)
    return out.unsqueeze(0), None


def _sdpa_by_length(q, k, v, cu: torch.Tensor, scaling, num_groups: int) -> torch.Tensor:
    """Varlen without the flash kernel: causal SDPA over sequences grouped by length, one batched
    call per distinct length (exact per sequence; [T, H, D] in and out)."""
    starts, lens = cu[:-1].long(), (cu[1:] - cu[:-1]).long()
    index, outs = [], []
    for length in lens.unique().tolist():
        seqs = (lens == length).nonzero().flatten()
        idx = (starts[seqs, None] + torch.arange(length, device=q.device)).reshape(-1)  # [n * L]
        qi, ki, vi = (t[idx].unflatten(0, (len(seqs), length)).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scaling, enable_gqa=num_groups > 1)
        index.append(idx)
        outs.append(o.transpose(1, 2).flatten(0, 1))
    return torch.cat(outs)[torch.argsort(torch.cat(index))]


VARLEN_GROUPED = "colocate_varlen_grouped"  # the same, never the flash kernel (fallback, comparisons)


def register_varlen_attention() -> str:
    """Make VARLEN (and VARLEN_GROUPED) valid transformers attention implementations; returns VARLEN."""
    import functools
    from transformers import AttentionInterface
    AttentionInterface.register(VARLEN, functools.partial(varlen_attention, flash=_varlen_kernel()))
    AttentionInterface.register(VARLEN_GROUPED, functools.partial(varlen_attention, use_kernel=False))
    return VARLEN


def check_varlen_kernel(device, dtype=torch.bfloat16, num_heads: int = 8, num_kv_heads: int = 2) -> dict:
    """Flash varlen against grouped SDPA on random packed q/k/v (GQA), forward and input gradients.

    -> {"kernel": bool, "out_rel_err", "grad_rel_err"}; a GPU start-up check (no kernel: kernel False)."""
    if _varlen_kernel()[0] is None or torch.device(device).type != "cuda":
        return {"kernel": False}
    g = torch.Generator(device=device).manual_seed(0)
    lens = [37, 128, 5, 200, 64]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)
    total = sum(lens)

    def rand(h):
        return torch.randn(1, h, total, 64, generator=g, device=device, dtype=dtype).requires_grad_()
    q, k, v = rand(num_heads), rand(num_kv_heads), rand(num_kv_heads)
    grad_out = torch.randn(1, total, num_heads, 64, generator=g, device=device, dtype=dtype)
    results = []
    for use_kernel in (True, False):
        out, _ = varlen_attention(None, q, k, v, None, 64 ** -0.5, cu_seq_lens_q=cu, max_length_q=max(lens),
                                  use_kernel=use_kernel)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        results.append((out.detach().float(), [x.float() for x in grads]))
    (out, grads), (ref, ref_grads) = results

    def rel(a, b):
        return float((a - b).norm() / b.norm())
    return {"kernel": True, "out_rel_err": rel(out, ref),
            "grad_rel_err": max(rel(a, b) for a, b in zip(grads, ref_grads))}


def resolve_attention(choice: str, device: torch.device, prefix_sharing: str = "off") -> str:
    """learner.attention (and learner.prefix_sharing) -> the implementation name the micro-batches
    need (`set_attention` registers ours with transformers). Flat (off): sdpa, or varlen (auto). Trees:
    FlexAttention on CUDA unless sdpa is asked for, the dense-mask SDPA reference otherwise
    (FlexAttention has no CPU backward)."""
    if prefix_sharing != "off":
        return TREE_FLEX if torch.device(device).type == "cuda" and choice != "sdpa" else TREE_SDPA
    return "sdpa" if choice == "sdpa" else VARLEN
