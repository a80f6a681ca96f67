"""The vLLM engine's grammars (`engine/vllm_grammar.py`): a Constraint as a token-id (or text)
grammar, the host-side replay of what it allowed, and the checks against llguidance itself (they
skip without it). No vLLM here."""
import random

import pytest

from colocate.constraint import Constraint, ConstraintState
from colocate.engine.vllm_grammar import completion_is_forced_eos, constraint_grammar, replay_allowed

EOS = 1


def prefix_constraint() -> Constraint:
    # slot 0: [5] is a prefix of [5, 6]; slot 1 choices share their first token
    return Constraint(slots=[[[5], [5, 6], [7, 8, 9]], [[10, 11], [10, 12]]], eos_id=EOS,
                      texts=[["a", "ab", "cde"], ["xy", "xz"]])


def random_walk(c: Constraint, rng: random.Random) -> list[int]:
    state, out = ConstraintState(c), []
    while not state.done:
        tok = rng.choice(state.allowed())
        out.append(tok)
        state.advance(tok)
    return out


# ------------------------------------------------------------------------------- grammar

def test_token_grammar_lists_each_slot_once_deduped():
    c = Constraint(slots=[[[3, 4], [3, 4], [5]], [[6]]], eos_id=EOS)
    g = constraint_grammar(c)
    assert g.splitlines() == ["start: s0 s1", "s0: <[3]> <[4]> | <[5]>", "s1: <[6]>"]


def test_text_grammar_quotes_strings_and_needs_texts():
    c = prefix_constraint()
    g = constraint_grammar(c, "text")
    assert 's0: "a" | "ab" | "cde"' in g
    with pytest.raises(ValueError):
        constraint_grammar(Constraint(slots=[[[3]]], eos_id=EOS), "text")
    with pytest.raises(ValueError):
        constraint_grammar(Constraint(slots=[], eos_id=EOS))
    with pytest.raises(ValueError):
        constraint_grammar(c, "regex")


# ------------------------------------------------------------------------------- replay

def test_replay_matches_constraint_state_on_random_walks():
    c, rng = prefix_constraint(), random.Random(0)
    for _ in range(50):
        ids = random_walk(c, rng)
        replay = replay_allowed(c, ids)
        assert replay.is_valid and replay.is_done and len(replay.allowed_ids) == len(ids)
        state = ConstraintState(c)
        for tok, allowed in zip(ids, replay.allowed_ids):
            assert allowed == state.allowed() and tok in allowed
            state.advance(tok)


def replay_by_state(c: Constraint, token_ids: list[int]):
    """The replay as `ConstraintState` walks it (the reference `replay_allowed` must equal)."""
    state, allowed = ConstraintState(c), []
    for tok in token_ids:
        if state.done:
            return allowed, False, True, False
        now = state.allowed()
        if tok not in now:
            return allowed, False, False, False
        allowed.append(now)
        state.advance(tok)
    return allowed, True, state.done, not state.done and state.allowed() == [c.eos_id]


def test_replay_equals_constraint_state_on_hard_constraints():
    """Tiny vocabularies (many prefix choices, duplicates, EOS inside choices), walks that are
    valid, cut short, carry a disallowed token or go on after EOS."""
    rng = random.Random(5)
    for _ in range(400):
        vocab = rng.randint(2, 5)
        slots = [[[rng.randint(0, vocab) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(1, 4))]
                 for _ in range(rng.randint(1, 3))]
        c = Constraint(slots=slots, eos_id=EOS)
        for _ in range(5):
            ids = random_walk(c, rng)
            for case in (ids, ids[:rng.randint(0, len(ids))], ids + [rng.randint(0, vocab)],
                         ids[:rng.randint(0, len(ids))] + [vocab + 1]):
                r = replay_allowed(c, case)
                assert (r.allowed_ids, r.is_valid, r.is_done, r.only_eos_next) == replay_by_state(c, case), case


def test_a_table_refuses_empty_slots_and_choices():
    for slots in ([[]], [[[5]], []], [[[5], []]]):
        with pytest.raises(ValueError):
            Constraint(slots=slots, eos_id=EOS).table()


def test_replay_prefix_choice_allows_eos_and_continuation():
    c = Constraint(slots=[[[5], [5, 6]]], eos_id=EOS)
    assert replay_allowed(c, [5, EOS]).allowed_ids == [[5], [EOS, 6]]
    assert replay_allowed(c, [5, 6, EOS]).allowed_ids == [[5], [EOS, 6], [EOS]]


def test_replay_reports_first_disallowed_token_and_tokens_after_eos():
    c = prefix_constraint()
    bad = replay_allowed(c, [7, 9])
    assert not bad.is_valid and not bad.is_done and bad.allowed_ids == [[5, 7]]
    after = replay_allowed(c, [5, 10, 11, EOS, 3])
    assert not after.is_valid and after.is_done and len(after.allowed_ids) == 4


def test_forced_positions_mark_tokens_the_constraint_alone_decides():
    from colocate.constraint import forced_positions
    c = prefix_constraint()  # slot 0: [5] | [5, 6] | [7, 8, 9]; slot 1: [10, 11] | [10, 12]
    # 7 (choice), 8, 9 forced; 10 forced (both slot-1 choices start with it), 11 choice, EOS forced
    assert forced_positions(c, [7, 8, 9, 10, 11, EOS]) == [False, True, True, True, False, True]
    # after [5] both 6 and 10 may follow: not forced
    assert forced_positions(c, [5, 10, 12, EOS]) == [False, False, False, True]
    with pytest.raises(ValueError):
        forced_positions(c, [8])


def test_forced_eos_detection():
    c = prefix_constraint()
    assert completion_is_forced_eos(c, [7, 8, 9, 10, 11])
    assert not completion_is_forced_eos(c, [7, 8, 9])            # slot 1 still open
    assert not completion_is_forced_eos(c, [7, 8, 9, 10, 11, EOS])  # already ended


def test_replay_says_eos_is_forced_as_the_reference_does():
    c, rng = prefix_constraint(), random.Random(1)
    for _ in range(50):
        ids = random_walk(c, rng)
        for cut in range(len(ids) + 1):  # every prefix, as vLLM may report it (without the EOS)
            replay = replay_allowed(c, ids[:cut])
            assert replay.only_eos_next == (not replay.is_done and completion_is_forced_eos(c, ids[:cut]))
    assert replay_allowed(c, [7, 8, 9, 10, 11]).only_eos_next
    assert not replay_allowed(c, [7, 8, 9]).only_eos_next
    assert not replay_allowed(c, [7, 9]).only_eos_next  # an invalid walk


# ------------------------------------------------------------------------------- llguidance

def llg_allowed(matcher, bitmask, vocab: int) -> list[int]:
    import llguidance.torch
    llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
    words = bitmask[0].tolist()
    return [w * 32 + b for w, v in enumerate(words) for b in range(32) if (v >> b) & 1 and w * 32 + b < vocab]


@pytest.mark.parametrize("make", ["prefix", "arithmetic"])
def test_llguidance_token_grammar_allows_exactly_the_constraint(make, tiny_tokenizer):
    llguidance = pytest.importorskip("llguidance")
    import llguidance.hf
    import llguidance.torch
    tok = tiny_tokenizer
    if make == "prefix":
        c = Constraint(slots=[[[5], [5, 6], [7, 8, 9]], [[10, 11], [10, 12]]], eos_id=tok.eos_token_id)
    else:
        answers = [str(v) for v in range(9)]
        c = Constraint(slots=[[tok.encode(" " + a, add_special_tokens=False) for a in answers]],
                       eos_id=tok.eos_token_id)
    vocab = 1024  # model vocab larger than the tokenizer's, as with the random Qwen shapes
    lt = llguidance.hf.from_tokenizer(tok, vocab)
    grammar = llguidance.grammar_from("grammar", constraint_grammar(c))
    assert not llguidance.LLMatcher.validate_grammar(grammar, lt)
    bitmask = llguidance.torch.allocate_token_bitmask(1, lt.vocab_size)
    rng = random.Random(1)
    for _ in range(20):
        matcher = llguidance.LLMatcher(lt, grammar, log_level=0)
        state = ConstraintState(c)
        while not state.done:
            assert llg_allowed(matcher, bitmask, vocab) == state.allowed()
            t = rng.choice(state.allowed())
            state.advance(t)
            if not state.done:
                assert matcher.consume_token(t)


def test_llguidance_text_grammar_admits_other_tokenizations(tiny_tokenizer):
    """Why the engine uses token grammars: a text grammar lets " 7" be spelled in other tokens."""
    llguidance = pytest.importorskip("llguidance")
    import llguidance.hf
    import llguidance.torch
    tok = tiny_tokenizer
    words = [" answer", " and"]  # canonically one token each; also spelt " ", "an", "sw", ...
    c = Constraint(slots=[[tok.encode(w, add_special_tokens=False) for w in words]], eos_id=tok.eos_token_id,
                   texts=[words])
    lt = llguidance.hf.from_tokenizer(tok, len(tok))
    matcher = llguidance.LLMatcher(lt, llguidance.grammar_from("grammar", constraint_grammar(c, "text")), log_level=0)
    bitmask = llguidance.torch.allocate_token_bitmask(1, lt.vocab_size)
    text_first = set(llg_allowed(matcher, bitmask, len(tok)))
    assert set(ConstraintState(c).allowed()) <= text_first
    assert text_first != set(ConstraintState(c).allowed())


def test_skip_client_grammar_validation_replaces_vllms_check(monkeypatch):
    import sys
    import types
    from colocate.engine.vllm_grammar import skip_client_grammar_validation
    guidance = types.ModuleType("vllm.v1.structured_output.backend_guidance")

    def strict(sampling_params, tokenizer=None):
        raise ValueError("Grammar error: checked")
    guidance.validate_guidance_grammar = strict
    for name in ("vllm", "vllm.v1", "vllm.v1.structured_output"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, guidance.__name__, guidance)
    monkeypatch.setattr(sys.modules["vllm.v1.structured_output"], "backend_guidance", guidance, raising=False)

    def verify(params):  # what SamplingParams._validate_structured_outputs does on every request
        from vllm.v1.structured_output.backend_guidance import validate_guidance_grammar
        return validate_guidance_grammar(params, tokenizer=None)
    with pytest.raises(ValueError, match="checked"):
        verify(object())
    skip_client_grammar_validation()
    assert verify(object()) is None and guidance.validate_guidance_grammar is not strict
