"""Shared benchmark helpers: machine description, timing, the printed table."""
from __future__ import annotations

import os
import platform
import statistics
import time

import torch


def machine_info() -> dict:
    info = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["num_gpus"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
    return info


def median_time(fn, *, warmup: int = 3, iters: int = 10, setup=None) -> float:
    """Median seconds of `fn()`; `setup()` runs untimed before each call (e.g. fresh in-place inputs)."""
    cuda = torch.cuda.is_available()
    times = []
    for i in range(warmup + iters):
        if setup is not None:
            setup()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def print_table(record: dict) -> None:
    rows = []
    for section in ("figures", "baseline", "ratios"):
        for k, v in (record.get(section) or {}).items():
            rows.append((section, k, f"{v:.4g}" if isinstance(v, float) else str(v)))
    width = max((len(r[1]) for r in rows), default=10)
    for section, k, v in rows:
        print(f"{section:9s} {k:{width}s} {v}")
