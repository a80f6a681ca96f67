"""The memory plan of every rank (colocate/gpu_budget.py): its learner estimate against the peaks
measured on GPUs, `micro_batch_tokens: auto`, and `colocate check --gpu-memory` refusing what
cannot fit and passing the shipped presets, on a CPU machine."""
import os

import pytest

from colocate.config import ConfigError, load_config
from colocate.gpu_budget import (AUTO_STEP, AUTO_WITHOUT_GPU, CARDS, GIB, Card, ModelShape, learner_parts, parse_gpu_memory,
                                 plan_memory, rank_estimate)
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
    assert parse_gpu_memory("81559MiB") == CARDS["h100"] == parse_gpu_memory("H100")
    with pytest.raises(ConfigError, match="--gpu-memory='lots'"):
        parse_gpu_memory("lots")


def plan(name: str, world: int, card: str, **learner) -> tuple[object, list[str]]:
    cfg = load_config(os.path.join(REPO, "configs", f"{name}.yaml"), {"learner": learner} if learner else {},
                      world_size=world)
    from colocate.topology import place_roles
    roles = place_roles(cfg, world, world)
    return cfg, plan_memory(cfg, meta_model(cfg), roles, rank_devices(world, world, world),
                            Card(parse_gpu_memory(card), world, card)).lines


def test_auto_takes_the_largest_budget_that_leaves_the_margin(seven_b):
    cfg, lines = plan("gpu-4", 4, "h100")
    tokens = cfg.learner.micro_batch_tokens
    assert isinstance(tokens, int) and tokens % AUTO_STEP == 0
    assert any(f"auto -> {tokens}" in line for line in lines)
    room = 0.9 * CARDS["h100"]
    assert rank_estimate(learner_parts(cfg, seven_b, 2, tokens)) <= room < \
        rank_estimate(learner_parts(cfg, seven_b, 2, tokens + AUTO_STEP))
    bigger, _ = plan("gpu-4", 4, "h200")
    assert bigger.learner.micro_batch_tokens > tokens  # the H200's 141 GB hold a larger budget


def test_auto_without_a_card_is_the_fixed_default():
    cfg = load_config(os.path.join(REPO, "configs", "gpu-4.yaml"), world_size=4)
    lines = plan_memory(cfg, meta_model(cfg), ["inference"] * 2 + ["learner"] * 2, None, None).lines
    assert cfg.learner.micro_batch_tokens == AUTO_WITHOUT_GPU and "no GPU" in lines[0]


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
    assert f"colocate: memory plan (80GiB, {world} per node, 80.0 GiB a GPU)" in err
    assert "micro_batch_tokens auto ->" in err


def test_auto_sizes_a_learner_beside_what_shares_its_gpu(capsys):
    """1 engine + 3 learners on 2 GPUs (round-robin: an engine and a learner on GPU 0, two learners
    on GPU 1): auto takes the budget the fullest GPU holds, and the plan then passes."""
    code, err = check(capsys, "--config", "configs/gpu-4.yaml", "--world-size", "4", "--gpu-memory", "h200",
                      "--gpus-per-node", "2", "--topology.num_inference=1", "--topology.num_learners=3")
    assert code == 0, err
    assert "2 per node" in err and "ranks 0, 2: an engine" in err


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
    """Merged mode keeps two copies of 61 GiB of weights: no share of an H100 holds them (one line,
    pointing at slot mode); slot mode's one copy needs a larger share; a 40 GB card needs tensor parallelism."""
    monkeypatch.chdir(REPO)
    base = ("--config", "configs/gpu-4.yaml", "--world-size=4", "--model.shape=qwen2.5-32b")
    code, err = check(capsys, *base, "--gpu-memory", "h100")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "less than its weights (122.1 GiB, engine.lora_mode=merged)" in lines[0]
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
    monkeypatch.setattr(preflight, "preflight", lambda *a, **k: {"0": 70.1, "1": 64.2})
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
