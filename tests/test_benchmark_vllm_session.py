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
    args = SimpleNamespace(model_path="", shape="qwen2.5-0.5b", data="x.jsonl",
                           variant=["nocap:engine.max_capture_tokens=0,engine.max_new_tokens=300"])
    plain, nocap = config(SimpleNamespace(**vars(args), side="ours")), config(SimpleNamespace(**vars(args), side="ours+nocap"))
    assert plain.engine.max_capture_tokens > 0 and plain.engine.max_new_tokens == MAX_TOKENS
    assert nocap.engine.max_capture_tokens == 0 and nocap.engine.max_new_tokens == 300
    assert nocap.model.shape == plain.model.shape == "qwen2.5-0.5b" and nocap.env.data_files == ["x.jsonl"]
