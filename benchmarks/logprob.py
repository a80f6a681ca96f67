"""Benchmark profile `logprob`: the sampled token's log-prob and rank inside vLLM's sampler, vLLM
0.25's V2 `compute_topk_logprobs(logits, 0, ids)` (one program per row, three reads) against ours
(`colocate.kernels.sampled_logprob`, one read over the whole GPU), on the float32 logits of one
decode step at the Qwen2.5 vocabulary (152,064) for `--rows` sequences.

Figures per row count: median device ms of each (`common.gpu_time_ms`: CUDA events around 20
calls with the host running ahead, divided by 20), and the largest difference of their log-probs
(ranks must be equal).
"""
from __future__ import annotations

VOCAB = 152064


def add_args(parser) -> None:
    parser.add_argument("--rows", default="16,64,128,256", help="comma-separated sequences per decode step")
    parser.add_argument("--iters", type=int, default=10)


def run(args) -> dict:
    import torch
    from vllm.v1.worker.gpu.sample.logprob import compute_topk_logprobs

    from benchmarks.common import gpu_time_ms
    from colocate.kernels.sampled_logprob import sampled_logprob
    figures, baseline, ratios = {}, {}, {}

    def device_ms(step) -> float:
        return gpu_time_ms(step, lambda: None, args.iters, calls=20)

    g = torch.Generator(device="cuda").manual_seed(0)
    for rows in [int(r) for r in args.rows.split(",")]:
        logits = torch.randn(rows, VOCAB, device="cuda", generator=g) * 4
        ids = torch.randint(0, VOCAB, (rows,), device="cuda", generator=g)
        theirs = compute_topk_logprobs(logits, 0, ids)
        logprobs, ranks = sampled_logprob(logits, ids)
        assert torch.equal(theirs.selected_token_ranks, ranks), "ranks differ"
        figures[f"rows{rows}_max_abs_diff"] = float((theirs.logprobs.squeeze(1) - logprobs).abs().max())
        baseline[f"rows{rows}_vllm_ms"] = device_ms(lambda: compute_topk_logprobs(logits, 0, ids))
        figures[f"rows{rows}_ours_ms"] = device_ms(lambda: sampled_logprob(logits, ids))
        ratios[f"rows{rows}_ours_vs_vllm"] = baseline[f"rows{rows}_vllm_ms"] / figures[f"rows{rows}_ours_ms"]
    return {"figures": figures, "baseline": baseline, "ratios": ratios}
