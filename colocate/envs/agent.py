"""Agents: multi-turn episodes with tool calls, each trained as one token-in/token-out trajectory.

An episode is the prompt, then alternating policy spans (the ids the engine sampled, with their
behaviour log-probs) and env spans (tool results, tokenized once through the chat template and
appended as ids). Nothing is re-rendered: the episode's next request is its prompt ids followed
by every span so far, so what the learner trains on is exactly what was sampled. The finished
episode is one `Sample` whose completion is every token after the prompt, with `loss_mask` True on
the policy spans only (env spans: log-prob 0, out of the loss). A group is G episodes of one row;
the episode reward gives one advantage, applied to its policy tokens (`data.build_batch`).

Episodes advance independently: `step` starts the tools of a turn's calls off the loop
(`colocate.tools.ToolRunner`), `requests` hands out the next turn of every episode whose tools have
answered, and only when no episode can move without a tool does it wait for one (then nothing is in
the engine either). An episode ends when a turn has no tool call, after `max_turns` turns or past
`max_tool_calls` calls, or - truncated, `finish_reason` length - when its next turn would not fit
`engine.max_model_len` or a turn ran out of `max_new_tokens`.

Inputs in TRL's shapes: prompts, columns and reward functions from the dataset env's files, plain
functions as tools (`env.tools`, schemas from type hints and docstrings handed to the chat
template's `tools=`), and an `environment_factory`-style class (`env.environment`): one instance
per episode, `reset(**row)` returns None or text appended to the prompt, its public methods are
tools, a `get_reward()` adds to the reward, and reward functions get the instances as
`environments=`. docs/agents.md.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import ClassVar, Hashable

from colocate.chat import MARKER, ChatFormat, is_messages
from colocate.constraint import Constraint
from colocate.data import Completion, Request, Sample
from colocate.envs.base import Env
from colocate.envs.checks import AGENT_RULES, KeyRules, check_agent, check_agent_tools
from colocate.rewards import REWARD_ERROR_KINDS, RewardSet
from colocate.tools import (PARSERS, TOOL_ERROR_KINDS, PendingCall, ToolResult, ToolRunner, ToolRunnerSettings,
                            environment_tools, tool_name, tool_schema, wait_any)

FINISH_REASONS = ("stop", "max_turns", "max_tool_calls", "truncated")
"""How an episode ends (`finish/<reason>` in the metrics: the share of episodes)."""


@dataclass
class AgentSettings:
    """One episode's limits, sampling and prompt column (`agent_settings`: from env.* and engine.*)."""
    KEYS: ClassVar[KeyRules] = AGENT_RULES
    """The agent keys with a range (its own and its tool runner's; `checks.check_agent` holds them)."""
    max_turns: int = 4
    max_tool_calls: int = 8
    max_new_tokens: int = 64
    """Per turn."""
    temperature: float = 1.0
    max_model_len: int = 1024
    """Prompt + every span of an episode (engine.max_model_len)."""
    tool_parser: str = "hermes"
    runner: ToolRunnerSettings = field(default_factory=ToolRunnerSettings)
    prompt_column: str = "prompt"
    """The row's column that holds the prompt (env.prompt_column)."""


class TurnFormat:
    """Prompt and env-span ids: through the chat template (tools passed as `tools=`) when the
    tokenizer has one, else raw text with `<tool_response>` tags."""

    def __init__(self, chat: ChatFormat, schemas: list[dict]):
        self.chat, self.tokenizer, self.schemas = chat, chat.tokenizer, schemas

    def prompt_ids(self, prompt) -> list[int]:
        if not self.chat.enabled or not self.schemas:
            return self.chat.ids(prompt)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return list(self.tokenizer.apply_chat_template(messages, tools=self.schemas, add_generation_prompt=True,
                                                       tokenize=True, return_dict=False))

    def tool_text(self, results: list[ToolResult]) -> str:
        """What follows the policy's end-of-turn token: the tool messages, then the next turn's opening."""
        if not self.chat.enabled:
            return "".join(f"\n<tool_response>\n{r.content}\n</tool_response>\n" for r in results)
        messages = [{"role": "user", "content": "."}, {"role": "assistant", "content": MARKER}]
        messages += [{"role": "tool", "name": r.name, "content": r.content} for r in results]
        text = self.tokenizer.apply_chat_template(messages, tools=self.schemas or None, add_generation_prompt=True,
                                                  tokenize=False)
        end = text.index(MARKER) + len(MARKER)
        eos = self.tokenizer.eos_token
        if not text.startswith(eos, end):
            raise ValueError(f"the chat template does not end an assistant turn with the EOS token {eos!r}: "
                             "cannot tell the policy's tokens from the tool message's")
        return text[end + len(eos):]

    def tool_ids(self, results: list[ToolResult]) -> list[int]:
        return self.chat.text_ids(self.tool_text(results))


@dataclass
class Episode:
    """One episode in play: its prompt and the spans after it, host lists."""
    group_id: int
    prompt: object                        # text or messages, as reward functions get it
    prompt_ids: list[int]
    environment: object | None            # the TRL-style instance, or None
    tools: dict                           # name -> callable
    ids: list[int] = field(default_factory=list)           # every token after the prompt
    loss_mask: list[bool] = field(default_factory=list)    # True: sampled by the policy
    logprobs: list[float] = field(default_factory=list)    # behaviour log-probs (0 on env spans)
    allowed: list[list[int]] | None = None                 # per token, when turns are constrained
    messages: list[dict] = field(default_factory=list)     # assistant and tool messages (rewards)
    versions: list[int] = field(default_factory=list)      # adapter versions of each turn's first and last token
    pending: list[PendingCall] = field(default_factory=list)
    calls_started: float = 0.0            # when the pending calls were submitted
    tool_time: float = 0.0                # seconds spent waiting for this episode's tools
    turns: int = 0
    tool_calls: int = 0
    ready: bool = True                    # its next turn can go to the engine
    finish: str = ""                      # "" in play; stop, truncated, max_turns, max_tool_calls

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.ids)

    def append(self, ids: list[int], *, policy: bool, logprobs: list[float] | None = None,
               allowed: list[list[int]] | None = None) -> None:
        """Append one span; env spans have log-prob 0 and (constrained episodes) allow only themselves."""
        self.ids += ids
        self.loss_mask += [policy] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        if allowed is not None or self.allowed is not None:
            self.allowed = (self.allowed or []) + (allowed if allowed is not None else [[t] for t in ids])


class AgentEnv(Env):
    KEYS = AgentSettings.KEYS

    def __init__(self, tokenizer, rows, rewards: RewardSet, settings: AgentSettings, *, group_size: int,
                 tools=(), environment=None, chat: ChatFormat | None = None):
        """`rows`: `next_row()` -> a dict of columns (and `state_dict` / `load_state_dict` for resume);
        `tools`: functions; `environment`: a TRL environment_factory class or callable."""
        self.tokenizer, self.rows, self.rewards, self.settings = tokenizer, rows, rewards, settings
        self.group_size, self.prompt_column = group_size, settings.prompt_column
        self.tools = {tool_name(t): t for t in tools}
        self.environment = environment
        if settings.tool_parser not in PARSERS:
            raise ValueError(f"unknown tool parser {settings.tool_parser!r}; expected one of {sorted(PARSERS)}")
        self.parse = PARSERS[settings.tool_parser]
        probe = environment_tools(environment()) if environment is not None else {}
        self.format = TurnFormat(chat or ChatFormat(tokenizer, "none"),
                                 [tool_schema(t) for t in {**self.tools, **probe}.values()])
        self.runner = ToolRunner(settings.runner)
        self.eos_id = tokenizer.eos_token_id
        self._episodes: dict[Hashable, Episode] = {}
        self._groups: dict[int, dict] = {}       # group -> its row's columns
        self._done: dict[int, list[Sample]] = {}
        self._counts: Counter = Counter()

    @classmethod
    def check(cls, cfg) -> None:
        """A subclass by path (`env.name`): its tools, environment and episode length (`checks.check_agent`)."""
        check_agent(cfg, f"env.name={cfg.env.name!r} (an AgentEnv)")

    @classmethod
    def preflight(cls, cfg) -> None:
        check_agent_tools(cfg)

    @classmethod
    def from_config(cls, cfg, tokenizer, seed: int) -> "AgentEnv":
        """env.name dataset with env.tools / env.environment: the dataset env supplies the rows (its
        order and resume state) and the reward functions; the tools and the class load by path."""
        from colocate.envs.dataset import DatasetEnv
        from colocate.objects import load_object
        rows = DatasetEnv.from_config(cfg, tokenizer, seed)
        environment = load_object(cfg.env.environment) if cfg.env.environment else None
        return cls(tokenizer, rows, rows.rewards, agent_settings(cfg), group_size=cfg.rollout.group_size,
                   tools=[load_object(p) for p in cfg.env.tools], environment=environment,
                   chat=ChatFormat(tokenizer, cfg.model.chat_template))

    # ------------------------------------------------------------------ episodes

    def start_group(self, group_id: int) -> None:
        row = dict(self.rows.next_row())
        self._groups[group_id] = {k: v for k, v in row.items() if k != self.prompt_column}
        shared_ids = None  # without an environment every episode of the group has the same prompt ids
        for i in range(self.group_size):
            instance = self.environment() if self.environment is not None else None
            prompt = row[self.prompt_column]
            if instance is not None:
                prompt = with_observation(prompt, instance.reset(**row))
            ids = shared_ids if shared_ids is not None and instance is None else self.format.prompt_ids(prompt)
            shared_ids = ids
            tools = {**self.tools, **(environment_tools(instance) if instance is not None else {})}
            self._episodes[(group_id, i)] = Episode(group_id, prompt, ids, instance, tools)

    def turn_constraint(self, episode: Episode) -> Constraint | None:
        """The constraint of the episode's next turn (None: free text). Subclasses shape the format."""
        return None

    def requests(self) -> list[tuple[Hashable, Request]]:
        """The next turn of every episode ready for one. With none ready and tools running, waits
        for a tool (nothing can be in the engine then: every live episode is waiting on one)."""
        self._collect_tool_results()
        # An episode is ready once all of its turn's calls answered; each wait answers at least one
        # call (its result or its deadline), so this ends. One wait was not enough: the first
        # deadline to pass could leave every episode with a later one still open (no request, nothing
        # in the engine: the worker's "env has no requests" error, under load).
        while not any(ep.ready for ep in self._episodes.values()):
            pending = [p for ep in self._episodes.values() for p in ep.pending if p.answer is None]
            if not pending:
                break
            wait_any(pending)
            self._collect_tool_results()
        out = []
        for key, ep in self._episodes.items():
            if ep.ready:
                room = self.settings.max_model_len - ep.length
                out.append((key, Request(prompt_ids=ep.prompt_ids + ep.ids,
                                         max_new_tokens=min(self.settings.max_new_tokens, room),
                                         temperature=self.settings.temperature, constraint=self.turn_constraint(ep))))
        return out

    def step(self, completions: dict[Hashable, Completion]) -> None:
        for key, completion in completions.items():
            ep = self._episodes[key]
            ep.ready = False
            ep.turns += 1
            ep.versions.extend((completion.version, completion.newest_version))
            ep.append(completion.token_ids, policy=True, logprobs=completion.logprobs, allowed=completion.allowed_ids)
            text = self.tokenizer.decode([t for t in completion.token_ids if t != self.eos_id])
            ep.messages.append({"role": "assistant", "content": text})
            calls = self.parse(text)
            if completion.finish_reason == "length":
                self._finish(key, "truncated")
            elif not calls:
                self._finish(key, "stop")
            elif ep.turns >= self.settings.max_turns:
                self._finish(key, "max_turns")
            elif ep.tool_calls + len(calls) > self.settings.max_tool_calls:
                self._finish(key, "max_tool_calls")
            else:
                ep.tool_calls += len(calls)
                self._counts["tool_calls"] += len(calls)
                self._start_calls(ep, calls)

    def _start_calls(self, ep: Episode, calls: list) -> None:
        """Submit a turn's calls within what is left of the episode's tool time budget."""
        ep.calls_started = time.monotonic()
        ep.pending = [self.runner.submit(call, ep.tools, budget_left_s=self.settings.runner.budget_s - ep.tool_time)
                      for call in calls]

    def _collect_tool_results(self) -> None:
        """Append the tool messages of every episode whose calls have all answered (or timed out)."""
        now = time.monotonic()
        for key, ep in list(self._episodes.items()):
            if not ep.pending:
                continue
            results = [p.result(now) for p in ep.pending]
            if any(r is None for r in results):
                continue
            ep.pending = []
            ep.tool_time += now - ep.calls_started
            for r in results:
                if r.error is not None:
                    self._counts[f"tool_errors/{r.error}"] += 1
                ep.messages.append({"role": "tool", "name": r.name, "content": r.content})
            env_ids = self.format.tool_ids(results)
            if ep.length + len(env_ids) >= self.settings.max_model_len:  # no room for a reply
                self._finish(key, "truncated")
                continue
            ep.append(env_ids, policy=False)
            ep.ready = True

    def _finish(self, key: Hashable, reason: str) -> None:
        ep = self._episodes[key]
        ep.finish, ep.ready = reason, False
        group = [self._episodes[(ep.group_id, i)] for i in range(self.group_size)]
        if all(e.finish for e in group):
            for i in range(self.group_size):
                del self._episodes[(ep.group_id, i)]
            self._done[ep.group_id] = self._score(ep.group_id, group)

    def pop_finished(self) -> list[Sample]:
        out = []
        for gid in sorted(self._done):
            out.extend(self._done.pop(gid))
        return out

    # ------------------------------------------------------------------ rewards

    def reward_completion(self, ep: Episode):
        """The completion as TRL's reward functions get it: the messages after a chat prompt, else
        the text of every span after the prompt."""
        if is_messages(ep.prompt):
            return list(ep.messages)
        return self.tokenizer.decode([t for t in ep.ids if t != self.eos_id])

    def _score(self, group_id: int, group: list[Episode]) -> list[Sample]:
        columns = {k: [v] * len(group) for k, v in self._groups.pop(group_id).items()}
        if self.environment is not None:
            columns["environments"] = [ep.environment for ep in group]
        rewards, bad = self.rewards.score([ep.prompt for ep in group], [self.reward_completion(ep) for ep in group],
                                          columns)
        samples = []
        for ep, reward, is_bad in zip(group, rewards, bad):
            if ep.environment is not None and callable(getattr(ep.environment, "get_reward", None)):
                extra = self.rewards.score_one(self._get_reward_name, ep.environment.get_reward)
                reward, is_bad = reward + (extra or 0.0), is_bad or extra is None
            self._count_episode(ep, reward)
            completion = Completion(token_ids=ep.ids, logprobs=ep.logprobs, allowed_ids=ep.allowed,
                                    version=min(ep.versions, default=0), last_version=max(ep.versions, default=0),
                                    finish_reason="length" if ep.finish == "truncated" else "stop",
                                    loss_mask=ep.loss_mask)
            samples.append(Sample(prompt_ids=ep.prompt_ids, completion=completion, reward=reward, group_key=group_id,
                                  info={"reward_error": is_bad, "turns": ep.turns, "tool_calls": ep.tool_calls}))
        return samples

    def _count_episode(self, ep: Episode, reward: float) -> None:
        c = self._counts
        c["episodes"] += 1
        c["episodes_calling"] += ep.tool_calls > 0
        c["episode_tool_calls"] += ep.tool_calls
        c[f"finish/{ep.finish}"] += 1
        c["turns"] += ep.turns
        c["correct"] += reward >= sum(self.rewards.weights) - 1e-9 if self.rewards.weights else 0
        c["policy_tokens"] += sum(ep.loss_mask)
        c["env_tokens"] += len(ep.loss_mask) - sum(ep.loss_mask)

    MEAN_OVER = {**dict.fromkeys(("tool_call_rate", "accuracy", "tool_calls_per_episode", "turns_per_episode",
                                  "policy_tokens_per_episode", "env_tokens_per_episode",
                                  *(f"finish/{r}" for r in FINISH_REASONS)), "episodes"),
                 "tool_error_rate": "tool_calls"}
    COUNTS = ("reward_errors", *(f"reward_errors/{kind}" for kind in REWARD_ERROR_KINDS),
              *(f"tool_errors/{kind}" for kind in TOOL_ERROR_KINDS), "tool_workers_abandoned", "tool_workers_hung")

    def metrics(self) -> dict[str, float]:
        """Since the last call, over the episodes scored (whole groups): tool-call rate (episodes with
        a call), accuracy (full marks from every reward function), calls / turns / tokens per episode,
        how episodes ended; and tool errors by kind, as a fraction of the calls made."""
        c, self._counts = self._counts, Counter()
        n = max(c["episodes"], 1)
        out = {"tool_call_rate": c["episodes_calling"] / n, "accuracy": c["correct"] / n,
               "tool_calls_per_episode": c["episode_tool_calls"] / n, "turns_per_episode": c["turns"] / n,
               "policy_tokens_per_episode": c["policy_tokens"] / n, "env_tokens_per_episode": c["env_tokens"] / n,
               **self.rewards.take_error_counts()}
        errors = {f"tool_errors/{kind}": float(c[f"tool_errors/{kind}"]) for kind in TOOL_ERROR_KINDS}
        out.update(errors)
        abandoned, hung = self.runner.take_abandoned()
        out.update(tool_workers_abandoned=float(abandoned), tool_workers_hung=float(hung))
        out["tool_error_rate"] = sum(errors.values()) / max(c["tool_calls"], 1)
        out.update({f"finish/{reason}": c[f"finish/{reason}"] / n for reason in FINISH_REASONS})
        out.update(episodes=float(c["episodes"]), tool_calls=float(c["tool_calls"]))
        return out

    @property
    def _get_reward_name(self) -> str:
        cls = self.environment
        return f"{getattr(cls, '__module__', '?')}:{getattr(cls, '__qualname__', tool_name(cls))}.get_reward"

    def close(self) -> None:
        self.runner.close()
        self.rewards.close()

    def state_dict(self) -> dict | None:
        return self.rows.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.rows.load_state_dict(state)


def agent_settings(cfg) -> AgentSettings:
    e = cfg.env
    return AgentSettings(max_turns=e.max_turns, max_tool_calls=e.max_tool_calls, max_new_tokens=cfg.engine.max_new_tokens,
                         temperature=cfg.engine.temperature, max_model_len=cfg.engine.max_model_len,
                         tool_parser=e.tool_parser, prompt_column=e.prompt_column,
                         runner=ToolRunnerSettings(timeout_s=e.tool_timeout_s, max_output_chars=e.tool_max_output_chars,
                                                   max_workers=e.tool_workers, budget_s=e.tool_budget_s))


def with_observation(prompt, observation):
    """TRL's reset contract: a returned string is appended to the last user message (or the text)."""
    if observation is None:
        return prompt
    if isinstance(prompt, str):
        return prompt + str(observation)
    return prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + str(observation)}]
