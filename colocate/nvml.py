"""What NVML says about a CUDA device, read without making a CUDA context (the launcher's checks run
before any rank touches CUDA): its memory and its compute capability. None without NVML or its
driver, where CUDA_VISIBLE_DEVICES lists MIG or UUID devices, or where NVML cannot answer."""
from __future__ import annotations

import os


def device_handle(index: int):
    """NVML's handle of CUDA device `index` (CUDA_VISIBLE_DEVICES mapped to the physical index), or None."""
    try:
        import pynvml
        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        physical = int(visible.split(",")[index]) if visible else index
        return pynvml.nvmlDeviceGetHandleByIndex(physical)
    except Exception:  # noqa: BLE001 - no driver, no library, a MIG or UUID list: no NVML figures
        return None


def memory(index: int) -> tuple[int, int] | None:
    """(total, used) bytes of CUDA device `index`."""
    handle = device_handle(index)
    if handle is None:
        return None
    try:
        import pynvml
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return int(info.total), int(info.used)
    except Exception:  # noqa: BLE001 - NVML cannot say
        return None


def capability(index: int) -> tuple[str, int, int] | None:
    """(name, major, minor) of CUDA device `index`: its compute capability, e.g. ("NVIDIA H100 80GB HBM3", 9, 0)."""
    handle = device_handle(index)
    if handle is None:
        return None
    try:
        import pynvml
        name = pynvml.nvmlDeviceGetName(handle)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
    except Exception:  # noqa: BLE001 - an NVML without the call, or one that cannot say
        return None
    return (name.decode() if isinstance(name, bytes) else str(name)), int(major), int(minor)
