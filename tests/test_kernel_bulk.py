"""The bulk-copy CUDA row kernel (`kernels/cuda_grpo.py`, `grpo_rows_sm90.cu`) against float64.

CPU: which calls it refuses and why, and that the dispatch reports a forced backend it cannot
honour (the kernel itself needs an sm_90 GPU: there is no interpreter for it).
GPU (sm_90+): the same float64 parity as the Triton kernel's tests, at small shapes (one chunk,
a few chunks with a partial one) and at the real vocabulary (chunks held in registers, resident in
the ring and read twice), in place and not, strided rows, more than 2**31 logits, every launch
variant it offers. (The learner's entry against the PyTorch reference,
`test_kernel_triton.test_cuda_entry_triton_equals_torch`, runs this kernel on sm_90: bf16 goes to it.)
"""
import pytest
import torch

from tests.test_kernel_triton import (CASES, OBJECTIVE_CASES, check_kernel_case, check_objective_case, cuda_batch,
                                     float64_chunked, kernel_case, objective_case, rel)

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
requires_sm90 = pytest.mark.skipif(not HAS_SM90, reason="needs an sm_90+ GPU")


def _bf16(num_rows=4, vocab=64, device="cpu"):
    return torch.zeros(num_rows, vocab, dtype=torch.bfloat16, device=device)


def test_unsupported_says_why_on_cpu():
    from colocate.kernels import cuda_grpo

    x = _bf16()
    assert "forward only" in cuda_grpo.unsupported(x, None)
    assert "CUDA" in cuda_grpo.unsupported(x, x)
    with pytest.raises(ValueError, match="reg_chunks"):  # a misspelt key names the nearest one
        cuda_grpo.unsupported(x, x, {"reg_chunk": 4})


def test_forced_bulk_backend_raises_with_the_reason():
    from colocate.kernels.triton_rows import grpo_rows

    x = _bf16()
    args = (torch.zeros(4, dtype=torch.long), torch.ones(4), torch.zeros(4), torch.ones(4), None, x)
    with pytest.raises(ValueError, match="backend 'bulk' cannot take this call: not CUDA"):
        grpo_rows(x, *args, temperature=1.0, eps_low=0.2, eps_high=0.28, beta=0.0, config={"backend": "bulk"})
    with pytest.raises(ValueError, match="backend 'cuda'"):
        grpo_rows(x, *args, temperature=1.0, eps_low=0.2, eps_high=0.28, beta=0.0, config={"backend": "cuda"})


# The Triton tests' bf16 cases with the bulk kernel forced (its launch overrides replace Triton's).
BULK_CASES = [(name, dt, inplace, beta, temperature, {k: v for k, v in extra.items() if k in ("neg_inf", "outlier")})
              for name, dt, inplace, beta, temperature, extra in CASES if dt == "bf16"]


@pytest.mark.gpu
@pytest.mark.timeout(300)
@requires_sm90
@pytest.mark.parametrize("vocab", [1000, 20000, 65536], ids=["one-chunk", "partial-chunk", "held-only"])
@pytest.mark.parametrize("case", BULK_CASES, ids=[c[0] for c in BULK_CASES])
def test_bulk_small_shapes_match_float64(case, vocab):
    name, *args = case
    args[-1] = {**args[-1], "backend": "bulk"}
    check_kernel_case(name, kernel_case(*args, device="cuda", num_rows=301, vocab=vocab, seed=5))


@pytest.mark.gpu
@pytest.mark.timeout(300)
@requires_sm90
@pytest.mark.parametrize("vocab", [1000, 20000], ids=["one-chunk", "partial-chunk"])
@pytest.mark.parametrize("case", [c for c in OBJECTIVE_CASES if c[1] == "bf16"],
                         ids=[c[0] for c in OBJECTIVE_CASES if c[1] == "bf16"])
def test_bulk_objectives_match_float64(case, vocab):
    """The objectives' gradient pass (a per-row dL/dlogp given to the kernel) and the folded
    start-of-batch inputs, with the bulk kernel forced."""
    name, dt, inplace, objective, with_old, _ = case
    check_objective_case(name, objective_case(dt, inplace, objective, with_old, {"backend": "bulk"}, device="cuda",
                                              num_rows=301, vocab=vocab, seed=5))


VARIANTS = [None, {"reg_chunks": 0, "slots": 13}, {"consumer_warps": 8, "reg_chunks": 8}, {"hints": 0},
            {"reg_chunks": 4, "prefetch": 2}]


@pytest.mark.gpu
@pytest.mark.timeout(300)
@requires_sm90
@pytest.mark.parametrize("num_rows,inplace,bulk", [(4096, False, None), (4096, True, None), (14200, True, None)]
                         + [(1024, True, v) for v in VARIANTS[1:]],
                         ids=["4096-copy", "4096-inplace", "14200-inplace-over-2^31-elements"]
                         + [f"variant-{i}" for i in range(1, len(VARIANTS))])
def test_bulk_real_vocab_matches_float64(num_rows, inplace, bulk):
    from colocate.kernels import LossRows, LossSpec
    from colocate.kernels.triton_grpo import grpo_loss_triton

    vocab, beta, temperature = 152064, 0.04, 0.9
    b = cuda_batch(num_rows, vocab, beta, temperature, seed=num_rows + 1)
    kw = dict(temperature=temperature, eps_low=0.2, eps_high=0.28, beta=beta)
    ref_loss, scale, ref_grad = float64_chunked(b, 1024, LossSpec(**kw))
    x = b["logits"].clone().requires_grad_()
    loss, _ = grpo_loss_triton(x, LossRows(b["targets"], b["weights"], b["behaviour"], b["advantages"], b["ref"]),
                               LossSpec(**kw), inplace_backward=inplace, config={"backend": "bulk", "bulk": bulk})
    loss.backward()
    assert float((loss.detach().double() - ref_loss).abs() / scale) <= 1e-2
    assert rel(x.grad, ref_grad) <= 1e-2
    assert torch.equal(x.grad[b["weights"] == 0], torch.zeros_like(x.grad[b["weights"] == 0]))


@pytest.mark.gpu
@pytest.mark.timeout(300)
@requires_sm90
def test_bulk_strided_rows_and_auto_dispatch():
    """Rows with a padded stride (a view), the default backend choosing the bulk kernel, and a
    vocabulary it refuses (not a multiple of 8) falling back to Triton with the same values."""
    from colocate.kernels import cuda_grpo
    from colocate.kernels.triton_rows import grpo_rows

    num_rows, vocab = 512, 152064
    b = cuda_batch(num_rows, vocab, 0.04, 1.0, seed=11)
    kw = dict(temperature=1.0, eps_low=0.2, eps_high=0.28, beta=0.04)
    padded = torch.zeros(num_rows, vocab + 64, dtype=torch.bfloat16, device="cuda")
    view = padded[:, :vocab]
    view.copy_(b["logits"])
    assert cuda_grpo.unsupported(view, view) is None
    args = (b["targets"], b["weights"], b["behaviour"], b["advantages"], b["ref"])
    g_triton = torch.empty_like(b["logits"])
    rows_triton = grpo_rows(b["logits"], *args, g_triton, config={"backend": "triton"}, **kw)
    rows_auto = grpo_rows(view, *args, view, **kw)  # in place over the strided view
    assert torch.allclose(rows_auto, rows_triton, rtol=1e-4, atol=1e-6)
    assert rel(view, g_triton) <= 1e-3
    assert torch.equal(padded[:, vocab:], torch.zeros_like(padded[:, vocab:]))  # the padding is untouched

    odd = b["logits"][:, : vocab - 3].contiguous()
    assert "multiple of 8" in cuda_grpo.unsupported(odd, odd)
    g_auto, g_ref = torch.empty_like(odd), torch.empty_like(odd)
    args = (b["targets"].clamp(max=vocab - 4), *args[1:])
    rows_auto = grpo_rows(odd, *args, g_auto, **kw)
    rows_ref = grpo_rows(odd, *args, g_ref, config={"backend": "triton"}, **kw)
    assert torch.equal(rows_auto, rows_ref) and torch.equal(g_auto, g_ref)


def test_every_launch_knob_is_a_macro_of_the_source():
    """cuda_grpo turns each DEFAULT_CONFIG key into a #define; a key the source never reads would be
    a knob that silently does nothing (and the source's own defaults must not disagree)."""
    import re

    from colocate.kernels import cuda_grpo

    source = cuda_grpo._SOURCE.read_text()
    assert "grpo_rows_bulk(" in source
    for key in cuda_grpo.DEFAULT_CONFIG:
        assert re.search(rf"\b{key.upper()}\b", source.split("#ifndef", 1)[-1]), key
    for key, default in re.findall(r"#ifndef (\w+)\n#define \1 (\d+)", source):
        assert cuda_grpo.DEFAULT_CONFIG[key.lower()] == int(default), key
