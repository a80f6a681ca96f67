"""A `Constraint` as a vLLM structured-output grammar, and the host-side replay of what it allowed.

The vLLM engine enforces constraints with vLLM's own structured outputs (llguidance backend): the
bitmask of allowed tokens is filled in Rust, in parallel, off the GPU and off our Python. Two
grammar forms, same Lark syntax:

  tokens (default)  every choice is the exact token-id sequence of the Constraint (`<[id]>`
                    terminals), so vLLM allows at each step exactly the ids `ConstraintState`
                    allows: the learner's softmax over `allowed_ids` is the distribution vLLM
                    sampled from, and the replay below never fails.
  text              every choice is its string (`Constraint.texts`). A text grammar accepts *any*
                    tokenization of the strings (" 7" as [" 7"] or [" ", "7"]), so the sampled ids
                    may leave the Constraint's token trie and the allowed sets differ from ours.
                    Kept to measure that mismatch (`replay_allowed` counts it), not for training.

xgrammar, vLLM's default backend, has no token-id terminals; llguidance does, hence the backend.

`replay_allowed` walks the Constraint's automaton (`Constraint.table`, what `ConstraintState` allows)
over the sampled ids after generation (host, cheap): it rebuilds `Completion.allowed_ids` per
sampled token, and says whether the walk held. It serves both `engine.constraint_masks` modes; with
`ours` vLLM never sees these grammars at all (`vllm_trie.py`).

`skip_client_grammar_validation` (`engine.validate_grammars: false`) spares the inference rank
vLLM's client-side re-check of these generated grammars.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from colocate.constraint import Constraint, ConstraintState

GRAMMAR_MODES = ("tokens", "text")


def _token_terminal(seq: list[int]) -> str:
    return " ".join(f"<[{t}]>" for t in seq)


def constraint_grammar(constraint: Constraint, mode: str = "tokens") -> str:
    """Lark grammar (llguidance dialect) whose language is one choice per slot, in order.

    EOS is not in the grammar: llguidance allows it once `start` is complete (and only it when
    nothing can follow), which is the Constraint's "then EOS".
    """
    if mode not in GRAMMAR_MODES:
        raise ValueError(f"grammar mode {mode!r} is not one of {GRAMMAR_MODES}")
    if not constraint.slots:
        raise ValueError("a constraint without slots has no grammar (only EOS is allowed)")
    if mode == "text" and constraint.texts is None:
        raise ValueError("text grammar needs Constraint.texts")
    lines = ["start: " + " ".join(f"s{i}" for i in range(len(constraint.slots)))]
    for i, choices in enumerate(constraint.slots):
        if mode == "tokens":
            alts = dict.fromkeys(_token_terminal(seq) for seq in choices)   # dedupe, keep order
        else:
            alts = dict.fromkeys(json.dumps(text) for text in constraint.texts[i])
        lines.append(f"s{i}: " + " | ".join(alts))
    return "\n".join(lines) + "\n"


@dataclass
class Replay:
    allowed_ids: list[list[int]]
    """[n][k_i] ids the constraint allowed before each sampled token (what the learner uses)."""
    is_valid: bool
    """Every sampled id was allowed by the Constraint's token trie."""
    is_done: bool
    """The walk ended on EOS after every slot was filled."""
    only_eos_next: bool = False
    """A valid walk that is not done, after which the constraint allows EOS and nothing else
    (what `completion_is_forced_eos` says, without a second walk)."""


def replay_allowed(constraint: Constraint, token_ids: list[int]) -> Replay:
    """Walk the Constraint's automaton (`Constraint.table`: what `ConstraintState` allows after every
    prefix, built once per Constraint) over sampled ids; stop at the first id it does not allow.

    On failure `allowed_ids` covers only the ids before it (len < len(token_ids)). One walk per
    answer, on the inference rank's main thread: 10 us for a Diplomacy answer on one core of a 2-core
    CPU, against 90 us walking `ConstraintState` (which builds the slot tries again for every answer).
    """
    offsets, tokens, targets = constraint.table().lists
    allowed: list[list[int]] = []
    state = 0
    for tok in token_ids:
        lo, hi = offsets[state], offsets[state + 1]
        if lo == hi:  # after EOS: only the state past the end has no edges
            return Replay(allowed, False, True)
        now = tokens[lo:hi]
        if tok not in now:
            return Replay(allowed, False, False)
        allowed.append(now)
        state = targets[lo + now.index(tok)]
    lo, hi = offsets[state], offsets[state + 1]
    return Replay(allowed, True, lo == hi, only_eos_next=tokens[lo:hi] == [constraint.eos_id])


def completion_is_forced_eos(constraint: Constraint, token_ids: list[int]) -> bool:
    """True when, after `token_ids`, the constraint allows EOS and nothing else (the reference for
    `Replay.only_eos_next`, which the engine uses).

    vLLM ends a request when the grammar can accept nothing more; whether the EOS it then samples
    appears in the output is checked by the caller, which appends it (log-prob 0: the only allowed
    token) so completions read as the HF engine's do.
    """
    state = ConstraintState(constraint)
    for tok in token_ids:
        if state.done:
            return False
        state.advance(tok)
    return not state.done and state.allowed() == [constraint.eos_id]


def skip_client_grammar_validation() -> None:
    """Stop vLLM's client from checking each request's llguidance grammar (`engine.validate_grammars`).

    `SamplingParams.verify` calls `backend_guidance.validate_guidance_grammar` for every request
    (1.1 ms median for a Diplomacy order grammar on one CPU core, ~0.8 s of host time per rollout
    batch of an inference rank). It imports the function from its module at each call, so
    replacing the module attribute is enough. The engine core (a child process, not patched)
    still compiles every grammar; one it cannot compile only logs a warning there, and the
    completion's replay then disagrees with the Constraint, which `_completion` raises on. Affects
    this process only, i.e. the inference rank that owns the engine.
    """
    from vllm.v1.structured_output import backend_guidance
    backend_guidance.validate_guidance_grammar = _no_grammar_validation


def _no_grammar_validation(sampling_params, tokenizer=None) -> None:
    return None
