"""The behaviour log-prob inside vLLM's sampler: our one-read kernel in place of vLLM's.

Every request of ours asks vLLM for `logprobs=0`: the sampled token's processed log-prob (and,
because vLLM always returns it, its rank). vLLM 0.25's V2 sampler computes that with one program
per row reading the row three times (`compute_topk_logprobs`); `colocate.kernels.sampled_logprob`
reads it once, spread over the whole GPU. `install` (run in vLLM's worker process through
`ColocateWorkerExtension.colocate_use_logprob_kernel`, `engine.logprob_kernel: ours`) swaps the
sampler's reference to that function for one that takes the requests asking exactly that and
hands every other call (top-k log-probs, custom token ids) to vLLM's own. The returned tensors have
vLLM's shapes and dtypes; vLLM's function is the reference of the parity test
(`tests/test_sampled_logprob.py`). `warm_up` compiles the kernel at engine start, not in the
first rollouts.
"""
from __future__ import annotations

SAMPLER_MODULE = "vllm.v1.worker.gpu.sample.sampler"
HANDLED_KEYWORDS = {"cu_num_logits", "logprob_token_ids_state", "expanded_idx_mapping", "max_per_req_token_ids"}
"""vLLM 0.25's keywords; a call with any other goes to vLLM's own function."""


def sampled_only_call(args: tuple, kwargs: dict):
    """(logits, sampled ids, cu_num_logits) of a `compute_topk_logprobs` call that asks only the
    sampled token's log-prob, as vLLM 0.25's sampler calls it; None for any other call."""
    if not 3 <= len(args) <= 4 or not set(kwargs) <= HANDLED_KEYWORDS:
        return None
    named = dict(zip(("logits", "num_logprobs", "sampled_token_ids", "cu_num_logits"), args)) | kwargs
    if named["num_logprobs"] != 0 or named.get("max_per_req_token_ids", 0):
        return None  # top-k log-probs or custom token ids
    return named["logits"], named["sampled_token_ids"], named.get("cu_num_logits")


CALLS = {"ours": 0, "vllm": 0}
"""Sampler calls served by our kernel and handed to vLLM's function in this worker since the
install (`calls`): that the patch is reached in a running engine, not only installed."""


def calls() -> dict[str, int]:
    return dict(CALLS)


def sampled_only(original):
    """vLLM's `compute_topk_logprobs` -> the same function, with our kernel for `num_logprobs=0`."""
    from colocate.kernels.sampled_logprob import sampled_logprob

    def compute_topk_logprobs(*args, **kwargs):
        call = sampled_only_call(args, kwargs)
        if call is None:
            CALLS["vllm"] += 1
            return original(*args, **kwargs)
        CALLS["ours"] += 1
        from vllm.v1.outputs import LogprobsTensors
        logits, sampled_token_ids, cu_num_logits = call
        logprobs, ranks = sampled_logprob(logits, sampled_token_ids)
        return LogprobsTensors(logprob_token_ids=sampled_token_ids.unsqueeze(-1), logprobs=logprobs.unsqueeze(-1),
                               selected_token_ranks=ranks, cu_num_generated_tokens=cu_num_logits)
    compute_topk_logprobs.colocate_original = original
    return compute_topk_logprobs


def install(runner_module: str) -> str:
    """Put `sampled_only` in vLLM's sampler when the worker runs the V2 model runner (module
    `runner_module`, under vllm.v1.worker.gpu.); returns what computes the log-probs now: "ours",
    or "vllm" (the V1 runner, or a vLLM without the V2 sampler)."""
    import importlib
    if not runner_module.startswith("vllm.v1.worker.gpu."):
        return "vllm"
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


VOCAB_PADDING = 64
"""vLLM pads the LM head's rows to a multiple of this (`DEFAULT_VOCAB_PADDING_SIZE`) and hands the
sampler a view of their first vocab_size columns."""


def warm_up_logits(vocab_size: int, device) -> list:
    """Logits in every layout vLLM's sampler may hand our kernels, in float32 and bfloat16, one row
    and two: rows contiguous (row stride vocab_size) and views of the padded LM head's output (row
    stride vocab_size rounded up to `VOCAB_PADDING`; a float32 copy of one such row keeps it). Triton
    compiles a kernel again for an integer argument of another class (divisible by 16 or not, 1):
    a vocabulary that is no multiple of 16 gives two strides, and a warm-up on both keeps every
    compile at engine start."""
    import torch
    padded = -(-vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    return [torch.zeros(rows, width, dtype=dtype, device=device)[:, :vocab_size]
            for dtype in (torch.float32, torch.bfloat16) for rows in (1, 2)
            for width in dict.fromkeys((vocab_size, padded))]


def warm_up(vocab_size: int, device) -> bool:
    """Run the kernel on logits of the model's width in every layout the sampler may pass
    (`warm_up_logits`), so Triton compiles it now, at engine start, instead of inside the first
    rollouts -> whether it ran. A failure is one line: the kernel then compiles at its first call."""
    import torch
    from colocate.kernels.sampled_logprob import sampled_logprob
    try:
        for logits in warm_up_logits(vocab_size, device):
            rows = logits.shape[0]
            sampled_logprob(logits, torch.zeros(rows, dtype=torch.int64, device=device))
    except Exception as exc:  # noqa: BLE001 - the kernel still compiles when first called
        print(f"colocate: engine.logprob_kernel warm-up failed ({type(exc).__name__}: {exc}); the kernel "
              "compiles in the first rollouts instead", flush=True)
        return False
    return True
