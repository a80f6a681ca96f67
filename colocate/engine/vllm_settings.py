"""What `VLLMEngine` passes to `vllm.LLM`, decided before vLLM is imported (no vLLM here):
engine sizes from the config and the workload, CUDA-graph capture sizes, the profiler's settings,
and the arguments refused before a minute of start-up. Pure functions, tested on CPU
(tests/test_vllm_settings.py)."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from colocate.config_schema import (CUDAGRAPH_MODES, LORA_MODES, QUANTIZATIONS, EngineConfig, LoraConfig, MetricsConfig,
                                    RolloutConfig)
from colocate.engine.fp8 import scale_groups
from colocate.engine.fp8_merge import merged_fp8_bytes

WORKER_EXTENSION = "colocate.engine.vllm_worker.ColocateWorkerExtension"
"""vLLM imports it by dotted path inside its GPU worker (the adapter slot: `vllm_worker.py`)."""


_E, _L, _M, _R = EngineConfig, LoraConfig, MetricsConfig, RolloutConfig  # a field mirroring a config key: its default


@dataclass(frozen=True)
class VLLMSettings:
    """Everything a `VLLMEngine` is built with besides the model directory, the adapter layout and
    its GPU (`engine_settings` fills it from a run's config; benchmarks set what they measure).
    Fields named after a config key default to that key's default, so the two cannot drift."""
    max_num_seqs: int = _E.max_num_seqs
    max_model_len: int = 1024
    """A length (the config's 0, derive it from the workload, is resolved by `engine_settings`)."""
    gpu_memory_utilization: float = _E.gpu_memory_utilization
    kv_cache_bytes: int = 0
    """0: vLLM sizes the KV cache from its share (config `engine.kv_cache_gib`)."""
    enforce_eager: bool = _E.enforce_eager
    enable_prefix_caching: bool = _E.enable_prefix_caching
    seed: int = 0
    dtype: str = "bfloat16"
    lora_rank: int = _L.rank
    lora_alpha: float = _L.alpha
    max_loras: int = 1
    lora_mode: str = _E.lora_mode
    """slot or merged (config `engine.lora_mode`)."""
    grammar_mode: str = "tokens"
    """Token-id grammars (`vllm_grammar.py`); text grammars are for measurements."""
    validate_grammars: bool = _E.validate_grammars
    logprob_kernel: str = _E.logprob_kernel
    """ours or vllm (config `engine.logprob_kernel`)."""
    constraint_masks: str = _E.constraint_masks
    """ours or vllm (config `engine.constraint_masks`)."""
    async_scheduling: bool | None = None
    """None: vLLM's default."""
    max_num_batched_tokens: int = _E.max_num_batched_tokens
    """0: vLLM's default."""
    max_capture_tokens: int = _E.max_capture_tokens
    cudagraph_mode: str = _E.cudagraph_mode
    profile_dir: str = ""
    """Non-empty: `start_profile` / `stop_profile` trace the engine core's worker into it."""
    profile_steps: int = _M.profile_engine_steps
    update: str = _R.update
    """`rollout.update`: inflight lets adapter updates land under running requests."""
    quantization: str = _E.quantization
    """none or fp8 (config `engine.quantization`): vLLM's online FP8 of the base weights."""
    prestart: bool = _E.prestart
    """Fork the engine core from the pre-started server (config `engine.prestart`, `prestart.py`)."""

    def replace(self, **changes) -> "VLLMSettings":
        return dataclasses.replace(self, **changes)


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


def requests_per_round(cfg, num_inference: int, requests_per_group: int) -> int:
    """Prompts one inference rank has in the engine at once (every live group's requests, as the
    env states them: `Env.requests_per_group`). With `rollout.update=inflight` the oversampled
    groups stay live too (a completed group is replaced at once), so they count."""
    most_groups = -(-cfg.rollout.groups_per_step // num_inference)  # the first ranks may take one more
    if cfg.rollout.update == "inflight":
        most_groups += cfg.rollout.oversample_groups
    return max(1, most_groups) * requests_per_group


def engine_max_model_len(cfg, prompt_bound: int) -> int:
    """The engine's context: engine.max_model_len, or (0) the env's prompt bound and a completion,
    rounded up to 64 tokens. The memory plan sizes the KV cache with it too."""
    return cfg.engine.max_model_len or -(-(prompt_bound + cfg.engine.max_new_tokens) // 64) * 64


def engine_settings(cfg, num_inference: int, seed: int, *, prompt_bound: int,
                    requests_per_group: int) -> VLLMSettings:
    """A `VLLMEngine`'s settings sized from config and workload; the workload's facts come from the
    env (`colocate.envs.env_facts`)."""
    max_num_seqs = max(1, min(cfg.engine.max_num_seqs, requests_per_round(cfg, num_inference, requests_per_group)))
    return VLLMSettings(max_num_seqs=max_num_seqs, max_model_len=engine_max_model_len(cfg, prompt_bound),
                max_num_batched_tokens=cfg.engine.max_num_batched_tokens,
                gpu_memory_utilization=cfg.engine.gpu_memory_utilization,
                kv_cache_bytes=int(cfg.engine.kv_cache_gib * 2**30), enforce_eager=cfg.engine.enforce_eager,
                enable_prefix_caching=cfg.engine.enable_prefix_caching, seed=seed,
                lora_rank=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_mode=cfg.engine.lora_mode,
                validate_grammars=cfg.engine.validate_grammars, max_capture_tokens=cfg.engine.max_capture_tokens,
                cudagraph_mode=cfg.engine.cudagraph_mode, update=cfg.rollout.update,
                logprob_kernel=cfg.engine.logprob_kernel, constraint_masks=cfg.engine.constraint_masks,
                quantization=cfg.engine.quantization, prestart=cfg.engine.prestart)


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


MERGED_HEADROOM_BYTES = 1 << 30
"""Free memory `vllm_worker.colocate_init_merged` wants beside the copy of W0 it allocates (and,
FP8, the scratch buffer: `merged_copy_bytes`); its check and `merged_memory_share` both use this."""


def merged_copy_bytes(names, shapes, dtype: str, quantization: str = "none") -> int:
    """Bytes of the W0 copy that lora_mode=merged keeps (`vllm_worker.colocate_init_merged`): one
    [out, in] weight per adapted module, from its adapter's A [r, in] and B [out, r] shapes; with
    quantization fp8 one byte a parameter (W0 in e4m3) and the fp32 scratch the largest fused weight
    is requantized in (`fp8_merge.merged_fp8_bytes`). Exact when every part of a fused vLLM module
    is adapted (q, k, v together; gate and up together: the presets' targets); the worker copies a
    partly adapted fused module whole, which this undercounts, and its own free-memory check then
    refuses at start naming the setting to lower."""
    shape = dict(zip(names, shapes))
    sizes = {a.split(".lora_A")[0]: shape[a][1] * shape[a.replace("lora_A", "lora_B")][0]
             for a in names if "lora_A" in a}
    if quantization == "fp8":
        return merged_fp8_bytes([sum(sizes[n] for n in group) for group in scale_groups(sizes)])
    return sum(sizes.values()) * {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]


def merged_memory_share(utilization: float, copy_bytes: int, total_bytes: int) -> float:
    """vLLM's `gpu_memory_utilization` under lora_mode=merged: `engine.gpu_memory_utilization` is
    the engine's whole share of the card, so vLLM's pool gives up room for the W0 copy (allocated
    after vLLM sized its KV cache) and its headroom, instead of the copy finding no room."""
    share = utilization - (copy_bytes + MERGED_HEADROOM_BYTES) / total_bytes
    if share <= 0.05:
        raise ValueError(f"engine.lora_mode=merged keeps a {copy_bytes / 2**30:.1f} GiB copy of the adapted weights, "
                         f"which leaves vLLM {max(share, 0):.2f} of the card at engine.gpu_memory_utilization="
                         f"{utilization}: raise it or use lora_mode=slot")
    return share


def check_engine_args(lora_mode: str, quantization: str = "none") -> None:
    """Refuse what vLLM would reject (or what would go wrong) only after a minute of start-up, before
    vLLM is imported. FP8 weights go with either LoRA mode (merged: `adapter_targets.MergedFp8Adapter`)."""
    if lora_mode not in LORA_MODES:
        raise ValueError(f"lora_mode={lora_mode!r} is not one of {LORA_MODES}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} is not one of {QUANTIZATIONS}")


def precision_arguments(s: VLLMSettings) -> dict:
    """vLLM's `quantization` (fp8 on an unquantized checkpoint: online FP8, one scale per weight,
    dynamic activation scales; slot LoRA runs beside it, `vllm/lora/layers/base_linear.py` calls the
    base layer's `quant_method.apply`; merged requantizes the weights at each update); {} at the
    default, so a bf16 engine's arguments stay what they were."""
    return {"quantization": s.quantization} if s.quantization != "none" else {}


def llm_arguments(model_dir: str, s: VLLMSettings) -> dict:
    """Every keyword argument of `vllm.LLM` for one engine. Log-probs are the processed ones (after
    temperature and the grammar mask: what the learner computes); grammars go to llguidance
    (token-id terminals, `vllm_grammar.py`)."""
    check_engine_args(s.lora_mode, s.quantization)
    kw = dict(model=model_dir, tokenizer=model_dir, max_num_seqs=s.max_num_seqs, dtype=s.dtype, seed=s.seed,
              max_model_len=s.max_model_len, gpu_memory_utilization=s.gpu_memory_utilization,
              enforce_eager=s.enforce_eager, enable_prefix_caching=s.enable_prefix_caching,
              logprobs_mode="processed_logprobs", structured_outputs_config={"backend": "guidance"},
              compilation_config=compilation_settings(s.max_num_seqs, s.max_num_batched_tokens, s.max_capture_tokens,
                                                      s.cudagraph_mode),
              worker_extension_cls=WORKER_EXTENSION)
    if s.lora_mode == "slot":
        kw.update(enable_lora=True, max_lora_rank=s.lora_rank, max_loras=s.max_loras, max_cpu_loras=s.max_loras)
    else:  # merged: the adapter is written into the base weights
        kw.update(enable_lora=False)
    kw.update(precision_arguments(s))
    if s.async_scheduling is not None:  # None: vLLM's default
        kw["async_scheduling"] = s.async_scheduling
    if s.max_num_batched_tokens > 0:  # 0: vLLM's default
        kw["max_num_batched_tokens"] = s.max_num_batched_tokens
    if s.kv_cache_bytes > 0:  # vLLM then skips its memory profile (0: it profiles its share)
        kw["kv_cache_memory_bytes"] = s.kv_cache_bytes
    if s.profile_dir:  # `start_profile` / `stop_profile` then trace the engine core's worker
        kw["profiler_config"] = profiler_settings(s.profile_dir, s.profile_steps)
    return kw
