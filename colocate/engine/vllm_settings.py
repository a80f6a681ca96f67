"""What `VLLMEngine` passes to `vllm.LLM`, decided before vLLM is imported (no vLLM here):
engine sizes from the config and the workload, CUDA-graph capture sizes, the profiler's settings,
and the arguments refused before a minute of start-up. Pure functions, tested on CPU
(tests/test_vllm_settings.py)."""
from __future__ import annotations

import os

from colocate.config_schema import CUDAGRAPH_MODES, LORA_MODES

WORKER_EXTENSION = "colocate.engine.vllm_worker.ColocateWorkerExtension"
"""vLLM imports it by dotted path inside its GPU worker (the adapter slot: `vllm_worker.py`)."""
PROMPT_BOUND = {"arithmetic": 64, "diplomacy": 1536}
"""Upper bound of prompt tokens per environment, for max_model_len when the config leaves it 0."""


def capture_sizes(max_num_seqs: int, max_tokens: int = 0) -> list[int]:
    """CUDA-graph sizes in tokens per engine step: 1, 2, 4, 8, every 16 to 128, every 32 beyond, and
    max_num_seqs itself (a decode step has one token per sequence; about half of vLLM's default
    list at 512: start-up is dominated by compile and capture); then every 64 up to `max_tokens`
    for mixed steps (prefill chunks + decodes), which vLLM runs without any graph above the largest
    size."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, min(max_num_seqs, 128) + 1, 16)) + list(range(160, max_num_seqs + 1, 32))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    sizes += list(range(-(-(max_num_seqs + 1) // 64) * 64, max_tokens + 1, 64))
    if max_tokens > sizes[-1]:
        sizes.append(max_tokens)
    return sizes


def compilation_settings(max_num_seqs: int, max_num_batched_tokens: int, max_capture_tokens: int,
                         cudagraph_mode: str = "") -> dict:
    """vLLM's `compilation_config`. Graphs are captured up to the step's token budget
    (`max_num_batched_tokens`, vLLM's default when 0) but at most `max_capture_tokens`: a mixed step
    larger than the largest graph runs every layer's kernels from Python, and with a small prefill
    chunk (the streaming presets' 1,024 tokens) that is most steps of a rollout, host-bound
    (docs/design.md, Traps; profiles/vllm.md). `cudagraph_mode` "" keeps vLLM's
    FULL_AND_PIECEWISE (full graphs for decode steps, piecewise for mixed ones, attention between
    the pieces run eagerly); FULL replays mixed steps as full graphs too (FlashAttention 3)."""
    if cudagraph_mode not in CUDAGRAPH_MODES:
        raise ValueError(f"engine.cudagraph_mode={cudagraph_mode!r} is not one of {CUDAGRAPH_MODES}")
    budget = max_num_batched_tokens if max_num_batched_tokens > 0 else max_capture_tokens
    out = {"cudagraph_capture_sizes": capture_sizes(max_num_seqs, min(budget, max_capture_tokens))}
    if cudagraph_mode:
        out["cudagraph_mode"] = cudagraph_mode
    return out


def requests_per_round(cfg, num_inference: int) -> int:
    """Prompts one inference rank has in the engine at once (every live game's every power). With
    `rollout.update=inflight` the oversampled groups stay live too (a completed group is replaced at
    once), so they count."""
    per_game = 7 if cfg.env.name == "diplomacy" else 1
    most_groups = -(-cfg.rollout.groups_per_step // num_inference)  # the first ranks may take one more
    if cfg.rollout.update == "inflight":
        most_groups += cfg.rollout.oversample_groups
    return max(1, most_groups) * cfg.rollout.group_size * per_game


def engine_settings(cfg, num_inference: int, seed: int) -> dict:
    """Keyword arguments of `VLLMEngine` (besides model_dir) sized from config and workload."""
    max_num_seqs = max(1, min(cfg.engine.max_num_seqs, requests_per_round(cfg, num_inference)))
    max_model_len = cfg.engine.max_model_len or \
        -(-(PROMPT_BOUND.get(cfg.env.name, 1024) + cfg.engine.max_new_tokens) // 64) * 64
    return dict(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                max_num_batched_tokens=cfg.engine.max_num_batched_tokens,
                gpu_memory_utilization=cfg.engine.gpu_memory_utilization, enforce_eager=cfg.engine.enforce_eager,
                enable_prefix_caching=cfg.engine.enable_prefix_caching, seed=seed,
                lora_rank=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_mode=cfg.engine.lora_mode,
                validate_grammars=cfg.engine.validate_grammars, max_capture_tokens=cfg.engine.max_capture_tokens,
                cudagraph_mode=cfg.engine.cudagraph_mode, update=cfg.rollout.update)


def profiler_settings(profile_dir: str, steps: int) -> dict:
    """vLLM's `profiler_config`: a torch.profiler trace of the engine core's worker (CPU and GPU)
    between `start_profile` and `stop_profile`, at most `steps` engine steps, gzipped, no stacks.
    No kernel table at the stop (vLLM would build and print one inside the step that ends the
    window, stalling the engine mid-batch); no front-end trace (the LLM client is ours to profile)."""
    if steps < 1:  # vLLM reads max_iterations 0 as "no limit"
        raise ValueError(f"profiler_settings: steps must be >= 1, got {steps}")
    return {"profiler": "torch", "torch_profiler_dir": os.path.abspath(profile_dir), "torch_profiler_with_stack": False,
            "torch_profiler_use_gzip": True, "torch_profiler_dump_cuda_time_total": False, "ignore_frontend": True,
            "max_iterations": steps}


def check_engine_args(lora_mode: str) -> None:
    """Refuse what vLLM would reject only after a minute of start-up, before vLLM is imported."""
    if lora_mode not in LORA_MODES:
        raise ValueError(f"lora_mode={lora_mode!r} is not one of {LORA_MODES}")


def llm_arguments(model_dir: str, *, lora_mode: str, lora_rank: int, max_loras: int, max_num_seqs: int,
                  max_num_batched_tokens: int, max_capture_tokens: int, cudagraph_mode: str,
                  async_scheduling: bool | None, profile_dir: str, profile_steps: int, **plain) -> dict:
    """Every keyword argument of `vllm.LLM` for one engine; `plain` (dtype, seed, max_model_len,
    gpu_memory_utilization, enforce_eager, enable_prefix_caching) passes through unchanged.
    Log-probs are the processed ones (after temperature and the grammar mask: what the learner
    computes); grammars go to llguidance (token-id terminals, `vllm_grammar.py`)."""
    check_engine_args(lora_mode)
    kw = dict(model=model_dir, tokenizer=model_dir, max_num_seqs=max_num_seqs, **plain,
              logprobs_mode="processed_logprobs", structured_outputs_config={"backend": "guidance"},
              compilation_config=compilation_settings(max_num_seqs, max_num_batched_tokens, max_capture_tokens,
                                                      cudagraph_mode),
              worker_extension_cls=WORKER_EXTENSION)
    if lora_mode == "slot":
        kw.update(enable_lora=True, max_lora_rank=lora_rank, max_loras=max_loras, max_cpu_loras=max_loras)
    else:  # merged: the adapter is written into the base weights
        kw.update(enable_lora=False)
    if async_scheduling is not None:  # None: vLLM's default
        kw["async_scheduling"] = async_scheduling
    if max_num_batched_tokens > 0:  # 0: vLLM's default
        kw["max_num_batched_tokens"] = max_num_batched_tokens
    if profile_dir:  # `start_profile` / `stop_profile` then trace the engine core's worker
        kw["profiler_config"] = profiler_settings(profile_dir, profile_steps)
    return kw
