"""Soak profile (issue 39): long runs on CPU, to see whether a converged policy stays converged.
Not a CI test: hours of CPU.

Runs cpu-tiny for `--steps` (5000) on each of `--seeds` (0,1,2) and the Diplomacy tiny preset for
`--diplomacy-steps` (1500), 2 processes each, `--jobs` runs at a time, with extra `--set` overrides
for every run (e.g. `--set loss.clip_ratio_c=3`). `--variant NAME:key=value,key=value` (repeatable)
runs the cpu-tiny seeds once per variant, its overrides on top of `--set` (a sweep in one call).
Per run: the reward of the last 1000 steps (mean, min of the 100-step windows), the first step
whose 100-step window reached the env's target, the lowest 100-step window after that, every ALERT
line, the exit code and the wall time.

    python scripts/benchmark.py --profile soak                       # the whole soak
    python scripts/benchmark.py --profile soak --seeds 0 --diplomacy-steps 0   # one cpu-tiny seed
    python scripts/benchmark.py --profile soak --jobs 6 --diplomacy-steps 0 \
        --variant signal:learner.scale_lr_by_signal=true --variant wd:learner.weight_decay=0.5
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor


def add_args(parser) -> None:
    parser.add_argument("--steps", type=int, default=5000, help="cpu-tiny steps per seed")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--diplomacy-steps", type=int, default=1500, help="0 skips the Diplomacy run")
    parser.add_argument("--set", action="append", default=[], help="extra section.key=value for every run")
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME:section.key=value,... : the cpu-tiny seeds once more with these overrides")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (2 processes each)")


def windows(rewards: list[float], size: int = 100) -> list[float]:
    """Means of consecutive (non-overlapping) windows of `size` steps."""
    return [sum(rewards[i:i + size]) / size for i in range(0, len(rewards) - size + 1, size)]


def reward_figures(rewards: list[float], target: float) -> dict:
    """The last-1000-steps figures and the window test of issue 39 (every 100-step window after the
    first that reaches the target stays at or above it)."""
    w = windows(rewards)
    first = next((i for i, v in enumerate(w) if v >= target), None)
    after = w[first + 1:] if first is not None else []
    last = rewards[-1000:]
    return {"last1000_mean": sum(last) / max(len(last), 1), "last1000_min_window": min(windows(last), default=0.0),
            "first_window_at_target": None if first is None else (first + 1) * 100,
            "min_window_after_target": min(after, default=None), "held_target": bool(after) and min(after) >= target}


def parse_variant(text: str) -> tuple[str, list[str]]:
    """'NAME:a.b=1,c.d=2' -> ('NAME', ['a.b=1', 'c.d=2']) (a value cannot hold a comma: use --set)."""
    name, _, sets = text.partition(":")
    if not name or not sets:
        raise SystemExit(f"soak: --variant {text!r}: expected NAME:section.key=value[,section.key=value]")
    return name, [item for item in sets.split(",") if item]


def one_run(config: str, steps: int, seed: int, extra: list[str], name: str, root: str) -> dict:
    run_dir = os.path.join(root, f"{name}-seed{seed}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "colocate.train", "--config", config, f"--learner.num_steps={steps}", f"--rollout.seed={seed}",
           f"--metrics.run_dir={run_dir}", "--metrics.nvml_interval_s=0", *[f"--{s}" for s in extra]]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t0
    alerts = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if " ALERT " in line]
    out = {"name": name, "config": config, "seed": seed, "steps": steps, "overrides": extra,
           "exit_code": proc.returncode, "wall_s": wall, "alerts": alerts}
    print(f"[soak] {name}-seed{seed}: exit {proc.returncode} in {wall:.0f} s", flush=True)
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
    except OSError:
        return {**out, "error": (proc.stderr or "")[-2000:]}
    return {**out, **reward_figures(summary["rewards"], summary["reward_target"]), "rewards": summary["rewards"]}


def curves_svg(runs: list[dict], target: float = 0.9, size: int = 100) -> str:
    """The 100-step window means of every run as lines on one plot (SVG, no plotting library):
    x = step, y = reward 0..1, the target dashed."""
    w, h, pad = 640, 320, 40
    longest = max((len(r.get("rewards", [])) for r in runs), default=0) or 1
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]

    def xy(step: float, reward: float) -> str:
        return f"{pad + (w - 2 * pad) * step / longest:.1f},{h - pad - (h - 2 * pad) * reward:.1f}"

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<polyline points="{xy(0, 0)} {xy(longest, 0)}" stroke="black" fill="none"/>',
           f'<polyline points="{xy(0, 0)} {xy(0, 1)}" stroke="black" fill="none"/>',
           f'<polyline points="{xy(0, target)} {xy(longest, target)}" stroke="gray" stroke-dasharray="4" fill="none"/>',
           f'<text x="{pad - 30}" y="{h - pad + 4}">0</text><text x="{pad - 30}" y="{pad + 4}">1</text>',
           f'<text x="{pad - 34}" y="{h - pad - (h - 2 * pad) * target + 4}">{target}</text>',
           f'<text x="{w - pad - 30}" y="{h - pad + 16}">{longest} steps</text>']
    for i, r in enumerate(runs):
        means = windows(r.get("rewards", []), size)
        if not means:
            continue
        color = colors[i % len(colors)]
        points = " ".join(xy((j + 1) * size, m) for j, m in enumerate(means))
        out.append(f'<polyline points="{points}" stroke="{color}" fill="none"/>')
        out.append(f'<text x="{w - pad - 150}" y="{h - pad - 12 - 13 * i}" fill="{color}">{r["name"]} seed {r["seed"]}</text>')
    out.append("</svg>")
    return "\n".join(out)


def run(args) -> dict:
    seeds = [int(s) for s in args.seeds.split(",") if s]
    variants = [parse_variant(v) for v in args.variant] or [("cpu-tiny", [])]  # a sweep runs its variants only
    names = [name for name, _ in variants]
    if len(set(names)) != len(names) or "cpu-diplomacy-tiny" in names:
        raise SystemExit(f"soak: variant names must be unique (each names its run directories): {names}")
    root = tempfile.mkdtemp(prefix="soak-")
    jobs = [("configs/cpu-tiny.yaml", args.steps, seed, [*args.set, *sets], name)
            for name, sets in variants for seed in seeds]
    if args.diplomacy_steps > 0:
        jobs.append(("configs/cpu-diplomacy-tiny.yaml", args.diplomacy_steps, 0, args.set, "cpu-diplomacy-tiny"))
    with ThreadPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        runs = list(pool.map(lambda job: one_run(*job, root), jobs))
    if args.out:  # the window curves beside the JSON
        with open(os.path.splitext(args.out)[0] + "-curves.svg", "w") as f:
            f.write(curves_svg(runs))
    figures = {}
    for r in runs:
        name = f"{r['name']}-seed{r['seed']}"
        for key in ("last1000_mean", "last1000_min_window", "min_window_after_target", "held_target", "exit_code",
                    "wall_s"):
            figures[f"{name}/{key}"] = r.get(key)
        figures[f"{name}/alerts"] = len(r["alerts"])
    return {"figures": figures, "runs": runs}
