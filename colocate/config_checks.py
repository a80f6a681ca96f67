"""Config checks: each key on its own (`check_values`: one table of choices and ranges), then the
rules across keys (`validate`). Every failure is a `ConfigError` with one line naming the keys
involved; `config.load_config` runs `validate` after merging, before anything is built. An env's own
rules (env.name, its keys' ranges, its keys among themselves, keys it would ignore, env.processes)
are its `check` hook, which `preflight` runs (`envs.check_env`); engine.kind is the engine table's
(`engine/table.py`).

This module imports nothing of colocate but `config_schema`.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import re

from colocate.config_schema import (ATTENTIONS, BAD_ROWS, CHAT_TEMPLATES, CUDAGRAPH_MODES, DTYPES,
                                    EVAL_OPPONENTS, LOGGERS, LOGPROB_KERNELS, CONSTRAINT_MASKS, LORA_MODES, LOSS_IMPLS, LR_SCHEDULES, MODEL_SHAPES,
                                    NORM_MODES, PLACEMENTS, PREFIX_SHARING, QUANTIZATIONS, RATIO_LEVELS, SYNC_BACKENDS, TOOL_PARSERS,
                                    UPDATE_MODES, Config, RolloutConfig)


class ConfigError(ValueError):
    """A bad configuration: the message is one line a user can act on."""


_CHOICES = {
    ("model", "shape"): MODEL_SHAPES,
    ("model", "dtype"): DTYPES,
    ("model", "chat_template"): CHAT_TEMPLATES,
    ("engine", "lora_mode"): LORA_MODES,
    ("engine", "logprob_kernel"): LOGPROB_KERNELS,
    ("engine", "constraint_masks"): CONSTRAINT_MASKS,
    ("engine", "cudagraph_mode"): CUDAGRAPH_MODES,
    ("engine", "quantization"): QUANTIZATIONS,
    ("env", "bad_rows"): BAD_ROWS,
    ("env", "tool_parser"): TOOL_PARSERS,
    ("loss", "norm"): NORM_MODES,
    ("loss", "impl"): LOSS_IMPLS,
    ("loss", "ratio_level"): RATIO_LEVELS,
    ("learner", "attention"): ATTENTIONS,
    ("learner", "prefix_sharing"): PREFIX_SHARING,
    ("learner", "lr_schedule"): LR_SCHEDULES,
    ("sync", "backend"): SYNC_BACKENDS,
    ("topology", "placement"): PLACEMENTS,
    ("rollout", "update"): UPDATE_MODES,
}
def nearest_key(key: str, valid: list[str]) -> str:
    """The valid key closest to a misspelt one."""
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.0)
    return match[0] if match else valid[0]


def resolve_roles(cfg: Config, world_size: int) -> tuple[int, int]:
    """(num_inference, num_learners) for this world size; default half and half, 1 + 1 for 2 processes."""
    t = cfg.topology
    num_inference = t.num_inference or max(1, world_size // 2)
    num_learners = t.num_learners or (world_size - num_inference)
    return num_inference, num_learners


_POSITIVE, _NON_NEGATIVE = "must be > 0", "must be >= 0"
_RANGES = {
    # (section, key): (the rule a valid value keeps, its wording); every float must also be finite
    ("lora", "rank"): (lambda v: v >= 1, "must be >= 1"),
    ("lora", "alpha"): (lambda v: v > 0, _POSITIVE),
    ("lora", "dropout"): (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    ("engine", "max_new_tokens"): (lambda v: v >= 1, "must be >= 1 (tokens sampled per completion)"),
    ("engine", "temperature"): (lambda v: v > 0, _POSITIVE),
    ("engine", "max_num_seqs"): (lambda v: v >= 1, "must be >= 1"),
    ("engine", "gpu_memory_utilization"): (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    ("engine", "kv_cache_gib"): (lambda v: v >= 0, "must be >= 0 (0: vLLM sizes the KV cache)"),
    ("engine", "max_model_len"): (lambda v: v >= 0, _NON_NEGATIVE + " (0 sizes it from the workload)"),
    ("engine", "max_num_batched_tokens"): (lambda v: v >= 0, _NON_NEGATIVE + " (0 keeps vLLM's default)"),
    ("engine", "max_capture_tokens"): (lambda v: v >= 0, _NON_NEGATIVE),
    ("rollout", "groups_per_step"): (lambda v: v >= 1, "must be >= 1"),
    ("rollout", "oversample_groups"): (lambda v: v >= 0, _NON_NEGATIVE),
    ("learner", "lr"): (lambda v: v > 0, _POSITIVE),
    ("learner", "weight_decay"): (lambda v: v >= 0, _NON_NEGATIVE),
    ("learner", "max_grad_norm"): (lambda v: v >= 0, _NON_NEGATIVE + " (0 disables clipping)"),
    ("learner", "num_steps"): (lambda v: v >= 1, "must be >= 1"),
    ("learner", "micro_batch_tokens"): (lambda v: v == "auto" or (isinstance(v, int) and v >= 1),
                                        "must be >= 1 (the packing budget in tokens) or auto (the largest that "
                                        "fits the GPU: colocate/gpu_budget.py)"),
    ("learner", "max_policy_lag"): (lambda v: v >= 0, _NON_NEGATIVE),
    ("learner", "updates_per_batch"): (lambda v: v >= 1, "must be >= 1 (optimizer steps per rollout batch)"),
    ("learner", "warmup_steps"): (lambda v: v >= 0, _NON_NEGATIVE + " (0 = no warm-up)"),
    ("learner", "min_lr_ratio"): (lambda v: 0 <= v <= 1, "must be in [0, 1] (a fraction of learner.lr)"),
    ("loss", "clip_ratio_c"): (lambda v: v == 0 or v > 1, "must be 0 (off) or > 1 (the dual clip bounds ratios "
                               "above the upper clip; verl uses 3)"),
    ("loss", "eps_low"): (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    ("loss", "eps_high"): (lambda v: v >= 0, _NON_NEGATIVE),
    ("loss", "beta"): (lambda v: v >= 0, _NON_NEGATIVE),
    ("loss", "seq_eps_low"): (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    ("loss", "seq_eps_high"): (lambda v: v >= 0, _NON_NEGATIVE),
    ("loss", "tis_cap"): (lambda v: v == 0 or v >= 1, "must be 0 (off) or >= 1 (a cap below 1 shrinks on-policy tokens)"),
    ("loss", "mis_threshold"): (lambda v: v >= 0, _NON_NEGATIVE + " (0 = off)"),
    ("sync", "canary_every"): (lambda v: v >= 0, _NON_NEGATIVE + " (0 = no canary)"),
    ("topology", "num_inference"): (lambda v: v >= 0, _NON_NEGATIVE + " (0 = half the world)"),
    ("topology", "num_learners"): (lambda v: v >= 0, _NON_NEGATIVE + " (0 = the rest)"),
    ("topology", "timeout_s"): (lambda v: v > 0, _POSITIVE),
    ("metrics", "log_every"): (lambda v: v >= 1, "must be >= 1"),
    ("metrics", "profile_wait"): (lambda v: v >= 0, _NON_NEGATIVE),
    ("metrics", "profile_warmup"): (lambda v: v >= 0, _NON_NEGATIVE),
    ("metrics", "profile_active"): (lambda v: v >= 1, "must be >= 1"),
    ("metrics", "profile_engine_steps"): (lambda v: v >= 0, _NON_NEGATIVE),
    ("metrics", "nvml_interval_s"): (lambda v: v >= 0, _NON_NEGATIVE + " (0 disables the sampler)"),
    ("metrics", "stall_timeout_s"): (lambda v: v >= 0, _NON_NEGATIVE + " (0 disables the alert)"),
    ("metrics", "max_nonfinite_steps"): (lambda v: v >= 1, "must be >= 1"),
    ("metrics", "peak_tflops"): (lambda v: v > 0, _POSITIVE),
    ("metrics", "reward_drop_alert"): (lambda v: 0 <= v < 1, "must be in [0, 1) (a fraction of the best reward; 0 = off)"),
    ("metrics", "entropy_alert"): (lambda v: 0 <= v < 1, "must be in [0, 1) (a fraction of the previous window; 0 = off)"),
    ("metrics", "grad_norm_alert"): (lambda v: v == 0 or v > 1, "must be 0 (off) or > 1 (times the recent median)"),
    ("metrics", "alert_window"): (lambda v: v >= 1, "must be >= 1"),
    ("checkpoint", "every"): (lambda v: v >= 0, _NON_NEGATIVE + " (0 = only at exit)"),
    ("checkpoint", "keep"): (lambda v: v >= 0, _NON_NEGATIVE + " (0 keeps every checkpoint)"),
    ("eval", "every"): (lambda v: v >= 0, _NON_NEGATIVE + " (0 = only at the end)"),
    ("eval", "temperature"): (lambda v: v >= 0, _NON_NEGATIVE + " (0 = greedy)"),
    ("eval", "games"): (lambda v: v >= 1, "must be >= 1"),
    ("eval", "horizon_years"): (lambda v: v >= 1, "must be >= 1"),
    ("eval", "max_samples"): (lambda v: v >= 0, _NON_NEGATIVE + " (0 = all)"),
}


def check_values(cfg: Config) -> None:
    """Each key on its own: a choice from its tuple, a finite float, a value in its range."""
    for (section, key), allowed in _CHOICES.items():
        value = getattr(getattr(cfg, section), key)
        if value not in allowed:
            near = nearest_key(str(value), [a for a in allowed if a]) if any(allowed) else ""
            raise ConfigError(f"{section}.{key}={value!r} is not one of {', '.join(map(repr, allowed))}"
                              + (f"; did you mean {near!r}?" if near else ""))
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        for g in dataclasses.fields(section):
            value = getattr(section, g.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{f.name}.{g.name}={value!r} must be a finite number")
    for (section, key), (ok, rule) in _RANGES.items():
        value = getattr(getattr(cfg, section), key)
        if not ok(value):
            raise ConfigError(f"{section}.{key}={value!r} {rule}")
    if not cfg.lora.target_modules:
        raise ConfigError("lora.target_modules is empty: at least one linear layer needs an adapter")
    bad = [o for o in cfg.metrics.loggers if o not in LOGGERS]
    if bad:
        raise ConfigError(f"metrics.loggers: {bad[0]!r} is not one of {', '.join(map(repr, LOGGERS))}")
    bad = [o for o in cfg.eval.opponents if o not in EVAL_OPPONENTS]
    if bad or not cfg.eval.opponents:
        raise ConfigError(f"eval.opponents={cfg.eval.opponents!r}: expected a non-empty list of "
                          f"{', '.join(map(repr, EVAL_OPPONENTS))}")


_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def is_object_path(text: str) -> bool:
    """"my_pkg.module:name" names an object to import (a custom env class, a reward function)."""
    return bool(_PATH.fullmatch(text))


def derive_batch_size(r: RolloutConfig) -> None:
    """rollout.batch_size is groups_per_step * group_size: 0 (the default) fills it in; a value set
    by hand is accepted only when it agrees (so `--rollout.group_size=16` alone is a valid change)."""
    derived = r.groups_per_step * r.group_size
    if r.batch_size not in (0, derived):
        raise ConfigError(f"rollout.batch_size={r.batch_size} must equal rollout.groups_per_step * rollout.group_size "
                          f"= {r.groups_per_step} * {r.group_size} = {derived} (or be left out: it is derived)")
    r.batch_size = derived


def validate(cfg: Config, *, world_size: int | None = None) -> None:
    """Value checks (`check_values`), then cross-field checks. Each failure is one line naming the
    fields involved."""
    check_values(cfg)
    r = cfg.rollout
    if r.group_size < 2:
        raise ConfigError(f"rollout.group_size={r.group_size}: GRPO needs at least 2 samples per group")
    derive_batch_size(r)
    if r.oversample_groups > 0 and cfg.learner.max_policy_lag < 2:
        raise ConfigError(f"rollout.oversample_groups={r.oversample_groups} needs learner.max_policy_lag >= 2: "
                          "a group carried over to the next batch is trained a step later, so batches start one "
                          "version fresher than the budget (lag 1 would make rollouts wait for every learner step)")
    if r.update == "inflight" and cfg.learner.max_policy_lag < 1:
        raise ConfigError("rollout.update=inflight needs learner.max_policy_lag >= 1: requests still in flight when a "
                          "batch ships are trained with a later batch, at least one version after their first token")
    check_schedule_and_alerts(cfg)
    check_fp8(cfg)
    if cfg.env.overlong_buffer > cfg.engine.max_new_tokens:
        raise ConfigError(f"env.overlong_buffer={cfg.env.overlong_buffer} exceeds engine.max_new_tokens="
                          f"{cfg.engine.max_new_tokens}: the penalty would start below zero length")
    if world_size is not None:
        num_inference, num_learners = resolve_roles(cfg, world_size)
        if num_inference < 1 or num_learners < 1 or num_inference + num_learners != world_size:
            raise ConfigError(
                f"topology: {num_inference} inference + {num_learners} learner ranks do not fit world size "
                f"{world_size} (need at least 1 of each, summing to the world size)")
        if r.groups_per_step < num_inference:  # uneven shares are fine (Topology.share); empty ones are not
            raise ConfigError(f"rollout.groups_per_step={r.groups_per_step} leaves some of the {num_inference} "
                              "inference ranks without a group")
        # learners may get shards one sequence apart (data.shard_batch) and run as many
        # micro-batches as the busiest one, so the batch need not divide by the learner count


def check_schedule_and_alerts(cfg: Config) -> None:
    """The learning-rate schedule fits the run; a key that would be ignored is refused."""
    lc, m = cfg.learner, cfg.metrics
    if lc.warmup_steps >= lc.num_steps:
        raise ConfigError(f"learner.warmup_steps={lc.warmup_steps} must be below learner.num_steps={lc.num_steps} "
                          "(the run would never train at learner.lr)")
    if lc.min_lr_ratio > 0 and lc.lr_schedule != "cosine":
        raise ConfigError(f"learner.min_lr_ratio={lc.min_lr_ratio} applies only to learner.lr_schedule=cosine "
                          f"(got {lc.lr_schedule!r})")
    if m.stop_on_collapse and m.reward_drop_alert == 0:
        raise ConfigError("metrics.stop_on_collapse needs metrics.reward_drop_alert > 0 (the alert that stops the run)")
    if m.stop_on_collapse and not cfg.checkpoint.enabled:
        raise ConfigError("metrics.stop_on_collapse needs checkpoint.enabled=true (it writes a checkpoint and keeps "
                          "the last good one; checkpoint.every > 0 gives one from before the drop)")


def check_fp8(cfg: Config) -> None:
    """FP8 weights sample from a rounded copy of the trained policy: the loss must correct for it,
    in either LoRA mode."""
    corrected = cfg.loss.tis_cap > 0 or cfg.loss.mis_threshold > 0 or cfg.learner.updates_per_batch > 1
    if cfg.engine.quantization == "fp8" and not corrected:
        raise ConfigError("engine.quantization=fp8 samples from a rounded copy of the trained policy: correct for "
                          "it in the loss with loss.tis_cap (truncated importance sampling, e.g. 2.0) or "
                          "loss.mis_threshold")
