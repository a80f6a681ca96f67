"""Role split: defaults, explicit counts, and the 8-rank layout dry-run on CPU (gloo, tiny model)."""
import json
import subprocess
import sys

import pytest

from colocate.config import ConfigError, load_config, resolve_roles
from tests.conftest import REPO


@pytest.mark.parametrize("world,overrides,expected", [
    (2, {}, (1, 1)), (8, {}, (4, 4)), (3, {}, (1, 2)),
    (8, {"num_inference": 6}, (6, 2)), (8, {"num_inference": 2}, (2, 6)),
])
def test_resolve_roles(world, overrides, expected):
    cfg = load_config(None, {"topology": overrides, "rollout": {"groups_per_step": 12, "batch_size": 96}},
                      world_size=world)
    assert resolve_roles(cfg, world) == expected


def test_roles_must_fill_the_world():
    with pytest.raises(ConfigError, match="do not fit world size 8"):
        load_config(None, {"topology": {"num_inference": 4, "num_learners": 3}}, world_size=8)


@pytest.mark.slow
def test_eight_rank_topology_trains_on_cpu(tmp_path):
    run = tmp_path / "run8"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8", "-m", "colocate.train",
           "--config", "configs/cpu-tiny.yaml", "--learner.num_steps=3", f"--metrics.run_dir={run}",
           f"--model.cache_dir={tmp_path / 'cache'}", "--metrics.nvml_interval_s=0", "--sync.check_checksum=true"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["num_inference"], summary["num_learners"], summary["steps"]) == (4, 4, 3)
