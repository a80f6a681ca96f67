"""Our requests to vLLM and its answers back, without vLLM: the `SamplingParams` fields of one
request, and a vLLM output's sampled ids and log-probs turned into a `Completion` (the constraint's
allowed ids replayed over them, vLLM's own failures counted) or a probe's prompt log-probs."""
from __future__ import annotations

import torch

from colocate.data import Completion, Request
from colocate.engine.vllm_grammar import replay_allowed


def sampling_kwargs(request: Request, eos_id: int) -> dict:
    """SamplingParams fields for one request (its constraint is added by `VLLMEngine._params`)."""
    kw = dict(n=1, temperature=request.temperature, max_tokens=request.max_new_tokens, logprobs=0,
              flat_logprobs=True, detokenize=False)
    if request.constraint is not None and not request.constraint.slots:
        kw.update(max_tokens=1, allowed_token_ids=[eos_id])  # nothing to choose: only EOS
    return kw


def sampled_logprobs(output) -> list[float]:
    """Per-token log-probs of the sampled ids from a vLLM CompletionOutput (flat or per-position)."""
    lps = output.logprobs
    if lps is None:
        raise RuntimeError("vLLM returned no logprobs: the request must ask for logprobs=0")
    flat = getattr(lps, "logprobs", None)
    if flat is not None and len(flat) == len(output.token_ids):
        return list(flat)
    return [lps[i][tok].logprob for i, tok in enumerate(output.token_ids)]


def prompt_logprobs_of(output, token_ids: list[int]) -> torch.Tensor:
    """[T-1] log-probs of token_ids[1:] from a vLLM RequestOutput asked for `prompt_logprobs=0`
    (position 0 has none; each later one maps the prompt's token id to its Logprob)."""
    positions = output.prompt_logprobs
    if positions is None or len(positions) != len(token_ids):
        raise RuntimeError(f"vLLM returned {'no' if positions is None else len(positions)} prompt log-probs for a "
                           f"{len(token_ids)}-token probe: the request must ask for prompt_logprobs=0")
    return torch.tensor([positions[t][tok].logprob for t, tok in enumerate(token_ids) if t],
                        dtype=torch.float32)


def completion_from_output(output, request: Request, version: int, eos_id: int) -> tuple[Completion, dict]:
    """vLLM CompletionOutput -> Completion (+ counters: walk failures, EOS appended, engine errors)."""
    ids = list(output.token_ids)
    logprobs = sampled_logprobs(output)
    # vLLM ends a request with "error" (or "abort") on its own failures, e.g. a token its grammar
    # refused, which it has appended already. Such an answer is cut short: counted, kept up to the
    # last token the Constraint allows, and reported as "length" (the env counts it as truncated).
    cut = output.finish_reason not in ("stop", "length")
    reason = "length" if output.finish_reason == "length" or cut else "stop"
    counts = {"walk_failures": 0, "eos_appended": 0, "engine_errors": int(cut)}
    allowed = None
    c = request.constraint
    if c is not None:
        replay = replay_allowed(c, ids)
        allowed = replay.allowed_ids
        if not replay.is_valid and cut:
            ids, logprobs = ids[:len(allowed)], logprobs[:len(allowed)]
        elif not replay.is_valid:
            counts["walk_failures"] = 1
            # A text grammar sampled a tokenization outside the trie (measurement mode only): from
            # there each sampled id stands alone, so the batch still packs (not fit for training).
            allowed = allowed + [[t] for t in ids[len(allowed):]]
        elif reason == "stop" and replay.only_eos_next:
            ids.append(eos_id)           # vLLM ended on the grammar without reporting the forced EOS:
            logprobs.append(0.0)         # it was the only allowed token, log-prob 0
            allowed.append([eos_id])
            counts["eos_appended"] = 1
    return Completion(token_ids=ids, logprobs=logprobs, allowed_ids=allowed, version=version,
                      finish_reason=reason), counts
