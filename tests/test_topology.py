"""Role split: defaults, explicit counts, and the 8-rank layout dry-run on CPU (gloo, tiny model)."""
import json
import subprocess
import sys

import pytest

from colocate.config import ConfigError, load_config
from colocate.config_checks import resolve_roles
from tests.conftest import REPO


@pytest.mark.parametrize("world,overrides,expected", [
    (2, {}, (1, 1)), (8, {}, (4, 4)), (3, {}, (1, 2)),
    (8, {"num_inference": 6}, (6, 2)), (8, {"num_inference": 2}, (2, 6)),
])
def test_resolve_roles(world, overrides, expected):
    cfg = load_config(None, {"topology": overrides, "rollout": {"groups_per_step": 12, "batch_size": 96}},
                      world_size=world)
    assert resolve_roles(cfg, world) == expected


def test_groups_split_as_evenly_as_possible_over_inference_ranks():
    from colocate.topology import Topology
    shares = [Topology(rank=r, world_size=8, local_rank=r, num_inference=6, num_learners=2,
                       device=None, backend="gloo").share(32) for r in range(6)]
    assert shares == [6, 6, 5, 5, 5, 5]
    # the old workload (32 groups) on 6 + 2 is a valid config; fewer groups than ranks is not
    cfg = load_config(f"{REPO}/configs/gpu-8.yaml", {"topology": {"num_inference": 6, "num_learners": 2}},
                      world_size=8)
    assert resolve_roles(cfg, 8) == (6, 2)
    with pytest.raises(ConfigError, match="without a group"):
        load_config(None, {"topology": {"num_inference": 6}, "rollout": {"groups_per_step": 4, "batch_size": 32}},
                    world_size=8)


def test_roles_must_fill_the_world():
    with pytest.raises(ConfigError, match="do not fit world size 8"):
        load_config(None, {"topology": {"num_inference": 4, "num_learners": 3}}, world_size=8)


@pytest.mark.slow
def test_eight_rank_topology_with_uneven_shares_trains_on_cpu(tmp_path):
    """8 ranks, 3 inference + 5 learners: 4 groups over 3 inference ranks are shares of 2, 1, 1, and
    each rank's batch (8, 4, 4 samples) goes to 5 learners in uneven shards (2, 1, 2, 1, 2 and
    1, 1, 0, 1, 1: a learner may get nothing from a rank); two steps train with checksummed adapters."""
    run = tmp_path / "run8"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8", "-m", "colocate.train",
           "--config", "configs/cpu-tiny.yaml", "--topology.num_inference=3", "--rollout.groups_per_step=4",
           "--rollout.group_size=4", "--rollout.batch_size=16", "--learner.num_steps=2", f"--metrics.run_dir={run}",
           f"--model.cache_dir={tmp_path / 'cache'}", "--metrics.nvml_interval_s=0", "--sync.check_checksum=true"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["num_inference"], summary["num_learners"], summary["steps"]) == (3, 5, 2)
    for r, samples in enumerate([8.0, 4.0, 4.0]):
        batches = json.loads((run / f"inference-rank{r}.json").read_text())["batches"]
        assert [b["samples"] for b in batches] == [samples, samples]


def test_split_cpu_threads_gives_each_local_rank_its_share_of_the_cores(monkeypatch):
    """The cores the process may run on (its affinity: SLURM, containers), split over the local ranks."""
    import torch
    from colocate import topology
    before = torch.get_num_threads()
    monkeypatch.setattr(topology.os, "sched_getaffinity", lambda pid: set(range(64)))
    try:
        assert topology.split_cpu_threads(4) == 16 and torch.get_num_threads() == 16
        assert topology.split_cpu_threads(128) == 1 and torch.get_num_threads() == 1
        monkeypatch.setattr(topology.os, "sched_getaffinity", lambda pid: {3})  # pinned to one core
        assert topology.split_cpu_threads(2) == 1
        monkeypatch.setattr(topology.os, "sched_getaffinity", lambda pid: set(range(8)))
        assert topology.split_cpu_threads(0) == 8  # no local world given: one rank
    finally:
        torch.set_num_threads(before)
