"""The behaviour log-prob inside vLLM's sampler: our one-read kernel in place of vLLM's.

Every request of ours asks vLLM for `logprobs=0`: the sampled token's processed log-prob (and,
because vLLM always returns it, its rank). vLLM 0.25's V2 sampler computes that with one program
per row reading the row three times (`compute_topk_logprobs`); `colocate.kernels.sampled_logprob`
reads it once, spread over the whole GPU. `install` (run in vLLM's worker process through
`ColocateWorkerExtension.colocate_use_logprob_kernel`, `engine.logprob_kernel: ours`) swaps the
sampler's reference to that function for one that takes the requests asking exactly that and
hands every other call (top-k log-probs, custom token ids) to vLLM's own. The returned tensors have
vLLM's shapes and dtypes; vLLM's function is the reference of the parity test
(`tests/test_sampled_logprob.py`).
"""
from __future__ import annotations

SAMPLER_MODULE = "vllm.v1.worker.gpu.sample.sampler"


def sampled_only(original):
    """vLLM's `compute_topk_logprobs` -> the same function, with our kernel for `num_logprobs=0`."""
    from colocate.kernels.sampled_logprob import sampled_logprob

    def compute_topk_logprobs(logits, num_logprobs, sampled_token_ids, cu_num_logits=None, **kwargs):
        if num_logprobs != 0 or kwargs.get("max_per_req_token_ids", 0):
            return original(logits, num_logprobs, sampled_token_ids, cu_num_logits, **kwargs)
        from vllm.v1.outputs import LogprobsTensors
        logprobs, ranks = sampled_logprob(logits, sampled_token_ids)
        return LogprobsTensors(logprob_token_ids=sampled_token_ids.unsqueeze(-1), logprobs=logprobs.unsqueeze(-1),
                               selected_token_ranks=ranks, cu_num_generated_tokens=cu_num_logits)
    compute_topk_logprobs.colocate_original = original
    return compute_topk_logprobs


def install() -> str:
    """Put `sampled_only` in vLLM's sampler; returns what computes the log-probs now ("ours", or
    "vllm" where this vLLM has no V2 sampler to patch)."""
    import importlib
    try:
        sampler = importlib.import_module(SAMPLER_MODULE)
    except ImportError:
        return "vllm"
    current = getattr(sampler, "compute_topk_logprobs", None)
    if current is None:
        return "vllm"
    if not hasattr(current, "colocate_original"):
        sampler.compute_topk_logprobs = sampled_only(current)
    return "ours"
