"""Parity of the Triton GRPO loss with a float64 formula.

Two tiers:
  * CPU: the kernel runs under Triton's interpreter at small shapes (N=37, V=1000). The
    interpreter is chosen when `triton.jit` decorates the kernel, so it must be switched on
    before `colocate.kernels.triton_rows` is imported in a process; another test may already
    have imported it in the pytest process. So this module runs itself as a script in a
    subprocess with TRITON_INTERPRET=1 (all cases, one process, JSON out), and the tests
    assert on that output.
  * GPU (skipped without CUDA): the same cases compiled, then real shapes (V=152064 bf16), more
    than 2**31 logits, and `grpo_loss(impl="triton")` against `impl="torch"` per norm mode and
    per policy objective.
Every case is checked against the float64 oracle of `tests/loss_oracle.py` (GRPO and the policy
objectives: GSPO, decoupled, TIS, MIS, `OBJECTIVE_CASES`) in both tiers, and `token_logprobs` (the
forward-only pass) against float64 log-probs.

Errors are relative: ||ours - ref|| / ||ref|| for d(logits); for the loss,
|ours - ref| / sum_t |w_t l_t| (the sum of the magnitudes it adds up, so a loss that cancels to
near zero does not turn rounding into a large relative error).
"""
import os

if __name__ == "__main__":  # the interpreter subprocess: before anything can import triton
    os.environ["TRITON_INTERPRET"] = "1"

import json
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


# ----------------------------------------------------------------------------- float64 oracle

def oracle(b, spec, seq_ids=None, old=None):
    """`tests/loss_oracle.py` on a batch of `make_batch` / `objective_inputs` -> its `Float64Loss`."""
    from colocate.kernels import LossRows
    from tests.loss_oracle import loss_float64
    rows = LossRows(b["targets"], b["weights"], b["behaviour"], b["advantages"], b["ref"], seq_ids, old)
    return loss_float64(b["logits"], rows, spec)


def rel(a, b, chunk=1024):
    """||a - b|| / ||b|| in float64, a row chunk at a time (bounded memory at real shapes)."""
    num = den = 0.0
    for ca, cb in zip(a.split(chunk), b.split(chunk)):
        ca, cb = ca.double(), cb.double()
        num += float(((ca - cb) ** 2).sum())
        den += float((cb ** 2).sum())
    return (num / max(den, 1e-300)) ** 0.5


def stats_error(stats, ref_stats):
    return max(abs(float(stats[k]) - float(ref_stats[k])) / max(1.0, abs(float(ref_stats[k]))) for k in ref_stats)


# ----------------------------------------------------------------------------- random inputs

def make_batch(num_rows, vocab, dtype, *, temperature, beta, seed, device, neg_inf=False, outlier=False):
    """Fresh random inputs: 20% masked rows, ratios spread around 1 so that some tokens clip."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(num_rows, vocab, generator=g) * 3).to(dtype)
    if neg_inf:  # a restricted vocabulary pads with -inf (never at the target)
        logits[:, : vocab // 3] = float("-inf")
    if outlier:  # every third row: one logit far above the first block's (pass 1 overflows, falls back)
        logits[::3, -7] = 150.0
    targets = torch.randint(vocab // 3 if neg_inf else 0, vocab, (num_rows,), generator=g)
    mask = (torch.rand(num_rows, generator=g) > 0.2).float()
    weights = mask / mask.sum().clamp(min=1)
    exact = torch.log_softmax(logits.double() / temperature, -1).gather(1, targets[:, None]).squeeze(1)
    behaviour = (exact + 0.3 * torch.randn(num_rows, generator=g, dtype=torch.float64)).float()
    advantages = torch.randn(num_rows, generator=g)
    ref = (exact + 0.2 * torch.randn(num_rows, generator=g, dtype=torch.float64)).float() if beta > 0 else None
    to = lambda t: None if t is None else t.to(device)
    return dict(logits=to(logits), targets=to(targets), weights=to(weights), behaviour=to(behaviour),
                advantages=to(advantages), ref=to(ref))


# Each case: (name, dtype, inplace, beta, temperature, launch overrides). The matrix runs the
# default launch (refmax pass 1, register prefetch in both passes) with block_v=256, so V=1000
# is four blocks with a partial last one, and num_programs=5, so each persistent program walks
# several rows (the GPU default: one program per SM). The variants cover the other reductions,
# pipelined loads, one block per row, and -inf logits.
MATRIX = {"block_v": 256, "num_programs": 5}
CASES = []
for dt in ("fp32", "bf16"):
    for inplace in (False, True):
        for beta, temperature in ((0.0, 1.0), (0.04, 0.7)):
            CASES.append((f"{dt}-{'inplace' if inplace else 'copy'}-beta{beta}-T{temperature}",
                          dt, inplace, beta, temperature, MATRIX))
CASES += [
    ("bf16-copy-beta0.04-T1.0-oneblock", "bf16", False, 0.04, 1.0, {}),
    ("fp32-inplace-beta0.04-T1.3-neginf", "fp32", True, 0.04, 1.3, {**MATRIX, "neg_inf": True}),
    ("fp32-inplace-beta0.04-T1.3-neginf-lanewise", "fp32", True, 0.04, 1.3,
     {**MATRIX, "neg_inf": True, "group": 1, "stages": 0}),
    ("fp32-inplace-beta0.04-T0.7-blockwise-prefetch", "fp32", True, 0.04, 0.7, {**MATRIX, "group": 0, "stages": 0}),
    ("bf16-copy-beta0.04-T0.7-group16-prefetch", "bf16", False, 0.04, 0.7, {"block_v": 128, "group": 16, "stages": 0}),
    ("bf16-inplace-beta0.04-T0.7-outlier", "bf16", True, 0.04, 0.7, {**MATRIX, "outlier": True}),
    ("fp32-copy-beta0.04-T1.0-outlier-prefetch", "fp32", False, 0.04, 1.0, {**MATRIX, "outlier": True, "stages": 0}),
    ("bf16-inplace-beta0.04-T0.7-online", "bf16", True, 0.04, 0.7, {**MATRIX, "pass1": "online"}),
    ("bf16-inplace-beta0.04-T0.7-prefetch-pass1", "bf16", True, 0.04, 0.7, {**MATRIX, "stages": 0, "stages_pass2": 3}),
    ("fp32-copy-beta0.0-T1.0-prefetch-pass2", "fp32", False, 0.0, 1.0, {**MATRIX, "stages": 3, "stages_pass2": 0}),
    ("bf16-copy-beta0.04-T1.0-prefetch-small-vocab", "bf16", False, 0.04, 1.0, {"block_v": 2048, "stages": 0}),
    # V a multiple of the block (no tail); one full block plus a tail, register prefetch in both passes
    ("fp32-inplace-beta0.04-T0.7-no-tail", "fp32", True, 0.04, 0.7, {"block_v": 256, "num_programs": 5, "vocab": 1024}),
    ("bf16-inplace-beta0.04-T1.0-one-full-block-prefetch", "bf16", True, 0.04, 1.0,
     {"block_v": 512, "num_programs": 5, "stages": 0, "stages_pass2": 0}),
    ("fp32-copy-beta0.04-T1.3-neginf-online", "fp32", False, 0.04, 1.3, {**MATRIX, "neg_inf": True, "pass1": "online"}),
    ("bf16-inplace-beta0.04-T0.7-pipelined", "bf16", True, 0.04, 0.7, {**MATRIX, "stages": 4}),
]


def kernel_case(dt, inplace, beta, temperature, extra, *, device, num_rows=37, vocab=1000, seed=0):
    """Run one case; return its errors (plain floats)."""
    from colocate.kernels import LossRows, LossSpec
    from colocate.kernels.triton_grpo import grpo_loss_triton

    extra = {"backend": "triton", **extra}  # this file tests the Triton row kernel (test_kernel_bulk: the other)
    neg_inf, outlier = extra.pop("neg_inf", False), extra.pop("outlier", False)
    vocab = extra.pop("vocab", vocab)
    b = make_batch(num_rows, vocab, DTYPES[dt], temperature=temperature, beta=beta, seed=seed, device=device,
                   neg_inf=neg_inf, outlier=outlier)
    kw = dict(temperature=temperature, eps_low=0.2, eps_high=0.28, beta=beta)
    expected = oracle(b, LossSpec(**kw))
    ref_loss, ref_grad, scale, ref_stats = expected.loss, expected.grad, expected.scale, expected.stats
    x = b["logits"].clone().requires_grad_()
    rows = LossRows(b["targets"], b["weights"], b["behaviour"], b["advantages"], b["ref"])
    loss, stats = grpo_loss_triton(x, rows, LossSpec(**kw), inplace_backward=inplace, config=extra or None)
    (2.0 * loss).backward()  # grad_output != 1 exercises the scaling path
    grad = x.grad / 2.0
    masked = b["weights"] == 0
    # Forward only (under no_grad): no gradient written, logits untouched even when in place was asked for.
    y = b["logits"].clone().requires_grad_()
    loss_nograd = loss.detach()
    if inplace:
        with torch.no_grad():
            loss_nograd, _ = grpo_loss_triton(y, rows, LossSpec(**kw), inplace_backward=True, config=extra or None)
    return {
        "loss": float((loss.detach().double() - ref_loss).abs() / scale),
        "grad": rel(grad, ref_grad),
        "grad_dtype_ok": float(x.grad.dtype == b["logits"].dtype),
        "grad_masked_rows_max": float(grad[masked].abs().max()) if masked.any() else 0.0,
        "finite": float(torch.isfinite(grad).all()),
        "stats": stats_error(stats, ref_stats),
        "loss_nograd": float((loss_nograd.double() - ref_loss).abs() / scale),
        "nograd_untouched": float(torch.equal(y.detach(), b["logits"])),
    }


# Objectives beyond GRPO (tests/loss_oracle.py): (name, dtype, inplace, objective, with start-of-batch
# log-probs, launch overrides). Sequence ratios and TIS/MIS against the current policy run the two-pass
# path (forward-only LOGP, then d(logits) from a per-row coefficient); with start-of-batch log-probs
# and a token ratio the one fused pass runs on folded inputs.
OBJECTIVE_CASES = [
    ("fp32-copy-gspo", "fp32", False, {"ratio_level": "sequence"}, False, MATRIX),
    ("fp32-inplace-gspo-decoupled", "fp32", True, {"ratio_level": "sequence"}, True, MATRIX),
    ("fp32-copy-tis", "fp32", False, {"tis_cap": 1.5}, False, MATRIX),
    ("fp32-inplace-mis", "fp32", True, {"mis_threshold": 0.2}, False, MATRIX),
    ("fp32-copy-decoupled-folded", "fp32", False, {}, True, MATRIX),
    ("fp32-inplace-tis-mis-decoupled-folded", "fp32", True, {"tis_cap": 1.5, "mis_threshold": 0.2}, True, MATRIX),
    ("bf16-inplace-gspo-tis-mis", "bf16", True, {"ratio_level": "sequence", "tis_cap": 1.5, "mis_threshold": 0.2},
     False, MATRIX),
    ("bf16-copy-decoupled-folded", "bf16", False, {"tis_cap": 1.5}, True, {}),
    # The row scale deferred to the caller (kernels.deferred): one pass writes d logp / d(logits); the
    # effective gradient is that times the returned scale.
    ("fp32-copy-gspo-deferred", "fp32", False, {"ratio_level": "sequence"}, False, MATRIX),
    ("fp32-inplace-tis-mis-deferred", "fp32", True, {"tis_cap": 1.5, "mis_threshold": 0.2}, False, MATRIX),
    ("bf16-inplace-gspo-decoupled-deferred", "bf16", True, {"ratio_level": "sequence"}, True, MATRIX),
    # The dual clip (loss.clip_ratio_c) is not in the row kernel: it takes the exact per-row path,
    # two passes here, one with the deferred row scale (what the learner runs).
    ("fp32-copy-dual-clip", "fp32", False, {"clip_ratio_c": 1.5}, False, MATRIX),
    ("fp32-copy-dual-clip-decoupled-deferred", "fp32", False, {"clip_ratio_c": 1.5}, True, MATRIX),
    ("bf16-inplace-dual-clip-deferred", "bf16", True, {"clip_ratio_c": 1.5}, False, MATRIX),
]


def objective_case(dt, inplace, objective, with_old, extra, *, device, num_rows=37, vocab=1000, seed=0,
                   deferred=False):
    """One objective through `grpo_loss_triton` (or `deferred_loss`, its row scale applied here)
    against the float64 formula -> errors (as kernel_case)."""
    from colocate.kernels import LossRows, LossSpec, Objective
    from colocate.kernels.deferred import deferred_loss
    from colocate.kernels.triton_grpo import grpo_loss_triton
    from tests.loss_oracle import objective_inputs

    b = {k: v.to(device) for k, v in objective_inputs(num_rows, vocab, DTYPES[dt], seed=seed, temperature=0.7).items()}
    old = b["old"] if with_old else None
    kw = dict(temperature=0.7, eps_low=0.03 if objective.get("ratio_level") else 0.2,
              eps_high=0.04 if objective.get("ratio_level") else 0.28, beta=0.04)
    spec = LossSpec(Objective(**objective), **kw)
    expected = oracle(b, spec, b["seq_ids"], old)
    ref_loss, ref_grad = expected.loss, expected.grad
    x = b["logits"].clone().requires_grad_()
    scale = torch.full((num_rows,), float("nan"), device=device)  # every row must be written
    rows = LossRows(b["targets"], b["weights"], b["behaviour"], b["advantages"], b["ref"], b["seq_ids"], old)
    config = {"backend": "triton", **extra}

    def loss_fn(logits, **more):
        if deferred:
            return deferred_loss(logits, rows, spec, row_scale=scale, fused=True, config=config, **more)
        return grpo_loss_triton(logits, rows, spec, config=config, **more)
    loss, stats = loss_fn(x, inplace_backward=inplace)
    (2.0 * loss).backward()
    grad = x.grad / 2.0
    if deferred:  # what the caller's lm_head input applies (kernels.deferred)
        grad = (grad.float() * scale[:, None]).to(grad.dtype)
    with torch.no_grad():
        loss_nograd, _ = loss_fn(b["logits"])
    scale = max(float(ref_loss.abs()), 1e-3)
    return {"loss": float((loss.detach().double() - ref_loss).abs()) / scale, "grad": rel(grad, ref_grad),
            "loss_nograd": float((loss_nograd.double() - ref_loss).abs()) / scale,
            "grad_dtype_ok": float(x.grad.dtype == b["logits"].dtype), "finite": float(torch.isfinite(grad).all()),
            "grad_masked_rows_max": float(grad[b["weights"] == 0].abs().max()),
            "mis_masked_seqs": float(stats["mis_masked_seqs"])}


def token_logprobs_case(dt, *, device, num_rows=37, vocab=1000):
    """`kernels.token_logprobs` (the forward-only row kernel) against float64, under a constraint mask too."""
    from colocate.kernels import token_logprobs

    b = make_batch(num_rows, vocab, DTYPES[dt], temperature=0.7, beta=0.0, seed=2, device=device)
    exact = torch.log_softmax(b["logits"].double() / 0.7, -1).gather(1, b["targets"][:, None]).squeeze(1)
    allowed = torch.stack([b["targets"], (b["targets"] + 1) % vocab, torch.full_like(b["targets"], -1)], 1)
    sub = b["logits"].double().gather(1, allowed.clamp(min=0)).masked_fill(allowed < 0, float("-inf")) / 0.7
    exact_allowed = torch.log_softmax(sub, -1)[:, 0]
    got = token_logprobs(b["logits"], b["targets"], temperature=0.7, impl="triton")
    got_allowed = token_logprobs(b["logits"], b["targets"], temperature=0.7, allowed_ids=allowed, impl="triton")
    return {"logp": float((got.double() - exact).abs().max()),
            "logp_allowed": float((got_allowed.double() - exact_allowed).abs().max())}


def row_scale_case(dt, *, device, rows=6, cols=700):
    """`deferred.scale_rows` through the Triton row kernel against float64 -> max relative error."""
    from colocate.kernels.deferred import scale_rows

    g = torch.Generator().manual_seed(4)
    grad = torch.randn(1, rows, cols, generator=g).to(DTYPES[dt]).to(device)
    scale = (torch.randn(rows, generator=g) * 1e-3).to(device)
    got = scale_rows(grad, scale, fused=True)
    exact = grad.double() * scale.double()[None, :, None]
    return {"rel": float(((got.double() - exact).abs() / exact.abs().clamp(min=1e-30)).max()),
            "dtype_ok": float(got.dtype == grad.dtype and got.shape == grad.shape)}


def all_cases(device):
    """name -> a thunk running that case on `device` (every kernel, objective and helper case)."""
    out = {name: (lambda a=args: kernel_case(*a, device=device)) for name, *args in CASES}
    out.update({name: (lambda a=args, n=name: objective_case(*a, device=device, deferred=n.endswith("-deferred")))
                for name, *args in OBJECTIVE_CASES})
    out.update({f"token_logprobs-{dt}": (lambda d=dt: token_logprobs_case(d, device=device)) for dt in DTYPES})
    out.update({f"row_scale-{dt}": (lambda d=dt: row_scale_case(d, device=device)) for dt in DTYPES})
    return out


def run_all(device, part: int = 0, parts: int = 1):
    """Every `parts`-th case from `part` (the interpreter's cases are split over processes)."""
    cases = all_cases(device)
    return {name: cases[name]() for name in list(cases)[part::parts]}


def check_objective_case(name, errors):
    tol = TOL[DTYPES[name.split("-")[0]]]
    assert errors["finite"] == 1.0 and errors["grad_dtype_ok"] == 1.0, errors
    assert errors["loss"] <= tol and errors["loss_nograd"] <= tol and errors["grad"] <= tol, errors
    assert errors["grad_masked_rows_max"] == 0.0, errors
    assert ("mis" in name) == (errors["mis_masked_seqs"] > 0), errors  # the mask drops sequences only when on


def check_kernel_case(name, errors):
    dt = name.split("-")[0]
    tol = TOL[DTYPES[dt]]
    assert errors["finite"] == 1.0, errors
    assert errors["loss"] <= tol and errors["loss_nograd"] <= tol, errors
    assert errors["grad"] <= tol, errors
    assert errors["grad_dtype_ok"] == 1.0 and errors["grad_masked_rows_max"] == 0.0, errors
    assert errors["stats"] <= 1e-4, errors  # clip_fraction/num_tokens exact; kl, ratio to fp32 rounding
    assert errors["nograd_untouched"] == 1.0, errors


# ----------------------------------------------------------------------------- CPU tier

@pytest.fixture(scope="module")
def interpreted():
    """All cases under TRITON_INTERPRET=1 in fresh processes, one per core (up to 2), each taking
    every other case (the interpreter is single-threaded Python: ~1 min of CPU in all)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    parts = max(1, min(2, os.cpu_count() or 1))
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), str(i), str(parts)], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(parts)]
    out = {}
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        if proc.returncode != 0 and "only 0-dimensional arrays can be converted to Python scalars" in stderr:
            # Triton 3.6's interpreter turns loop bounds into ints with int(1-element array), which
            # NumPy >= 2.4 refuses; newer Triton (3.9) squeezes first.
            for other in procs:
                other.kill()
            pytest.skip("this Triton's interpreter cannot run dynamic loops under this NumPy (Triton 3.9 can)")
        assert proc.returncode == 0, stderr[-4000:]
        out.update(json.loads(stdout.strip().splitlines()[-1]))
    assert set(out) == set(all_cases("cpu")), "every case ran once"
    return out


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_interpreted_kernel_matches_float64(interpreted, name):
    check_kernel_case(name, interpreted[name])


@pytest.mark.parametrize("name", [c[0] for c in OBJECTIVE_CASES])
def test_interpreted_objectives_match_float64(interpreted, name):
    check_objective_case(name, interpreted[name])


@pytest.mark.parametrize("dt", list(DTYPES))
def test_interpreted_token_logprobs_match_float64(interpreted, dt):
    errors = interpreted[f"token_logprobs-{dt}"]
    assert errors["logp"] <= 1e-5 and errors["logp_allowed"] <= 1e-5, errors  # fp32 math over exact inputs


@pytest.mark.parametrize("dt", list(DTYPES))
def test_interpreted_row_scale_is_one_rounding(interpreted, dt):
    errors = interpreted[f"row_scale-{dt}"]
    assert errors["dtype_ok"] == 1.0
    # the fp32 product, rounded once: within one bf16 unit (the interpreter's cast truncates)
    assert errors["rel"] <= (2.0 ** -7 if dt == "bf16" else 1e-7), errors


def test_launch_config_is_checked():
    from colocate.kernels import LossRows
    from colocate.kernels.triton_grpo import grpo_loss_triton

    n, v = 2, 8
    with pytest.raises(ValueError, match=r"unknown key 'num_warp'; keys: .*\bnum_warps\b"):
        grpo_loss_triton(torch.zeros(n, v), LossRows(torch.zeros(n, dtype=torch.long), torch.ones(n), torch.zeros(n),
                                                     torch.zeros(n)), config={"num_warp": 8})


# ----------------------------------------------------------------------------- GPU tier

@pytest.mark.gpu
@pytest.mark.timeout(300)
@requires_cuda
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cuda_kernel_small_shapes(case):
    name, *args = case
    check_kernel_case(name, kernel_case(*args, device="cuda", num_rows=301, vocab=1000, seed=3))


@pytest.mark.gpu
@pytest.mark.timeout(300)
@requires_cuda
@pytest.mark.parametrize("case", OBJECTIVE_CASES, ids=[c[0] for c in OBJECTIVE_CASES])
def test_cuda_objectives_small_shapes(case):
    name, *args = case
    check_objective_case(name, objective_case(*args, device="cuda", num_rows=301, vocab=1000, seed=3,
                                                 deferred=name.endswith("-deferred")))


def float64_chunked(b, chunk, spec):
    """The oracle over row chunks (a float64 [N, V] of the real shape would need ~40 GB with autograd)."""
    loss, scale, grads = 0.0, 0.0, []
    for s in range(0, b["logits"].shape[0], chunk):
        part = {k: None if b[k] is None else b[k][s:s + chunk]
                for k in ("logits", "targets", "weights", "behaviour", "advantages", "ref")}
        expected = oracle(part, spec)
        loss, scale = loss + expected.loss, scale + expected.scale
        grads.append(expected.grad.to(b["logits"].dtype))  # compared in the logits dtype to bound memory
    return loss, scale, torch.cat(grads)


def cuda_batch(num_rows, vocab, beta, temperature, seed):
    # Built on the GPU directly (the CPU path of make_batch is slow at this size).
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(num_rows, vocab, device="cuda", generator=g) * 3).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (num_rows,), device="cuda", generator=g)
    mask = (torch.rand(num_rows, device="cuda", generator=g) > 0.2).float()
    exact = torch.cat([torch.log_softmax(c.float() / temperature, -1).gather(1, t[:, None]).squeeze(1)
                       for c, t in zip(logits.split(2048), targets.split(2048))])
    behaviour = exact + 0.3 * torch.randn(num_rows, device="cuda", generator=g)
    ref = exact + 0.2 * torch.randn(num_rows, device="cuda", generator=g) if beta > 0 else None
    return dict(logits=logits, targets=targets, mask=mask, weights=mask / mask.sum(), behaviour=behaviour,
                advantages=torch.randn(num_rows, device="cuda", generator=g), ref=ref)


@pytest.mark.gpu
@pytest.mark.timeout(300)
@requires_cuda
@pytest.mark.parametrize("num_rows,inplace,config,dtype", [
    (4096, False, {"backend": "triton"}, "bf16"), (4096, True, {"backend": "triton"}, "bf16"),
    (14200, True, {"backend": "triton"}, "bf16"), (4096, True, {"stages": 4, "num_warps": 16, "backend": "triton"}, "bf16"),
    (512, True, None, "fp32"), (512, False, {"stages": 4}, "fp32")],
    ids=["4096-copy", "4096-inplace", "14200-inplace-over-2^31-elements", "4096-inplace-pipelined",
         "fp32-512-inplace", "fp32-512-copy-pipelined"])
def test_cuda_real_vocab(num_rows, inplace, config, dtype):
    """Real vocabulary, bf16 (1e-2) and fp32 (1e-5) logits. fp32 with pipelined loads also checks
    their shared memory stays under the H200's 227 KB per block (it launches)."""
    from colocate.kernels import LossRows, LossSpec
    from colocate.kernels.triton_grpo import grpo_loss_triton

    vocab, beta, temperature = 152064, 0.04, 0.9
    b = cuda_batch(num_rows, vocab, beta, temperature, seed=num_rows)
    b["logits"] = b["logits"].to(DTYPES[dtype])
    tol = 1e-2 if dtype == "bf16" else 1e-5
    kw = dict(temperature=temperature, eps_low=0.2, eps_high=0.28, beta=beta)
    ref_loss, scale, ref_grad = float64_chunked(b, 1024 if dtype == "bf16" else 256, LossSpec(**kw))
    x = b["logits"].clone().requires_grad_()
    loss, _ = grpo_loss_triton(x, LossRows(b["targets"], b["weights"], b["behaviour"], b["advantages"], b["ref"]),
                               LossSpec(**kw), inplace_backward=inplace, config=config)
    loss.backward()
    assert float((loss.detach().double() - ref_loss).abs() / scale) <= tol
    assert rel(x.grad, ref_grad) <= tol
    assert float(x.grad[-1].float().abs().sum()) > 0 or float(b["weights"][-1]) == 0  # the last row was written


@pytest.mark.gpu
@pytest.mark.timeout(300)
@requires_cuda
@pytest.mark.parametrize("norm", ["grpo", "dapo", "dr_grpo"])
def test_cuda_entry_triton_equals_torch(norm):
    from colocate.kernels import LossBatch, LossSpec, grpo_loss

    num_rows, vocab, num_seqs = 4096, 152064, 16
    b = cuda_batch(num_rows, vocab, 0.04, 1.0, seed=7)
    seq_ids = torch.arange(num_rows, device="cuda") // (num_rows // num_seqs)
    batch = LossBatch(b["targets"], b["mask"], b["behaviour"], b["advantages"], b["ref"], seq_ids=seq_ids,
                      num_seqs=num_seqs)
    results = {}
    for impl in ("torch", "triton"):
        x = b["logits"].clone().requires_grad_()
        loss, stats = grpo_loss(x, batch, LossSpec(beta=0.04, norm=norm, max_len=num_rows // num_seqs, impl=impl))
        loss.backward()
        results[impl] = (loss.detach(), stats, x.grad)
    (lt, st, gt), (lk, sk, gk) = results["torch"], results["triton"]
    assert float((lk - lt).abs() / lt.abs().clamp(min=1e-6)) <= 1e-3
    assert rel(gk, gt) <= 1e-2
    for k in st:
        assert abs(float(sk[k]) - float(st[k])) <= 1e-3 * max(1.0, abs(float(st[k]))), k


@pytest.mark.gpu
@pytest.mark.timeout(300)
@requires_cuda
@pytest.mark.parametrize("objective,with_old", [({"ratio_level": "sequence"}, False), ({"ratio_level": "sequence"}, True),
                                                ({"tis_cap": 2.0, "mis_threshold": 0.25}, False), ({"tis_cap": 2.0}, True)],
                         ids=["gspo", "gspo-decoupled", "tis-mis", "tis-decoupled-folded"])
@pytest.mark.parametrize("deferred", [False, True], ids=["two-pass", "deferred"])
def test_cuda_entry_objectives_triton_equal_torch(objective, with_old, deferred):
    """Real vocabulary, bf16: each objective through the fused path (the bulk kernel on sm_90 for
    the gradient pass; deferred: one pass, its row scale applied here) against the reference, and
    the peak memory above the inputs stays far below one [N, V] float32 ([N] vectors only)."""
    from colocate.kernels import LossBatch, LossSpec, Objective, grpo_loss

    num_rows, vocab, num_seqs = 4096, 152064, 16
    b = cuda_batch(num_rows, vocab, 0.04, 1.0, seed=9)
    seq_ids = torch.arange(num_rows, device="cuda") // (num_rows // num_seqs)
    old = b["behaviour"] + 0.05 * torch.randn(num_rows, device="cuda") if with_old else None
    eps = (3e-4, 4e-4) if objective.get("ratio_level") else (0.2, 0.28)
    batch = LossBatch(b["targets"], b["mask"], b["behaviour"], b["advantages"], b["ref"], seq_ids=seq_ids,
                      old_logprobs=old, num_seqs=num_seqs)
    kw = dict(objective=Objective(**objective), norm="grpo", eps_low=eps[0], eps_high=eps[1], beta=0.04)
    results = {}
    for impl in ("torch", "triton"):
        x = b["logits"].clone().requires_grad_()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        scale = torch.empty(num_rows, device="cuda") if deferred and impl == "triton" else None
        loss, stats = grpo_loss(x, batch, LossSpec(impl=impl, **kw), inplace_backward=impl == "triton",
                                row_scale=scale)
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        grad = x.grad if scale is None else (x.grad.float() * scale[:, None]).to(x.grad.dtype)
        results[impl] = (loss.detach(), stats, grad, peak)
    (lt, st, gt, _), (lk, sk, gk, peak) = results["torch"], results["triton"]
    assert float((lk - lt).abs() / lt.abs().clamp(min=1e-6)) <= 1e-3
    assert rel(gk, gt) <= 1e-2
    for k in st:
        assert abs(float(sk[k]) - float(st[k])) <= 1e-3 * max(1.0, abs(float(st[k]))), k
    assert peak < 0.1 * num_rows * vocab * 4  # in place: no [N, V] temporary


if __name__ == "__main__":  # [PART PARTS]: the interpreter subprocess of the `interpreted` fixture
    torch.set_num_threads(1)
    print(json.dumps(run_all("cpu", *map(int, sys.argv[1:3]))))
