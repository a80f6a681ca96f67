"""Run configuration: nested dataclasses, YAML files, `--section.key=value` overrides, validation.

One dataclass per component, each field documented by the string literal under it (the torchtitan
habit). `load_config` is the only entry: it merges YAML and overrides, rejects unknown keys (naming
the nearest valid one) and wrong types, then `validate` runs the cross-field checks. Everything here
runs before any model is built or any process group exists; a `ConfigError` ends the job with exit
code 2 and one line (see `train.py`).

Deliberately absent: environment-variable magic, `exec`, registries. What a run used is written to
`<run_dir>/config.yaml` by the composition root.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml


class ConfigError(ValueError):
    """A bad configuration: the message is one line a user can act on."""


@dataclass
class ModelConfig:
    path: str = ""
    """Local HF model directory. Empty: build the embedded tiny model (random weights, local tokenizer)."""
    shape: str = "tiny"
    """Named random-init shape when `path` is empty: tiny, qwen2.5-0.5b, qwen2.5-7b."""
    dtype: str = "float32"
    """Parameter dtype of the base model: float32 or bfloat16."""
    cache_dir: str = ".cache/colocate"
    """Where the embedded tokenizer and tiny model are built once and reused."""
    seed: int = 0
    """Seed of the random base weights (all ranks build the same model from it)."""


@dataclass
class LoraConfig:
    rank: int = 8
    """LoRA rank r."""
    alpha: float = 16.0
    """LoRA alpha; the update is scaled by alpha / r."""
    dropout: float = 0.0
    """LoRA dropout (0 keeps sampler and learner log-probs identical)."""
    target_modules: list = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    """Linear layers that get an adapter."""
    fused_epilogue: bool = True
    """Add the LoRA term inside the up-projection GEMM (`addmm`, beta=1, alpha=scaling) instead of
    peft's separate `* scaling` and `+` over [tokens, out] (`models.set_fused_lora`)."""


@dataclass
class EngineConfig:
    kind: str = "auto"
    """auto (vllm on CUDA when installed, else hf), hf or vllm."""
    max_new_tokens: int = 8
    """Most tokens sampled per completion."""
    temperature: float = 1.0
    """Sampling temperature; the learner divides logits by the same value."""
    max_num_seqs: int = 512
    """vLLM: most sequences in flight."""
    gpu_memory_utilization: float = 0.85
    """vLLM: fraction of the GPU the engine may take."""
    max_model_len: int = 0
    """vLLM: context length; 0 sizes it from the workload (prompt + max_new_tokens)."""
    enforce_eager: bool = False
    """vLLM: disable CUDA graphs (debugging only)."""
    enable_prefix_caching: bool = True
    """vLLM: share KV blocks of common prompt prefixes."""
    max_num_batched_tokens: int = 0
    """vLLM: most tokens (prefill chunks + one per decoding sequence) in one engine step; 0 keeps
    vLLM's default (16384 on an H200). Streaming rollouts want it small, so that prefills of new
    phases do not slow every other game's decode steps."""
    lora_mode: str = "slot"
    """vLLM: how the adapter reaches the engine. slot: one pinned LoRA slot written in place (vLLM's
    LoRA kernels run every step). merged: W0 + (alpha/r) B A written into the base weights on each
    update (no LoRA kernels; keeps a copy of the adapted base weights, ~12 GiB at 7B; bf16 rounds
    away updates below half an ulp of W0, see engine/vllm_worker.py)."""
    jump_forward: int = 0
    """vLLM: most grammar-forced tokens taken in one engine step (0 = off). Each constrained
    request's next forced tokens go to vLLM as a speculative draft; with token grammars (the
    default) the rejection sampler always accepts them, and sampling stays exact for any draft
    (engine/vllm_ff.py). Needs vLLM's synchronous scheduling and V1 model runner, which it selects;
    with lora_mode=slot, max_num_batched_tokens >= max_num_seqs * (1 + jump_forward). Not yet
    measured on GPUs."""
    validate_grammars: bool = True
    """vLLM: let vLLM's client check every request's grammar with llguidance before it queues the
    request (~1 ms of the inference rank's host time per request at a 152k vocabulary). Our
    grammars are generated (engine/vllm_grammar.py, checked against llguidance in the tests) and
    the engine core compiles each one anyway. false skips the check in the inference rank's
    process: a grammar the core could not compile would then surface when its completion's replay
    disagrees with the Constraint (an error either way; with the check, at submit)."""


@dataclass
class EnvConfig:
    name: str = "arithmetic"
    """Environment: arithmetic (synthetic, verifiable) or diplomacy."""
    max_operand: int = 4
    """arithmetic: operands are drawn from 0..max_operand."""
    use_constraint: bool = True
    """Constrain sampling to well-formed answers (legal orders for diplomacy)."""
    horizon_years: int = 4
    """diplomacy: years played after the fork before the reward is taken."""
    stall_years: int = 2
    """diplomacy: a continuation stops early when no supply centre changed for this many years."""
    train_later_phases: bool = False
    """diplomacy: also train the phases after the fork with the continuation's advantage (multi-turn)."""
    unit_labels: bool = True
    """diplomacy: each order line starts with its unit (A PAR - BUR). false: the line leaves the unit
    out (- BUR) and its position names it; under the constraint those tokens are forced, so this
    saves about a third of the decode steps (envs/diplomacy/prompt.py). Meant for constrained
    sampling: in free text one stray line shifts the positions of all later ones."""
    list_supports: bool = True
    """diplomacy: the prompt lists each unit's legal supports and convoys. false: only moves, holds,
    convoyed moves and retreats are listed (the constraint still allows every legal order). Supports
    are 70 % of a power's own part, which is what the engine prefills per request: false cuts the
    prefill per request by about two thirds, at the cost of a less informed policy."""
    state_cache: str = ""
    """diplomacy: JSON-lines file of mid-game states to fork from; empty starts from the opening."""
    reward_target: float = 0.9
    """Mean reward the run is expected to reach; summary.json says whether it did."""


@dataclass
class RolloutConfig:
    groups_per_step: int = 16
    """GRPO groups per learner step, summed over all inference ranks."""
    group_size: int = 8
    """Samples per group (G)."""
    batch_size: int = 128
    """Samples per learner step = groups_per_step * group_size; checked."""
    seed: int = 0
    """Seed of prompt selection and sampling (offset per inference rank)."""
    oversample_groups: int = 0
    """Extra groups kept in play per inference rank; a batch ships as soon as enough groups finish,
    stragglers join a later batch (0 = every batch plays exactly its own groups)."""
    stream: bool = False
    """Each game sends its next phase to the engine as soon as its current one is answered, instead
    of every game waiting for the round's slowest completion (a phase barrier). Needs an engine
    that streams (vLLM); the HF engine answers all pending requests at once either way. With
    oversample_groups > 0 the batch takes the groups that finish first in wall-clock time, which
    leans toward games with short completions."""


@dataclass
class LearnerConfig:
    lr: float = 1e-3
    """AdamW learning rate of the adapter."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip; 0 disables."""
    num_steps: int = 50
    """Learner steps (= adapter versions) in the run."""
    micro_batch_tokens: int = 4096
    """Token budget of one forward/backward micro-batch."""
    activation_checkpointing: bool = False
    """Recompute decoder-block activations in backward."""
    compile: bool = False
    """torch.compile each decoder block (dynamic shapes); the first step pays the compilation."""
    fsdp: bool = True
    """Shard base model and adapter over the learner ranks with FSDP2 (one learner too: same code path,
    and bf16 compute with fp32 reductions on GPU). False: a full replica per learner, adapter gradients
    all-reduced (the reference path)."""
    attention: str = "auto"
    """Attention over packed micro-batches: varlen (flash-attention varlen kernel, sequence boundaries
    from cu_seqlens), sdpa (block-diagonal causal mask), auto (varlen on CUDA, sdpa elsewhere)."""
    max_policy_lag: int = 0
    """A trajectory sampled with version v is trained at step s only if s - v <= this; 0 = synchronous."""


@dataclass
class LossConfig:
    eps_low: float = 0.2
    """Lower clip of the importance ratio: ratio >= 1 - eps_low."""
    eps_high: float = 0.28
    """Upper clip of the importance ratio: ratio <= 1 + eps_high."""
    beta: float = 0.0
    """Weight of the k3 KL against the adapter-disabled model; 0 skips the reference pass."""
    norm: str = "dapo"
    """Token normalization: grpo (per-sequence mean), dapo (per-token mean), dr_grpo (fixed length)."""
    impl: str = "auto"
    """auto (triton on CUDA, torch elsewhere), triton or torch."""


@dataclass
class SyncConfig:
    backend: str = "auto"
    """auto (nccl on CUDA, gloo on CPU), nccl or gloo."""
    check_checksum: bool = False
    """Broadcast a checksum with every adapter and verify it on the receivers."""
    fanout: str = "broadcast"
    """vLLM engines: how each adapter version reaches them. broadcast: one NCCL group of learner
    rank 0 and every engine, so every engine takes a version at the same moment (one that finished
    its batch first waits at the broadcast for the others). per_engine: one group per engine, each
    send on its own CUDA stream, so each engine takes a version when it is ready; the learner's
    later kernels still wait until every engine has it. The HF engine always takes the broadcast
    on the torch sync group."""


@dataclass
class TopologyConfig:
    num_inference: int = 0
    """Inference ranks; 0 = half of the world (rounded down, at least 1)."""
    num_learners: int = 0
    """Learner ranks; 0 = the rest of the world."""
    timeout_s: float = 300.0
    """Collective timeout: a dead peer ends the job instead of hanging it."""


@dataclass
class MetricsConfig:
    run_dir: str = "runs/default"
    """Output directory: resolved config, TensorBoard events, summary.json, traces."""
    log_every: int = 1
    """Print a progress line every this many steps (one rank per role)."""
    tensorboard: bool = True
    """Write TensorBoard event files under <run_dir>/tb/<role>."""
    profile: bool = False
    """Record a torch.profiler trace window per role."""
    profile_wait: int = 1
    """Profiler: steps skipped before warm-up."""
    profile_warmup: int = 1
    """Profiler: warm-up steps."""
    profile_active: int = 2
    """Profiler: recorded steps."""
    profile_dir: str = "profiles"
    """Profiler traces go to <profile_dir>/<run name>/ (one trace file per role)."""
    nvml_interval_s: float = 5.0
    """Seconds between NVML / CPU samples; 0 disables the sampler."""
    stall_timeout_s: float = 600.0
    """Alert when a role makes no progress (no trajectory produced or consumed) for this long; 0 = off."""
    max_nonfinite_steps: int = 3
    """A NaN/inf loss skips the update; this many in a row stop the run with an error."""
    peak_tflops: float = 790.0
    """Per-device dense bf16 peak for learner/mfu (790 = measured H200 matmul peak)."""


@dataclass
class CheckpointConfig:
    every: int = 0
    """Write a checkpoint every this many steps (and at exit); 0 = only at exit."""
    keep: int = 2
    """Checkpoints kept (oldest removed)."""
    resume: str = ""
    """'' = fresh run, 'auto' = newest complete checkpoint in <run_dir>/checkpoints, or a path."""
    enabled: bool = False
    """Write checkpoints at all."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


_CHOICES = {
    ("model", "shape"): ("tiny", "qwen2.5-0.5b", "qwen2.5-7b"),
    ("model", "dtype"): ("float32", "bfloat16"),
    ("engine", "kind"): ("auto", "hf", "vllm"),
    ("engine", "lora_mode"): ("slot", "merged"),
    ("env", "name"): ("arithmetic", "diplomacy"),
    ("loss", "norm"): ("grpo", "dapo", "dr_grpo"),
    ("loss", "impl"): ("auto", "triton", "torch"),
    ("learner", "attention"): ("auto", "varlen", "sdpa"),
    ("sync", "backend"): ("auto", "nccl", "gloo"),
    ("sync", "fanout"): ("broadcast", "per_engine"),
}


def _nearest(key: str, valid: list[str]) -> str:
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.0)
    return match[0] if match else valid[0]


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check (and for CLI strings, parse) one value against its field type."""
    origin = typing.get_origin(annotation) or annotation
    if isinstance(value, str) and annotation is not str and origin is not list:
        # Overrides arrive as strings: parse them as YAML scalars ("3" -> 3, "true" -> True).
        value = yaml.safe_load(value)
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        return value
    ok = isinstance(value, annotation) and not (annotation is int and isinstance(value, bool))
    if not ok:
        raise ConfigError(f"{where}: expected {annotation.__name__}, got {type(value).__name__} {value!r}")
    return value


def _merge(section: Any, values: dict, path: str) -> None:
    hints = typing.get_type_hints(type(section))
    names = [f.name for f in dataclasses.fields(section)]
    for key, value in values.items():
        where = f"{path}.{key}" if path else key
        if key not in names:
            raise ConfigError(f"unknown config key '{where}'; did you mean "
                              f"'{(path + '.') if path else ''}{_nearest(key, names)}'?")
        current = getattr(section, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: expected a mapping of keys, got {value!r}")
            _merge(current, value, where)
        else:
            setattr(section, key, _coerce(value, hints[key], where))


def parse_overrides(argv: list[str]) -> tuple[str | None, dict, bool]:
    """Split `--config PATH`, `--resume` and `--a.b=value` arguments into (path, nested dict, resume)."""
    config_path, nested, resume = None, {}, False
    it = iter(argv)
    for arg in it:
        if arg == "--config":
            config_path = next(it, None)
            continue
        if arg.startswith("--config="):
            config_path = arg.split("=", 1)[1]
            continue
        if arg == "--resume":
            resume = True
            continue
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"cannot parse argument {arg!r}; expected --section.key=value")
        key, sep, value = arg[2:].partition("=")
        if not sep:
            value = next(it, None)
            if value is None:
                raise ConfigError(f"argument {arg!r} has no value")
        node = nested
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return config_path, nested, resume


def load_config(path: str | None = None, overrides: dict | None = None, *, world_size: int | None = None) -> Config:
    """YAML file, then overrides (nested dict, string leaves allowed), then `validate`."""
    cfg = Config()
    if path:
        if not os.path.exists(path):
            raise ConfigError(f"config file not found: {path}")
        with open(path) as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
        _merge(cfg, data, "")
    if overrides:
        _merge(cfg, overrides, "")
    validate(cfg, world_size=world_size)
    return cfg


def resolve_roles(cfg: Config, world_size: int) -> tuple[int, int]:
    """(num_inference, num_learners) for this world size; default half and half, 1 + 1 for 2 processes."""
    t = cfg.topology
    num_inference = t.num_inference or max(1, world_size // 2)
    num_learners = t.num_learners or (world_size - num_inference)
    return num_inference, num_learners


def validate(cfg: Config, *, world_size: int | None = None) -> None:
    """Cross-field checks. Each failure is one line naming the fields involved."""
    for (section, key), allowed in _CHOICES.items():
        value = getattr(getattr(cfg, section), key)
        if value not in allowed:
            raise ConfigError(f"{section}.{key}={value!r} is not one of {', '.join(allowed)}")
    r = cfg.rollout
    if r.group_size < 2:
        raise ConfigError(f"rollout.group_size={r.group_size}: GRPO needs at least 2 samples per group")
    if r.batch_size % r.group_size != 0:
        raise ConfigError(f"rollout.group_size={r.group_size} does not divide rollout.batch_size={r.batch_size}")
    if r.groups_per_step * r.group_size != r.batch_size:
        raise ConfigError(f"rollout.batch_size={r.batch_size} must equal rollout.groups_per_step * rollout.group_size "
                          f"= {r.groups_per_step * r.group_size}")
    if cfg.learner.max_policy_lag < 0:
        raise ConfigError(f"learner.max_policy_lag={cfg.learner.max_policy_lag} must be >= 0")
    if cfg.learner.num_steps < 1:
        raise ConfigError("learner.num_steps must be >= 1")
    if cfg.loss.eps_low < 0 or cfg.loss.eps_high < 0 or cfg.loss.beta < 0:
        raise ConfigError("loss.eps_low, loss.eps_high and loss.beta must be >= 0")
    if cfg.engine.jump_forward < 0:
        raise ConfigError(f"engine.jump_forward={cfg.engine.jump_forward} must be >= 0 (0 = off)")
    if cfg.engine.temperature <= 0:
        raise ConfigError(f"engine.temperature={cfg.engine.temperature} must be > 0")
    if cfg.model.path and not os.path.isdir(cfg.model.path):
        raise ConfigError(f"model.path={cfg.model.path!r} is not a local directory (nothing is downloaded)")
    if cfg.model.path and not os.path.exists(os.path.join(cfg.model.path, "config.json")):
        raise ConfigError(f"model.path={cfg.model.path!r} has no config.json: not an HF model directory")
    if world_size is not None:
        num_inference, num_learners = resolve_roles(cfg, world_size)
        if num_inference < 1 or num_learners < 1 or num_inference + num_learners != world_size:
            raise ConfigError(
                f"topology: {num_inference} inference + {num_learners} learner ranks do not fit world size "
                f"{world_size} (need at least 1 of each, summing to the world size)")
        if r.groups_per_step < num_inference:  # uneven shares are fine (Topology.share); empty ones are not
            raise ConfigError(f"rollout.groups_per_step={r.groups_per_step} leaves some of the {num_inference} "
                              "inference ranks without a group")
        # learners may get shards one sequence apart (transport.shard_batch) and run as many
        # micro-batches as the busiest one, so the batch need not divide by the learner count


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str) -> None:
    """Write the resolved config (atomically: temp file + rename)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
    os.replace(tmp, path)


def field_docs(section_cls: type) -> dict[str, str]:
    """Field docstrings of a config dataclass (for `--help` and the README table)."""
    import ast
    import inspect
    tree = ast.parse(inspect.getsource(section_cls))
    docs, body = {}, tree.body[0].body
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = nxt.value.value
    return docs

