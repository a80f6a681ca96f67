"""`--profile sync`: adapter sync into a vLLM engine, ours (NCCL into the pinned LoRA slot) against
the disk path (save adapter + LoRARequest(path) + first generate), same engine, same process.

  ours  learner step end -> flatten + broadcast from cuda:0 -> the engine's worker (GPU 1, child
        process) receives and writes the slot -> first token sampled with the new version
  disk  learner step end -> peft `save_pretrained` -> LoRARequest with a new id -> first token
Also checks one update bit for bit (checksum of the received bytes, slot read-back, engine bytes
== learner bytes). Needs 2 GPUs and vllm; `--also parity,rollout` adds those measurements to the
same session (one engine start, ~1 minute, serves them all), and `--trace-dir` traces the engine
core over a few updates after them. See `vllm_session.py`.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch

from benchmarks import parity, rollout
from benchmarks.common import median_time
from benchmarks.vllm_session import Part, Session, add_session_args, run_profile, sync_learner, synthetic_requests
from colocate.data import Request
from colocate.wire import checksum, flatten_lora


def add_args(parser) -> None:
    add_session_args(parser, others="parity, rollout")


def run(args) -> dict:
    parts = {"sync": part(args), "parity": parity.part(args), "rollout": rollout.part(args)}
    return run_profile(args, "sync", parts, first=True, trace=lambda s, deadline: trace_first_tokens(s))


def part(args) -> Part:
    return lambda s, deadline: measure_sync(s, iters=args.iters)


def first_token_probe(s: Session) -> list[Request]:
    """One unconstrained request, a 64-token prompt, one new token: what "first token" times."""
    return synthetic_requests(1, len(s.tokenizer), s.tokenizer.eos_token_id, seed=7, prompt_len=64, shared=0,
                              max_new_tokens=1, constrained=False)


def timed_update(s: Session, probe: list[Request]) -> dict:
    """One learner step's adapter to the first token sampled with it, each part timed (ms):
    step end -> enqueue send (gather: one multi-tensor copy) -> worker receive + apply -> first token."""
    s.step_adapter()
    sync_learner()
    t0 = time.perf_counter()                                   # learner step end
    s.sender.send(s.gather(), s.version, wait=False)
    t1 = time.perf_counter()
    got = s.receive()
    t2 = time.perf_counter()
    (c,) = s.engine.generate(probe)
    t3 = time.perf_counter()
    assert c.version == s.version == got.version
    sync_learner()
    return {"send_enqueue_ms": (t1 - t0) * 1e3, "receive_apply_ms": (t2 - t1) * 1e3,
            "first_token_ms": (t3 - t2) * 1e3, "total_ms": (t3 - t0) * 1e3, "apply_ms": got.apply_ms}


def measure_sync(s: Session, iters: int = 10, warmup: int = 3) -> dict:
    probe = first_token_probe(s)
    out = {}
    # Correctness first: one update with checksum and slot read-back.
    s.step_adapter()
    got = s.push(with_checksum=True, verify=True)
    engine_bytes = flatten_lora(s.engine.lora_state(), s.spec)
    learner_bytes = flatten_lora({k: v.detach().cpu() for k, v in s.lora().items()}, s.spec)
    out["sync/checksum_ok"] = bool(got.checksum_ok)
    out["sync/slot_matches_received"] = bool(got.slot_ok)
    out["sync/engine_bytes_equal_learner"] = bool(torch.equal(engine_bytes.view(torch.uint8),
                                                              learner_bytes.view(torch.uint8)))
    out["sync/checksum"] = checksum(learner_bytes)
    out["sync/adapter_mb"] = s.spec.numel * s.spec.dtype.itemsize / 1e6
    # Ours: step end -> enqueue send -> worker receive+apply -> first token with the new version.
    runs = [timed_update(s, probe) for _ in range(warmup + iters)][warmup:]
    for k in runs[0]:
        out[f"sync/ours_{k}"] = statistics.median(r[k] for r in runs)
    # The same first token without any update (what sampling costs anyway).
    out["sync/first_token_no_update_ms"] = 1e3 * median_time(lambda: s.engine.generate(probe), warmup=0, iters=iters)
    out.update(first_token_breakdown(s, probe, iters))
    if s.engine.lora_mode == "merged":  # built without LoRA: vLLM's loader, the disk path, is not there
        out["sync/disk_skipped"] = "lora_mode=merged"
    else:
        out.update(measure_disk(s, probe, iters))
        out["sync/speedup_vs_disk"] = out["sync/disk_total_ms"] / out["sync/ours_total_ms"]
    return out


def measure_disk(s: Session, probe: list[Request], iters: int) -> dict:
    """The disk path: save the adapter (peft), a new LoRARequest from the path, first token with it."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    prompt = [{"prompt_token_ids": probe[0].prompt_ids}]
    params = SamplingParams(max_tokens=1, detokenize=False)
    disk = {"save_ms": [], "load_first_token_ms": [], "total_ms": []}
    with tempfile.TemporaryDirectory(dir=os.environ.get("COLOCATE_DISK_DIR") or None) as root:
        for i in range(max(3, iters // 2) + 1):
            s.step_adapter()
            sync_learner()
            t0 = time.perf_counter()
            path = os.path.join(root, f"v{s.version}")
            s.policy.save_pretrained(path, is_main_process=True)
            t1 = time.perf_counter()
            s.engine.llm.generate(prompt, params, lora_request=LoRARequest(f"disk-v{s.version}", 100 + i, path),
                                  use_tqdm=False)
            t2 = time.perf_counter()
            if i >= 1:  # the first disk load also warms the loader
                disk["save_ms"].append((t1 - t0) * 1e3)
                disk["load_first_token_ms"].append((t2 - t1) * 1e3)
                disk["total_ms"].append((t2 - t0) * 1e3)
    s.push()  # the engine's slot holds the learner's latest again
    return {f"sync/disk_{k}": statistics.median(v) for k, v in disk.items()}


def trace_first_tokens(s: Session, cycles: int = 5) -> dict:
    """vLLM's engine-core trace over `cycles` updates, each followed by its first token (the part of
    the sync path inside vLLM). The session runs it after every other part: after vLLM's profiler
    window the engine's steps stay slower (docs/design.md, Traps). Summarized per trace file
    (`common.summarize_trace`): GPU busy and idle time, kernel families, vLLM's per-step
    annotations ("execute_context_1(64)_generation_0(0)": one request's 64-token prefill) and
    whether its steps replayed a CUDA graph (cudaGraphLaunch) or launched kernel by kernel."""
    import glob
    from benchmarks.common import summarize_trace
    probe = first_token_probe(s)
    pattern = os.path.join(s.engine.profile_dir, "**", "*.json*")
    before = set(glob.glob(pattern, recursive=True))
    s.engine.start_profile()
    try:
        walls = [timed_update(s, probe)["total_ms"] for _ in range(cycles)]
    finally:
        s.engine.stop_profile()
    files = sorted(set(glob.glob(pattern, recursive=True)) - before)
    return {"sync/trace_cycles": cycles, "sync/trace_cycle_ms": walls,  # profiled: slower than untraced
            "sync/trace": [summarize_trace(p) for p in files]}


def first_token_breakdown(s: Session, probe: list[Request], iters: int) -> dict:
    """Where the one-token generate after an update goes, each part timed on its own (medians):
      rpc_roundtrip_ms       one `collective_rpc` that does nothing (client -> engine core -> worker -> back):
                             the worker's own no-op `check_health`, called by name
      first_token_stream_ms  the probe through `submit` + `poll` (`LLM.enqueue` + `llm_engine.step()`,
                             what streamed rollouts use) instead of `LLM.generate`
      first_token_16_ms      a 16-token prompt instead of 64 (how much is prefill)
      two_tokens_ms          max_tokens=2: minus first_token_no_update_ms, one decode step
      first_token_base_ms    no LoRA request at all (slot mode: the LoRA kernels' share)"""
    from vllm import SamplingParams

    def median_ms(fn) -> float:
        return 1e3 * median_time(fn, warmup=1, iters=iters)

    vocab, eos = len(s.tokenizer), s.tokenizer.eos_token_id
    short = synthetic_requests(1, vocab, eos, seed=8, prompt_len=16, shared=0, max_new_tokens=1, constrained=False)
    two = synthetic_requests(1, vocab, eos, seed=7, prompt_len=64, shared=0, max_new_tokens=2, constrained=False)
    prompt = [{"prompt_token_ids": probe[0].prompt_ids}]
    out = {
        "sync/rpc_roundtrip_ms": median_ms(lambda: s.engine.llm.collective_rpc("check_health")),
        "sync/first_token_stream_ms": median_ms(lambda: (s.engine.submit(probe), s.engine.poll(wait_all=True))),
        "sync/first_token_16_ms": median_ms(lambda: s.engine.generate(short)),
        "sync/two_tokens_ms": median_ms(lambda: s.engine.generate(two)),
    }
    if s.engine.lora_mode == "slot":
        params = SamplingParams(max_tokens=1, detokenize=False)
        out["sync/first_token_base_ms"] = median_ms(
            lambda: s.engine.llm.generate(prompt, params, use_tqdm=False))
    return out
