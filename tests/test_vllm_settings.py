"""What `VLLMEngine` passes to `vllm.LLM` (`engine/vllm_settings.py`): CUDA-graph capture sizes,
the compilation config, engine sizes from config and workload, the profiler's settings, and the
arguments refused before vLLM starts. Pure functions, no vLLM."""
import os

import pytest

from colocate.engine.vllm_settings import capture_sizes, engine_settings


def test_capture_sizes_cover_the_batch():
    assert capture_sizes(512)[:5] == [1, 2, 4, 8, 16] and capture_sizes(512)[-1] == 512
    assert capture_sizes(100)[-1] == 100 and capture_sizes(3) == [1, 2, 3]
    # mixed steps: every 64 tokens past the decode sizes, up to the step's token budget
    sizes = capture_sizes(224, 1024)
    assert sizes == sorted(set(sizes)) and sizes[:15] == capture_sizes(224)
    assert sizes[15:] == list(range(256, 1025, 64))
    assert capture_sizes(224, 1000)[-2:] == [960, 1000] and capture_sizes(224, 100) == capture_sizes(224)


def test_compilation_settings_capture_mixed_steps_up_to_the_token_budget():
    from colocate.engine.vllm_settings import compilation_settings
    # the streaming preset: 224 sequences, 1,024-token steps -> graphs up to 1,024 tokens
    assert compilation_settings(224, 1024, 2048)["cudagraph_capture_sizes"][-1] == 1024
    # vLLM's default budget (0): up to max_capture_tokens; 0 keeps decode sizes only
    assert compilation_settings(224, 0, 2048)["cudagraph_capture_sizes"][-1] == 2048
    assert compilation_settings(224, 1024, 0)["cudagraph_capture_sizes"] == capture_sizes(224)
    assert "cudagraph_mode" not in compilation_settings(8, 0, 64)  # vLLM's default mode
    assert compilation_settings(8, 0, 64, "FULL")["cudagraph_mode"] == "FULL"
    with pytest.raises(ValueError, match="cudagraph_mode='full'"):
        compilation_settings(8, 0, 64, "full")


def test_engine_settings_from_config(tiny_cfg):
    import dataclasses
    from colocate.envs import env_facts
    facts = env_facts(tiny_cfg)
    assert facts == {"prompt_bound": 64, "requests_per_group": 8}  # the arithmetic env states them
    s = engine_settings(tiny_cfg, num_inference=2, seed=5, **facts)
    assert s.max_num_seqs == (16 // 2) * 8 and s.max_model_len == 128
    assert s.lora_rank == tiny_cfg.lora.rank and s.seed == 5 and s.lora_mode == "slot" and s.update == "drain"
    assert s.validate_grammars is True  # vLLM's own check stays on unless the config turns it off
    # 16 groups on 3 ranks: 6, 5, 5; the engine is sized for the largest share
    assert engine_settings(tiny_cfg, num_inference=3, seed=0, **facts).max_num_seqs == 6 * 8
    # inflight: the oversampled groups stay live, so they count; Diplomacy: seven requests per continuation
    cfg = dataclasses.replace(tiny_cfg, rollout=dataclasses.replace(tiny_cfg.rollout, update="inflight",
                                                                   oversample_groups=2))
    assert engine_settings(cfg, num_inference=2, seed=0, **facts).max_num_seqs == (8 + 2) * 8
    dip = dataclasses.replace(tiny_cfg, env=dataclasses.replace(tiny_cfg.env, name="diplomacy"))
    assert env_facts(dip) == {"prompt_bound": 1536, "requests_per_group": 8 * 7}


def test_engine_args_refused_before_vllm_starts():
    from colocate.engine.vllm_settings import check_engine_args
    check_engine_args("slot")
    check_engine_args("merged")
    with pytest.raises(ValueError, match="lora_mode"):
        check_engine_args("lora")


def test_profiler_settings_trace_the_engine_core_for_a_bounded_number_of_steps():
    from colocate.engine.vllm_settings import profiler_settings
    s = profiler_settings("profiles/run/inference-engine", 40)
    assert s["profiler"] == "torch" and os.path.isabs(s["torch_profiler_dir"])  # vLLM requires an absolute path
    assert s["torch_profiler_dir"].endswith(os.path.join("profiles", "run", "inference-engine"))
    assert s["max_iterations"] == 40 and s["torch_profiler_use_gzip"] and not s["torch_profiler_with_stack"]
    assert not s["torch_profiler_dump_cuda_time_total"]  # no table built mid-batch when the window ends
    with pytest.raises(ValueError, match=">= 1"):
        profiler_settings("d", 0)  # vLLM would read 0 as "no limit"


def test_merged_mode_takes_its_weight_copy_out_of_the_engine_share(tiny_cfg, tiny_tokenizer):
    """lora_mode=merged keeps W0 of every adapted weight beside vLLM's pool: the copy's size comes
    from the adapter's shapes (every adapted base weight, counted on the meta model), and vLLM's
    share shrinks by it plus the worker's 1 GiB headroom."""
    import torch
    from colocate.engine.vllm import lora_spec_for
    from colocate.engine.vllm_settings import MERGED_HEADROOM_BYTES, merged_copy_bytes, merged_memory_share
    from colocate.models import add_lora, build_model
    spec = lora_spec_for(tiny_cfg, tiny_tokenizer)
    with torch.device("meta"):
        model = add_lora(build_model(tiny_cfg.model, tiny_tokenizer, "meta"), tiny_cfg.lora)
    adapted = [m.base_layer.weight for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    assert adapted and merged_copy_bytes(spec.names, spec.shapes, "bfloat16") == sum(2 * w.numel() for w in adapted)
    assert merged_copy_bytes(spec.names, spec.shapes, "float32") == sum(4 * w.numel() for w in adapted)
    # FP8 weights: W0 in e4m3 and the fp32 scratch of the largest fused weight (gate and up of a block)
    mlp = model.base_model.model.model.layers[0].mlp
    largest = mlp.gate_proj.base_layer.weight.numel() + mlp.up_proj.base_layer.weight.numel()
    assert merged_copy_bytes(spec.names, spec.shapes, "bfloat16", "fp8") == sum(w.numel() for w in adapted) \
        + 4 * largest
    gib = 1 << 30
    # the dataset_rollout benchmark's case: 0.95 of an 80 GiB card, a 12 GiB copy -> 0.95 - 13/80
    assert merged_memory_share(0.95, 12 * gib, 80 * gib) == pytest.approx(0.95 - 13 / 80, abs=1e-12)
    assert MERGED_HEADROOM_BYTES == gib
    with pytest.raises(ValueError, match="lora_mode=slot"):
        merged_memory_share(0.2, 12 * gib, 80 * gib)


def test_a_fixed_kv_cache_reaches_vllm_and_zero_leaves_it_to_vllms_profile(tiny_cfg):
    """engine.kv_cache_gib: vLLM's kv_cache_memory_bytes (it then skips its memory profile, which
    counts other processes' allocations as its own); 0 passes nothing, vLLM profiles its share."""
    import dataclasses
    from colocate.engine.vllm_settings import llm_arguments
    from colocate.envs import env_facts
    facts = env_facts(tiny_cfg)
    assert "kv_cache_memory_bytes" not in llm_arguments("/m", engine_settings(tiny_cfg, 1, 0, **facts))
    cfg = dataclasses.replace(tiny_cfg, engine=dataclasses.replace(tiny_cfg.engine, kv_cache_gib=1.5))
    assert llm_arguments("/m", engine_settings(cfg, 1, 0, **facts))["kv_cache_memory_bytes"] == 3 * 2**29


def test_fp8_reaches_vllm_as_online_quantization(tiny_cfg):
    """engine.quantization=fp8: vLLM's `quantization="fp8"` (online FP8 of the bf16 checkpoint); the
    default passes none, so a bf16 engine's arguments are what they were. FP8 weights go with either
    LoRA mode (merged: requantized at each update, `adapter_targets.MergedFp8Adapter`)."""
    import dataclasses
    from colocate.engine.vllm_settings import check_engine_args, llm_arguments
    from colocate.envs import env_facts
    facts = env_facts(tiny_cfg)

    def arguments(**engine):
        cfg = dataclasses.replace(tiny_cfg, engine=dataclasses.replace(tiny_cfg.engine, **engine))
        return llm_arguments("/m", engine_settings(cfg, 1, 0, **facts))
    plain = arguments()
    assert "quantization" not in plain
    fp8 = arguments(quantization="fp8")
    assert fp8["quantization"] == "fp8" and fp8["enable_lora"]
    assert {k: v for k, v in fp8.items() if k != "quantization"} == plain
    check_engine_args("slot", "fp8")
    check_engine_args("merged", "fp8")
    merged = arguments(quantization="fp8", lora_mode="merged")
    assert merged["quantization"] == "fp8" and not merged["enable_lora"]
    with pytest.raises(ValueError, match="quantization='int4'"):
        check_engine_args("slot", "int4")
