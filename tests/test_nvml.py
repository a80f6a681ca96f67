"""colocate/nvml.py against a stand-in pynvml: the device CUDA_VISIBLE_DEVICES maps to, names as
bytes or str, and None wherever NVML cannot answer (the launcher's checks then skip, never fail)."""
import sys
from types import SimpleNamespace

from colocate import nvml


def fake_pynvml(calls: list, capability=(9, 0), name=b"NVIDIA H200"):
    def handle(physical):
        calls.append(physical)
        return f"gpu{physical}"
    return SimpleNamespace(nvmlInit=lambda: None, nvmlDeviceGetHandleByIndex=handle,
                           nvmlDeviceGetName=lambda h: name, nvmlDeviceGetCudaComputeCapability=lambda h: capability,
                           nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(total=80 * 2**30, used=2**30))


def test_the_visible_device_is_read_and_its_name_decoded(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(calls))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert nvml.capability(1) == ("NVIDIA H200", 9, 0) and calls == [5]
    assert nvml.memory(0) == (80 * 2**30, 2**30) and calls == [5, 3]
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(calls, (8, 0), "NVIDIA A100-SXM4-80GB"))
    assert nvml.capability(0) == ("NVIDIA A100-SXM4-80GB", 8, 0)


def test_no_answer_is_none(monkeypatch):
    broken = fake_pynvml([])
    broken.nvmlDeviceGetCudaComputeCapability = None  # an NVML without the call
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert nvml.capability(0) is None and nvml.memory(0) is not None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-4f1c")  # a MIG list: no index to map
    assert nvml.capability(0) is None and nvml.memory(0) is None


def test_the_system_sampler_reads_the_ranks_own_gpu(monkeypatch, tmp_path):
    """The sampler's GPU figures are the rank's device as NVML numbers it: CUDA index 1 under
    CUDA_VISIBLE_DEVICES=3,5 is physical GPU 5 (NVML ignores CUDA_VISIBLE_DEVICES)."""
    import time

    from colocate.metrics import MetricsWriter, SystemSampler
    calls = []
    fake = fake_pynvml(calls)
    fake.NVML_CLOCK_SM = 1
    fake.nvmlDeviceGetUtilizationRates = lambda h: SimpleNamespace(gpu=float(h == "gpu5") * 100, memory=0)
    fake.nvmlDeviceGetClockInfo = lambda h, kind: 1980
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    sampler = SystemSampler(MetricsWriter(str(tmp_path), "learner", enabled=True, tensorboard=False), 0.01, 1)
    sampler.start()
    for _ in range(500):  # its first sample comes after one 0.01 s interval
        if sampler.gpu_util:
            break
        time.sleep(0.01)
    sampler.halted.set()
    sampler.join()
    assert calls == [5] and sampler.gpu_util[0][1] == 100.0
