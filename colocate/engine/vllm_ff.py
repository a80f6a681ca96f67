"""Jump-forward over grammar-forced tokens through vLLM's speculative decoding (`engine.jump_forward`).

About 43 % of the tokens of a Diplomacy answer are forced: the grammar allows exactly one
(`constraint.forced_positions`; the env profile's `forced_token_share`), yet plain decoding spends
one engine step on each. The longest answer of a game phase, which a streamed game waits for,
would shrink from 37.5 to 22.1 steps on average (`phase_longest_choice_tokens`, CPU, profiles/e2e.md).

vLLM 0.25 has no jump-forward for structured outputs, but its speculative decoding does the same
work when the draft is the forced chain:
  * `ForcedDraftScheduler.update_draft_token_ids` (engine core, after each step, once the grammar
    has consumed the sampled tokens) sets every constrained request's draft to the tokens its
    llguidance matcher forces next (`LLMatcher.compute_ff_tokens`, ~2 us), at most
    `num_speculative_tokens`;
  * `NoDraft` is the proposer vLLM calls in the worker; it proposes nothing (the worker has no
    grammar state);
  * the rejection sampler accepts a draft token with probability p_target(draft) (drafts carry no
    probabilities). Under a token grammar (`grammar_mode="tokens"`, the default) a forced token has
    probability 1 after the mask, so it is always accepted and its processed log-prob is exactly
    0, as in plain decoding and in the learner. Any draft keeps the sampled distribution exact; a
    forced one only makes acceptance certain. (Under a text grammar the forced bytes' usual
    tokenization may compete with shorter tokens, so drafts can be rejected: still exact.)
    Drafts draw extra random numbers, so runs are not token-for-token those without it.

Costs, to be weighed by measurement (profiles/e2e.md): vLLM runs these proposers only with
synchronous scheduling and its V1 model runner (the presets use async scheduling and V2 now),
and batches with drafts mix query lengths (piecewise CUDA graphs).

vLLM imports this module inside the engine core by dotted path (`scheduler_cls`,
`speculative_config.model`). Without vLLM (the CPU tests) the scheduler's base is `object`, so its
draft logic can be tested on stand-ins.
"""
from __future__ import annotations

from contextlib import contextmanager

try:
    from vllm.v1.core.sched.scheduler import Scheduler
except ModuleNotFoundError as e:  # no vLLM here: only the CPU tests import this module then
    if e.name != "vllm" and not (e.name or "").startswith("vllm."):
        raise
    Scheduler = object


def forced_chain(grammar, limit: int) -> list[int]:
    """The tokens `grammar` (vLLM's GuidanceGrammar) forces next, at most `limit`, checked by it."""
    matcher = grammar.ll_matcher
    if limit <= 0 or matcher.is_stopped() or matcher.is_error():
        return []
    chain = list(matcher.compute_ff_tokens())[:limit]
    return grammar.validate_tokens(chain) if chain else []


@contextmanager
def matchers_swapped_for_copies(requests: dict, scheduled_spec_decode_tokens: dict):
    """While active, every request with drafts has a copy of its llguidance matcher.

    vLLM fills the mask of each draft position by consuming the drafts into the request's
    matcher, then rolls them back. On llguidance 1.7.6 that round trip corrupts the matcher: after
    a mask was computed at state S, a token consumed and rolled back to S is refused when it is
    consumed again (the test extras pin llguidance 1.7.6; tests/test_vllm_host.py checks the
    copies avoid it). In the e2e run every request died within its first drafts ("grammar
    rejected tokens", session 6). The masks are the same on a copy; the request's own matcher
    then only ever moves forward, as in plain decoding. Grammars of other backends (no
    `ll_matcher`) are left alone.
    """
    swapped = []
    try:
        for req_id, drafts in scheduled_spec_decode_tokens.items():
            request = requests.get(req_id)
            so = getattr(request, "structured_output_request", None)
            grammar = getattr(so, "grammar", None)
            if drafts and getattr(grammar, "ll_matcher", None) is not None:
                swapped.append((grammar, grammar.ll_matcher, grammar.terminated, grammar.rollback_lag))
                grammar.ll_matcher = grammar.ll_matcher.deep_copy()
        yield
    finally:
        for grammar, matcher, terminated, rollback_lag in reversed(swapped):
            grammar.ll_matcher, grammar.terminated, grammar.rollback_lag = matcher, terminated, rollback_lag


class NoDraft:
    """Speculative proposer (`method="custom_class"`) that proposes nothing: the scheduler below
    supplies the drafts."""

    def __init__(self, vllm_config, *args, **kwargs):
        self.vllm_config = vllm_config

    def propose(self, sampled_token_ids, *args, **kwargs) -> list[list[int]]:
        return [[] for _ in sampled_token_ids]


class ForcedDraftScheduler(Scheduler):
    """vLLM's scheduler whose drafts are each constrained request's grammar-forced chain."""

    def get_grammar_bitmask(self, scheduler_output):
        with matchers_swapped_for_copies(self.requests, scheduler_output.scheduled_spec_decode_tokens):
            return super().get_grammar_bitmask(scheduler_output)

    def update_draft_token_ids(self, draft_token_ids) -> None:
        for req_id in draft_token_ids.req_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.is_prefill_chunk or not self.structured_output_manager.should_advance(request):
                request.spec_token_ids = []
                continue
            # leave room for the token sampled after the drafts; vLLM stops at max_tokens anyway
            room = request.max_tokens - request.num_output_tokens - 1
            grammar = request.structured_output_request.grammar
            request.spec_token_ids = forced_chain(grammar, min(self.num_spec_tokens, room))
