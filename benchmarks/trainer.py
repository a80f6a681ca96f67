"""Benchmark profile `trainer`: learner steps (FSDP2 + LoRA) with packed micro-batches against the old
padded layout, on the 7B shape with random weights, in one run.

Launch: `python scripts/benchmark.py --profile trainer [--num-gpus 2]`. The profile spawns one worker
process per GPU itself (torch.multiprocessing, NCCL); `--quick` runs the tiny shape on 2 CPU
processes (gloo) as a smoke test. Every worker is a learner rank: same model, same step code
(`colocate.learner.Learner`, through `padded.PaddedLearner`), its own synthetic trajectories.

Variants, measured in this order (the model is built once without and once with activation
checkpointing):
  padded    the old setting (`padded.py`): micro-batches of `--padded-batch` sequences left-padded
            to the longest, SDPA with a padding mask, peft's own LoRA forward (the baseline;
            `--baseline-fused` gives it our fused LoRA epilogue too; `--padded-batch 0` skips it)
  packed-B  token-budget packing to B tokens, varlen flash attention (`--budgets`): flat, every
            sequence whole (`learner.prefix_sharing: off`)
  tree-B    the same budgets with prefix trees (`learner.prefix_sharing: tree`, FlexAttention;
  group-B   `group`: only whole prompts shared), for each mode in `--prefix-sharing`
  compiled-tree-B  tree with torch.compile per decoder block (`--compile-tree-budget`; 0 skips)
  gspo-B    packed, with GSPO's sequence ratio (`loss.ratio_level: sequence`): the loss's row scale
            deferred to the lm_head's input, as the learner runs it; gspo-two-pass-B the same with
            two loss passes (`--objectives gspo,gspo-two-pass`, at the first budget)
  sdpa-B    packed, but SDPA with a dense block-diagonal mask (`--sdpa-budget`; 0 skips)
  ac-B      packed with activation checkpointing (`--ac-budget`; 0 skips)
  compiled-B packed with torch.compile per decoder block (`--compile-budget`; 0 skips; the
            first steps compile and are not timed)
  gathered-B packed, each block's weights kept gathered from forward to backward
            (`learner.reshard_after_forward: false`, `--gathered-budget`; 0 skips)
Per variant: `--warmup` untimed steps, then the median of `--steps` timed steps; peak memory per
rank (max_memory_allocated) over the variant; samples/s; tokens forwarded per step (all ranks) beside
the flat equivalent. tokens/s and MFU count the flat layout's tokens and FLOPs for every variant
(work done per second as flat packing would count it), so a tree's figures are effective ones.
The issue-27 workload (the e2e run's batches: 32 groups x 2 continuations x 7 powers on one learner):
`--num-gpus 1 --seqs-per-rank 448 --group-size 2 --budgets 16384 --prefix-sharing tree,group
--padded-batch 0 --sdpa-budget 0 --ac-budget 0`.

The synthetic trajectories and the MFU formula: `trainer_workload.py`.
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import torch

from benchmarks.trainer_workload import PEAK_FLOPS, SyntheticVocab, batch_stats, diplomacy_like_batch, step_flops

# Variants that differ from packed only in the learner's settings, each run last at its own budget:
# kind -> (budget argument, learner settings beyond packed's)
LEARNER_VARIANTS = {
    "compiled": ("compile_budget", {"compile": True}),
    "gathered": ("gathered_budget", {"reshard_after_forward": False}),
    "compiled-tree": ("compile_tree_budget", {"compile": True, "prefix_sharing": "tree"}),
}
SHARING_KINDS = ("tree", "group")  # packed variants whose kind is their learner.prefix_sharing
OBJECTIVE_KINDS = {"gspo": True, "gspo-two-pass": False}  # packed GSPO variants: whether the row scale is deferred


def add_args(parser) -> None:
    parser.add_argument("--num-gpus", type=int, default=0, help="worker processes (default: all GPUs; --quick 2)")
    parser.add_argument("--shape", default="", help="model shape (default qwen2.5-7b; --quick tiny)")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--seqs-per-rank", type=int, default=48, help="sequences per learner rank per step")
    parser.add_argument("--group-size", type=int, default=4, help="samples sharing one prompt")
    parser.add_argument("--padded-batch", type=int, default=4,
                        help="sequences per padded micro-batch (baseline; 0 skips it)")
    parser.add_argument("--baseline-fused", action="store_true",
                        help="the baseline uses our fused LoRA epilogue too (default: peft's forward, as the old setting)")
    parser.add_argument("--budgets", default="", help="packed token budgets, comma separated (default 8192,12288)")
    parser.add_argument("--sdpa-budget", type=int, default=-1, help="dense-mask SDPA variant budget (0 skips)")
    parser.add_argument("--ac-budget", type=int, default=-1, help="activation-checkpointing variant budget (0 skips)")
    parser.add_argument("--extra-budget", type=int, default=0, help="one more packed budget, run last (OOM risk)")
    parser.add_argument("--compile-budget", type=int, default=0,
                        help="packed with torch.compile per block at this budget, run last (0 skips)")
    parser.add_argument("--gathered-budget", type=int, default=0,
                        help="packed with learner.reshard_after_forward=false (blocks stay gathered from forward to "
                             "backward: half the all-gathers) at this budget, run last (0 skips)")
    parser.add_argument("--prefix-sharing", default="",
                        help="also run these learner.prefix_sharing modes (tree, group; comma separated) "
                             "at each budget")
    parser.add_argument("--compile-tree-budget", type=int, default=0,
                        help="prefix trees with torch.compile per block at this budget, run last (0 skips)")
    parser.add_argument("--objectives", default="",
                        help=f"GSPO variants at the first budget, comma separated: {', '.join(OBJECTIVE_KINDS)}")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--loss-impl", default="auto", choices=("auto", "triton", "torch"))
    parser.add_argument("--time-limit-s", type=float, default=330.0,
                        help="no new variant starts after this many seconds (the rest are reported as skipped)")
    parser.add_argument("--partial", default="", help="also write the record here after every variant")
    parser.add_argument("--trace-variant", default="",
                        help="after timing these variants (comma separated, e.g. packed-16384,compiled-16384), one "
                             "more step each under torch.profiler: rank 0's GPU time by kernel family and its idle "
                             "gaps go in the record under 'traces'")
    parser.add_argument("--trace-dir", default="",
                        help="also write those steps' Chrome traces here (trace-<variant>-rank0.json.gz)")
    parser.add_argument("--trace-host", action="store_true",
                        help="profile the traced steps' host side too (CPU operators, the learner's annotations, "
                             "GC pauses): 'host_gaps' then names what the host did in the GPU's longest idle gaps "
                             "(the step runs slower under it)")


def run(args) -> dict:
    import torch.multiprocessing as mp
    quick = args.quick
    if not torch.cuda.is_available() and not quick:
        raise SystemExit("the trainer profile needs CUDA GPUs (or --quick for the CPU smoke test)")
    num = args.num_gpus or (2 if quick else torch.cuda.device_count())
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        port = _free_port()
        mp.start_processes(_worker, args=(num, port, vars(args), result_path), nprocs=num, join=True,
                           start_method="spawn")
        with open(result_path) as f:
            record = json.load(f)
    print(f"{'variant':20s} {'samples/s':>9s} {'tok/s':>9s} {'MFU':>6s} {'step_s':>7s} {'peak_GB':>8s} {'micro':>5s} "
          f"{'forwarded':>10s} {'flat':>10s}")
    for v in record["variants"]:
        print(f"{v['name']:20s} {v['samples_per_s']:9.1f} {v['tokens_per_s']:9.0f} {v['mfu']:6.3f} {v['step_s']:7.2f} "
              f"{max(v['peak_gb']):8.1f} {v['micro_batches_per_rank']:5.0f} {v['tokens_forwarded']:10.0f} "
              f"{v['tokens_flat_equivalent']:10.0f}")
    return record


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the worker -----------------------------------------------------------------------------------

def _worker(rank: int, world: int, port: int, args: dict, result_path: str) -> None:
    import datetime
    import torch.distributed as dist
    from colocate.topology import split_cpu_threads
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    cuda = torch.cuda.is_available() and not args["quick"]
    if cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        split_cpu_threads(world)  # as train.py: the cores split among the ranks
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=180), device_id=device if cuda else None)
    try:
        record = _measure(rank, world, device, args)
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump(record, f)
    finally:
        dist.destroy_process_group()


def _log0(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"[trainer-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- one run: the variants in order ------------------------------------------------------------

@dataclass
class _Run:
    """What every variant of one benchmark run shares, on one rank."""
    rank: int
    world: int
    device: torch.device
    args: dict
    shape: str
    budgets: list[int]
    loss_impl: str
    packed_attention: str
    topo: object
    vocab: SyntheticVocab
    batch: object   # this rank's TrajectoryBatch, the same every step
    stats: dict     # batch_stats(batch)
    t_start: float
    record: dict = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def trace_names(self) -> list[str]:
        return [n.strip() for n in (self.args.get("trace_variant") or "").split(",") if n.strip()]

    def out_of_time(self) -> bool:
        return time.perf_counter() - self.t_start > self.args["time_limit_s"]

    def log(self, msg: str) -> None:
        _log0(self.rank, msg)

    def save_partial(self) -> None:
        if self.rank == 0 and self.args["partial"]:
            with open(self.args["partial"], "w") as f:
                json.dump(self.record, f, indent=2)

    def config(self, ac: bool, budget: int, **learner):
        from colocate.config import load_config
        return load_config(None, {
            "model": {"shape": self.shape, "dtype": "bfloat16" if self.cuda else "float32", "seed": 0},
            "lora": {"rank": self.args["lora_rank"], "alpha": 2.0 * self.args["lora_rank"]},
            "engine": {"max_new_tokens": 100, "temperature": 1.0},
            "learner": {"lr": 1e-5, "micro_batch_tokens": budget, "activation_checkpointing": ac, "fsdp": True,
                        "attention": "auto", "max_policy_lag": 1_000_000, **learner},
            "loss": {"beta": 0.0, "norm": "dapo", "impl": self.loss_impl},
        })


def _measure(rank: int, world: int, device: torch.device, args: dict) -> dict:
    run = _start_run(rank, world, device, args)
    for ac, variants in _plans(args, run.budgets):
        if run.out_of_time():
            run.record["skipped"] += [f"{k}-{b}" for k, b in variants]
            continue
        _run_plan(run, ac, variants)
    run.record["skipped"] += [f"trace {n}: no variant of that name ran" for n in run.trace_names
                              if n not in {v["name"] for v in run.record["variants"]}]
    _summarize(run.record)
    run.save_partial()
    return run.record


def _start_run(rank: int, world: int, device: torch.device, args: dict) -> _Run:
    """Pick the loss and the packed attention that run here, and make this rank's batch."""
    import torch.distributed as dist
    from colocate.topology import Topology
    t_start = time.perf_counter()
    quick = args["quick"]
    shape = args["shape"] or ("tiny" if quick else "qwen2.5-7b")
    budgets = [int(b) for b in (args["budgets"] or ("256,512" if quick else "8192,12288")).split(",") if b]
    vocab = SyntheticVocab(512 if shape == "tiny" else 151646)
    loss_impl = _pick_loss_impl(args["loss_impl"], device)
    packed_attention, probe = _pick_packed_attention(device)
    _log0(rank, f"flash varlen probe: {probe} -> packed attention {packed_attention}")
    cuda = device.type == "cuda"
    topo = Topology(rank=rank, world_size=world, local_rank=rank, num_inference=0, num_learners=world,
                    device=device, backend="nccl" if cuda else "gloo", learner_group=dist.new_group(list(range(world))))
    batch = diplomacy_like_batch(args["seqs_per_rank"], len(vocab), args["group_size"], seed=1000 + rank,
                                 scale=0.05 if quick else 1.0)  # --quick: sequences 20x shorter
    run = _Run(rank, world, device, args, shape, budgets, loss_impl, packed_attention, topo, vocab, batch,
               batch_stats(batch), t_start)
    run.record = {"figures": {}, "baseline": {}, "ratios": {}, "variants": [], "skipped": [],
                  "setup": _setup_record(run, probe)}
    return run


def _setup_record(run: _Run, probe: dict) -> dict:
    ours = "fused" if run.config(False, 1).lora.fused_epilogue else "peft"
    return {"shape": run.shape, "num_ranks": run.world, "lora_rank": run.args["lora_rank"],
            "loss_impl": run.loss_impl, "batch_per_rank": dict(run.stats), "peak_flops": PEAK_FLOPS,
            "torch": torch.__version__, "varlen_probe": probe, "packed_attention": run.packed_attention,
            "lora_epilogue": {"baseline": "fused" if run.args["baseline_fused"] else "peft", "ours": ours}}


def _plans(args: dict, budgets: list[int]) -> list[tuple[bool, list[tuple[str, int]]]]:
    """One entry per model build, in run order: (activation checkpointing, [(kind, budget)])."""
    quick = args["quick"]
    sdpa_budget = args["sdpa_budget"] if args["sdpa_budget"] >= 0 else (256 if quick else 8192)
    ac_budget = args["ac_budget"] if args["ac_budget"] >= 0 else (512 if quick else 16384)
    modes = [m.strip() for m in (args.get("prefix_sharing") or "").split(",") if m.strip()]
    objectives = [o.strip() for o in (args.get("objectives") or "").split(",") if o.strip()]
    for flag, given, allowed in (("--prefix-sharing", modes, SHARING_KINDS), ("--objectives", objectives,
                                                                           OBJECTIVE_KINDS)):
        bad = [m for m in given if m not in allowed]
        if bad:
            raise SystemExit(f"{flag} takes {', '.join(allowed)}, got {', '.join(bad)}")
    plans = [(False, ([("padded", 0)] if args["padded_batch"] > 0 else []) + [("packed", b) for b in budgets]
              + [(m, b) for b in budgets for m in modes] + [(o, budgets[0]) for o in objectives]
              + ([("sdpa", sdpa_budget)] if sdpa_budget else [])),
             (True, [("ac", ac_budget)] if ac_budget else []),
             (False, [("packed", args["extra_budget"])] if args["extra_budget"] else []),
             *[(False, [(kind, args[arg])]) for kind, (arg, _) in LEARNER_VARIANTS.items() if args.get(arg)]]
    return [(ac, variants) for ac, variants in plans if variants]


def _run_plan(run: _Run, ac: bool, variants: list[tuple[str, int]]) -> None:
    """Build the model once, time each of `variants` on it, free it."""
    t0 = time.perf_counter()
    kind0, budget0 = variants[0]
    settings = LEARNER_VARIANTS[kind0][1] if kind0 in LEARNER_VARIANTS else {}
    learner, p_blocks = _build(run.config(ac, budget0 or run.budgets[0], **settings), run.topo, run.vocab)
    build_s = time.perf_counter() - t0
    run.log(f"built {run.shape} (ac={ac}) in {build_s:.1f}s")
    if "check" not in run.record:
        run.record["check"] = _check_packed_equals_padded(learner, run.batch, run.device, run.packed_attention)
        run.log(f"packed vs padded log-probs: {run.record['check']}")
        run.record["tree_check"] = _check_tree_equals_flat(learner, run.batch, run.device, run.packed_attention)
        run.log(f"tree vs flat log-probs: {run.record['tree_check']}")
    for kind, budget in variants:
        if run.out_of_time():
            run.record["skipped"].append(f"{kind}-{budget}")
            continue
        _run_variant(run, learner, kind, budget, p_blocks, build_s)
    del learner
    gc.collect()
    if run.cuda:
        torch.cuda.empty_cache()


def _run_variant(run: _Run, learner, kind: str, budget: int, p_blocks: int, build_s: float) -> None:
    """Time one variant into the record (a failure is recorded as skipped), then trace it if asked."""
    try:
        result = _time_variant(run, learner, kind, budget, p_blocks)
    except Exception as e:  # noqa: BLE001 - e.g. a compiler failure: the same on every rank
        reason = f"{type(e).__name__}: {str(e)[:300]}"
        run.record["skipped"].append(f"{kind}-{budget}: {reason}")
        run.log(f"{kind}-{budget} failed: {reason}")
        run.save_partial()
        return
    result.update(name=f"{kind}-{budget}" if budget else kind, build_s=build_s)
    run.record["variants"].append(result)
    if result["name"] in run.trace_names:  # one more step, profiled; every rank steps (FSDP)
        _trace_variant(run, learner, result)
    run.log(f"{result['name']}: {result['tokens_per_s']:.0f} tok/s, MFU {result['mfu']:.3f}, "
            f"step {result['step_s']:.2f}s, peak {max(result['peak_gb']):.1f} GB")
    run.save_partial()


def _trace_variant(run: _Run, learner, result: dict) -> None:
    out = ""
    if run.rank == 0 and run.args.get("trace_dir"):
        os.makedirs(run.args["trace_dir"], exist_ok=True)
        out = os.path.join(run.args["trace_dir"], f"trace-{result['name']}-rank0.json.gz")
    try:
        traced = _trace_step(learner, run.batch, run.device, out, host=bool(run.args.get("trace_host")))
        trace = {"median_step_ms": result["step_s"] * 1e3, **traced}
        run.record.setdefault("traces", {})[result["name"]] = trace
        run.log(f"trace of {result['name']}: {json.dumps(trace)[:600]}")
    except Exception as e:  # noqa: BLE001 - e.g. out of memory under the profiler: keep the rest
        run.record["skipped"].append(f"trace {result['name']}: {type(e).__name__}: {str(e)[:300]}")


def _pick_loss_impl(choice: str, device: torch.device) -> str:
    """The Triton loss if it runs here (a tiny fwd+bwd), else the PyTorch reference."""
    if choice != "auto" or device.type != "cuda":
        return choice if choice != "auto" else "torch"
    from colocate.kernels import LossBatch, LossSpec, grpo_loss
    try:
        logits = torch.randn(8, 1024, device=device, dtype=torch.bfloat16, requires_grad=True)
        targets = torch.randint(0, 1024, (8,), device=device)
        loss, _ = grpo_loss(logits, LossBatch(targets, torch.ones(8, dtype=torch.bool, device=device),
                                              torch.full((8,), -7.0, device=device), torch.randn(8, device=device)),
                            LossSpec(impl="triton"))
        loss.backward()
        torch.cuda.synchronize()
        return "triton"
    except Exception as e:  # noqa: BLE001 - any failure means: use the reference
        print(f"[trainer-bench] triton loss unavailable ({type(e).__name__}: {e}); using torch", flush=True)
        return "torch"


def _pick_packed_attention(device: torch.device) -> tuple[str, dict]:
    """VARLEN when torch's flash varlen kernel agrees with grouped SDPA here, else VARLEN_GROUPED."""
    from colocate.learner.packing import VARLEN, VARLEN_GROUPED, check_varlen_kernel, register_varlen_attention
    register_varlen_attention()
    try:
        probe = check_varlen_kernel(device)
    except Exception as e:  # noqa: BLE001 - a failing kernel means: use the fallback
        probe = {"kernel": False, "error": f"{type(e).__name__}: {e}"[:300]}
    ok = probe.get("kernel") and probe["out_rel_err"] < 2e-2 and probe["grad_rel_err"] < 2e-2
    return (VARLEN if ok else VARLEN_GROUPED), probe


def _build(cfg, topo, vocab):
    from benchmarks.padded import PaddedLearner
    from colocate.models import build_policy
    learner = PaddedLearner(cfg, topo, build_policy(cfg, vocab, "meta"), vocab)
    p_blocks = sum(p.numel() for n, p in learner.model.named_parameters() if ".layers." in n and "lora_" not in n)
    return learner, p_blocks


# ---- one variant --------------------------------------------------------------------------------

def _time_variant(run: _Run, learner, kind: str, budget: int, p_blocks: int) -> dict:
    """Median step time, throughput, MFU and peak memory per rank of one variant."""
    _select_layout(run, learner, kind, budget)
    if run.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t_first = time.perf_counter()
    times, first_step_s, out = _timed_steps(run, learner, kind)
    peaks = _peak_memory(run, learner)
    step_s = statistics.median(times)
    total = {k: run.stats[k] * run.world for k in ("tokens", "completion_tokens", "sum_sq_len")}
    flops = step_flops(learner.model.config, p_blocks, total)
    return {"kind": kind, "budget": budget, "step_s": step_s, "step_times": times, "first_step_s": first_step_s,
            "variant_s": time.perf_counter() - t_first, "samples_per_s": run.stats["sequences"] * run.world / step_s,
            "tokens_forwarded": out["tokens_forwarded"], "tokens_flat_equivalent": out["tokens_flat_equivalent"],
            "tokens_per_s": total["tokens"] / step_s, "completion_tokens_per_s": total["completion_tokens"] / step_s,
            "mfu": flops / (step_s * run.world * PEAK_FLOPS), "tflops_per_gpu": flops / step_s / run.world / 1e12,
            "micro_batches_per_rank": out["micro_batches"], "peak_gb": [float(p[0]) for p in peaks],
            "reserved_gb": [float(p[1]) for p in peaks], "loss": out["loss"], "grad_norm": out["grad_norm"]}


def _select_layout(run: _Run, learner, kind: str, budget: int) -> None:
    """Point the one learner at this variant: padded chunks (the baseline) or packing at `budget`."""
    from dataclasses import replace

    from colocate.kernels import Objective
    from colocate.learner.passes import lm_head_frozen
    from colocate.learner.loss import loss_spec
    from colocate.learner.packing import resolve_attention
    from colocate.models import set_fused_lora
    learner.spec = loss_spec(learner.cfg)
    learner.defer_row_scale = lm_head_frozen(learner.model) and OBJECTIVE_KINDS.get(kind, True)
    if kind in OBJECTIVE_KINDS:
        learner.spec = replace(learner.spec, objective=Objective(ratio_level="sequence"),
                               eps_low=learner.cfg.loss.seq_eps_low, eps_high=learner.cfg.loss.seq_eps_high)
    set_fused_lora(learner.model, learner.cfg.lora.fused_epilogue and (kind != "padded" or run.args["baseline_fused"]))
    if kind != "padded":
        learner.cfg.learner.micro_batch_tokens = budget
    sharing = _sharing(kind)
    learner.cfg.learner.prefix_sharing = sharing
    attention = "sdpa" if kind == "sdpa" else run.packed_attention
    if sharing != "off":
        attention = resolve_attention("auto", run.device, sharing)
    learner.use_layout(run.args["padded_batch"] if kind == "padded" else 0, attention)


def _sharing(kind: str) -> str:
    """The variant's learner.prefix_sharing."""
    if kind in SHARING_KINDS:
        return kind
    return LEARNER_VARIANTS[kind][1].get("prefix_sharing", "off") if kind in LEARNER_VARIANTS else "off"


def _timed_steps(run: _Run, learner, kind: str) -> tuple[list[float], float | None, dict]:
    """Warm-up then timed steps -> (timed step seconds, the first warm-up step's, the last step's stats).
    A step's time is the slowest rank's."""
    import torch.distributed as dist
    warmup = max(run.args["warmup"], 2) if kind == "compiled" else run.args["warmup"]  # compile, then recompiles
    times, first_step_s, out = [], None, {}
    for i in range(warmup + run.args["steps"]):
        run.batch.versions[:] = learner.version
        if run.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = learner.train_step(run.batch)
        if run.cuda:
            torch.cuda.synchronize()
        dt = torch.tensor([time.perf_counter() - t0], device=run.device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=learner.topology.learner_group)
        if i >= warmup:
            times.append(float(dt))
        elif i == 0:
            first_step_s = float(dt)
    return times, first_step_s, out


def _peak_memory(run: _Run, learner) -> list[torch.Tensor]:
    """Per rank: [2] GB peak allocated, peak reserved (zeros on CPU)."""
    import torch.distributed as dist
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if run.cuda else 0.0,
                         torch.cuda.max_memory_reserved() / 2**30 if run.cuda else 0.0], device=run.device)
    peaks = [torch.zeros_like(peak) for _ in range(run.world)]
    dist.all_gather(peaks, peak, group=learner.topology.learner_group)
    return peaks


def _trace_step(learner, batch, device, trace_out: str, host: bool = False) -> dict:
    """One learner step (as timed before it) under torch.profiler: `common.trace_call`'s summary."""
    from benchmarks.common import trace_call
    batch.versions[:] = learner.version
    return trace_call(lambda: learner.train_step(batch), device.type == "cuda", trace_out, host)


@torch.no_grad()
def _check_packed_equals_padded(learner, batch, device, attention) -> dict:
    """Log-probs of 8 sequences: packed (varlen) against padded (SDPA + mask), same sharded model."""
    from benchmarks.padded import padded_micro_batch
    from colocate.kernels.reference import per_token_logprobs
    from colocate.learner.packing import completion_logits, packed_micro_batch, set_attention
    sub = batch.select(list(range(min(8, batch.num_sequences))))
    packed = packed_micro_batch(sub, device, attention)
    set_attention(learner.model, attention)
    lp_packed = per_token_logprobs(completion_logits(learner.model, packed).float(), packed.targets, 1.0)
    padded = padded_micro_batch(sub, learner.pad_id, device)
    set_attention(learner.model, "sdpa")
    lp_padded = per_token_logprobs(completion_logits(learner.model, padded).float(), padded.targets, 1.0)
    set_attention(learner.model, learner.attention)
    diff = (lp_packed - lp_padded).abs()
    return {"attention": attention, "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
            "mean_logprob": float(lp_padded.mean()), "tokens": int(diff.numel())}


@torch.no_grad()
def _check_tree_equals_flat(learner, batch, device, attention) -> dict:
    """Log-probs of the first 2 x 7 x G sequences (two boards): prefix tree (FlexAttention on CUDA)
    against flat packing (`attention`), same sharded model."""
    from colocate.kernels.reference import per_token_logprobs
    from colocate.learner.packing import (completion_logits, packed_micro_batch, resolve_attention, set_attention,
                                          tree_micro_batch)
    sub = batch.select(list(range(min(28, batch.num_sequences))))
    tree_attention = resolve_attention("auto", device, "tree")
    tree = tree_micro_batch(sub, device, tree_attention, "tree")
    set_attention(learner.model, tree_attention)
    lp_tree = per_token_logprobs(completion_logits(learner.model, tree).float(), tree.targets, 1.0)
    flat = packed_micro_batch(sub, device, attention)
    set_attention(learner.model, attention)
    lp_flat = per_token_logprobs(completion_logits(learner.model, flat).float(), flat.targets, 1.0)
    set_attention(learner.model, learner.attention)
    diff = (lp_tree - lp_flat).abs()
    return {"attention": tree_attention, "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
            "tokens_tree": tree.num_tokens, "tokens_flat": flat.num_tokens, "completion_tokens": int(diff.numel())}


def _summarize(record: dict) -> None:
    by_name = {v["name"]: v for v in record["variants"]}
    base = by_name.get("padded")
    packed = [v for v in record["variants"] if v["kind"] in ("packed", *SHARING_KINDS) or v["kind"] in LEARNER_VARIANTS]
    if base:
        record["baseline"] = {"padded_tokens_per_s": base["tokens_per_s"], "padded_mfu": base["mfu"],
                              "padded_step_s": base["step_s"], "padded_peak_gb": max(base["peak_gb"])}
    if packed:
        best = max(packed, key=lambda v: v["tokens_per_s"])
        record["figures"] = {"best": best["name"], "tokens_per_s": best["tokens_per_s"], "mfu": best["mfu"],
                             "step_s": best["step_s"], "peak_gb": max(best["peak_gb"])}
        for v in record["variants"]:
            if v["kind"] != "padded":
                record["figures"][f"{v['name']}_tokens_per_s"] = v["tokens_per_s"]
                record["figures"][f"{v['name']}_mfu"] = v["mfu"]
                record["figures"][f"{v['name']}_peak_gb"] = max(v["peak_gb"])
                record["figures"][f"{v['name']}_samples_per_s"] = v["samples_per_s"]
                record["figures"][f"{v['name']}_tokens_forwarded"] = v["tokens_forwarded"]
        if base:
            record["ratios"] = {"tokens_per_s_vs_padded": best["tokens_per_s"] / base["tokens_per_s"]}
    for v in record["variants"]:  # prefix sharing against flat packing at the same budget
        flat = by_name.get(f"packed-{v['budget']}")
        if v["kind"] in SHARING_KINDS and flat:
            record["ratios"][f"{v['name']}_samples_per_s_vs_flat"] = v["samples_per_s"] / flat["samples_per_s"]
            record["ratios"][f"{v['name']}_tokens_forwarded_vs_flat"] = v["tokens_forwarded"] / flat["tokens_forwarded"]
