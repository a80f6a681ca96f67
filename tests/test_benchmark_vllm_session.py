"""The vLLM benchmark session's synthetic workload (`benchmarks/vllm_session.py`), on CPU."""
import random

from tests.test_vllm_grammar import EOS, random_walk


def test_synthetic_workload_shapes(tiny_tokenizer):
    from benchmarks.vllm_session import synthetic_requests
    reqs = synthetic_requests(16, len(tiny_tokenizer), EOS, seed=0)
    assert all(len(r.prompt_ids) == 440 and r.prompt_ids[:300] == reqs[0].prompt_ids[:300] for r in reqs)
    assert reqs[0].constraint is reqs[7].constraint and reqs[8].constraint is not reqs[0].constraint
    rng = random.Random(0)
    assert {len(random_walk(r.constraint, rng)) for r in reqs} == {32}  # 31 order tokens + EOS
