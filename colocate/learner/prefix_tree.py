"""Prefix trees over a batch's prompts: every shared prompt prefix is forwarded once.

A batch's sequences are merged into a radix tree by their prompt token ids (no env knowledge: the
Diplomacy prompt order - instruction, board, power - already puts what is shared first). Modes
(`learner.prefix_sharing`):
  * tree  - radix tree of any depth: a node per maximal run of prompt tokens shared by the same
            sequences (Diplomacy: instruction -> board -> power part);
  * group - one level: a node per distinct whole prompt (a GRPO group's G samples share it).
Each sequence's completion is a leaf under the node where its prompt ends.

Layout (`TreeLayout`): the tree's segments (nodes, then leaves) in depth-first preorder, so a
segment's subtree is one contiguous token range; position ids continue from the parent's end. Tree
attention is then one rule per token pair (`tree_attention.py`): query i sees key j iff
j <= i < kv_end[j], with kv_end[j] the end of j's segment's subtree.

Splitting (`split_by_budget`): a tree that does not fit one micro-batch is cut at node boundaries;
each micro-batch is a subset of sequences, rebuilt as its own tree, so ancestors shared with other
micro-batches are forwarded again there. Each sequence's forward is the same in any tree that holds
it, which is why the split is exact.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from colocate.config_schema import PREFIX_SHARING


@dataclass
class Node:
    """A run of prompt tokens shared by every sequence below it."""
    tokens: list[int]
    parent: int
    """Index of the parent node; -1 for the root (which holds no tokens)."""
    children: dict[int, int] = field(default_factory=dict)
    """First token -> child node index."""
    seqs: list[int] = field(default_factory=list)
    """Sequences whose prompt ends exactly at this node (their completions are its leaves)."""


def _common_prefix(a: list[int], b: list[int], start: int) -> int:
    """Length of the common prefix of `a` and `b[start:]`."""
    n = min(len(a), len(b) - start)
    if a[:n] == b[start:start + n]:  # the usual case (a whole node matches): one C-level compare
        return n
    i = 0
    while a[i] == b[start + i]:
        i += 1
    return i


def _insert(nodes: list[Node], prompt: list[int], seq: int) -> None:
    """Walk the radix tree along `prompt`, splitting a node where the prompt leaves it."""
    cur, pos = 0, 0
    while pos < len(prompt):
        child = nodes[cur].children.get(prompt[pos])
        if child is None:
            nodes.append(Node(prompt[pos:], cur))
            nodes[cur].children[prompt[pos]] = cur = len(nodes) - 1
            pos = len(prompt)
            break
        m = _common_prefix(nodes[child].tokens, prompt, pos)
        if m < len(nodes[child].tokens):  # split: the shared head becomes the child's new parent
            head = Node(nodes[child].tokens[:m], cur)
            nodes.append(head)
            mid = len(nodes) - 1
            nodes[child].tokens = nodes[child].tokens[m:]
            nodes[child].parent = mid
            head.children[nodes[child].tokens[0]] = child
            nodes[cur].children[prompt[pos]] = mid
            child = mid
        cur, pos = child, pos + m
    nodes[cur].seqs.append(seq)


def build_tree(prompts: list[list[int]], mode: str) -> list[Node]:
    """Nodes of the prefix tree of `prompts` (index 0: the empty root). mode tree or group."""
    if mode not in PREFIX_SHARING or mode == "off":
        raise ValueError(f"prefix tree mode must be tree or group, got {mode!r}")
    nodes = [Node([], -1)]
    by_prompt: dict[tuple[int, ...], int] = {}
    for seq, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"sequence {seq} has an empty prompt: its first completion token has no predictor")
        if mode == "tree":
            _insert(nodes, prompt, seq)
            continue
        key = tuple(prompt)
        if key not in by_prompt:
            nodes.append(Node(list(prompt), 0))
            by_prompt[key] = len(nodes) - 1
            nodes[0].children[len(nodes) - 1] = len(nodes) - 1  # keyed by index: prompts may share a first token
        nodes[by_prompt[key]].seqs.append(seq)
    return nodes


def split_prompts(batch) -> tuple[list[list[int]], list[list[int]]]:
    """A packed TrajectoryBatch -> (prompt ids, completion ids) per sequence, host lists."""
    tokens = batch.tokens.tolist()
    out_p, out_c, start = [], [], 0
    for n, p in zip(batch.seq_lens.tolist(), batch.prompt_lens.tolist()):
        out_p.append(tokens[start:start + p])
        out_c.append(tokens[start + p:start + n])
        start += n
    return out_p, out_c


def preorder(nodes: list[Node]) -> list[int]:
    """Node indices in depth-first preorder from the root (children in insertion order)."""
    order, stack = [], [0]
    while stack:
        n = stack.pop()
        order.append(n)
        stack.extend(reversed(list(nodes[n].children.values())))
    return order


@dataclass
class TreeLayout:
    """One micro-batch's tree as one packed row of T tokens, and where its N completion tokens are."""
    tokens: torch.Tensor
    """[T] int64: every node's tokens once, each completion as a leaf after its prompt's node (preorder)."""
    position_ids: torch.Tensor
    """[T] int64: a segment's positions continue from its parent's end (as in the flat sequence)."""
    kv_end: torch.Tensor
    """[T] int64: key j is seen by queries j .. kv_end[j] - 1 (the end of its segment's subtree)."""
    keep: torch.Tensor
    """[N] int64 rows whose hidden state predicts each completion token, in sequence order. A
    completion's first token is predicted by the last token of its prompt's node, a row shared by
    every leaf of that node: it appears once per leaf."""
    targets: torch.Tensor
    """[N] int64 completion token ids, in sequence order (the flat layout's order)."""
    seq_ids: torch.Tensor
    """[N] int64 sequence of each completion token."""

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())


def tree_layout(prompts: list[list[int]], completions: list[list[int]], mode: str) -> TreeLayout:
    """Pack the prefix tree of the sequences (prompt + completion) into one row (see TreeLayout)."""
    nodes = build_tree(prompts, mode)
    flat: list[int] = []
    seg_start, seg_len, seg_pos0, seg_end = [], [], [], []  # per segment (node or leaf)
    last_row, comp_row = [0] * len(prompts), [0] * len(prompts)
    depth = {0: 0}  # node -> tokens above and in it (its children's first position)
    open_segs: list[tuple[int, int]] = []  # (node, its segment) whose subtree is still being emitted
    for n in preorder(nodes):
        node = nodes[n]
        while open_segs and open_segs[-1][0] != node.parent:  # left those subtrees: they end here
            seg_end[open_segs.pop()[1]] = len(flat)
        if n == 0:
            continue
        depth[n] = depth[node.parent] + len(node.tokens)
        seg_start.append(len(flat))
        seg_len.append(len(node.tokens))
        seg_pos0.append(depth[node.parent])
        seg_end.append(-1)
        open_segs.append((n, len(seg_start) - 1))
        flat.extend(node.tokens)
        prompt_end = len(flat) - 1  # shared by every leaf of this node
        for s in node.seqs:  # the leaves: completions of prompts ending here
            last_row[s], comp_row[s] = prompt_end, len(flat)
            if completions[s]:
                seg_start.append(len(flat))
                seg_len.append(len(completions[s]))
                seg_pos0.append(depth[n])
                seg_end.append(len(flat) + len(completions[s]))
                flat.extend(completions[s])
    for _, seg in open_segs:
        seg_end[seg] = len(flat)
    lens = torch.tensor(seg_len, dtype=torch.long)
    starts = torch.tensor(seg_start, dtype=torch.long)
    position_ids = torch.arange(len(flat)) + torch.repeat_interleave(torch.tensor(seg_pos0) - starts, lens)
    kv_end = torch.repeat_interleave(torch.tensor(seg_end, dtype=torch.long), lens)
    keep, target_rows, seq_ids = _completion_rows(last_row, comp_row, [len(c) for c in completions])
    tokens = torch.tensor(flat, dtype=torch.long)
    return TreeLayout(tokens=tokens, position_ids=position_ids, kv_end=kv_end, keep=keep,
                      targets=tokens[target_rows], seq_ids=seq_ids)


def _completion_rows(last_row: list[int], comp_row: list[int], comp_lens: list[int]):
    """-> ([N] rows predicting each completion token, [N] rows holding it, [N] its sequence)."""
    lens = torch.tensor(comp_lens, dtype=torch.long)
    seq_ids = torch.repeat_interleave(torch.arange(len(comp_lens)), lens)
    firsts = torch.cumsum(lens, 0) - lens
    within = torch.arange(int(lens.sum())) - torch.repeat_interleave(firsts, lens)
    target_rows = torch.tensor(comp_row, dtype=torch.long)[seq_ids] + within
    # token k of a completion is predicted at row k - 1 of its leaf; token 0 at its prompt's last row
    keep = torch.where(within == 0, torch.tensor(last_row, dtype=torch.long)[seq_ids], target_rows - 1)
    return keep, target_rows, seq_ids


@dataclass
class _Item:
    """A unit of splitting: sequences that stay together, the tokens only they need, and the
    ancestor nodes they share with other items (forwarded once per micro-batch that holds any)."""
    seqs: list[int]
    own: int
    shared: list[int]


def _items(nodes: list[Node], comp_lens: list[int], budget: int) -> list[_Item]:
    """Cut the tree at node boundaries into items that each fit `budget` with their ancestors: a
    node's whole subtree where it fits, else each leaf of the node alone and its children recursively."""
    order = preorder(nodes)
    subtree = [0] * len(nodes)  # tokens of the node, its leaves and everything below
    for n in reversed(order):
        subtree[n] = len(nodes[n].tokens) + sum(comp_lens[s] for s in nodes[n].seqs)
        subtree[n] += sum(subtree[c] for c in nodes[n].children.values())
    items, stack = [], [(0, [])]  # (node, its ancestors root-first; the empty root left out)
    while stack:
        n, path = stack.pop()
        above = sum(len(nodes[a].tokens) for a in path)
        if n != 0 and above + subtree[n] <= budget:
            items.append(_Item(_subtree_seqs(nodes, n), subtree[n], path))
            continue
        here = path + [n] if n != 0 else path
        items.extend(_Item([s], comp_lens[s], here) for s in nodes[n].seqs)
        stack.extend((c, here) for c in reversed(list(nodes[n].children.values())))
    return items


def _subtree_seqs(nodes: list[Node], n: int) -> list[int]:
    seqs, stack = [], [n]
    while stack:
        m = stack.pop()
        seqs.extend(nodes[m].seqs)
        stack.extend(nodes[m].children.values())
    return seqs


def split_by_budget(prompts: list[list[int]], comp_lens: list[int], mode: str, budget: int) -> list[list[int]]:
    """Sequence indices grouped so each group's tree holds at most `budget` tokens: first-fit
    decreasing over the items of `_items`, an item costing its own tokens plus the ancestors the
    group does not hold yet. A sequence longer than the budget gets a group of its own. Groups list
    indices in input order."""
    nodes = build_tree(prompts, mode)
    items = _items(nodes, comp_lens, budget)
    size = {id(it): it.own + sum(len(nodes[a].tokens) for a in it.shared) for it in items}
    bins: list[tuple[list[int], set[int], list[int]]] = []  # (sequences, nodes held, [tokens])
    for it in sorted(items, key=lambda it: -size[id(it)]):
        for seqs, held, used in bins:
            extra = it.own + sum(len(nodes[a].tokens) for a in it.shared if a not in held)
            if used[0] + extra <= budget:
                break
        else:
            seqs, held, used = [], set(), [0]
            bins.append((seqs, held, used))
            extra = size[id(it)]
        seqs.extend(it.seqs)
        held.update(it.shared)
        used[0] += extra
    return [sorted(seqs) for seqs, _, _ in bins]
