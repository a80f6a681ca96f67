"""The vLLM benchmarks on CPU: the session's synthetic workload (`benchmarks/vllm_session.py`) and the
dataset rollout's accounting (`benchmarks/dataset_rollout.py`)."""
import random

import pytest

from tests.test_vllm_grammar import EOS, random_walk


def test_synthetic_workload_shapes(tiny_tokenizer):
    from benchmarks.vllm_session import synthetic_requests
    reqs = synthetic_requests(16, len(tiny_tokenizer), EOS, seed=0)
    assert all(len(r.prompt_ids) == 440 and r.prompt_ids[:300] == reqs[0].prompt_ids[:300] for r in reqs)
    assert reqs[0].constraint is reqs[7].constraint and reqs[8].constraint is not reqs[0].constraint
    rng = random.Random(0)
    assert {len(random_walk(r.constraint, rng)) for r in reqs} == {32}  # 31 order tokens + EOS


def test_dataset_rollout_splits_each_round_into_engine_and_host_time():
    """Tokens/s over all rounds; ms per engine step over the engine's spans; the host work outside
    the engine per round; an unknown or repeated side is refused before any process starts."""
    from types import SimpleNamespace

    from benchmarks.dataset_rollout import run, summarize
    rounds = [{"wall_s": 4.5, "out_tokens": 64000, "engine_s": 4.3, "engine_steps": 500},
              {"wall_s": 4.7, "out_tokens": 64000, "engine_s": 4.4, "engine_steps": 502}]
    s = summarize(rounds)
    assert s["out_tokens_per_s"] == pytest.approx(128000 / 9.2)
    assert s["engine_ms_per_step"] == pytest.approx(1e3 * 8.7 / 1002)
    assert s["engine_steps_per_round"] == 501 and s["outside_engine_s"] == pytest.approx(0.25)
    for sides in ("vllm,theirs", "ours,ours", "", "vllm,ours+nocap"):
        with pytest.raises(SystemExit, match="--sides"):
            run(SimpleNamespace(side="", sides=sides, variant=[]))


def test_dataset_rollout_variants_override_ours_config():
    """Side ours+NAME runs the benchmark's config with the variant's overrides on top; the others
    keep it."""
    from types import SimpleNamespace

    from benchmarks.dataset_rollout import MAX_TOKENS, config
    args = SimpleNamespace(model_path="", shape="qwen2.5-0.5b", data="x.jsonl", questions=16,
                           variant=["nocap:engine.max_capture_tokens=0,engine.max_new_tokens=300"])
    plain, nocap = config(SimpleNamespace(**vars(args), side="ours")), config(SimpleNamespace(**vars(args), side="ours+nocap"))
    assert plain.engine.max_capture_tokens > 0 and plain.engine.max_new_tokens == MAX_TOKENS
    assert nocap.engine.max_capture_tokens == 0 and nocap.engine.max_new_tokens == 300
    assert nocap.model.shape == plain.model.shape == "qwen2.5-0.5b" and nocap.env.data_files == ["x.jsonl"]


def test_dataset_rollout_compares_fp8_sides_by_named_ratios():
    """The FP8 comparison of one run: `--ratios A/B` pairs of its sides (each refused unless both are
    sides); the FP8 variant is ours in slot mode with a correction (the config check refuses FP8
    without one, the variant then names the key); vllm_fp8 is a side of its own."""
    from types import SimpleNamespace

    from benchmarks.dataset_rollout import SIDES, config, parse_ratios
    from colocate.config import ConfigError
    sides = ["ours", "ours+fp8", "vllm", "vllm_fp8"]
    assert "vllm_fp8" in SIDES
    assert parse_ratios("ours+fp8/ours, ours+fp8/vllm_fp8", sides) == [("ours+fp8", "ours"), ("ours+fp8", "vllm_fp8")]
    assert parse_ratios("", sides) == []
    for bad in ("ours+fp8", "ours+fp8/theirs", "ours/ours", "/ours"):
        with pytest.raises(SystemExit, match="--ratios"):
            parse_ratios(bad, sides)
    args = dict(model_path="", shape="qwen2.5-0.5b", data="x.jsonl", questions=16, side="ours+fp8")
    fp8 = config(SimpleNamespace(**args, variant=["fp8:engine.quantization=fp8,engine.lora_mode=slot,loss.tis_cap=2.0"]))
    assert (fp8.engine.quantization, fp8.engine.lora_mode) == ("fp8", "slot")
    spec = "fp8m:engine.quantization=fp8,engine.lora_mode=merged,loss.tis_cap=2.0"  # W0 requantized at each update
    side = config(SimpleNamespace(**{**args, "side": "ours+fp8m"}, variant=[spec]))
    assert (side.engine.quantization, side.engine.lora_mode) == ("fp8", "merged")
    with pytest.raises(ConfigError, match="loss.tis_cap"):
        config(SimpleNamespace(**args, variant=["fp8:engine.quantization=fp8,engine.lora_mode=slot"]))


def test_session_profiles_take_the_engines_precision():
    """`--quantization` of the sync and rollout profiles (the parity part's FP8 gap): parsed with the
    config's choices, FP8 in either LoRA mode."""
    import argparse

    from benchmarks.vllm_session import add_session_args
    parser = argparse.ArgumentParser()
    add_session_args(parser, others="parity")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(["--quantization", "fp8", "--also", "parity"])
    assert (args.quantization, args.lora_mode) == ("fp8", "slot")
    assert parser.parse_args([]).quantization == "none"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int8"])
    merged = parser.parse_args(["--quantization", "fp8", "--lora-mode", "merged"])
    assert (merged.quantization, merged.lora_mode) == ("fp8", "merged")


def test_dataset_rollout_questions_size_both_sides():
    """`--questions N`: N groups of 8 a round in ours' config, and room for all of them in both sides'
    engines (the old script's 256 sequence slots at least)."""
    import argparse
    from types import SimpleNamespace

    from benchmarks.dataset_rollout import QUESTIONS, SAMPLES, add_args, config, engine_sizing
    parser = argparse.ArgumentParser()
    add_args(parser)
    assert parser.parse_args([]).questions == QUESTIONS and parser.parse_args(["--questions", "64"]).questions == 64
    assert engine_sizing(QUESTIONS)["max_num_seqs"] == 256 and engine_sizing(64)["max_num_seqs"] == 64 * SAMPLES
    cfg = config(SimpleNamespace(model_path="", shape="qwen2.5-0.5b", data="x.jsonl", questions=64, side="ours",
                                 variant=[]))
    assert (cfg.rollout.groups_per_step, cfg.rollout.group_size, cfg.engine.max_num_seqs) == (64, SAMPLES, 512)


def test_dataset_rollout_traces_only_the_ours_sides(monkeypatch, tmp_path):
    """`--trace-dir DIR`: each ours side's engine is built with its engine core's profiler aimed at
    DIR/<side>/ for `TRACE_STEPS` steps; the plain vLLM sides are run without it."""
    import argparse
    import json
    import subprocess

    from benchmarks import dataset_rollout
    from colocate.engine.vllm_settings import VLLMSettings
    settings = VLLMSettings()
    assert dataset_rollout.traced(settings, "", "ours") is settings
    traced = dataset_rollout.traced(settings, "/t", "ours+fp8m")
    assert (traced.profile_dir, traced.profile_steps) == ("/t/ours+fp8m", dataset_rollout.TRACE_STEPS)
    commands = []

    def fake_side(cmd, check, env):  # a side's process: its command recorded, a result written
        commands.append(cmd)
        result = {"out_tokens_per_s": 1.0}
        with open(cmd[cmd.index("--result") + 1], "w") as f:
            json.dump(result, f)
    monkeypatch.setattr(subprocess, "run", fake_side)
    parser = argparse.ArgumentParser()
    dataset_rollout.add_args(parser)
    args = parser.parse_args(["--sides", "ours,vllm_fp8,ours+fp8m", "--variant", "fp8m:engine.quantization=fp8",
                              "--trace-dir", str(tmp_path)])
    dataset_rollout.run(args)
    traced_sides = {c[c.index("--side") + 1]: c[c.index("--trace-dir") + 1] if "--trace-dir" in c else None
                    for c in commands}
    assert traced_sides == {"ours": str(tmp_path), "vllm_fp8": None, "ours+fp8m": str(tmp_path)}
