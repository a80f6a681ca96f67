"""Config: parsing, overrides, and every bad config exits with code 2 and one line, fast."""
import os
import subprocess
import sys
import time

import pytest

from colocate.config import ConfigError, field_docs, load_config, parse_overrides, ModelConfig, Config
from tests.conftest import REPO


def test_overrides_parse_and_coerce():
    path, nested, resume = parse_overrides(["--config", "configs/cpu-tiny.yaml", "--learner.lr=0.5",
                                            "--env.use_constraint", "false", "--resume"])
    assert path == "configs/cpu-tiny.yaml" and resume
    cfg = load_config(os.path.join(REPO, path), nested)
    assert cfg.learner.lr == 0.5 and cfg.env.use_constraint is False
    assert cfg.rollout.group_size == 8  # from the YAML file


def test_unknown_key_names_nearest():
    with pytest.raises(ConfigError, match=r"unknown config key 'learner.lrr'.*'learner.lr'"):
        load_config(None, {"learner": {"lrr": 1}})
    with pytest.raises(ConfigError, match=r"'rolout'.*'rollout'"):
        load_config(None, {"rolout": {}})


def test_wrong_type():
    with pytest.raises(ConfigError, match="learner.num_steps: expected int"):
        load_config(None, {"learner": {"num_steps": "many"}})


def test_every_field_documented():
    import dataclasses
    for f in dataclasses.fields(Config):
        section = f.default_factory()
        docs = field_docs(type(section))
        missing = [g.name for g in dataclasses.fields(section) if g.name not in docs]
        assert not missing, f"{f.name}: undocumented fields {missing}"
    assert "path" in field_docs(ModelConfig)


BAD = [
    (["--learner.lrr=1"], {}, "unknown config key 'learner.lrr'"),
    (["--learner.num_steps=abc"], {}, "expected int"),
    (["--topology.num_inference=3"], {"WORLD_SIZE": "2"}, "do not fit world size"),
    (["--rollout.group_size=3"], {}, "does not divide"),
    (["--model.path=/nonexistent/model"], {}, "not a local directory"),
]


@pytest.mark.parametrize("args,env,message", BAD, ids=["unknown", "type", "roles", "group", "path"])
def test_bad_config_exits_2(args, env, message):
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "colocate.train", "--config", "configs/cpu-tiny.yaml", *args],
                          cwd=REPO, env={**os.environ, "WORLD_SIZE": "2", **env}, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert time.time() - t0 < 30


def test_choice_and_range_fields_are_checked():
    with pytest.raises(ConfigError, match=r"sync.fanout='ring' is not one of broadcast, per_engine"):
        load_config(None, {"sync": {"fanout": "ring"}})
    with pytest.raises(ConfigError, match=r"engine.jump_forward=-1 must be >= 0"):
        load_config(None, {"engine": {"jump_forward": -1}})
    with pytest.raises(ConfigError, match=r"engine.cudagraph_mode='full' is not one of"):
        load_config(None, {"engine": {"cudagraph_mode": "full"}})
    with pytest.raises(ConfigError, match=r"cudagraph_mode cannot be set with engine.jump_forward"):
        load_config(None, {"engine": {"cudagraph_mode": "FULL", "jump_forward": 4}})
    with pytest.raises(ConfigError, match=r"engine.max_capture_tokens=-1 must be >= 0"):
        load_config(None, {"engine": {"max_capture_tokens": -1}})
    with pytest.raises(ConfigError, match=r"learner.prefetch_blocks=-2 must be >= 0"):
        load_config(None, {"learner": {"prefetch_blocks": -2}})
    assert load_config(None, {"engine": {"cudagraph_mode": "FULL"}}).engine.cudagraph_mode == "FULL"
    for lag in (0, 1):  # lag 1 would leave the batches no overlap with training
        with pytest.raises(ConfigError, match=r"rollout.oversample_groups=4 needs learner.max_policy_lag >= 2"):
            load_config(None, {"rollout": {"oversample_groups": 4}, "learner": {"max_policy_lag": lag}})


def test_oversampled_batches_start_one_version_fresher():
    from colocate.config import sampling_lag
    assert sampling_lag(load_config(None, {"learner": {"max_policy_lag": 2}})) == 2
    assert sampling_lag(load_config(None, {"learner": {"max_policy_lag": 2}, "rollout": {"oversample_groups": 4}})) == 1
    assert sampling_lag(load_config(None, {"learner": {"max_policy_lag": 3}, "rollout": {"oversample_groups": 1}})) == 2


def test_world_of_one_does_not_fit():
    with pytest.raises(ConfigError, match="do not fit world size 1"):
        load_config(None, {}, world_size=1)


@pytest.mark.parametrize("name,world", [("cpu-tiny", 2), ("cpu-diplomacy-tiny", 2), ("gpu-1", 2), ("gpu-2", 2),
                                        ("gpu-4", 4), ("gpu-8", 8), ("gpu-7b-h100x8", 8)])
def test_shipped_configs_validate(name, world):
    cfg = load_config(os.path.join(REPO, "configs", f"{name}.yaml"), world_size=world)
    assert cfg.rollout.batch_size == cfg.rollout.groups_per_step * cfg.rollout.group_size
