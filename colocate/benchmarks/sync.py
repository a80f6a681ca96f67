"""`--profile sync`: adapter sync into a vLLM engine, ours (NCCL into the pinned LoRA slot) against
the disk path (save adapter + LoRARequest(path) + first generate), same engine, same process.

  ours  learner step end -> flatten + broadcast from cuda:0 -> the engine's worker (GPU 1, child
        process) receives and writes the slot -> first token sampled with the new version
  disk  learner step end -> peft `save_pretrained` -> LoRARequest with a new id -> first token
Also checks one update bit for bit (checksum of the received bytes, slot read-back, engine bytes
== learner bytes). Needs 2 GPUs and vllm; `--also parity,rollout` adds those measurements to the
same session (one engine start, ~1 minute, serves them all). See `vllm_session.py`.
"""
from __future__ import annotations


def add_args(parser) -> None:
    parser.add_argument("--shape", default="7b", choices=("0.5b", "7b", "tiny"))
    parser.add_argument("--learner-device", default="cuda:0", help="cpu: dry run against a stand-in vllm")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--also", default="", help="comma list of more parts: parity, rollout")
    parser.add_argument("--num-seqs", type=int, default=512, help="rollout batch (with --also rollout)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="skip later parts past this")


def run(args) -> dict:
    from colocate.benchmarks import vllm_session
    from colocate.benchmarks.vllm_session import run_session
    vllm_session.LEARNER = args.learner_device
    shape = "0.5b" if args.quick else args.shape
    parts = ["sync"] + [p for p in args.also.split(",") if p]
    figures = run_session(shape, parts, budget_s=args.budget_s, num_seqs=args.num_seqs, sync_iters=args.iters)
    return split(figures)


def split(figures: dict) -> dict:
    """figures / baseline / ratios for the benchmark record (baselines: disk, vLLM alone, HF)."""
    ratios = {k: v for k, v in figures.items() if "speedup" in k or "_vs_" in k}
    baseline = {k: v for k, v in figures.items() if k not in ratios
                and any(t in k for t in ("disk_", "vllm_alone", "hf_generate", "vllm_unconstrained"))}
    rest = {k: v for k, v in figures.items() if k not in baseline and k not in ratios}
    return {"figures": rest, "baseline": baseline, "ratios": ratios}
