"""Constrained decoding as data: which token sequences a completion may consist of.

A `Constraint` is an ordered list of slots; each slot is a set of allowed token-id sequences
(Diplomacy: one slot per orderable unit, its legal orders; arithmetic: one slot of answers). A
completion is one choice per slot, concatenated, then EOS. The HF reference engine walks it with
`ConstraintState` (a token trie per slot); the vLLM engine turns the same slots into a grammar.

The state is a set of (slot, trie node) positions, so a choice that is a prefix of another choice
is handled without lookahead: both continuations stay allowed.
"""
from __future__ import annotations

from dataclasses import dataclass


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


class ConstraintState:
    """Where one sequence is inside its constraint; `allowed()` then `advance(token)` per step."""

    def __init__(self, constraint: Constraint):
        self.eos_id = constraint.eos_id
        self._tries = constraint.tries()
        self._positions: list[tuple[int, dict]] = self._enter(0)
        self.done = False

    def _enter(self, slot: int) -> list[tuple[int, dict]]:
        # Position at the root of `slot`; past the last slot only EOS remains (marked by node None).
        if slot >= len(self._tries):
            return [(slot, None)]
        return [(slot, self._tries[slot])]

    def allowed(self) -> list[int]:
        """Sorted token ids allowed next (EOS once every slot is filled)."""
        if self.done:
            return []
        toks: set[int] = set()
        for _, node in self._positions:
            if node is None:
                toks.add(self.eos_id)
            else:
                toks.update(k for k in node if k is not None)
        return sorted(toks)

    def advance(self, token: int) -> None:
        if self.done:
            raise ValueError("constraint already finished")
        nxt: list[tuple[int, dict]] = []
        for slot, node in self._positions:
            if node is None:
                if token == self.eos_id:
                    self.done = True
                    return
                continue
            child = node.get(token)
            if child is None:
                continue
            if any(k is not None for k in child):
                nxt.append((slot, child))
            if None in child:  # a choice ends here: the next slot may start
                nxt.extend(self._enter(slot + 1))
        if not nxt:
            raise ValueError(f"token {token} is not allowed by the constraint")
        self._positions = nxt


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

