"""The built-in envs' own checks, which their `check` and `preflight` hooks (`base.Env`) call: each
env's keys in their ranges (`check_key_rules` over an env's `KEYS`), the agent keys an env would
ignore, an agent episode's length limit, the dataset env's keys among themselves, and what its
files and an agent's tools hold. Each failure is one `ConfigError` line naming the key;
`envs.check_env` runs the hooks before any model is built.
"""
from __future__ import annotations

import math
from collections.abc import Callable

from colocate.config_checks import ConfigError, is_object_path
from colocate.config_schema import BUILTIN_REWARDS, EnvConfig

KeyRules = dict[str, tuple[Callable[[object], bool], str]]
"""An env's keys -> (the rule a valid value keeps, its wording): what its `check` holds them to."""

POSITIVE, NON_NEGATIVE = "must be > 0", "must be >= 0"

ENV_KEYS: KeyRules = {
    "processes": (lambda v: v >= 0, NON_NEGATIVE + " (0 runs the env on the loop that feeds the engine)"),
    "overlong_buffer": (lambda v: v >= 0, NON_NEGATIVE + " (0 = no length penalty)"),
}
"""Keys every env reads (the rollout worker and `EnvProcesses` apply them): `envs.check_env` checks
them for any class."""

AGENT_RULES: KeyRules = {
    "max_turns": (lambda v: v >= 1, "must be >= 1 (policy turns per episode)"),
    "max_tool_calls": (lambda v: v >= 0, NON_NEGATIVE),
    "tool_timeout_s": (lambda v: v > 0, POSITIVE),
    "tool_max_output_chars": (lambda v: v >= 1, "must be >= 1"),
    "tool_workers": (lambda v: v >= 1, "must be >= 1"),
    "tool_budget_s": (lambda v: v > 0, POSITIVE + " (an episode's tool time in all)"),
}
"""The agent episodes' keys with a range (`agent.AgentSettings.KEYS`; `check_agent` holds them)."""

AGENT_KEYS = ("tools", "environment", "tool_parser", *AGENT_RULES)
"""env keys only agent episodes read (`envs/agent.py`)."""


def check_key_rules(cfg, rules: KeyRules) -> None:
    """Each key of `rules` (env.<key>) keeps its rule."""
    for key, (ok, rule) in rules.items():
        value = getattr(cfg.env, key)
        if not ok(value):
            raise ConfigError(f"env.{key}={value!r} {rule}")


def no_tool_episodes(cfg) -> str:
    """Why an env that is no `AgentEnv` refuses the agent keys (the default `Env.check`)."""
    name = cfg.env.name
    return f"env.name={name!r} is not an AgentEnv" if is_object_path(name) else f"env.name={name} plays no tool episodes"


def is_agent(cfg) -> bool:
    """Whether the run plays multi-turn tool episodes (`envs/agent.py`)."""
    return bool(cfg.env.tools or cfg.env.environment)


def refuse_agent_keys(cfg, why: str, keys: tuple[str, ...] = AGENT_KEYS) -> None:
    """Refuse any of `keys` set away from its default: the env would ignore it (`why`)."""
    default = EnvConfig()
    given = [f"env.{k}={getattr(cfg.env, k)!r}" for k in keys if getattr(cfg.env, k) != getattr(default, k)]
    if given:
        raise ConfigError(f"{', '.join(given)}: {why}, so the setting would be ignored (agent episodes: "
                          "env.name=dataset with env.tools or env.environment, or an AgentEnv subclass by path; "
                          "docs/agents.md)")


def check_agent_paths(cfg) -> None:
    """env.tools / env.environment name objects by path (whether they import is `check_agent_tools`')."""
    env = cfg.env
    for path in env.tools + ([env.environment] if env.environment else []):
        if not isinstance(path, str) or not is_object_path(path):
            raise ConfigError(f"env.tools / env.environment: {path!r} is not a path like 'my_pkg.tools:search'")


def check_agent(cfg, what: str) -> None:
    """An agent env's keys (`what` names the env): each in its range, tools and environment by path,
    an episode's token limit (engine.max_model_len) that holds a prompt and a whole turn."""
    check_key_rules(cfg, AGENT_RULES)
    check_agent_paths(cfg)
    check_agent_lengths(cfg, what)


def check_agent_lengths(cfg, what: str) -> None:
    """An agent env's episode limit holds a prompt and one whole turn."""
    if cfg.engine.max_model_len <= 0:
        raise ConfigError(f"{what} needs engine.max_model_len > 0: the token limit of a whole episode (prompt, "
                          "every turn and every tool message)")
    if cfg.engine.max_model_len <= cfg.engine.max_new_tokens:
        raise ConfigError(f"engine.max_model_len={cfg.engine.max_model_len} cannot hold a prompt and one turn of "
                          f"engine.max_new_tokens={cfg.engine.max_new_tokens} ({what} plays whole episodes within it)")


def check_dataset_keys(env: EnvConfig) -> None:
    """The dataset env's keys among themselves (what the files hold is `check_dataset`'s)."""
    if not env.data_files:
        raise ConfigError("env.name=dataset needs env.data_files: local json, jsonl, parquet or csv files of prompts")
    for key in ("data_files", "eval_files", "reward"):
        bad = [v for v in getattr(env, key) if not isinstance(v, str) or not v]
        if bad:
            raise ConfigError(f"env.{key}: {bad[0]!r} is not a non-empty string")
    if not env.reward:
        raise ConfigError("env.reward is empty: name at least one reward function (gsm8k, boxed, exact or "
                          "my_pkg.module:function)")
    for name in env.reward:
        if name not in BUILTIN_REWARDS and not is_object_path(name):
            raise ConfigError(f"env.reward: {name!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) nor a "
                              "function path like 'my_pkg.rewards:score'")
    if env.reward_weights and len(env.reward_weights) != len(env.reward):
        raise ConfigError(f"env.reward_weights has {len(env.reward_weights)} entries for {len(env.reward)} "
                          "reward functions (one weight each, or none for all 1.0)")
    env.reward_weights = [finite_number(w, "env.reward_weights") for w in env.reward_weights]


def finite_number(value, where: str) -> float:
    """A list item as a float (items of a list given on the command line arrive as strings)."""
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number):
        raise ConfigError(f"{where}: {value!r} is not a finite number")
    return number


def check_agent_tools(cfg) -> None:
    """env.tools / env.environment: each imports; a tool is a function whose schema (what the chat
    template's `tools=` gets) builds from its type hints and docstring; the environment is a class
    with `reset`, and so is every public method of one instance (its tools)."""
    if not (cfg.env.tools or cfg.env.environment):
        return
    from colocate.objects import ObjectPathError, load_object
    from colocate.tools import environment_tools
    for path in cfg.env.tools:
        try:
            fn = load_object(path)
        except ObjectPathError as e:
            raise ConfigError(f"env.tools: {e}") from None
        if isinstance(fn, type) or not callable(fn):
            raise ConfigError(f"env.tools: {path!r} is not a function")
        _check_tool_schema("env.tools", path, fn)
    if not cfg.env.environment:
        return
    path = cfg.env.environment
    try:
        cls = load_object(path)
    except ObjectPathError as e:
        raise ConfigError(f"env.environment: {e}") from None
    if not isinstance(cls, type) or not callable(getattr(cls, "reset", None)):
        raise ConfigError(f"env.environment: {path!r} is not a class with a reset(**row) method "
                          "(TRL's environment_factory shape: docs/agents.md)")
    try:
        instance = cls()
    except Exception as e:  # noqa: BLE001 - a user's constructor may raise anything
        raise ConfigError(f"env.environment: {path}() failed: {type(e).__name__}: {e}") from None
    for name, method in environment_tools(instance).items():
        _check_tool_schema("env.environment", f"{path}.{name}", method)


def _check_tool_schema(key: str, path: str, fn) -> None:
    from colocate.tools import tool_schema
    try:
        tool_schema(fn)
    except Exception as e:  # noqa: BLE001 - transformers' schema builder raises its own kinds
        raise ConfigError(f"{key}: {path!r} has no tool schema: {type(e).__name__}: {' '.join(str(e).split())} "
                          "(a tool needs type hints and a Google-style docstring with an Args: section)") from None
