"""Constrained decoding as data: which token sequences a completion may consist of.

A `Constraint` is an ordered list of slots; each slot is a set of allowed token-id sequences
(Diplomacy: one slot per orderable unit, its legal orders; arithmetic: one slot of answers). A
completion is one choice per slot, concatenated, then EOS. The HF reference engine walks it with
`ConstraintState` (a token trie per slot); the vLLM engine turns the same slots into a grammar.

The state is a set of (slot, trie node) positions, so a choice that is a prefix of another choice
is handled without lookahead: both continuations stay allowed.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import numpy as np


@dataclass
class Constraint:
    slots: list[list[list[int]]]
    """slots[i] = the allowed token-id sequences of slot i (each non-empty)."""
    eos_id: int
    """Token that ends a completion once every slot is filled."""
    texts: list[list[str]] | None = None
    """Optional: the strings behind each choice (the vLLM grammar is built from these)."""

    def tries(self) -> list[dict]:
        """One nested-dict trie per slot; the key None marks the end of a choice."""
        out = []
        for choices in self.slots:
            root: dict = {}
            for seq in choices:
                if not seq:
                    raise ValueError("a constraint choice must have at least one token")
                node = root
                for tok in seq:
                    node = node.setdefault(tok, {})
                node[None] = {}
            out.append(root)
        return out

    def table(self) -> "TrieTable":
        """The constraint as a deterministic automaton (`trie_table`), built once per Constraint."""
        cached = self.__dict__.get("_table")
        if cached is None:
            cached = self.__dict__["_table"] = trie_table(self)
        return cached


class ConstraintState:
    """Where one sequence is inside its constraint; `allowed()` then `advance(token)` per step."""

    def __init__(self, constraint: Constraint):
        self.eos_id = constraint.eos_id
        self._tries = constraint.tries()
        self._positions: tuple[tuple[int, dict | None], ...] = (_entry(self._tries, 0),)
        self.done = False

    def allowed(self) -> list[int]:
        """Sorted token ids allowed next (EOS once every slot is filled)."""
        return [] if self.done else sorted(_allowed(self._positions, self.eos_id))

    def advance(self, token: int) -> None:
        if self.done:
            raise ValueError("constraint already finished")
        nxt = _positions_after(self._positions, token, self._tries, self.eos_id)
        if nxt is None:
            self.done = True
        elif not nxt:
            raise ValueError(f"token {token} is not allowed by the constraint")
        else:
            self._positions = nxt


def _allowed(positions: tuple, eos_id: int) -> set[int]:
    """The tokens a set of (slot, node) positions allows: each node's children, EOS past the end."""
    out: set[int] = set()
    for _, node in positions:
        out.update([eos_id] if node is None else (k for k in node if k is not None))
    return out


def _entry(tries: list[dict], slot: int) -> tuple[int, dict | None]:
    """The position at the root of `slot`; past the last slot only EOS remains (node None)."""
    return (slot, tries[slot] if slot < len(tries) else None)


def forced_positions(constraint: Constraint, token_ids: list[int]) -> list[bool]:
    """[n] for each token of a completion the constraint allows: was it the only token allowed?

    A forced token is decided by the constraint alone, yet a sampler spends one decode step on it;
    the share of them is what jump-forward decoding would save (profiles/e2e.md)."""
    state, out = ConstraintState(constraint), []
    for tok in token_ids:
        out.append(len(state.allowed()) == 1)
        state.advance(tok)
        if state.done:
            break
    return out



@dataclass(frozen=True)
class TrieTable:
    """A Constraint as a deterministic automaton over token ids, in flat int32 arrays (what the
    vLLM engine's GPU masks walk: `colocate.kernels.trie_mask`). State 0 is the start; state s
    allows tokens[offsets[s]:offsets[s+1]] (sorted) and moves to targets[...] on each. EOS is an
    edge like any other, into the state after the end, which has no edges. Each state is one set of
    `ConstraintState` positions, so the two allow the same tokens after every prefix."""
    offsets: np.ndarray
    tokens: np.ndarray
    targets: np.ndarray
    eos_id: int
    key: str
    """Digest of the three arrays: equal tables share one copy on the GPU."""

    @property
    def max_degree(self) -> int:
        return int(np.diff(self.offsets).max())

    @functools.cached_property
    def lists(self) -> tuple[list[int], list[int], list[int]]:
        """(offsets, tokens, targets) as Python lists, for walks on the host."""
        return self.offsets.tolist(), self.tokens.tolist(), self.targets.tolist()


def _positions_after(positions: tuple, token: int, tries: list[dict], eos_id: int) -> tuple | None:
    """The (slot, node) positions after `token`: empty when it is not allowed, None when it is the
    EOS that ends the walk. A choice that ends enters the next slot's root too."""
    nxt: list[tuple[int, dict | None]] = []
    for slot, node in positions:
        if node is None:
            if token == eos_id:
                return None
            continue
        child = node.get(token)
        if child is None:
            continue
        if any(k is not None for k in child):
            nxt.append((slot, child))
        if None in child:
            nxt.append(_entry(tries, slot + 1))
    return tuple(nxt)


def trie_table(constraint: Constraint) -> TrieTable:
    """Determinize the Constraint's slot tries. Where no choice is a prefix of another in its slot
    (Diplomacy's order lines) the tries are chained as they are (`_chained_edges`, ~5x faster);
    otherwise breadth first over `ConstraintState` position sets (`_determinized_edges`)."""
    if any(not choices or not all(choices) for choices in constraint.slots):
        raise ValueError("every constraint slot needs a choice, and every choice a token")
    edges = _chained_edges(constraint)
    if edges is None:
        edges = _determinized_edges(constraint)
    node, tok, tgt = (np.asarray(a, dtype=np.int32) for a in edges)
    num_states = int(max(node.max(initial=-1), tgt.max(initial=-1))) + 1
    order = np.lexsort((tok, node))
    offsets = np.zeros(num_states + 1, dtype=np.int32)
    np.cumsum(np.bincount(node, minlength=num_states), out=offsets[1:])
    arrays = (offsets, tok[order], tgt[order])
    eos = constraint.eos_id
    digest = hashlib.blake2b(b"".join(a.tobytes() for a in arrays) + eos.to_bytes(8, "little", signed=True),
                             digest_size=12).hexdigest()
    return TrieTable(*arrays, eos_id=eos, key=digest)


def _chained_edges(constraint: Constraint) -> tuple[list, list, list] | None:
    """(state, token, next state) of the slot tries chained end to root, then EOS; None when some
    choice ends where another of its slot goes on."""
    node_of, tok_of, next_of = [], [], []
    base = 0
    for choices in constraint.slots:
        children: dict[tuple[int, int], int] = {}  # (local node, token) -> local child, or -1: a choice ends
        count = 1
        for seq in choices:
            node, last = 0, len(seq) - 1
            for i, t in enumerate(seq):
                child = children.get((node, t))
                if i == last:
                    if child is not None and child >= 0:
                        return None
                    children[(node, t)] = -1
                elif child is None:
                    child = children[(node, t)] = count
                    count += 1
                elif child < 0:
                    return None
                node = child
        for (node, t), child in children.items():
            node_of.append(base + node)
            tok_of.append(t)
            next_of.append(base + count if child < 0 else base + child)  # a choice's end: the next slot's root
        base += count
    node_of.append(base)  # every slot filled: EOS, into a state without edges
    tok_of.append(constraint.eos_id)
    next_of.append(base + 1)
    return node_of, tok_of, next_of


def _determinized_edges(constraint: Constraint) -> tuple[list, list, list]:
    """(state, token, next state), each state a set of (slot, node) positions reached breadth first."""
    tries, eos = constraint.tries(), constraint.eos_id
    start = (_entry(tries, 0),)
    key_of = lambda positions: tuple(sorted({(slot, id(node)) for slot, node in positions}))  # noqa: E731
    index, queue = {key_of(start): 0}, [start]
    node_of, tok_of, next_of = [], [], []
    done_state = -1
    for state, positions in enumerate(queue):
        for tok in sorted(_allowed(positions, eos)):
            nxt = _positions_after(positions, tok, tries, eos)
            if nxt is None:
                if done_state < 0:
                    done_state = len(queue)
                    queue.append(())
                target = done_state
            else:
                k = key_of(nxt)
                if k not in index:
                    index[k] = len(queue)
                    queue.append(nxt)
                target = index[k]
            node_of.append(state)
            tok_of.append(tok)
            next_of.append(target)
    return node_of, tok_of, next_of
