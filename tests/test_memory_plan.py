"""The memory plan of every rank (colocate/gpu_budget.py): its learner estimate against the peaks
measured on GPUs, `micro_batch_tokens: auto`, and `colocate check --gpu-memory` refusing what
cannot fit and passing the shipped presets, on a CPU machine."""
import os

import pytest

from colocate.config import ConfigError, load_config
from colocate.gpu_budget import (AUTO_STEP, AUTO_WITHOUT_GPU, CARDS, GIB, Card, MemoryPlan, ModelShape, learner_parts,
                                 parse_gpu_memory, plan_memory, rank_estimate)
from colocate.preflight import meta_model
from colocate.topology import rank_devices
from tests.conftest import REPO

# max_memory_allocated per learner GPU, 7B shape, LoRA r16 on the 7 projections, packed micro-batches
# (profiles/trainer.md "Memory, and the 80 GB preset", 4 x H200, 2026-11-22):
# (learners, micro_batch_tokens, activation checkpointing, compile) -> GiB
MEASURED_PEAKS = {
    (2, 8192, False, False): 58.9,
    (2, 16384, False, False): 105.8,
    (4, 16384, False, False): 103.7,
    (2, 16384, True, False): 18.5,
    (2, 16384, False, True): 85.6,
    (4, 16384, False, True): 83.2,
}
TOLERANCE = 0.15  # the plan must land within 15 % of a measured peak (the bound), erring high where it errs


@pytest.fixture(scope="module")
def seven_b():
    cfg = load_config(None, {"model": {"shape": "qwen2.5-7b", "dtype": "bfloat16"}})
    return ModelShape.of(cfg, meta_model(cfg))


@pytest.mark.parametrize("key,measured", sorted(MEASURED_PEAKS.items()))
def test_the_learner_estimate_is_within_15_percent_of_the_measured_peak(seven_b, key, measured):
    learners, tokens, ac, compiled = key
    cfg = load_config(None, {"model": {"shape": "qwen2.5-7b"},
                             "learner": {"micro_batch_tokens": tokens, "activation_checkpointing": ac, "compile": compiled}})
    parts = learner_parts(cfg, seven_b, learners, tokens)
    allocated = (rank_estimate(parts) - parts["context"]) / GIB  # the context is outside PyTorch's allocator
    assert abs(allocated - measured) <= TOLERANCE * measured, (allocated, measured)


def test_gpu_memory_takes_sizes_and_card_names():
    assert parse_gpu_memory("80GiB") == 80 * GIB
    assert parse_gpu_memory("80GB") == 80 * 10**9
    assert parse_gpu_memory("79.6GB") == 79_600_000_000  # exactly: no float rounding
    assert parse_gpu_memory("81559MiB") == CARDS["h100"] == parse_gpu_memory("H100")
    with pytest.raises(ConfigError, match="--gpu-memory='lots'"):
        parse_gpu_memory("lots")
    for unitless in ("80", "80g"):  # GB or GiB? 7 % apart: the unit is required
        with pytest.raises(ConfigError, match=r"expected a size with its unit, 80GiB \(2\^30 bytes\) or 80GB"):
            parse_gpu_memory(unitless)


def test_the_plan_says_which_unit_it_read_the_merged_copy_and_the_kv_cache_room(capsys, monkeypatch):
    """80GB is 80e9 bytes (74.5 GiB), and the plan says so; bf16 merged mode adds a copy of the decoder blocks;
    the KV cache gets vLLM's share less the weights, in tokens and sequences of the engine's length."""
    monkeypatch.chdir(REPO)
    bf16 = "--engine.quantization=none"  # the preset samples in FP8 (an FP8 plan: test_an_fp8_engine_plans_...)
    code, err = check(capsys, "--config", "configs/gpu-4.yaml", "--gpu-memory", "80GB", bf16)
    assert code == 0, err
    assert "memory plan (4 GPUs per node of 80GB = 74.5 GiB, GB being 10^9 bytes)" in err
    total = 80 * 10**9
    own, copy = 7_615_616_512 * 2, (7_615_616_512 - 2 * 152_064 * 3_584 - 3_584) * 2  # 7B bf16; its blocks' W0
    pool, weights = int(0.75 * total), own + copy  # gpu_memory_utilization; embeddings and LM head copied never
    assert (f"of which weights {weights / GIB:.1f} = {own / GIB:.1f} + {copy / GIB:.1f}, vLLM's and the decoder "
            "blocks' W0") in err
    per_token = 2 * 28 * 4 * 128 * 2  # K and V, 28 layers, 4 KV heads of 128, bf16
    length = -(-(1536 + 160) // 64) * 64  # Diplomacy's prompt bound and max_new_tokens, rounded up to 64
    tokens = (pool - weights) // per_token
    assert (f"KV cache gets at most {(pool - weights) / GIB:.1f} GiB" in err and f"~{tokens:,} tokens at 56 KiB a token, "
            f"{tokens // length:,} sequences of max_model_len={length}" in err), err
    code, err = check(capsys, "--config", "configs/gpu-4.yaml", "--gpu-memory", "80GB", bf16,
                      "--engine.max_model_len=4096")
    assert f"{tokens // 4096:,} sequences of max_model_len=4096" in err  # the length the engine will have


def test_max_model_len_beyond_the_models_positions_is_refused(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    code, err = check(capsys, "--config", "configs/gpu-4.yaml", "--gpu-memory", "h100", "--engine.max_model_len=131072")
    assert code == 2 and err.strip().splitlines() == [
        "colocate: config error: engine.max_model_len=131072 exceeds the 32768 positions of model.shape=qwen2.5-7b "
        "(max_position_embeddings); set it to at most 32768, or 0 to size it from the workload"]


def test_cpu_ranks_whose_weights_exceed_the_hosts_memory_are_refused(monkeypatch):
    """gpu-4.yaml with engine.kind=hf on CPUs: two engines of the whole 7B model and two learners
    of half of it each, beyond a 24 GiB host, are refused before any process starts."""
    from colocate import gpu_budget
    cfg = load_config(os.path.join(REPO, "configs", "gpu-4.yaml"), {"engine": {"kind": "hf"}}, world_size=4)
    model, roles = meta_model(cfg), ["inference"] * 2 + ["learner"] * 2
    shape = ModelShape.of(cfg, model)
    engine = shape.num_params * 2
    learner = rank_estimate(learner_parts(cfg, shape, 2, 0)) - gpu_budget.CONTEXT_BYTES
    with pytest.raises(ConfigError, match=rf"^4 CPU processes would hold at least {(2 * engine + 2 * learner) / GIB:.1f}"
                                          rf" GiB of weights \(2 engines x {engine / GIB:.1f} GiB, 2 learners x "
                                          rf"{learner / GIB:.1f} GiB of model.shape=qwen2.5-7b\), more than this "
                                          r"host's 24.0 GiB"):
        gpu_budget.check_host_memory(cfg, model, roles, 4, 24 * GIB)
    gpu_budget.check_host_memory(cfg, model, roles, 4, 2 * engine + 2 * learner)  # what fits is not refused


def plan(name: str, world: int, card: str, **learner) -> tuple[object, object]:
    cfg = load_config(os.path.join(REPO, "configs", f"{name}.yaml"), {"learner": learner} if learner else {},
                      world_size=world)
    from colocate.topology import place_roles
    roles = place_roles(cfg, world, world)
    return cfg, plan_memory(cfg, meta_model(cfg), roles, rank_devices(world, world, world),
                            Card(parse_gpu_memory(card), world, card))


def test_auto_takes_the_largest_budget_that_leaves_the_margin(seven_b):
    cfg, memory = plan("gpu-4", 4, "h100")
    tokens = memory.micro_batch_tokens
    assert cfg.learner.micro_batch_tokens == "auto"  # the planner returns what it chose, the config is left alone
    assert isinstance(tokens, int) and tokens % AUTO_STEP == 0
    assert any(f"auto -> {tokens}" in line for line in memory.lines)
    room = 0.9 * CARDS["h100"]
    assert rank_estimate(learner_parts(cfg, seven_b, 2, tokens)) <= room < \
        rank_estimate(learner_parts(cfg, seven_b, 2, tokens + AUTO_STEP))
    _, bigger = plan("gpu-4", 4, "h200")
    assert bigger.micro_batch_tokens > tokens  # the H200's 141 GB hold a larger budget


def test_auto_without_a_card_is_the_fixed_default():
    cfg = load_config(os.path.join(REPO, "configs", "gpu-4.yaml"), world_size=4)
    memory = plan_memory(cfg, meta_model(cfg), ["inference"] * 2 + ["learner"] * 2, None, None)
    assert memory.micro_batch_tokens == AUTO_WITHOUT_GPU and "no GPU" in memory.lines[0]
    assert cfg.learner.micro_batch_tokens == "auto"


def test_the_settings_that_ran_out_of_memory_on_h100s_are_refused_there():
    """gpu-4.yaml as it shipped at 966b654 (16,384 tokens, compiled) ran out of memory in the learner's
    first step on 4 x H100; the plan refuses it there and passes it on H200s, where it ran."""
    with pytest.raises(ConfigError, match=r"cannot hold a learner at 16384 tokens.*lower learner.micro_batch_tokens"):
        plan("gpu-4", 4, "h100", micro_batch_tokens=16384, prefix_sharing="off")
    plan("gpu-4", 4, "h200", micro_batch_tokens=16384, prefix_sharing="off")


def check(capsys, *args: str) -> tuple[int, str]:
    """`colocate check ARGS` in this process -> (exit code, stderr)."""
    from colocate.cli import main
    try:
        code = main(["check", *args])
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def test_check_refuses_a_budget_that_cannot_fit_in_one_line(capsys):
    code, err = check(capsys, "--config", "configs/gpu-4.yaml", "--world-size=4", "--gpu-memory", "80GiB",
                      "--learner.micro_batch_tokens=65536", "--learner.compile=false")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("colocate: config error: GPU 2 (ranks 2) cannot hold a learner")
    assert "learner.micro_batch_tokens" in lines[0] and "GiB of 80.0 GiB" in lines[0]


@pytest.mark.parametrize("name,world", [("gpu-2", 2), ("gpu-4", 4), ("gpu-8", 8), ("gpu-4-gsm8k", 4),
                                        ("gpu-8-gsm8k", 8)])
def test_the_shipped_presets_pass_the_check_for_h100s(capsys, monkeypatch, name, world):
    """The multi-GPU presets (the one-GPU ones: tests/test_shared_gpu.py)."""
    monkeypatch.chdir(REPO)
    code, err = check(capsys, "--config", f"configs/{name}.yaml", "--world-size", str(world), "--gpu-memory", "80GiB")
    assert code == 0, err
    assert f"colocate: memory plan ({world} GPUs per node of 80GiB = 80.0 GiB, GiB being 2^30 bytes)" in err
    assert "micro_batch_tokens auto ->" in err


def test_auto_sizes_a_learner_beside_what_shares_its_gpu(capsys):
    """1 engine + 3 learners on 2 GPUs (round-robin: an engine and a learner on GPU 0, two learners
    on GPU 1): auto takes the budget the fullest GPU holds, and the plan then passes."""
    code, err = check(capsys, "--config", "configs/gpu-4.yaml", "--world-size", "4", "--gpu-memory", "h200",
                      "--gpus-per-node", "2", "--topology.num_inference=1", "--topology.num_learners=3")
    assert code == 0, err
    assert "2 GPUs per node" in err and "ranks 0, 2: an engine" in err


def test_planning_flags_belong_to_check_and_bad_values_are_one_line(capsys):
    from colocate.launch import split_check_flags
    with pytest.raises(ConfigError, match="plan a card for `colocate check`"):
        split_check_flags(["--config", "x.yaml", "--gpu-memory", "h100"])
    with pytest.raises(ConfigError, match="--gpus-per-node: give the card too"):
        split_check_flags(["--check", "--gpus-per-node", "2"])
    with pytest.raises(ConfigError, match=r"learner.micro_batch_tokens: expected int or str, got '\['"):
        load_config(None, {"learner": {"micro_batch_tokens": "["}})


# Parameters of the published bf16 checkpoints (their safetensors' total_size / 2).
PUBLISHED_PARAMS = {"qwen2.5-14b": 14_770_033_664, "qwen2.5-32b": 32_763_876_352}


@pytest.mark.parametrize("shape", sorted(PUBLISHED_PARAMS))
def test_the_14b_and_32b_shapes_are_qwens(shape):
    cfg = load_config(None, {"model": {"shape": shape, "dtype": "bfloat16"}})
    planned = ModelShape.of(cfg, meta_model(cfg))
    assert abs(planned.num_params - PUBLISHED_PARAMS[shape]) <= 1e-3 * PUBLISHED_PARAMS[shape], planned.num_params
    assert (planned.hidden, planned.kv, planned.vocab) == (5120, 8 * 128, 152064)


def test_a_32b_engine_is_refused_on_one_80gb_card_saying_why(capsys, monkeypatch):
    """Merged mode keeps 61 GiB of weights and a copy of their decoder blocks: no share of an H100 holds
    them (one line, pointing at slot mode); slot mode's one copy needs a larger share; a 40 GB card
    needs tensor parallelism. In FP8 (the preset's) the refusal names the quantization too."""
    monkeypatch.chdir(REPO)
    preset = ("--config", "configs/gpu-4.yaml", "--world-size=4", "--model.shape=qwen2.5-32b")
    code, err = check(capsys, *preset, "--gpu-memory", "h100")
    assert code == 2 and "engine.lora_mode=merged, engine.quantization=fp8) plus room for a KV cache" in err, err
    base = (*preset, "--engine.quantization=none")
    code, err = check(capsys, *base, "--gpu-memory", "h100")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    # 61.0 GiB loaded and its decoder blocks' W0 again (58.1: embeddings and LM head are not copied)
    assert "less than its weights (119.2 GiB, engine.lora_mode=merged)" in lines[0]
    assert lines[0].endswith("no share of one card holds them: use engine.lora_mode=slot (one copy of the weights)")
    code, err = check(capsys, *base, "--gpu-memory", "h100", "--engine.lora_mode=slot")
    assert code == 2 and err.strip().endswith("(61.0 GiB, engine.lora_mode=slot) plus room for a KV cache; raise it")
    code, err = check(capsys, *base, "--gpu-memory", "a100-40", "--engine.lora_mode=slot",
                      "--learner.micro_batch_tokens=1024")  # the engine's GPU is planned first
    assert code == 2 and err.strip().endswith("the model needs a tensor-parallel engine, not built yet")


def test_a_14b_learner_fits_beside_another_at_an_auto_budget(capsys, monkeypatch):
    """Two FSDP2 learners of 14B on H100s: each holds half the weights, and the plan finds a budget."""
    monkeypatch.chdir(REPO)
    code, err = check(capsys, "--config", "configs/gpu-4.yaml", "--world-size=4", "--model.shape=qwen2.5-14b",
                      "--gpu-memory", "h100")
    assert code == 0, err
    tokens = int(err.split("micro_batch_tokens auto -> ")[1].split()[0])
    assert tokens >= AUTO_STEP and tokens % AUTO_STEP == 0
    assert f"ranks 2, 3: a learner at {tokens} tokens (weights 13.8," in err  # 14.77 B bf16 parameters / 2


@pytest.mark.parametrize("rank,written", [("0", True), ("1", False)])
def test_rank_0_keeps_the_plans_estimates_in_the_run_dir(monkeypatch, tmp_path, rank, written):
    """The estimates preflight made are what summary.json sets beside the measured peaks: rank 0 of a
    run writes them once it holds the run directory (no second model build); other ranks and
    `--check` write nothing."""
    from colocate import launch, preflight
    monkeypatch.setattr(preflight, "preflight", lambda *a, **k: MemoryPlan([], {"0": 70.1, "1": 64.2}, 4096))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    argv = ["--config", os.path.join(REPO, "configs", "cpu-tiny.yaml"), f"--metrics.run_dir={tmp_path / 'run'}"]
    launch.check_config([*argv, "--check"])
    assert not (tmp_path / "run" / "memory_plan.json").exists()
    launch.check_config(argv)
    path = tmp_path / "run" / "memory_plan.json"
    assert path.exists() == written
    if written:
        from colocate.jsonfile import read_object
        assert read_object(str(path)) == {"0": 70.1, "1": 64.2}


def test_an_fp8_engine_plans_its_blocks_at_one_byte_and_its_kv_cache_in_the_models_dtype(seven_b):
    """engine.quantization fp8: vLLM holds the decoder blocks' weights in e4m3 (one byte), the
    embeddings and LM head in bf16; a cached token keeps the model's dtype (a key and a value of
    4 KV heads x 128 per layer, 28 layers, bf16: 56 KiB) either way."""
    from colocate.gpu_budget import GpuPlan, engine_parts, kv_cache_lines
    cfg = load_config(None, {"model": {"shape": "qwen2.5-7b", "dtype": "bfloat16"}})
    bf16 = engine_parts(cfg, seven_b, 80 * GIB)["of which weights"]
    assert bf16 == seven_b.num_params * 2
    plan = [GpuPlan(gpu=(0, 0), ranks=(0,), roles=("inference",), parts=({"vLLM": 40 * GIB, "of which weights": 0},),
                    micro_batch_tokens=0)]
    per_token = {}
    for quantization in ("none", "fp8"):
        cfg.engine.quantization = quantization
        (line,) = kv_cache_lines(cfg, seven_b, plan)
        per_token[quantization] = int(line.split(" KiB a token")[0].rsplit(" ", 1)[1])
    assert per_token == {"none": 56, "fp8": 56}
    blocks = seven_b.block_params * seven_b.num_layers
    fp8 = engine_parts(cfg, seven_b, 80 * GIB)["of which weights"]
    assert fp8 == bf16 - blocks and 0.5 < (bf16 - blocks) / bf16 < 0.6


def test_an_fp8_merged_engine_plans_w0_at_one_byte_and_its_scratch(seven_b, capsys, monkeypatch):
    """lora_mode merged on FP8 weights keeps W0 in e4m3 (one byte a decoder parameter) and the fp32
    buffer the largest fused weight is requantized in (gate_up at 7B: 2 x 18944 x 3584), not a
    second copy of the weights; the plan says how its weights split."""
    from colocate.gpu_budget import engine_parts
    cfg = load_config(None, {"model": {"shape": "qwen2.5-7b", "dtype": "bfloat16"}, "loss": {"tis_cap": 2.0},
                             "engine": {"quantization": "fp8", "lora_mode": "merged"}})
    blocks = seven_b.block_params * seven_b.num_layers
    own, copy = (seven_b.num_params - blocks) * 2 + blocks, blocks + 4 * 2 * 18944 * 3584
    parts = engine_parts(cfg, seven_b, 80 * GIB)
    assert parts["of which weights"] == own + copy and parts["of which the merged copy"] == copy
    assert 6.5 < copy / GIB < 6.7
    monkeypatch.chdir(REPO)
    code, err = check(capsys, "--config", "configs/gpu-1-7b.yaml", "--gpu-memory", "80GiB", "--gpus-per-node", "1",
                      "--engine.quantization=fp8", "--engine.lora_mode=merged", "--loss.tis_cap=2")
    assert code == 0, err
    assert (f"of which weights {(own + copy) / GIB:.1f} = {own / GIB:.1f} + {copy / GIB:.1f}, vLLM's and W0 in "
            "e4m3 with the fp32 buffer the merge is requantized in") in err, err


def test_engines_sharing_a_gpu_need_a_fixed_kv_cache(capsys, monkeypatch):
    """Two vLLM engines on one GPU start together: each sizing its KV cache by vLLM's start-up memory
    profile would count the other's memory as its own, so the plan refuses them without
    engine.kv_cache_gib, in one line naming the ranks and the key; with it (the preset's) they plan.
    The HF engine sizes nothing at start: no refusal."""
    monkeypatch.chdir(REPO)
    one_gpu = ("--config", "configs/gpu-1-gsm8k.yaml", "--world-size", "3", "--gpus-per-node", "1", "--gpu-memory",
               "80GiB")
    code, err = check(capsys, *one_gpu, "--engine.kv_cache_gib=0")
    lines = [line for line in err.splitlines() if line.startswith("colocate:")]
    assert code == 2 and lines == ["colocate: config error: ranks 0, 1 are 2 engines on GPU 0: they start together, "
                                   "and vLLM's start-up memory profile would count the others' memory as its own; set "
                                   "engine.kv_cache_gib (a fixed KV cache per engine, no profile)"], err
    code, err = check(capsys, *one_gpu)
    assert code == 0, err
    code, err = check(capsys, *one_gpu, "--engine.kv_cache_gib=0", "--engine.kind=hf")
    assert "engines on GPU" not in err, err
