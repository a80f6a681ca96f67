"""End-to-end profile: the same training job synchronous (max_policy_lag=0) and asynchronous (lag L),
back to back in one benchmark run; steps/hour, learner and inference busy fractions, policy lag.

Busy fractions: learner = time in `train_step` / wall; inference = time playing games (`collect`) /
wall (rank 0's `inference-rank0.json`). On GPU machines the NVML utilization is in TensorBoard
(`system/gpu_util_percent`). Command (CPU smoke):
    python scripts/benchmark.py --profile e2e --config configs/cpu-tiny.yaml --nproc 2 --steps 30
GPU (4 GPUs, 2 + 2): --config configs/gpu-4.yaml --nproc 4 --steps 12 --warmup 2
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile


def add_args(parser) -> None:
    parser.add_argument("--config", default="configs/cpu-tiny.yaml")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lag", type=int, default=1, help="max_policy_lag of the async run")
    parser.add_argument("--set", nargs="*", default=[], help="extra --section.key=value overrides")


def run_job(args, lag: int, run_dir: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           "-m", "colocate.train", "--config", args.config, f"--learner.num_steps={args.steps}",
           f"--learner.max_policy_lag={lag}", f"--metrics.run_dir={run_dir}", *args.set]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"e2e run (lag {lag}) failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, "inference-rank0.json")) as f:
        inference = json.load(f)
    return {"steps_per_hour": summary["steps_per_hour"], "seconds_per_step": 3600 / summary["steps_per_hour"],
            "learner_busy_fraction": summary["learner_busy_fraction"],
            "inference_busy_fraction": inference["busy_fraction"], "dropped_stale": summary["dropped_stale"],
            "reward_end": summary["reward_end"]}


def run(args) -> dict:
    root = tempfile.mkdtemp(prefix="colocate-e2e-")
    sync = run_job(args, 0, os.path.join(root, "sync"))
    ours = run_job(args, args.lag, os.path.join(root, "async"))
    return {"figures": {f"async_{k}": v for k, v in ours.items()},
            "baseline": {f"sync_{k}": v for k, v in sync.items()},
            "ratios": {"steps_per_hour_async_over_sync": ours["steps_per_hour"] / sync["steps_per_hour"]}}
