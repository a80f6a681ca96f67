"""Sync faults for the canary tests (`tests/test_canary.py`), injected from outside the code.

This folder goes first on PYTHONPATH of a test's `colocate train`, so Python imports this module
at start-up in every process of the run (the launcher, torchrun, each rank, a vLLM engine core).
With `CANARY_TEST_FAULT` set (read here only) it replaces an engine's update method with a faulty
one; production code has no hook for it:
  * skip:  the HF engine takes versions >= 1 without copying the tensors (an update silently skipped);
  * slot:  each adapter tensor of layer 0 lands in layer 1's place and back (the wrong slot);
  * scale: lora_B is written twice over (the in-place alpha / r scaling applied again);
  * vllm-skip: the vLLM worker receives every version but never writes it (the LoRA slot or the
    merged weights, bf16 or FP8, keep version 0: a skipped update, a stale merged copy).
"""
import os

FAULT = os.environ.get("CANARY_TEST_FAULT", "")


def faulty_tensors(fault: str, tensors: dict) -> dict:
    """The tensors as the faulty engine writes them."""
    if fault == "scale":
        return {n: t * 2 if ".lora_B." in n else t for n, t in tensors.items()}
    if fault == "slot":
        swap = {".layers.0.": ".layers.1.", ".layers.1.": ".layers.0."}
        out = {}
        for name in tensors:
            key = next((k for k in swap if k in name), None)
            out[name] = tensors[name.replace(key, swap[key])] if key else tensors[name]
        return out
    raise ValueError(f"CANARY_TEST_FAULT={fault!r}")


def install_hf(fault: str) -> None:
    from colocate.engine.hf import HFEngine
    load_lora = HFEngine.load_lora

    def faulty_load_lora(self, version, tensors):
        if version < 1:
            return load_lora(self, version, tensors)
        if fault == "skip":
            self.version = version
            return None
        return load_lora(self, version, faulty_tensors(fault, tensors))
    HFEngine.load_lora = faulty_load_lora


def install_vllm() -> None:
    from colocate.engine.adapter_targets import AdapterSlot, MergedAdapter, MergedFp8Adapter
    for cls in (AdapterSlot, MergedAdapter, MergedFp8Adapter):
        cls.apply = lambda self: None


if FAULT == "vllm-skip":
    install_vllm()
elif FAULT:
    install_hf(FAULT)
