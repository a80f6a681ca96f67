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


def add_args(parser) -> None:
    parser.add_argument("--shape", default="7b", choices=("0.5b", "7b", "tiny"))
    parser.add_argument("--learner-device", default="cuda:0", help="cpu: dry run against a stand-in vllm")
    parser.add_argument("--num-seqs", type=int, default=512)
    parser.add_argument("--also", default="", help="comma list of more parts: sync, parity")
    parser.add_argument("--iters", type=int, default=10, help="sync iterations (with --also sync)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="skip later parts past this")


def run(args) -> dict:
    from colocate.benchmarks.sync import split
    from colocate.benchmarks import vllm_session
    from colocate.benchmarks.vllm_session import run_session
    vllm_session.LEARNER = args.learner_device
    shape = "0.5b" if args.quick else args.shape
    parts = [p for p in args.also.split(",") if p] + ["rollout"]
    figures = run_session(shape, parts, budget_s=args.budget_s, num_seqs=args.num_seqs, sync_iters=args.iters)
    return split(figures)
