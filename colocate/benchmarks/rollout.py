"""`--profile rollout`: output tokens/s of the same requests through vLLM alone, our inference-rank
path, and HF `generate`, in one process (engine on GPU 1, HF on cuda:0).

  vLLM alone  `LLM.generate` on prompts and SamplingParams (grammar, logprobs) built beforehand
  ours        `VLLMEngine.generate(requests)`: grammar from each Constraint, SamplingParams, generate,
              allowed_ids replay, then each completion decoded as an env's parser would
  HF          peft `generate`, 64 sequences, 32 new tokens, unconstrained (the anchor's baseline)
Synthetic 440-token prompts (300 shared) with 32-token constrained completions; also one Diplomacy
fork phase (env prompt building and order parsing included) and the text-grammar mismatch count.
Needs 2 GPUs and vllm; `--also sync,parity` adds those to the same session.
"""
from __future__ import annotations

from colocate.benchmarks.vllm_session import add_session_args, run_profile


def add_args(parser) -> None:
    add_session_args(parser, others="sync, parity")


def run(args) -> dict:
    return run_profile(args, "rollout", first=False)
