"""The `parity` part of a vLLM session (`--also parity` of the sync and rollout profiles): vLLM's
sampled-token log-probs against the learner's on the same completions, same adapter, same mask.
Not a profile of its own: the sync and rollout profiles hand `part` to `vllm_session.run_session`,
which runs it in an open engine session.
"""
from __future__ import annotations

import statistics

import torch

from benchmarks.vllm_session import Part, Session, synthetic_requests


def part(args) -> Part:
    return lambda s, deadline: measure_parity(s)


@torch.no_grad()
def learner_logprobs(policy, requests, completions, temperature: float, batch: int = 16,
                     use_adapter: bool = True) -> list[float]:
    """The learner's log-probs of the sampled tokens: softmax over `allowed_ids` when the completion
    has them (the learner's `restrict_to_allowed`), over the vocabulary otherwise."""
    import contextlib
    from colocate.kernels import restrict_to_allowed
    from colocate.kernels.reference import per_token_logprobs
    out: list[float] = []
    device = next(policy.parameters()).device
    with policy.disable_adapter() if not use_adapter else contextlib.nullcontext():
        for start in range(0, len(requests), batch):
            reqs, comps = requests[start:start + batch], completions[start:start + batch]
            seqs = [r.prompt_ids + c.token_ids for r, c in zip(reqs, comps)]
            width = max(len(x) for x in seqs)
            ids = torch.zeros((len(seqs), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            rows, cols, targets, allowed = [], [], [], []
            for i, (r, c, x) in enumerate(zip(reqs, comps, seqs)):
                ids[i, :len(x)] = torch.tensor(x)
                mask[i, :len(x)] = 1
                p = len(r.prompt_ids)
                rows += [i] * len(c.token_ids)
                cols += list(range(p - 1, p - 1 + len(c.token_ids)))
                targets += c.token_ids
                allowed += c.allowed_ids if c.allowed_ids is not None else []
            logits = policy(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[rows, cols]
            tgt = torch.tensor(targets, device=device)
            if allowed:
                k = max(len(a) for a in allowed)
                allowed_t = torch.full((len(allowed), k), -1, dtype=torch.long)
                for j, a in enumerate(allowed):
                    allowed_t[j, :len(a)] = torch.tensor(a)
                logits, tgt = restrict_to_allowed(logits, tgt, allowed_t.to(device))
            out += per_token_logprobs(logits, tgt, temperature).tolist()
    return out


def parity_stats(prefix: str, s: Session, reqs, comps) -> dict:
    engine_lp = [x for c in comps for x in c.logprobs]
    mine = learner_logprobs(s.policy, reqs, comps, 1.0)
    base = learner_logprobs(s.policy, reqs, comps, 1.0, use_adapter=False)
    diffs = [abs(a - b) for a, b in zip(engine_lp, mine)]
    out = {f"{prefix}/tokens": len(diffs), f"{prefix}/mean_abs_diff": statistics.mean(diffs),
           f"{prefix}/max_abs_diff": max(diffs), f"{prefix}/p99_abs_diff": sorted(diffs)[int(0.99 * (len(diffs) - 1))],
           f"{prefix}/adapter_effect_mean_abs": statistics.mean(abs(a - b) for a, b in zip(mine, base)),
           f"{prefix}/mean_logprob": statistics.mean(engine_lp)}
    if all(c.allowed_ids is not None for c in comps):
        sizes = [len(a) for c in comps for a in c.allowed_ids]
        free = [d for d, k in zip(diffs, sizes) if k > 1]  # tokens with a choice (forced ones are log 1 = 0)
        forced = [abs(x) for x, k in zip(engine_lp, sizes) if k == 1]
        out.update({f"{prefix}/free_tokens": len(free),
                    f"{prefix}/free_mean_abs_diff": statistics.mean(free) if free else 0.0,
                    f"{prefix}/free_max_abs_diff": max(free) if free else 0.0,
                    f"{prefix}/forced_max_abs_logprob": max(forced) if forced else 0.0})
    return out


def measure_parity(s: Session, n: int = 64) -> dict:
    """vLLM's sampled-token log-probs vs the learner's on the same completions, same adapter, same mask.

    Three workloads: synthetic constrained (most tokens forced), Diplomacy orders (real branching),
    and unconstrained (softmax over the whole vocabulary: the hardest, no mask to hide behind)."""
    vocab, eos = len(s.tokenizer), s.tokenizer.eos_token_id
    reqs = synthetic_requests(n, vocab, eos, seed=11)
    comps = s.engine.generate(reqs)
    assert all(c.version == s.version for c in comps)
    out = parity_stats("parity", s, reqs, comps)
    try:
        from colocate.envs.diplomacy import DiplomacyEnv, DiplomacySettings
        env = DiplomacyEnv(s.tokenizer, DiplomacySettings(group_size=4, horizon_years=1), seed=3)
        for g in range(3):
            env.start_group(g)
        dreqs = [r for _, r in env.requests()][:n]
        out.update(parity_stats("parity_diplomacy", s, dreqs, s.engine.generate(dreqs)))
        # Engine steps for one answer alone: one per token in plain decoding.
        longest = max(dreqs, key=lambda r: sum(max(len(c) for c in slot) for slot in r.constraint.slots))
        steps = s.engine.counters["steps"]
        s.engine.submit([longest])
        ((_, answer),) = s.engine.poll(wait_all=True)
        out["parity_diplomacy/one_answer_tokens"] = len(answer.token_ids)
        out["parity_diplomacy/one_answer_engine_steps"] = s.engine.counters["steps"] - steps
    except Exception as exc:
        out["parity_diplomacy/error"] = f"{type(exc).__name__}: {exc}"[:300]
    ureqs = synthetic_requests(n // 2, vocab, eos, seed=12, max_new_tokens=16, constrained=False)
    out.update(parity_stats("parity_unconstrained", s, ureqs, s.engine.generate(ureqs)))
    out.update({"parity/walk_failures": s.engine.counters["walk_failures"],
                "parity/eos_appended": s.engine.counters["eos_appended"],
                "parity/engine_errors": s.engine.counters["engine_errors"],
                "parity/constraint_masks": s.engine.constraint_masks, "parity/masked_rows": s.engine.masked_rows()})
    return out
