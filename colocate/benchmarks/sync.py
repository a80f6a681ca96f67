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

from colocate.benchmarks.vllm_session import add_session_args, run_profile


def add_args(parser) -> None:
    add_session_args(parser, others="parity, rollout")


def run(args) -> dict:
    return run_profile(args, "sync", first=True)
