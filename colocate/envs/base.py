"""The `Env` base: what the rollout worker needs from an environment.

An environment owns many groups at once (continuous batching across games). The worker loop is:

    env.start_group(group_id)               # G continuations from one fresh (or forked) state
    while groups are unfinished:
        keyed = env.requests()              # every prompt waiting for an action, across all groups
        completions = engine.generate([r for _, r in keyed])
        env.step({key: c for (key, _), c in zip(keyed, completions)})
        samples += env.pop_finished()       # Samples of fully finished groups, with rewards

Samples carry `group_key`: the worker normalizes advantages over the anchors of each key (the GRPO
group; per power within the group for Diplomacy). The env never sees the engine or the learner.
An env implements `from_config` and the four methods of the loop; `metrics`, the resume state,
`evaluate` and `corpus` have defaults here, so the role loops call them unconditionally. The
protocol for users' own envs (`env.name: my_pkg.my_env:MyEnv`) is docs/envs.md.
"""
from __future__ import annotations

from typing import Hashable

from colocate.data import Completion, Request, Sample
from colocate.envs.checks import KeyRules, check_key_rules, no_tool_episodes, refuse_agent_keys


class ResumeError(ValueError):
    """A checkpoint this run cannot continue from (`Env.check_resume`); the caller names the checkpoint."""


class Env:
    group_size: int = 1
    """G: continuations per group."""

    KEYS: KeyRules = {}
    """The env.* keys this env reads that have a range -> (the rule a valid value keeps, its
    wording), e.g. its settings record's (`DatasetSettings.KEYS`); the default `check` holds them.
    Keys of other envs are ignored (a preset may inherit them through `base:`)."""

    @classmethod
    def from_config(cls, cfg, tokenizer, seed: int) -> "Env":
        """The env of one inference rank: `cfg` is the run's `Config` (a custom env's own settings are
        `cfg.env.options`), `seed` differs per rank. Prompts go through
        `colocate.chat.ChatFormat(tokenizer, cfg.model.chat_template)`."""
        raise NotImplementedError(f"{cls.__name__} does not implement from_config(cfg, tokenizer, seed)")

    @classmethod
    def corpus(cls, cfg) -> list[str]:
        """Text the embedded tiny tokenizer is trained on when `model.path` is empty (your prompts and
        answers). Default: none, so text is spelled in byte-level pieces."""
        return []

    def start_group(self, group_id: int) -> None:
        """Begin G continuations sharing one start state."""
        raise NotImplementedError

    def requests(self) -> list[tuple[Hashable, Request]]:
        """All prompts now waiting for a completion, keyed."""
        raise NotImplementedError

    def step(self, completions: dict[Hashable, Completion]) -> None:
        """Apply the completions of (a subset of) the keys from `requests`."""
        raise NotImplementedError

    def pop_finished(self) -> list[Sample]:
        """Samples of groups whose every continuation has finished; each group is returned once."""
        raise NotImplementedError

    # ---- optional, with defaults ---------------------------------------------------------------

    @classmethod
    def check(cls, cfg) -> None:
        """The run's config against this env's rules (keys among themselves, keys it would ignore):
        raise `colocate.config.ConfigError` with one line naming the keys. Runs before anything is
        built, after the config's own checks (`envs.check_env`). Default: its `KEYS` in range, and
        the agent keys refused (an env that is no `AgentEnv` plays no tool episodes, so it would
        ignore them); an override calls `super().check(cfg)` to keep both."""
        check_key_rules(cfg, cls.KEYS)
        refuse_agent_keys(cfg, no_tool_episodes(cfg))

    @classmethod
    def preflight(cls, cfg) -> None:
        """What the config points at in the outside world (data files, a state cache, tools that
        import): raise `ConfigError` with one line naming the key. Runs after `check`, before any
        model is built (`envs.check_env`). Default: nothing to check."""

    @classmethod
    def check_resume(cls, saved: list[dict], cfg) -> None:
        """Whether this run can continue from the env resume states `saved` (`state_dict()` of each
        inference rank that kept one): raise `ResumeError` with one line saying what differs and what
        to do (e.g. the dataset env's files changed). Default: any saved state resumes."""

    @classmethod
    def corpus_key(cls, cfg) -> str | None:
        """Names the embedded tokenizer trained on `corpus(cfg)`: a key that changes when the text
        does, so the tokenizer is trained once per text. Default None: keyed by the text itself."""
        return None

    @classmethod
    def prompt_bound(cls, cfg) -> int:
        """Most prompt tokens one of its requests carries: sizes vLLM's context (max_model_len) when
        `engine.max_model_len` is 0. Default 1024."""
        return 1024

    @classmethod
    def requests_per_group(cls, cfg) -> int:
        """Requests one live group has in the engine at once: sizes vLLM's max_num_seqs. Default: one
        per continuation (`rollout.group_size`)."""
        return cfg.rollout.group_size

    def metrics(self) -> dict[str, float]:
        """Counters since the last call (e.g. invalid-order rate), namespaced by the caller."""
        return {}

    MEAN_OVER: dict[str, str] = {}
    """Each mean that `metrics()` reports -> the count metric it is a mean over (`merge_metrics`
    weights by it; the count adds up)."""
    COUNTS: tuple[str, ...] = ()
    """Other metrics that add up over copies (events counted)."""

    @classmethod
    def merge_metrics(cls, parts: list[dict[str, float]]) -> dict[str, float]:
        """One `metrics()` from those of several copies of the env (`env.processes`): a key ending in
        `_max` takes the max, a count (`COUNTS`, or named in `MEAN_OVER`) adds up, a mean named in
        `MEAN_OVER` is weighted by its count, and any other key is the mean over the copies that
        report it."""
        counts = set(cls.COUNTS) | set(cls.MEAN_OVER.values())
        out = {}
        for key in dict.fromkeys(k for p in parts for k in p):
            have = [p for p in parts if key in p]
            if key.endswith("_max"):
                out[key] = max(p[key] for p in have)
            elif key in counts:
                out[key] = sum(p[key] for p in have)
            elif key in cls.MEAN_OVER:
                out[key] = weighted_mean(have, key, cls.MEAN_OVER[key])
            else:
                out[key] = sum(p[key] for p in have) / len(have)
        return out

    def settle(self) -> None:
        """Wait until `requests()` and `pop_finished()` reflect every `start_group` and `step` so far.
        An env that works in this process always does (default); `EnvProcesses` waits for its copies."""

    def has_news(self) -> bool:
        """Whether work done elsewhere has come back that `requests()` or `pop_finished()` would now
        return (a streamed engine poll then stops waiting). Default: never (the work is done in `step`)."""
        return False

    def close(self) -> None:
        """Release what the env holds beyond this process's memory (`EnvProcesses`: its worker
        processes). Default: nothing."""

    def data_stats(self) -> dict[str, float]:
        """Facts about the env's data fixed when it was opened, written once under `data/` (e.g.
        "dropped/empty_prompt": rows dropped under env.bad_rows=skip). Default: none."""
        return {}

    def state_dict(self) -> dict | None:
        """What a resumed run needs to continue this env's sampling exactly (JSON-able; None: nothing)."""
        return None

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`'s output."""

    def evaluate(self, engine, eval_cfg, out_dir: str | None = None) -> dict[str, float]:
        """Held-out evaluation with `engine` (its current adapter), on the inference rank between
        training batches and from `python -m colocate.eval`: -> metrics named below `eval/` (e.g.
        "accuracy", "diplomacy/greedy/mean_centres"). `eval_cfg` is `config.EvalConfig`; files a person
        may look at (saved games, pictures) go under `out_dir`. Default: nothing to evaluate."""
        return {}


def weighted_mean(parts: list[dict], key: str, weight: str) -> float:
    """The mean `key` over all parts, each part weighted by its count `weight`."""
    return sum(p[weight] * p[key] for p in parts) / max(sum(p[weight] for p in parts), 1)
