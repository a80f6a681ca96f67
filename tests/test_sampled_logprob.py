"""The sampled token's log-prob and rank (`colocate.kernels.sampled_logprob`) and its place in
vLLM's sampler (`colocate.engine.vllm_logprobs`).

The kernel runs under Triton's interpreter in a subprocess (the interpreter is chosen when
`triton.jit` decorates the kernel, so it must be on before the kernel module is imported) and,
on CUDA, compiled at the real shape; both against float64 from the same float32 logits, and on
CUDA against vLLM's own `compute_topk_logprobs` where vLLM is installed.

Tolerance, from the arithmetic (eps = 2**-24, float32's relative rounding):
  * each exponential exp(x - m): the argument rounds by eps |x - m| <= 2 eps max|x|, and the
    GPU's approximate exp adds up to 2 eps relative (PTX ex2.approx: 2 ulp);
  * the sum: Triton adds each thread's BLOCK / (32 * 8 warps) = 16 values in sequence, then a tree
    over the 256 threads (8 levels), then the fold over the row's blocks (log2 of their number):
    at most (16 + 8 + log2(V / BLOCK) + 1) eps relative, and its log that much absolutely;
  * the max, the log and the two subtractions: 4 roundings of at most max|x| + log(V).
vLLM's own sums each thread's 149 values of a 152,064-wide row in sequence (blocks of 1,024 over
128 threads): its bound has V / 1,024 in place of 16 (`vllm_tolerance`).
Ranks are counts of the same float32 comparisons: exact.
"""
import json
import math
import os
import sys
import types

import pytest
import torch

from colocate.kernels.sampled_logprob import BLOCK, sampled_logprob_reference
from tests.conftest import run_interpreted

EPS = 2.0 ** -24


def tolerance(logits: torch.Tensor, sequential: float = BLOCK / 256) -> float:
    finite = logits[torch.isfinite(logits)]
    largest = float(finite.abs().max())
    vocab = logits.shape[1]
    summed = sequential + 8 + math.log2(max(vocab / BLOCK, 1)) + 1
    return (summed + 2) * EPS + 2 * EPS * largest + 4 * EPS * (largest + math.log(vocab))


def vllm_tolerance(logits: torch.Tensor) -> float:
    return tolerance(logits, sequential=math.ceil(logits.shape[1] / 1024))


def float64_truth(logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.double()
    chosen = x.gather(1, ids.view(-1, 1))
    return (chosen - torch.logsumexp(x, dim=-1, keepdim=True)).squeeze(1), (x >= chosen).sum(-1)


def cases(device: str = "cpu") -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Rows of float32 logits (vLLM hands the sampler's float32 copy) and a sampled id per row."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, (rows, vocab, scale) in {"one_block": (3, 1000, 3.0), "ragged_last_block": (4, 3 * BLOCK + 17, 5.0),
                                       "wide_logits": (2, 2 * BLOCK, 40.0)}.items():
        x = torch.randn(rows, vocab, generator=g) * scale
        out[name] = (x, torch.randint(0, vocab, (rows,), generator=g))
    masked = torch.full((3, 2 * BLOCK + 5), float("-inf"))  # a grammar's mask: blocks of only -inf
    masked[0, [1, BLOCK + 2, 2 * BLOCK + 4]] = torch.tensor([0.5, -1.0, 2.0])
    masked[1, :BLOCK] = torch.randn(BLOCK, generator=g)
    masked[2, 7] = 1.0  # one allowed token: log-prob 0, rank 1
    out["masked"] = (masked, torch.tensor([BLOCK + 2, 10, 7]))
    ties = torch.zeros(2, BLOCK + 9)
    ties[:, ::3] = 1.0
    out["ties"] = (ties, torch.tensor([3, 1]))  # rank counts every logit at or above the sampled one
    # a sampled id the mask had ruled out (a NaN row upstream): log-prob -inf, rank V (not the padding)
    out["sampled_masked"] = (masked[:1].clone(), torch.tensor([5]))
    out["no_rows"] = (torch.zeros(0, 100), torch.zeros(0, dtype=torch.long))
    return {k: (x.to(device), i.to(device)) for k, (x, i) in out.items()}


def check(name: str, logits, ids, logprobs, ranks) -> None:
    truth_lp, truth_rank = float64_truth(logits.cpu(), ids.cpu())
    assert logprobs.dtype == torch.float32 and ranks.dtype == torch.int64, name
    assert logprobs.shape == ranks.shape == ids.shape, name
    ours = logprobs.cpu().double()
    assert torch.equal(torch.isneginf(ours), torch.isneginf(truth_lp)), name
    finite = torch.isfinite(truth_lp)
    if finite.any():
        assert float((ours[finite] - truth_lp[finite]).abs().max()) <= tolerance(logits.cpu()), name
    assert torch.equal(ranks.cpu(), truth_rank), name


def test_reference_matches_float64():
    for name, (logits, ids) in cases().items():
        check(name, logits, ids, *sampled_logprob_reference(logits, ids))


def test_masked_single_token_is_certain(interpreted):
    logits, ids = cases()["masked"]
    for logprobs, ranks in (sampled_logprob_reference(logits, ids), interpreted["masked"]):
        assert logprobs[2] == 0 and ranks[2] == 1  # exp(0) / exp(0): exact in any float
    assert interpreted["sampled_masked"][1].tolist() == [logits.shape[1]]


@pytest.fixture(scope="module")
def interpreted():
    return {k: (torch.tensor(lp, dtype=torch.float32), torch.tensor(r, dtype=torch.int64))
            for k, (lp, r) in json.loads(run_interpreted(__file__)).items()}


@pytest.mark.parametrize("name", list(cases()))
def test_interpreted_kernel_matches_float64(interpreted, name):
    logits, ids = cases()[name]
    check(name, logits, ids, *interpreted[name])


# ----------------------------------------------------------------------------- in vLLM's sampler

def fake_vllm(monkeypatch, with_sampler: bool = True) -> types.SimpleNamespace:
    """Stand-ins for vllm.v1.outputs (LogprobsTensors) and the V2 sampler module."""
    outputs = types.ModuleType("vllm.v1.outputs")
    outputs.LogprobsTensors = lambda **kw: types.SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm.v1.outputs", outputs)
    calls = []
    sampler = types.ModuleType("vllm.v1.worker.gpu.sample.sampler")
    sampler.compute_topk_logprobs = lambda *a, **kw: calls.append((a, kw)) or "vllm's"
    if with_sampler:
        monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu.sample.sampler", sampler)
    else:
        monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu.sample.sampler", None)  # import fails
    return types.SimpleNamespace(sampler=sampler, calls=calls)


def test_install_takes_sampled_only_requests_and_hands_on_the_rest(monkeypatch):
    from colocate.engine import vllm_logprobs
    fake = fake_vllm(monkeypatch)
    monkeypatch.setattr(vllm_logprobs, "CALLS", {"ours": 0, "vllm": 0})
    v2 = "vllm.v1.worker.gpu.model_runner"
    assert vllm_logprobs.install("vllm.v1.worker.gpu_model_runner") == "vllm"  # the V1 runner: left alone
    assert not hasattr(fake.sampler.compute_topk_logprobs, "colocate_original")
    assert vllm_logprobs.install(v2) == "ours"
    patched = fake.sampler.compute_topk_logprobs
    assert vllm_logprobs.install(v2) == "ours" and fake.sampler.compute_topk_logprobs is patched  # not wrapped twice
    logits, ids = cases()["ragged_last_block"]
    out = patched(logits, 0, ids, [0, 1, 2, 3, 4], logprob_token_ids_state=None, max_per_req_token_ids=0)
    truth_lp, truth_rank = float64_truth(logits, ids)
    assert torch.equal(out.logprob_token_ids, ids.unsqueeze(-1)) and out.logprobs.shape == (4, 1)
    assert float((out.logprobs.squeeze(1).double() - truth_lp).abs().max()) <= tolerance(logits)
    assert torch.equal(out.selected_token_ranks, truth_rank) and out.cu_num_generated_tokens == [0, 1, 2, 3, 4]
    assert fake.calls == []
    # top-k log-probs or custom token ids: vLLM's own, with the same arguments
    assert patched(logits, 5, ids, None, max_per_req_token_ids=0) == "vllm's"
    assert patched(logits, 0, ids, None, max_per_req_token_ids=2) == "vllm's"
    assert [c[0][1] for c in fake.calls] == [5, 0] and fake.calls[1][1] == {"max_per_req_token_ids": 2}
    # a call this wrapper was not written for (another argument): vLLM's own, untouched
    assert patched(logits, 0, ids, None, logits_mode="raw") == "vllm's"
    assert patched(logits, 0, ids, None, "extra") == "vllm's" and len(fake.calls) == 4
    assert vllm_logprobs.calls() == {"ours": 1, "vllm": 4}  # what the worker reports (colocate_logprob_calls)


def test_install_without_a_v2_sampler_leaves_vllm_alone(monkeypatch):
    from colocate.engine import vllm_logprobs
    fake_vllm(monkeypatch, with_sampler=False)
    assert vllm_logprobs.install("vllm.v1.worker.gpu.model_runner") == "vllm"


# ----------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernel_matches_float64_and_vllm():
    from colocate.kernels.sampled_logprob import sampled_logprob
    for name, (logits, ids) in cases("cuda").items():
        check(name, logits, ids, *sampled_logprob(logits, ids))
    g = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(128, 152064, device="cuda", generator=g) * 4  # a decode step at the Qwen2.5 vocab
    ids = torch.randint(0, 152064, (128,), device="cuda", generator=g)
    logprobs, ranks = sampled_logprob(logits, ids)
    check("qwen_vocab", logits, ids, logprobs, ranks)
    try:
        from vllm.v1.worker.gpu.sample.logprob import compute_topk_logprobs
    except ImportError:
        pytest.skip("the kernel matched float64; vLLM is not installed to compare with its function")
    theirs = compute_topk_logprobs(logits, 0, ids)
    assert torch.equal(theirs.selected_token_ranks, ranks)
    assert float((theirs.logprobs.squeeze(1) - logprobs).abs().max()) <= tolerance(logits) + vllm_tolerance(logits)


if __name__ == "__main__":  # the interpreter subprocess
    from colocate.kernels.sampled_logprob import sampled_logprob
    assert os.environ.get("TRITON_INTERPRET") == "1"
    result = {}
    for name, (logits, ids) in cases().items():
        lp, r = sampled_logprob(logits, ids)
        result[name] = (lp.tolist(), r.tolist())
    print(json.dumps(result))
