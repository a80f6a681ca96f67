"""Benchmark profiles for `scripts/benchmark.py`: each module's `run(args)` returns
{"figures": {...}, "baseline": {...}, "ratios": {...}} measured in one process."""
