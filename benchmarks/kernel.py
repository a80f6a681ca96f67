"""Benchmark profile `kernel`: the GRPO loss fwd+bwd on bf16 logits, ours against the baselines.

Same inputs, same process, one GPU:
  naive     fp32 log_softmax + gather + clip + k3 KL, as plain PyTorch writes it
  compiled  torch.compile of `reference.grpo_loss_reference`
  liger     liger-kernel 0.8.5 `triton_grpo_loss` in place and not (optional; "unavailable" if absent)
  ours      `triton_grpo.grpo_loss_triton` in place and not (its default backend: the bulk-copy CUDA
            row kernel on sm_90 with bf16 logits, `cuda_grpo`), and `ours_triton_*` with the Triton
            row kernel forced (`backend: triton`), old against new in the same run
Figures per implementation: median fwd+bwd ms (wall, synchronized: includes the Python launch
overhead), median fwd+bwd device ms (`_gpu_ms`, CUDA events with the host running ahead, as in
training) and peak memory above what was allocated before the call (the logits and inputs), in GB.
In-place calls get their logits copied back from a pristine buffer, untimed, before every call.
Loss values and gradients are compared on pristine logits.
`ours_kernel_only_inplace_ms` times the row kernel alone (no autograd) to show the wrapper's cost.
The policy objectives beside GRPO (`OBJECTIVES`), ours only, in place and not, against `ours_inplace`
in the same run: `ours_gspo_*` (sequence ratio: a forward-only pass for logp, the objective on [N]
vectors in PyTorch, then the fused pass with that per-row coefficient), `ours_tis_mis_*` (the same
path for truncated / masked importance sampling against the current policy),
`ours_gspo_deferred_*` / `ours_tis_mis_deferred_*` (what the learner runs: one fused pass with a
unit coefficient, the objective on [N], and the per-row scale applied to a [N, HIDDEN] bf16
gradient of the lm_head's input, timed and counted in memory as part of the call:
`kernels.deferred`) and `ours_decoupled_*` (several updates per batch: start-of-batch log-probs
folded into the one fused pass); `ours_forward_only_ms` is the forward-only pass alone. Their
losses and gradients (deferred: the stored gradient times the row scale) are compared with the
reference's on pristine logits.
`--sweep` first times launch configurations of ours (kernel only) and then measures the fastest.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from benchmarks.common import gpu_time_ms, median_time

EPS_LOW, EPS_HIGH, BETA = 0.2, 0.28, 0.04
LOSS_KW = dict(temperature=1.0, eps_low=EPS_LOW, eps_high=EPS_HIGH, beta=BETA)
# name -> (Objective keyword arguments, its clip range, whether start-of-batch log-probs are given,
# whether the row scale is deferred to the lm_head's input)
OBJECTIVES = {"gspo": ({"ratio_level": "sequence"}, (3e-4, 4e-4), False, False),
              "gspo_deferred": ({"ratio_level": "sequence"}, (3e-4, 4e-4), False, True),
              "tis_mis": ({"tis_cap": 2.0, "mis_threshold": 0.5}, (EPS_LOW, EPS_HIGH), False, False),
              "tis_mis_deferred": ({"tis_cap": 2.0, "mis_threshold": 0.5}, (EPS_LOW, EPS_HIGH), False, True),
              "decoupled": ({}, (EPS_LOW, EPS_HIGH), True, False)}
HIDDEN = 3584  # the lm_head's input width at V = 152064 (Qwen2.5-7B): what a deferred row scale multiplies


def add_args(parser) -> None:
    parser.add_argument("--batch", type=int, default=0, help="sequences (default 16; --quick 4)")
    parser.add_argument("--seq-len", type=int, default=0,
                        help="completion tokens per sequence (default 1024; --quick 256)")
    parser.add_argument("--vocab", type=int, default=0, help="vocabulary (default 152064; --quick 32000)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    parser.add_argument("--sweep", action="store_true",
                        help="first time launch configurations of ours (kernel only), then measure the fastest")
    parser.add_argument("--config", default="", help='JSON launch overrides for ours, e.g. \'{"block_v": 16384}\'')


def naive_loss(logits, targets, weights, behaviour, ref, advantages):
    """[N, V] bf16 -> scalar; materializes a float32 [N, V] log-softmax (the baseline)."""
    logp = torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None]).squeeze(-1)
    ratio = torch.exp(logp - behaviour)
    pg = -torch.minimum(ratio * advantages, ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * advantages)
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    return ((pg + BETA * kl) * weights).sum()


def make_inputs(batch, seq_len, vocab, seed=0, device="cuda"):
    """Liger's layout [B, L+1, V] (its kernel drops the last position) and ours [N, V] = [:, :-1]."""
    g = torch.Generator(device=device).manual_seed(seed)
    logits3d = (torch.randn(batch, seq_len + 1, vocab, device=device, generator=g) * 2).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (batch, seq_len), device=device, generator=g)
    mask = (torch.rand(batch, seq_len, device=device, generator=g) > 0.1).float()
    adv_seq = torch.randn(batch, device=device, generator=g)
    # Behaviour and reference log-probs = the true ones + noise, so ratios spread around 1 and clip.
    with torch.no_grad():
        lse = torch.stack([torch.logsumexp(s[:-1].float(), -1) for s in logits3d])               # [B, L]
        true_logp = logits3d[:, :-1].gather(-1, targets[..., None]).squeeze(-1).float() - lse
    behaviour = true_logp + 0.2 * torch.randn(batch, seq_len, device=device, generator=g)
    ref = true_logp + 0.1 * torch.randn(batch, seq_len, device=device, generator=g)
    n = batch * seq_len
    flat = dict(targets=targets.reshape(n), weights=(mask / mask.sum()).reshape(n), behaviour=behaviour.reshape(n),
                ref=ref.reshape(n), advantages=adv_seq[:, None].expand(batch, seq_len).reshape(n).contiguous(),
                seq_ids=torch.arange(batch, device=device).repeat_interleave(seq_len),
                old=(true_logp + 0.05 * torch.randn(batch, seq_len, device=device, generator=g)).reshape(n))
    seq = dict(targets=targets, mask=mask, behaviour=behaviour, ref=ref, advantages=adv_seq)
    return logits3d, logits3d[:, :-1].reshape(n, vocab), flat, seq


def restore(x, pristine, inplace=True):
    """Untimed, before each call: drop the last gradient; give in-place calls fresh logits."""
    x.grad = None
    if inplace:
        with torch.no_grad():
            x.copy_(pristine)


def measure(loss_fn, x, pristine, inplace, iters):
    """(median fwd+bwd wall ms, peak GB above the allocation before the call, median fwd+bwd device
    ms) of loss_fn(x).backward(). Wall: synchronized before and after, so it includes the Python
    launch overhead (its size per host: profiles/kernel.md); device: CUDA events (gpu_time_ms)."""
    def setup():
        restore(x, pristine, inplace)

    after = getattr(loss_fn, "after_backward", None)  # work the call leaves downstream (deferred objectives)

    def step():
        loss_fn(x).backward()
        if after is not None:
            after()

    ms = median_time(step, warmup=3, iters=iters, setup=setup) * 1e3
    gpu_ms = gpu_time_ms(step, lambda: restore(x, pristine, True), iters)  # every impl behind the same copy
    setup()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - base) / 1e9
    x.grad = None
    return round(ms, 3), round(extra, 3), gpu_ms


def load_liger():
    """(triton_grpo_loss, None) or (None, why): liger-kernel is an optional benchmark-only dependency."""
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
        return triton_grpo_loss, None
    except Exception as exc:  # noqa: BLE001 - any import failure means absent
        return None, f"{type(exc).__name__}: {exc}"


def liger_loss(liger, seq, inplace):
    """Liger's triton_grpo_loss on [B, L+1, V] logits, dapo normalization (= our weights)."""
    return lambda t: liger(t, seq["behaviour"], seq["ref"], seq["targets"], seq["advantages"],
                           completion_mask=seq["mask"], temperature=1.0, beta=BETA, eps_low=EPS_LOW,
                           eps_high=EPS_HIGH, inplace=inplace, loss_type="dapo", reduce=True)[0]


def rel_diff(a, b, chunk=1024):
    """||a - b|| / ||b|| over [N, V] tensors, a row chunk at a time in float32."""
    num = den = 0.0
    for ca, cb in zip(a.split(chunk), b.split(chunk)):
        num += float((ca.float() - cb.float()).pow(2).sum())
        den += float(cb.float().pow(2).sum())
    return (num / max(den, 1e-30)) ** 0.5


@dataclass
class Bench:
    """One run's inputs: pristine logits, the working copies the timed calls write over, the
    per-token inputs and ours' launch overrides (--config, over the best of --sweep)."""
    pristine: torch.Tensor  # [N, V] bf16, N = B * L
    logits3d: torch.Tensor  # [B, L+1, V] bf16 (Liger's layout)
    x: torch.Tensor         # [N, V] working copy for naive / compiled / ours
    x3d: torch.Tensor       # [B, L+1, V] working copy for Liger
    f: dict                 # [N] per-token inputs (targets, weights, behaviour, ref, advantages)
    seq: dict               # [B, L] / [B] inputs for Liger
    shape: str
    iters: int
    config: dict


def run(args) -> dict:
    if not torch.cuda.is_available():
        return {"figures": {"skipped": "needs CUDA"}, "baseline": {}, "ratios": {}}
    b = make_bench(args)
    figures, baseline = {}, {}
    if args.sweep:
        b.config = {**sweep_best(b, figures), **b.config}
    impls = implementations(b, compile_reference=not args.no_compile)
    time_implementations(b, impls, figures, baseline)
    time_kernel_only(b, figures)
    liger = time_liger(b, baseline)
    compare_outputs(b, impls, liger, figures)
    return {"figures": figures, "baseline": baseline, "ratios": ratios_to_ours(figures, baseline)}


def make_bench(args) -> Bench:
    """The inputs at the asked shape (the defaults, or small ones with --quick)."""
    batch = args.batch or (4 if args.quick else 16)
    seq_len = args.seq_len or (256 if args.quick else 1024)
    vocab = args.vocab or (32000 if args.quick else 152064)
    logits3d, pristine, f, seq = make_inputs(batch, seq_len, vocab)
    return Bench(pristine=pristine, logits3d=logits3d, x=pristine.clone().requires_grad_(),
                 x3d=logits3d.clone().requires_grad_(), f=f, seq=seq,
                 shape=f"N={batch * seq_len} (B={batch} x L={seq_len}) V={vocab} bf16", iters=args.iters,
                 config=json.loads(args.config) if args.config else {})


def sweep_best(b: Bench, figures: dict) -> dict:
    """Time every sweep configuration (one figure each) and return the fastest in place."""
    results = sweep(b.x, b.pristine, b.f, LOSS_KW)
    figures.update({name: text for name, (_, text) in results.items()})
    return min((r for r in results.values() if r[0] is not None), key=lambda r: float(r[1].split()[3]))[0]


def triton_only(config: dict) -> dict:
    return {**config, "backend": "triton"}


def ours(f: dict, inplace: bool, config: dict | None = None):
    """Our loss through autograd, as a function of the logits (config None: the library default)."""
    from colocate.kernels import LossSpec
    from colocate.kernels.triton_grpo import grpo_loss_triton

    rows, spec = loss_rows(f), LossSpec(**LOSS_KW)
    return lambda t: grpo_loss_triton(t, rows, spec, inplace_backward=inplace, config=config)[0]


def loss_rows(f: dict, objective: bool = False, with_old: bool = False):
    """The benchmark's per-row inputs as the loss takes them (sequence ids for the objectives)."""
    from colocate.kernels import LossRows
    return LossRows(f["targets"], f["weights"], f["behaviour"], f["advantages"], f["ref"],
                    f["seq_ids"] if objective else None, f["old"] if with_old else None)


def ours_objective(f: dict, name: str, inplace: bool, config: dict | None = None, impl=None):
    """One of `OBJECTIVES` through ours (or through `impl`, the reference), as a function of the
    logits. A deferred one also applies its row scale to a [N, HIDDEN] stand-in for d(lm_head input)."""
    from colocate.kernels import LossSpec, Objective
    from colocate.kernels.deferred import deferred_loss, scale_rows
    from colocate.kernels.triton_grpo import grpo_loss_triton

    kw, (eps_low, eps_high), with_old, deferred = OBJECTIVES[name]
    spec = LossSpec(Objective(**kw), temperature=1.0, eps_low=eps_low, eps_high=eps_high, beta=BETA)
    rows = loss_rows(f, objective=True, with_old=with_old)
    if impl is not None:
        return lambda t: impl(t, rows, spec)[0]
    if not deferred:
        return lambda t: grpo_loss_triton(t, rows, spec, inplace_backward=inplace, config=config)[0]
    n = f["targets"].shape[0]
    if f"row_scale_{n}" not in f:  # one buffer pair per row count, shared by the in-place and copy variants
        f[f"row_scale_{n}"] = torch.empty(n, device=f["targets"].device)
        f[f"grad_hidden_{n}"] = torch.randn(n, HIDDEN, device=f["targets"].device, dtype=torch.bfloat16)
    scale, grad_hidden = f[f"row_scale_{n}"], f[f"grad_hidden_{n}"]

    def loss(t):
        return deferred_loss(t, rows, spec, row_scale=scale, fused=True, inplace_backward=inplace, config=config)[0]
    loss.row_scale = scale
    # What the lm_head input's backward adds (`scale_grad_rows`): a new [N, HIDDEN] scaled gradient.
    loss.after_backward = lambda: scale_rows(grad_hidden, scale)
    return loss


def implementations(b: Bench, compile_reference: bool) -> dict:
    """name -> (loss as a function of the logits, whether it writes over them)."""
    from colocate.kernels import LossSpec
    from colocate.kernels.reference import grpo_loss_reference

    f = b.f
    impls = {"naive": (lambda t: naive_loss(t, f["targets"], f["weights"], f["behaviour"], f["ref"],
                                            f["advantages"]), False)}
    if compile_reference:
        compiled = torch.compile(grpo_loss_reference, dynamic=False)
        rows, spec = loss_rows(f), LossSpec(**LOSS_KW)
        impls["compiled"] = (lambda t: compiled(t, rows, spec)[0], False)
    impls["ours_inplace"] = (ours(f, True, b.config or None), True)
    impls["ours"] = (ours(f, False, b.config or None), False)
    impls["ours_triton_inplace"] = (ours(f, True, triton_only(b.config)), True)
    for name in OBJECTIVES:
        impls[f"ours_{name}_inplace"] = (ours_objective(f, name, True, b.config or None), True)
        impls[f"ours_{name}"] = (ours_objective(f, name, False, b.config or None), False)
    return impls


def time_implementations(b: Bench, impls: dict, figures: dict, baseline: dict) -> None:
    """The shape, ours' config and the copy floor, then wall ms, extra GB and device ms of each one."""
    from colocate.kernels.triton_rows import default_config

    figures.update({"shape": b.shape, "logits_GB": round(b.pristine.numel() * 2 / 1e9, 3),
                    "ours_config": str({**default_config(b.pristine.shape[1], b.x.device), **b.config})})
    # The floor: a read and a write of [N, V] (what ours moves), timed as a device copy.
    figures["copy_NV_ms"] = copy_time_ms(b.pristine, b.iters)
    for name, (fn, inplace) in impls.items():
        ms, gb, gpu_ms = measure(fn, b.x, b.pristine, inplace, b.iters)
        (figures if name.startswith("ours") else baseline).update(
            {f"{name}_ms": ms, f"{name}_extra_GB": gb, f"{name}_gpu_ms": gpu_ms})
    if b.config:  # the library default in the same run, for old-vs-new (fwd+bwd through autograd, in place)
        figures["ours_default_config_inplace_ms"], _, _ = measure(ours(b.f, True), b.x, b.pristine, True, b.iters)


def time_kernel_only(b: Bench, figures: dict) -> None:
    """The row kernel alone (no autograd, in place), ours and the Triton one; and which one ours ran."""
    from colocate.kernels.triton_rows import default_config, grpo_rows, row_backend

    f, xd = b.f, b.x.detach()
    for name, cfg in (("ours", b.config or None), ("ours_triton", triton_only(b.config))):
        figures[f"{name}_kernel_only_inplace_ms"] = round(1e3 * median_time(
            lambda: grpo_rows(xd, f["targets"], f["weights"], f["behaviour"], f["advantages"], f["ref"], xd,
                              config=cfg, **LOSS_KW),
            iters=b.iters, setup=lambda: restore(b.x, b.pristine)), 3)
    figures["ours_backend"] = row_backend(xd, xd, {**default_config(xd.shape[1], xd.device), **b.config})
    figures["ours_forward_only_ms"] = round(1e3 * median_time(  # the first pass of the two-pass objectives
        lambda: grpo_rows(xd, f["targets"], f["weights"], f["behaviour"], f["advantages"], None, None,
                          config=b.config or None, **LOSS_KW),
        iters=b.iters, setup=lambda: restore(b.x, b.pristine)), 3)


def time_liger(b: Bench, baseline: dict):
    """Liger in place and not, when it is installed; returns its loss (None when absent)."""
    liger, why = load_liger()
    if liger is None:
        baseline["liger"] = f"unavailable ({why})"
        return None
    for name, inplace in (("liger_inplace", True), ("liger", False)):
        ms, gb, gpu_ms = measure(liger_loss(liger, b.seq, inplace), b.x3d, b.logits3d, inplace, b.iters)
        baseline.update({f"{name}_ms": ms, f"{name}_extra_GB": gb, f"{name}_gpu_ms": gpu_ms})
    return liger


def compare_outputs(b: Bench, impls: dict, liger, figures: dict) -> None:
    """Every implementation's loss and ours' gradient against naive, on pristine logits (the
    in-place calls timed before left garbage)."""
    x = b.x
    restore(x, b.pristine)
    restore(b.x3d, b.logits3d)
    with torch.no_grad():
        values = {name: float(fn(x)) for name, (fn, _) in impls.items()}
        if liger is not None:
            values["liger"] = float(liger_loss(liger, b.seq, False)(b.x3d))
    figures["loss_values"] = {k: round(v, 7) for k, v in values.items()}
    figures["ours_loss_rel_diff_vs_naive"] = abs(values["ours"] - values["naive"]) / max(abs(values["naive"]), 1e-12)
    restore(x, b.pristine)
    impls["naive"][0](x).backward()
    g_naive, x.grad = x.grad, None
    impls["ours"][0](x).backward()
    figures["ours_grad_rel_diff_vs_naive"] = rel_diff(x.grad, g_naive)
    x.grad = None
    compare_objectives(b, figures)


def compare_objectives(b: Bench, figures: dict, rows: int = 4096) -> None:
    """Each objective's loss and gradient, ours (not in place) against the reference, on the first
    `rows` pristine rows (whole sequences; the reference's float32 [N, V] temporaries stay small)."""
    from colocate.kernels.reference import grpo_loss_reference

    rows = min(rows, b.pristine.shape[0])
    f = {k: v[:rows] for k, v in b.f.items()}
    x = b.pristine[:rows].clone().requires_grad_()
    for name in OBJECTIVES:
        loss_ref = ours_objective(f, name, False, impl=grpo_loss_reference)(x)
        loss_ref.backward()
        g_ref, x.grad = x.grad, None
        fn = ours_objective(f, name, False, b.config or None)
        loss = fn(x)
        loss.backward()
        if hasattr(fn, "row_scale"):  # deferred: the stored gradient times the row scale
            x.grad = (x.grad.float() * fn.row_scale[:, None]).to(x.grad.dtype)
        diff = (loss.detach() - loss_ref.detach()).abs() / loss_ref.detach().abs().clamp(min=1e-12)
        figures[f"ours_{name}_loss_rel_diff_vs_reference"] = float(diff)
        figures[f"ours_{name}_grad_rel_diff_vs_reference"] = rel_diff(x.grad, g_ref)
        x.grad = None


def ratios_to_ours(figures: dict, baseline: dict) -> dict:
    """Wall and device ms of each baseline (and the copy floor) over ours in place."""
    ratios = {}
    for name in ("naive", "compiled", "liger_inplace", "liger"):
        if isinstance(baseline.get(f"{name}_ms"), float):
            ratios[f"{name}_ms_over_ours_inplace"] = round(baseline[f"{name}_ms"] / figures["ours_inplace_ms"], 3)
    ratios["ours_triton_inplace_ms_over_ours_inplace"] = round(
        figures["ours_triton_inplace_ms"] / figures["ours_inplace_ms"], 3)
    objectives = [f"ours_{name}{how}" for name in OBJECTIVES for how in ("_inplace", "")]
    for name in ("naive", "compiled", "liger_inplace", "ours_triton_inplace", *objectives):  # on device time
        source = figures if name.startswith("ours") else baseline
        if isinstance(source.get(f"{name}_gpu_ms"), float):
            ratios[f"{name}_gpu_ms_over_ours_inplace"] = round(source[f"{name}_gpu_ms"] / figures["ours_inplace_gpu_ms"], 3)
    ratios["copy_ms_over_ours_inplace_gpu"] = round(figures["copy_NV_ms"] / figures["ours_inplace_gpu_ms"], 3)
    ratios["copy_ms_over_ours_inplace"] = round(figures["copy_NV_ms"] / figures["ours_inplace_ms"], 3)
    return ratios


def copy_time_ms(pristine: torch.Tensor, iters: int) -> float:
    """Median ms of one device copy of `pristine` (a read and a write: the floor of what ours moves)."""
    dst = torch.empty_like(pristine)
    return round(median_time(lambda: dst.copy_(pristine), iters=iters) * 1e3, 3)


def sweep_configs():
    """Launch configurations to time: overrides of a base, the default (block_v 16384, 32 warps,
    one program per SM, pass-1 group 8, register prefetch in both passes, refmax pass 1).

    One row in flight per SM, read twice (pass 2 mostly from L1 with plain loads). Fewer programs
    than SMs, several programs per row, blocks of 32768, two blocks prefetched in registers and
    staggered, flat and whole-row split schedules were swept too and measured slower
    (profiles/HISTORY.md), so they are no longer rows here.
    """
    base = {"block_v": 16384, "num_warps": 32, "programs_per_sm": 1, "group": 8, "stages": 0, "stages_pass2": 0,
            "pass1": "refmax"}
    rows = [{}, {"num_warps": 16}, {"num_warps": 16, "stages": 4, "stages_pass2": 4},
            {"num_warps": 16, "stages": 4, "stages_pass2": 4, "pass1": "online"},
            {"block_v": 8192}, {"block_v": 8192, "num_warps": 16}]
    triton = [{**base, **r, "backend": "triton"} for r in rows]
    # The bulk-copy CUDA kernel (cuda_grpo): overrides of its DEFAULT_CONFIG.
    bulk = [{}, {"reg_chunks": 7}, {"reg_chunks": 4}, {"prefetch": 2}, {"hints": 0},
            {"consumer_warps": 8, "reg_chunks": 8}, {"reg_chunks": 0, "slots": 13}]
    return triton + [{"backend": "bulk", "bulk": b} for b in bulk]


def sweep_name(cfg: dict) -> str:
    if cfg.get("backend") == "bulk":
        return "sweep_bulk_" + ("_".join(f"{k}{v}" for k, v in cfg["bulk"].items()) or "default")
    return "sweep_b{block_v}_w{num_warps}_p{programs_per_sm}_s{stages}_s{stages_pass2}_{pass1}".format(**cfg)


def sweep(x, pristine, f, kw, iters=10):
    """Kernel-only timings per config: name -> (config or None on error, "fwd ms inplace ms copy ms").

    fwd: forward only; inplace: fused, writing over the logits (restored untimed); copy: fused
    into a separate buffer."""
    from colocate.kernels.triton_rows import grpo_rows

    x = x.detach()
    grad_buf = torch.empty_like(pristine)
    out = {}
    for cfg in sweep_configs():
        name = sweep_name(cfg)

        def call(grad):
            return lambda: grpo_rows(x, f["targets"], f["weights"], f["behaviour"], f["advantages"], f["ref"], grad,
                                     config=cfg, **kw)
        try:
            # Forward only always runs the Triton row kernel (the bulk kernel is the fused path only).
            fwd = "-" if cfg.get("backend") == "bulk" else "{:.3f}".format(
                1e3 * median_time(call(None), warmup=2, iters=iters, setup=lambda: x.copy_(pristine)))
            times = [median_time(call(x), warmup=2, iters=iters, setup=lambda: x.copy_(pristine)),
                     median_time(call(grad_buf), warmup=2, iters=iters, setup=lambda: x.copy_(pristine))]
            out[name] = (cfg, "fwd {} inplace {:.3f} copy {:.3f}".format(fwd, *(t * 1e3 for t in times)))
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile or run is a result
            out[name] = (None, f"error {type(exc).__name__}: {str(exc)[:80]}")
    return out
