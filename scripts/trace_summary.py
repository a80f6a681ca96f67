"""Where a profiled region's GPU time went: kernel families, idle gaps, top kernels, per trace file.

    python scripts/trace_summary.py profiles/<run>/inference-engine/*.json.gz profiles/<run>/*.pt.trace.json

Reads torch.profiler Chrome traces (the role traces of `metrics.profile`, vLLM's engine-core trace,
the trainer benchmark's `--trace-dir` files) and prints one JSON summary per file
(`colocate.benchmarks.common.summarize_trace`): over the span of the GPU work, the time at least one
kernel ran, the idle fraction, time per kernel family (GEMM, attention, NCCL, the GRPO loss,
inductor's Triton kernels, other) and the top kernels.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from colocate.benchmarks.common import summarize_trace  # noqa: E402


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__)
        return 2
    for path in paths:
        print(json.dumps(summarize_trace(path), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
