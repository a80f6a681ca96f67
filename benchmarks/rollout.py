"""`--profile rollout`: output tokens/s of the same requests through vLLM alone, our inference-rank
path, and HF `generate`, in one process (engine on GPU 1, HF on cuda:0).

  vLLM alone  `LLM.generate` on prompts and SamplingParams (grammar, logprobs) built beforehand
  ours        `VLLMEngine.generate(requests)`: grammar from each Constraint, SamplingParams, generate,
              allowed_ids replay, then each completion decoded as an env's parser would
  HF          peft `generate`, 64 sequences, 32 new tokens, unconstrained (the baseline)
Synthetic 440-token prompts (300 shared) with 32-token constrained completions; also one Diplomacy
fork phase (env prompt building and order parsing included) and the text-grammar mismatch count.
Needs 2 GPUs and vllm; `--also parity` adds that part to the same session (the sync profile,
`--profile sync --also rollout`, runs every part).
"""
from __future__ import annotations

import statistics
import time

import torch

from benchmarks import parity
from benchmarks import vllm_session as vs
from benchmarks.vllm_session import (Part, Session, add_session_args, log, run_profile, sync_learner,
                                     synthetic_requests)


def add_args(parser) -> None:
    add_session_args(parser, others="parity")


def run(args) -> dict:
    return run_profile(args, "rollout", {"rollout": part(args), "parity": parity.part(args)}, first=False)


def part(args) -> Part:
    """Leaves 30 s of the budget for the session's later steps (trace, shutdown)."""
    return lambda s, deadline: measure_rollout(s, num_seqs=args.num_seqs, deadline=deadline - 30)


def _vllm_inputs(engine, requests, constrained: bool = True):
    """Prompts + SamplingParams, built before the clock starts: constrained exactly as VLLMEngine
    builds them (its constraint masks or grammars); unconstrained ones run to their length."""
    if constrained:
        return engine._params(requests)
    from vllm import SamplingParams
    from colocate.engine.vllm_requests import sampling_kwargs
    params = [SamplingParams(**sampling_kwargs(r, engine.eos_id), min_tokens=r.max_new_tokens, ignore_eos=True)
              for r in requests]
    return [{"prompt_token_ids": r.prompt_ids} for r in requests], params


def _timed_vllm_alone(engine, prompts, params) -> tuple[float, int]:
    engine.llm.reset_prefix_cache()
    t = time.perf_counter()
    outs = engine.llm.generate(prompts, params, lora_request=engine._lora_request, use_tqdm=False)
    return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)


def _timed_ours(engine, tokenizer, requests) -> tuple[float, int]:
    engine.llm.reset_prefix_cache()
    t = time.perf_counter()
    comps = engine.generate(requests)
    for c in comps:  # what an env does with a completion: decode it to text for its parser
        tokenizer.decode(c.token_ids[:-1] if c.token_ids and c.token_ids[-1] == engine.eos_id else c.token_ids)
    return time.perf_counter() - t, sum(len(c.token_ids) for c in comps)


@torch.no_grad()
def hf_generate_tok_s(policy, requests, new_tokens: int = 32) -> float:
    ids = torch.tensor([r.prompt_ids for r in requests], device=vs.LEARNER)
    policy.generate(input_ids=ids[:4], attention_mask=torch.ones_like(ids[:4]), max_new_tokens=4, do_sample=True)
    sync_learner()
    t = time.perf_counter()
    policy.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens, do_sample=True, temperature=1.0)
    sync_learner()
    return len(requests) * new_tokens / (time.perf_counter() - t)


def measure_rollout(s: Session, num_seqs: int = 512, rounds: int = 2, hf_seqs: int = 64,
                    deadline: float = float("inf")) -> dict:
    e, tok = s.engine, s.tokenizer
    vocab, eos = len(tok), tok.eos_token_id
    out = {}
    warm = synthetic_requests(32, vocab, eos, seed=99)
    e.generate(warm)
    alone, ours = [], []
    for r in range(rounds):  # fresh prompts each run (same shapes); the order alternates per round
        def run_alone():
            prompts, params = _vllm_inputs(e, synthetic_requests(num_seqs, vocab, eos, seed=1000 + r))
            dt, n = _timed_vllm_alone(e, prompts, params)
            alone.append(n / dt)

        def run_ours():
            dt, n = _timed_ours(e, tok, synthetic_requests(num_seqs, vocab, eos, seed=2000 + r))
            ours.append(n / dt)
        for run in ((run_alone, run_ours) if r % 2 == 0 else (run_ours, run_alone)):
            run()
    out["rollout/num_seqs"] = num_seqs
    out["rollout/vllm_alone_out_tok_s"] = statistics.mean(alone)
    out["rollout/ours_out_tok_s"] = statistics.mean(ours)
    out["rollout/ours_vs_vllm_alone"] = out["rollout/ours_out_tok_s"] / out["rollout/vllm_alone_out_tok_s"]
    out["rollout/ours_host_s_per_seq_ms"] = 1e3 * e.counters["host_s"] / max(e.counters["requests"], 1)
    log(f"{s.shape}: rollout alone {out['rollout/vllm_alone_out_tok_s']:.0f} ours {out['rollout/ours_out_tok_s']:.0f} tok/s")
    reqs = synthetic_requests(num_seqs, vocab, eos, seed=3000, constrained=False)
    prompts, params = _vllm_inputs(e, reqs, constrained=False)
    dt, n = _timed_vllm_alone(e, prompts, params)
    out["rollout/vllm_unconstrained_out_tok_s"] = n / dt
    out["rollout/hf_generate_seqs"] = hf_seqs
    out["rollout/hf_generate_out_tok_s"] = hf_generate_tok_s(s.policy, synthetic_requests(hf_seqs, vocab, eos, seed=4000))
    out["rollout/ours_vs_hf"] = out["rollout/ours_out_tok_s"] / out["rollout/hf_generate_out_tok_s"]
    log(f"{s.shape}: hf generate {out['rollout/hf_generate_out_tok_s']:.0f} tok/s")
    if time.time() < deadline:
        out.update(measure_diplomacy(s))
    if time.time() < deadline:
        out.update(measure_text_grammar(s))
    return out


def measure_diplomacy(s: Session, groups: int = 9, group_size: int = 8) -> dict:
    """One fork phase of Diplomacy (every power of every continuation): vLLM alone vs our path with
    the env's own prompt building and order parsing (`requests` + `generate` + `step`)."""
    from colocate.envs.diplomacy import DiplomacyEnv, DiplomacySettings
    out = {}
    try:
        def fresh():
            env = DiplomacyEnv(s.tokenizer, DiplomacySettings(group_size=group_size, horizon_years=1), seed=5)
            for g in range(groups):
                env.start_group(g)
            return env
        env_a = fresh()
        reqs = [r for _, r in env_a.requests()]
        prompts, params = _vllm_inputs(s.engine, reqs)
        dt_a, n_a = _timed_vllm_alone(s.engine, prompts, params)
        env_b = fresh()
        s.engine.llm.reset_prefix_cache()
        t = time.perf_counter()
        keyed = env_b.requests()
        comps = s.engine.generate([r for _, r in keyed])
        env_b.step({k: c for (k, _), c in zip(keyed, comps)})
        dt_b = time.perf_counter() - t
        n_b = sum(len(c.token_ids) for c in comps)
        metrics = env_b.metrics()
        out.update({"diplomacy/requests": len(reqs), "diplomacy/mean_prompt_tokens": statistics.mean(len(r.prompt_ids) for r in reqs),
                    "diplomacy/mean_out_tokens": n_b / len(comps),
                    "diplomacy/vllm_alone_out_tok_s": n_a / dt_a, "diplomacy/ours_out_tok_s": n_b / dt_b,
                    "diplomacy/ours_vs_vllm_alone": (n_b / dt_b) / (n_a / dt_a),
                    **{f"diplomacy/env_{k}": float(v) for k, v in metrics.items() if isinstance(v, (int, float))}})
    except Exception as exc:  # the env is someone else's and optional here
        out["diplomacy/error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def measure_text_grammar(s: Session, n: int = 128) -> dict:
    """How often a text grammar (choices as strings) samples ids outside the Constraint's trie."""
    from colocate.envs.diplomacy import DiplomacyEnv, DiplomacySettings
    e = s.engine
    before = dict(e.counters)
    masks, e.grammar_mode, e.constraint_masks = e.constraint_masks, "text", "vllm"  # text grammars are vLLM's
    try:
        env = DiplomacyEnv(s.tokenizer, DiplomacySettings(group_size=8, horizon_years=1), seed=6)
        for g in range(3):
            env.start_group(g)
        reqs = [r for _, r in env.requests()][:n]
        comps = e.generate(reqs)
    except Exception as exc:
        return {"text_grammar/error": f"{type(exc).__name__}: {exc}"[:300]}
    finally:
        e.grammar_mode, e.constraint_masks = "tokens", masks
    failures = e.counters["walk_failures"] - before["walk_failures"]
    e.counters["walk_failures"] = before["walk_failures"]
    return {"text_grammar/completions": len(comps), "text_grammar/walk_failures": failures,
            "text_grammar/failure_rate": failures / max(len(comps), 1)}
