"""Env keys live with their envs: each built-in env's settings record (or class) declares its env.*
keys with their ranges (`KEYS`) and its `check` holds them; the flat `env.*` keys of a config keep
reaching the env that reads them; `config_checks` has no env row left; the env names are
`envs.BUILTIN`'s; and a new env registered there (DEVELOPERS.md's env recipe) is a name whose
keys are checked by the default `Env.check`, which also refuses the agent keys."""
import os

import pytest

from colocate import config_checks
from colocate.config import ConfigError, load_config
from colocate.envs import BUILTIN, check_env
from colocate.envs.arithmetic import ArithmeticEnv
from tests.conftest import REPO


def config(file: str, **env):
    return load_config(os.path.join(REPO, "configs", file), {"env": env} if env else {})


def test_config_checks_hold_no_env_row():
    assert [k for k in config_checks._RANGES if k[0] == "env"] == []
    assert ("env", "name") not in config_checks._CHOICES


def test_flat_env_keys_reach_the_env_that_reads_them():
    """A config written before the keys moved (flat `env.*`) still loads and configures each env."""
    from colocate.envs.agent import agent_settings
    from colocate.envs.dataset import DatasetSettings
    from colocate.envs.diplomacy.env import DiplomacySettings
    cfg = config("cpu-diplomacy-tiny.yaml", horizon_years=3, stall_years=1)
    check_env(cfg, outside_world=False)
    assert (DiplomacySettings.from_config(cfg).horizon_years, DiplomacySettings.from_config(cfg).stall_years) == (3, 1)
    cfg = config("cpu-dataset-tiny.yaml", reward_workers=2, prefetch_prompts=5)
    check_env(cfg, outside_world=False)
    assert (DatasetSettings.from_config(cfg).reward_workers, DatasetSettings.from_config(cfg).prefetch_prompts) == (2, 5)
    cfg = config("cpu-dataset-tiny.yaml", tools=["colocate.calculator:calculator"], max_turns=5, max_tool_calls=2)
    cfg.engine.max_model_len = 512
    check_env(cfg, outside_world=False)
    settings = agent_settings(cfg)
    assert (settings.max_turns, settings.max_tool_calls) == (5, 2)


@pytest.mark.parametrize("name,env,message", [
    ("cpu-tiny.yaml", {"max_operand": 0}, "env.max_operand=0 must be >= 1"),
    ("cpu-diplomacy-tiny.yaml", {"horizon_years": 0}, "env.horizon_years=0 must be >= 1"),
    ("cpu-dataset-tiny.yaml", {"reward_timeout_s": 0}, "env.reward_timeout_s=0.0 must be > 0"),
    ("cpu-dataset-tiny.yaml", {"tools": ["colocate.calculator:calculator"], "tool_workers": 0},
     "env.tool_workers=0 must be >= 1"),
    ("cpu-diplomacy-tiny.yaml", {"processes": -1}, "env.processes=-1 must be >= 0"),
])
def test_each_env_checks_its_own_keys(name, env, message):
    cfg = config(name, **env)
    cfg.engine.max_model_len = 512
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        check_env(cfg, outside_world=False)


def test_another_envs_key_is_ignored():
    """A preset may inherit another env's keys through `base:` (gpu-gsm8k.yaml: gpu.yaml's Diplomacy
    keys); only the env that reads a key holds it to its range."""
    check_env(config("cpu-tiny.yaml", horizon_years=0), outside_world=False)


class ToyEnv(ArithmeticEnv):
    KEYS = {"max_operand": (lambda v: v <= 9, "must be <= 9 (single digits)")}


def test_a_registered_env_is_a_name_with_its_keys_checked(monkeypatch):
    """DEVELOPERS.md's env recipe: a class in `BUILTIN` is a valid env.name (no other list to edit),
    its `KEYS` are held by the default `check`, which also refuses the agent keys."""
    monkeypatch.setitem(BUILTIN, "toy", f"{__name__}:ToyEnv")
    check_env(config("cpu-tiny.yaml", name="toy", max_operand=9), outside_world=False)
    with pytest.raises(ConfigError, match=r"env.max_operand=10 must be <= 9"):
        check_env(config("cpu-tiny.yaml", name="toy", max_operand=10), outside_world=False)
    with pytest.raises(ConfigError, match=r"env.max_turns=2: env.name=toy plays no tool episodes"):
        check_env(config("cpu-tiny.yaml", name="toy", max_turns=2), outside_world=False)
    with pytest.raises(ConfigError, match=r"env.name='toyy' is not one of .*'toy'; did you mean 'toy'"):
        check_env(config("cpu-tiny.yaml", name="toyy"), outside_world=False)
