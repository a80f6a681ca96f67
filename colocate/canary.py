"""The sync canary: proof, once per adapter version, that the engine samples the policy being trained.

A run can train one policy while its engine samples another, silently: an update the engine skips,
an adapter written into the wrong slot or with the wrong scale, a merged copy left stale. Checksums
(`sync.check_checksum`) prove the bytes arrived; only the engine's own forward proves they are used.
So both sides score one fixed probe sequence (`probe_ids`: a sentence through the run's tokenizer,
`PROBE_TOKENS` long) with the same adapter version:

  * the learner, in each step's first forward, with the version the step starts from (the one the
    engines got at the end of the step before): the probe rides that forward as one more sequence
    the loss never sees (`Learner.train_step`, `packing.with_rider`; every learner rank carries it
    in its own first pass), so it costs its tokens in a forward that runs anyway instead of a
    forward of its own (with LoRA dropout, which the training forward applies, it still gets one
    after each send: `Learner.score_probe`); the log-probs and the logits' scale stay on the
    device, unread (`CanaryCheck.record`) until the engines' scores of the version are checked;
  * each inference rank, before it samples a batch with a version it has not scored yet
    (`Engine.score`: the HF engine's forward, vLLM's `prompt_logprobs`), and ships the log-probs
    with that batch's trajectories (`wire.ProbeScore` in the shard header: one direction, on the
    existing transport, no extra message or collective).

The learner compares them (`CanaryCheck.check`) in the step whose shards bring the engines' scores,
after that step's forward (so its own reference of the version is there): the gap is the mean
|engine - learner| log-prob over the probe's tokens (nats), `sync/canary_gap` in TensorBoard and
`canary` on the step line; past `bound` it is an `ALERT canary_mismatch`, and
`metrics.stop_on_mismatch` ends the run (exit 3).

The bound comes from the arithmetic, not from measurements (`canary_bound`, docs/design.md):
each side's logits carry a relative error eps = u + sqrt(K) * 2^-24 (one rounding of a GEMM's
output to the compute dtype, unit roundoff u, plus the fp32 accumulation of its K-long dot
products in another order), accumulated over the L decoder layers as independent roundings
(x sqrt(L)); a log-prob is a logit minus the log-sum-exp, both carrying that error (x 2), and two
independent implementations differ by up to twice one's error (x 2). Relative error becomes
absolute in proportion to the logits' magnitude, so the bound scales with the learner's logits
RMS over the probe (`logit_scale`). bf16 (u = 2^-8) gives a few 1e-2 nats on real models; fp32 on
the CPU (u = 2^-24) about 1e-5.

An FP8 engine (`engine.quantization: fp8`) rounds more than the learner does: each of its linear
layers multiplies a weight and an input both rounded to float8 e4m3 (3 mantissa bits, u = 2^-4),
a relative error of up to 2u per product beside the compute dtype's; in merged mode the weight is
rounded twice (W0, then the merge W0 + s B A at each update), 3u. The two sides then differ by the
engine's error plus the learner's, not twice one's: 2 (eps_engine + eps_learner) sqrt(L) x logit
RMS, which is the bf16 bound plus 2 u_e4m3 sqrt(L) x logit RMS per FP8 rounding (`canary_bound`'s
`fp8_roundings`): about 17 times bf16's for FP8 weights in slot mode. It still catches an engine
that stops taking updates once the learner has moved the probe past it (tests/test_canary.py),
and a wrong slot or scale at once; an update skipped once and taken at the next version hides in
FP8's noise.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from colocate.wire import ProbeScore

PROBE_TEXT = ("The canary checks that the engine samples the policy being trained: "
              "add 3 and 4 ; answer : 7 . 12 + 30 = 42 , so the model keeps score .")
"""Encoded by each run's tokenizer: words and digits, so a byte-level tokenizer trained on a
narrow corpus (the CPU configs') still gives a varied sequence."""

PROBE_TOKENS = 48
"""Probe length: one short forward on either side (47 scored tokens)."""

UNIT_ROUNDOFF = {dtype: torch.finfo(dtype).eps / 2
                 for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)}
"""Half a unit in the last place, relative: the largest relative error of one rounding (2^-24, 2^-8,
2^-11, and e4m3's 2^-4 from its 3 mantissa bits)."""


def probe_ids(tokenizer) -> list[int]:
    """The probe: `PROBE_TEXT` through the tokenizer (no special tokens), repeated to
    `PROBE_TOKENS` ids. Deterministic: both roles build the same one from the same tokenizer."""
    ids = list(tokenizer.encode(PROBE_TEXT, add_special_tokens=False))
    if not ids:
        raise ValueError("the tokenizer encodes the canary's probe text to nothing")
    return (ids * (PROBE_TOKENS // len(ids) + 1))[:PROBE_TOKENS]


def compute_dtype(model_dtype: str, on_gpu: bool) -> torch.dtype:
    """The coarser of the two sides' compute dtypes: on a GPU the learner runs bf16 (FSDP's mixed
    precision) and vLLM bf16 or the model's dtype; on the CPU both run the model's dtype."""
    return torch.bfloat16 if on_gpu or model_dtype == "bfloat16" else getattr(torch, model_dtype)


def fp8_roundings(quantization: str, lora_mode: str) -> int:
    """How many float8 e4m3 roundings each of the engine's products carries beyond the learner's
    (engine.quantization, engine.lora_mode): FP8 weights 2 (the weight and the input), 3 in merged
    mode (W0, then W0 + s B A quantized again at each update)."""
    if quantization != "fp8":
        return 0
    return 3 if lora_mode == "merged" else 2


def canary_bound(dtype: torch.dtype, *, reduction: int, num_layers: int, logit_scale: float,
                 fp8_roundings: int = 0) -> float:
    """The largest mean |log-prob difference| two correct implementations can show (module docstring):
    2 * (eps_engine + eps_learner) * sqrt(L) * logit RMS, eps = u + sqrt(K) * 2^-24 on either side
    and u_e4m3 more on the engine's per FP8 rounding (`fp8_roundings`)."""
    eps = UNIT_ROUNDOFF[dtype] + math.sqrt(reduction) * UNIT_ROUNDOFF[torch.float32]
    engine = eps + fp8_roundings * UNIT_ROUNDOFF[torch.float8_e4m3fn]
    return 2.0 * (engine + eps) * math.sqrt(num_layers) * logit_scale


def due(version: int, every: int) -> bool:
    """Whether both sides score `version` (`sync.canary_every`; 0: never)."""
    return every > 0 and version % every == 0


@dataclass(frozen=True)
class CanaryResult:
    version: int
    gap: float
    """Largest over the inference ranks of the mean |engine - learner| log-prob over the probe (nats)."""
    bound: float

    @property
    def failed(self) -> bool:
        return not self.gap <= self.bound  # a NaN gap fails too


class CanaryCheck:
    """Learner side: the learner's probe log-probs per adapter version, until the engines' arrive."""

    def __init__(self, dtype: torch.dtype, *, reduction: int, num_layers: int, every: int, fp8_roundings: int = 0):
        self.dtype, self.reduction, self.num_layers, self.every = dtype, reduction, num_layers, every
        self.fp8_roundings = fp8_roundings  # `canary.fp8_roundings` of the engines' settings
        self.references: dict[int, tuple[torch.Tensor, torch.Tensor | float]] = {}

    def due(self, version: int) -> bool:
        return due(version, self.every)

    def record(self, version: int, logprobs: torch.Tensor, logit_scale: torch.Tensor | float) -> None:
        """The learner's [T-1] probe log-probs of `version` and its logits' RMS, where they were computed
        (a GPU's: read back only by `check`, so recording never waits for the forward)."""
        self.references[version] = (logprobs.detach(), logit_scale)

    def check(self, scores: list[ProbeScore]) -> CanaryResult | None:
        """The engines' scores of one version (one per inference rank) against the learner's -> the
        result, or None when no score came; older references are dropped."""
        if not scores:
            return None
        version = scores[0].version
        if any(s.version != version for s in scores) or version not in self.references:
            raise RuntimeError(f"canary: engines scored versions {sorted({s.version for s in scores})}, the "
                               f"learner holds references for {sorted(self.references)}")
        reference, scale = self.references[version]
        reference, scale = reference.float().cpu(), float(scale)
        gap = max(float((s.logprobs.float() - reference).abs().mean()) for s in scores)
        for v in [v for v in self.references if v <= version]:
            del self.references[v]
        bound = canary_bound(self.dtype, reduction=self.reduction, num_layers=self.num_layers, logit_scale=scale,
                             fp8_roundings=self.fp8_roundings)
        return CanaryResult(version, gap, bound)
