"""Roles that share a GPU: which groups may be NCCL, which layouts are refused, the memory split.

On CPU the group plan is checked by building the topology of a 2-process world on "one GPU" with
torch.distributed's constructors recorded; the real run (both roles on cuda:0, the adapter by
CUDA IPC) is the GPU test at the end."""
import os
import subprocess
import sys

import pytest
import torch

from colocate.config import ConfigError, load_config
from colocate.gpu_budget import GIB, Card, ModelShape, plan_memory
from colocate.preflight import meta_model
from colocate.topology import check_shared_gpus, group_backend, rank_devices
from tests.conftest import REPO


def test_rank_devices_share_round_robin_per_node():
    assert rank_devices(2, 2, 1) == [(0, 0), (0, 0)]
    assert rank_devices(4, 2, 2) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert rank_devices(4, 4, 2) == [(0, 0), (0, 1), (0, 0), (0, 1)]


def test_no_nccl_group_across_ranks_on_one_gpu():
    one_gpu = rank_devices(2, 2, 1)
    assert group_backend([0, 1], one_gpu, "nccl") == "gloo"
    assert group_backend([1], one_gpu, "nccl") == "nccl"  # a learner group of one
    two_gpus = rank_devices(4, 4, 2)
    assert group_backend([0, 1], two_gpus, "nccl") == "nccl"
    assert group_backend([0, 2], two_gpus, "nccl") == "gloo"
    assert group_backend([0, 1], one_gpu, "gloo") == "gloo"


def test_a_mixed_layout_is_refused():
    devices = rank_devices(4, 4, 2)  # ranks 0, 2 on GPU 0; 1, 3 on GPU 1; learner rank 0 is rank 2
    with pytest.raises(ValueError, match=r"inference ranks \[0\] share learner rank 0's GPU but \[1\] do not.*run all 4 "
                                         r"on one \(CUDA_VISIBLE_DEVICES=0\)"):
        check_shared_gpus(["inference", "inference", "learner", "learner"], devices)
    check_shared_gpus(["inference", "inference", "learner", "learner"], rank_devices(4, 4, 4))
    check_shared_gpus(["inference", "learner"], rank_devices(2, 2, 1))  # both on one GPU: IPC to all
    check_shared_gpus(["inference", "learner"], rank_devices(2, 2, 2))  # own GPUs: NCCL to all


def test_topology_on_one_gpu_builds_no_nccl_group_across_it(monkeypatch):
    import torch.distributed as dist

    from colocate import topology
    made = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: made.append(("default", backend, None)))
    monkeypatch.setattr(dist, "new_group", lambda ranks, backend, **kw: made.append(("group", backend, ranks)) or ranks)
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    topo = topology.build_topology(load_config(None, {}, world_size=2))
    assert topo.device == torch.device("cuda", 0) and topo.shared_gpu
    assert made == [("default", "gloo", None), ("group", "nccl", [1]), ("group", "gloo", [0, 1]),
                    ("group", "gloo", [0, 1])]


def one_gpu_plan(cfg, total):
    """Every rank of the config's world (both roles; 2 processes unless the config fixes more) on GPU 0
    of `total` bytes -> the lines (raises ConfigError)."""
    engines = cfg.topology.num_inference or 1
    roles = ["inference"] * engines + ["learner"] * (cfg.topology.num_learners or 1)
    devices = rank_devices(len(roles), len(roles), 1)
    return plan_memory(cfg, meta_model(cfg), roles, devices, Card(total, 1, "test")).lines


def test_memory_split_refuses_what_cannot_fit():
    overrides = {"model": {"shape": "qwen2.5-7b", "dtype": "bfloat16"}, "engine": {"gpu_memory_utilization": 0.45},
                 "learner": {"micro_batch_tokens": 8192, "activation_checkpointing": True}}
    cfg = load_config(None, overrides)
    assert 14 * GIB < ModelShape.of(cfg, meta_model(cfg)).num_params * 2 < 16 * GIB  # 7.6B parameters in bf16
    line, kv_cache = one_gpu_plan(cfg, 80 * GIB)
    assert "to spare" in line and "ranks 0, 1" in line and "KV cache gets at most" in kv_cache
    with pytest.raises(ConfigError, match=r"GPU 0 \(ranks 0, 1\) cannot hold"):
        one_gpu_plan(load_config(None, {**overrides, "engine": {"gpu_memory_utilization": 0.9}}), 80 * GIB)
    with pytest.raises(ConfigError, match="less than its weights"):
        one_gpu_plan(load_config(None, {**overrides, "engine": {"gpu_memory_utilization": 0.1}}), 80 * GIB)


H100_80GB = 81559 * 2**20  # what an H100 80GB HBM3 reports (79.6 GiB)


@pytest.mark.parametrize("name, processes", [("gpu-1", 2), ("gpu-1-7b", 2), ("gpu-1-gsm8k", 3)])
def test_the_one_gpu_presets_fit_an_80gb_card(name, processes):
    """Each one-GPU preset's planned split (vLLM's shares and the learner's estimate) fits an H100;
    gpu-1-gsm8k.yaml runs two engines beside the learner."""
    one_gpu_plan(load_config(os.path.join(REPO, "configs", f"{name}.yaml"), world_size=processes), H100_80GB)


@pytest.mark.gpu
@pytest.mark.timeout(660)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_both_roles_on_cuda0_train_three_steps(tmp_path):
    """2 processes on one GPU (the HF engine, so no vLLM is needed): 3 steps, every adapter checked
    bit for bit on the engine (sync.check_checksum)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "colocate.train",
           "--config", "configs/cpu-tiny.yaml", "--engine.kind=hf", "--learner.num_steps=3",
           "--sync.check_checksum=true", f"--metrics.run_dir={tmp_path}", f"--model.cache_dir={tmp_path / 'cache'}"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "colocate: memory plan" in out.stderr and "to spare" in out.stderr  # the memory split was printed
    assert os.path.exists(tmp_path / "summary.json")
