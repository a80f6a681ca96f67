"""Checks of what a valid config points at, before any process group or model exists.

`config_checks.validate` checks values (types, ranges, cross-field rules); this checks the world they name:
the run directory can be written, a model directory holds a `config.json` that parses, the
Diplomacy state cache loads, the dataset env's files load with their columns and reward functions,
a custom env class imports, an agent's tools and environment class import and give tool schemas,
and every LoRA target module exists in the model. Each failure is one
`ConfigError` line naming the key, which `train.py` prints before exiting with code 2; the same
checks run for `python -m colocate.train --config X --check`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
import sys
import tempfile

from colocate.config import Config, ConfigError
from colocate.config_checks import check_agent_lengths, refuse_agent_keys


def check_run_dir(run_dir: str) -> None:
    """metrics.run_dir must be writable, or creatable under its nearest existing parent
    (checkpoints, summaries and events go there). Nothing is created here."""
    check_writable_dir(f"metrics.run_dir={run_dir!r}", run_dir)


def check_writable_dir(what: str, path: str) -> None:
    """`path` is a directory that can be written, or can be created under its nearest existing
    parent; `what` names it in the error (a key, or a flag: `--out='x'`)."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"{what}: {existing} is a file, not a directory")
    try:  # a real write: permission bits do not tell root about read-only mounts
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ConfigError(f"{what}: {existing} is not writable ({e.strerror or e})") from None


def check_model_dir(path: str) -> None:
    """model.path: a local directory with a config.json that is a JSON object."""
    if not path:
        return
    if not os.path.isdir(path):
        raise ConfigError(f"model.path={path!r} is not a local directory (nothing is downloaded)")
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ConfigError(f"model.path={path!r} has no config.json (a Hugging Face model directory is expected)")
    try:
        with open(file) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path={path!r}: config.json does not parse ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model.path={path!r}: config.json is not a JSON object")


def check_state_cache(cfg: Config) -> None:
    """env.state_cache (Diplomacy): the file exists and every line is a saved game state."""
    if cfg.env.name != "diplomacy" or not cfg.env.state_cache:
        return
    from colocate.envs.diplomacy.game import StateCacheError, load_state_cache
    try:
        load_state_cache(cfg.env.state_cache)
    except (OSError, StateCacheError) as e:
        raise ConfigError(f"env.state_cache={cfg.env.state_cache!r}: {e}") from None


def check_data_files(key: str, files: list[str]) -> None:
    """Each file exists (a directory stands for the data files under it), and all are of one kind
    `datasets` reads."""
    from colocate.envs.dataset import BUILDERS, builder_of
    from colocate.envs.rows import expand_files
    for f in files:
        if os.path.isdir(f) and not expand_files([f]):
            raise ConfigError(f"env.{key}: {f!r} is a directory with no json, jsonl, parquet or csv files in it")
        if not os.path.exists(f):
            where = "" if os.path.isabs(f) else f"; a relative path is from the working directory {os.getcwd()}"
            raise ConfigError(f"env.{key}: {f!r} does not exist (local json, jsonl, parquet or csv files{where})")
        if not os.path.isdir(f) and not os.path.isfile(f):
            raise ConfigError(f"env.{key}: {f!r} is not a regular file")
    files = expand_files(files)
    try:
        builder_of(files)
    except ValueError:
        raise ConfigError(f"env.{key}: {files} must all be one of {', '.join(sorted(BUILDERS))}") from None
    if all(os.path.getsize(f) == 0 for f in files):  # `datasets` fails obscurely on empty files
        raise ConfigError(f"env.{key}: {files} is empty (no rows to draw prompts from)")


def check_prompt_column(key: str, rows, cfg: Config) -> None:
    """The split has rows, and its prompt column holds text or chat messages (from the Arrow schema:
    every row has that type, so no row is read)."""
    import datasets
    env = cfg.env
    if len(rows) == 0:
        raise ConfigError(f"env.{key}: split {env.split!r} of {getattr(env, key)} is empty")
    if env.prompt_column not in rows.column_names:
        raise ConfigError(f"env.prompt_column={env.prompt_column!r} is no column of env.{key} "
                          f"(columns: {', '.join(rows.column_names)})")
    feature = rows.features[env.prompt_column]
    inner = feature.feature if isinstance(feature, (datasets.List, datasets.Sequence)) else None
    # a null column (every prompt null) passes here: the row checks name its first row
    is_text = isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string", "null")
    is_messages = isinstance(inner, dict) and {"role", "content"} <= set(inner) and all(
        isinstance(inner[k], datasets.Value) and inner[k].dtype in ("string", "large_string") for k in ("role", "content"))
    if not (is_text or is_messages):
        raise ConfigError(f"env.prompt_column={env.prompt_column!r} of env.{key} holds {feature}: a prompt must be "
                          "text or a list of chat messages with string role and content")
    builtins = [r for r in env.reward if ":" not in r]
    if (builtins or env.answer_choices) and env.answer_column not in rows.column_names:
        raise ConfigError(f"env.answer_column={env.answer_column!r} is no column of env.{key} (the built-in "
                          f"reward {builtins[0]} compares against it; columns: {', '.join(rows.column_names)})")


def check_dataset(cfg: Config) -> None:
    """env.name=dataset: the files load, the split is not empty, the columns are there and of the
    right kind, every reward function imports and scores the first row."""
    if cfg.env.name != "dataset":
        return
    from colocate.envs.dataset import load_rows
    from colocate.envs.rows import expand_files, first_bad_json
    from colocate.objects import ObjectPathError
    from colocate.rewards import load_reward
    first = None
    for key, split in (("data_files", cfg.env.split), ("eval_files", "train")):
        files = getattr(cfg.env, key)
        if not files:
            continue
        check_data_files(key, files)
        try:
            rows = load_rows(files, split, cfg.model.cache_dir)
        except Exception as e:  # noqa: BLE001 - datasets/pyarrow raise many kinds; one line names the files
            if "corresponds to no data" in str(e):  # a split expression that selects nothing
                raise ConfigError(f"env.{key}: split {split!r} of {files} is empty") from None
            bad_line = first_bad_json(expand_files(files))
            if bad_line:  # the file's own line, not the row of a parser chunk
                raise ConfigError(f"env.{key}: {bad_line}; fix that line") from None
            cause = e.__cause__ or e  # datasets wraps the parser's error
            raise ConfigError(f"env.{key}: {files} do not load as split {split!r} "
                              f"({type(cause).__name__}: {' '.join(str(cause).split())[:300]})") from None
        check_prompt_column(key, rows, cfg)
        rows = check_rows(key, cfg)
        if key == "data_files":
            first = rows[0]
    for name in cfg.env.reward:
        try:
            fn = load_reward(name, cfg.env.answer_column)
        except ObjectPathError as e:
            raise ConfigError(f"env.reward: {e}") from None
        check_reward_call(cfg, name, fn, first)


def check_reward_call(cfg: Config, name: str, fn, row: dict) -> None:
    """A user's reward function, called on the first row as the dataset env calls it (an agent's
    rewards also get each episode's environment: checked at run time)."""
    from colocate.envs.dataset import reward_limits
    from colocate.rewards import RewardRow, check_reward
    if ":" not in name or row is None or cfg.env.tools or cfg.env.environment:
        return
    env = cfg.env
    columns = {k: v for k, v in row.items() if k != env.prompt_column}
    problem = check_reward(name, fn, RewardRow(row[env.prompt_column], row.get(env.answer_column), columns),
                           reward_limits(cfg))
    if problem:
        raise ConfigError(f"env.reward: {problem}")


def lazy_prompt_ids(cfg: Config):
    """prompt -> token ids as the env will compute them; the tokenizer is loaded on the first call
    (only a prompt that may be too long for the model needs it)."""
    chat = []

    def prompt_ids(prompt) -> list[int]:
        if not chat:
            from colocate.chat import ChatFormat
            from colocate.envs import env_corpus
            from colocate.models import load_tokenizer
            key, corpus_fn = env_corpus(cfg)
            chat.append(ChatFormat(load_tokenizer(cfg.model, corpus_fn, key), cfg.model.chat_template))
        return chat[0].ids(prompt)
    return prompt_ids


def check_rows(key: str, cfg: Config):
    """Every row of env.<key> (`envs/rows.py`): under env.bad_rows=error the first unusable one is
    the error; under skip the dropped rows are counted in one line (stdout, rank 0) -> the usable rows."""
    from colocate.envs.dataset import BadRowError, open_rows
    try:
        rows, scan = open_rows(cfg, key, lazy_prompt_ids(cfg))
    except BadRowError as e:
        raise ConfigError(str(e)) from None
    if scan.bad and len(rows) == 0:
        raise ConfigError(f"env.{key}: every row is unusable ({_counts(scan.counts)}; env.bad_rows=skip "
                          "dropped them all): nothing to draw prompts from")
    if scan.bad and int(os.environ.get("RANK", "0")) == 0:
        print(f"colocate: env.{key}: dropping {len(scan.bad)} unusable rows ({_counts(scan.counts)}; "
              "env.bad_rows=skip)", file=sys.stderr, flush=True)
    return rows


def _counts(counts: dict) -> str:
    return ", ".join(f"{reason} {n}" for reason, n in sorted(counts.items()))


def check_custom_env(cfg: Config) -> None:
    """A custom env class by path: it imports, subclasses `Env` and follows its protocol by
    signature, and `env.options` fits its constructor (`envs/protocol.py`)."""
    if cfg.env.name in ("arithmetic", "diplomacy", "dataset"):
        return
    from colocate.envs import env_class
    from colocate.envs.protocol import EnvProtocolError, check_env_class
    from colocate.objects import ObjectPathError
    try:
        cls = env_class(cfg.env.name)
    except ObjectPathError as e:
        raise ConfigError(f"env.name: {e}") from None
    try:
        check_env_class(cls, cfg.env.options)
    except EnvProtocolError as e:
        raise ConfigError(f"env.name={cfg.env.name!r}: {e}") from None
    from colocate.envs.agent import AgentEnv
    if issubclass(cls, AgentEnv):
        check_agent_lengths(cfg, f"env.name={cfg.env.name!r} (an AgentEnv)")
    else:
        refuse_agent_keys(cfg, f"env.name={cfg.env.name!r} is not an AgentEnv")


def check_agent_tools(cfg: Config) -> None:
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


def check_optional_packages(cfg: Config) -> None:
    """Packages the config needs beyond the base install: vLLM for engine.kind=vllm."""
    import importlib.util
    if cfg.engine.kind == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("engine.kind=vllm but vllm is not installed in this environment (pip install vllm, "
                          "or set engine.kind=hf / auto)")


def meta_model(cfg: Config):
    """The base model on the meta device (no memory): its module names and sizes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from colocate.models import model_config
    config = AutoConfig.from_pretrained(cfg.model.path) if cfg.model.path else \
        model_config(cfg.model.shape, 1024, cfg.model.dtype)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def check_lora_targets(cfg: Config, model) -> None:
    """lora.target_modules: each names modules of the (meta-device) model (peft would fail later,
    deep inside)."""
    import difflib
    names = {name.rpartition(".")[2] for name, _ in model.named_modules()}
    for target in cfg.lora.target_modules:
        if target not in names:
            near = difflib.get_close_matches(target, sorted(names), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"lora.target_modules: {target!r} is no module of the model{hint}")


def check_placement(cfg: Config, world: int | None, local_world: int | None, gpus: int) -> None:
    """topology.placement against the world torchrun gives (WORLD_SIZE, LOCAL_WORLD_SIZE), and which
    ranks share one of the `gpus` GPUs (`topology.check_shared_gpus`)."""
    from colocate.topology import check_shared_gpus, place_roles, rank_devices
    if world is None:
        return
    try:
        roles = place_roles(cfg, world, local_world or world)
        if gpus:
            check_shared_gpus(roles, rank_devices(world, local_world or world, gpus))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def gpu_count(cfg: Config) -> int:
    """GPUs the ranks will use (0: the job runs on CPUs)."""
    import torch
    if cfg.sync.backend == "gloo" or not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count()


@dataclass(frozen=True)
class CardSpec:
    """`colocate check --gpu-memory SIZE [--gpus-per-node G]`: plan for a card this machine may not have."""
    memory: str
    """80GiB, 80GB, 81559MiB, or a card's name (`gpu_budget.CARDS`)."""
    gpus_per_node: int | None = None
    """GPUs per node; None: one per rank (more ranks than GPUs share them round-robin, as a run does)."""


def the_card(card: CardSpec | None, gpus: int, local_world: int):
    """The GPUs to plan memory for: `card` (a check for another machine), else this machine's (NVML),
    else None (CPU ranks)."""
    from colocate.gpu_budget import Card, gpu_total_bytes, parse_gpu_memory
    if card is not None:
        per_node = card.gpus_per_node or local_world
        return Card(parse_gpu_memory(card.memory), per_node, f"{card.memory}, {per_node} per node")
    total = gpu_total_bytes() if gpus else None
    return Card(total, gpus, "this machine's GPUs") if total else None


def plan_memory(cfg: Config, model, world: int | None, local_world: int | None, card: CardSpec | None,
                gpus: int, show: bool) -> None:
    """`gpu_budget.plan_memory` over the ranks' placement: `auto` resolved, every GPU checked, the
    plan printed where `show` (a check, or rank 0 of a run)."""
    from colocate.gpu_budget import plan_memory as plan, print_plan
    from colocate.topology import place_roles, rank_devices
    world = world or 2
    local_world = local_world or world
    roles = place_roles(cfg, world, local_world)
    planned = the_card(card, gpus, local_world)
    lines = plan(cfg, model, roles, rank_devices(world, local_world, planned.per_node) if planned else None, planned)
    if show:
        print_plan(lines)


def preflight(cfg: Config, world: int | None = None, local_world: int | None = None,
              card: CardSpec | None = None, show_plan: bool = False) -> None:
    gpus = gpu_count(cfg)
    check_placement(cfg, world, local_world, gpus)
    check_run_dir(cfg.metrics.run_dir)
    check_model_dir(cfg.model.path)
    check_state_cache(cfg)
    check_dataset(cfg)
    check_custom_env(cfg)
    check_agent_tools(cfg)
    if card is None:  # `--gpu-memory` plans for another machine: its packages are not this one's
        check_optional_packages(cfg)
    model = meta_model(cfg)  # once: its module names and its size
    check_lora_targets(cfg, model)
    plan_memory(cfg, model, world, local_world, card, gpus, show_plan)
