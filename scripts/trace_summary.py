"""Where a profiled region's GPU time went: kernel families, idle gaps, top kernels, per trace file.

    python scripts/trace_summary.py profiles/<run>/inference-engine/*.json.gz profiles/<run>/*.pt.trace.json

Reads torch.profiler Chrome traces (the role traces of `metrics.profile`, vLLM's engine-core trace,
the trainer benchmark's `--trace-dir` files) and prints a JSON list, one summary per file
(`benchmarks.common.summarize_trace`): over the span of the GPU work, the time at least one
kernel ran, the idle fraction, time per kernel family (GEMM, attention, NCCL, the GRPO loss,
inductor's Triton kernels, other), the top kernels, and under "host" the CPU side's annotated
regions (e.g. vLLM's "gpu_model_runner: forward") and CUDA runtime calls (cudaGraphLaunch or not).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import summarize_trace  # noqa: E402


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__)
        return 2
    print(json.dumps([summarize_trace(path) for path in paths], indent=1))  # one JSON list, one entry per file
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
