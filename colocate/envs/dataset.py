"""Prompts from local files, scored by reward functions (`env.name: dataset`).

The files (json / jsonl / parquet / csv) are loaded with Hugging Face `datasets`, which converts
them once into Arrow files under `model.cache_dir` and memory-maps them: every inference rank reads
the same pages from the page cache instead of holding its own copy, and a row is only materialized
when its group starts. Each group is G samples of one prompt (GRPO's group); the prompt's token ids
are computed once per group (`colocate.chat`: raw text or the chat template), ahead of time by one
background thread for the next `env.prefetch_prompts` rows of the order (the thread that feeds the
engine then only picks them up), or when the group starts with 0. Training prompts are built on
that one thread; the reward threads' decoding and `evaluate`'s prompts may use the tokenizer at
the same time, which read-only calls of a fast tokenizer allow (nothing here changes its
truncation or padding).

Order: each epoch is a permutation of the rows seeded by (rank seed, epoch); the position in it is
the env's resume state, so a resumed run continues with the prompt it would have drawn next.

Rewards (`colocate.rewards`) are computed when a group's G completions are in: inline, or with
`env.reward_workers` threads while the rollout goes on submitting to the engine. A group enters a
batch once it is scored.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Hashable

from colocate.chat import ChatFormat, is_messages
from colocate.constraint import Constraint
from colocate.data import Completion, Request, Sample
from colocate.config_checks import ConfigError
from colocate.envs.base import Env, ResumeError
from colocate.envs.checks import AGENT_KEYS, check_agent, check_agent_tools, check_dataset_keys, is_agent, refuse_agent_keys
from colocate.envs.dataset_files import check_dataset, data_fingerprint, load_rows, open_rows, reward_limits
from colocate.envs.rows import RowScan, expand_files, too_large
from colocate.rewards import RewardSet

def decode_texts(tokenizer, id_lists: list[list[int]]) -> list[str]:
    """`tokenizer.decode` of each list, in one call to the Rust tokenizer when that is the same
    text (a fast tokenizer without transformers' space clean-up): it decodes the lists in parallel
    without the GIL, so a group's rewards do not hold up the thread that feeds the engine (half of
    `decode`'s time per answer is transformers' wrapper)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return [tokenizer.decode(ids) for ids in id_lists]
    return backend.decode_batch(id_lists, skip_special_tokens=False)


def prompt_text(prompt) -> str:
    """A prompt as plain text (the tokenizer corpus; a message list's contents, one per line; a row
    that is no prompt at all, which the row checks refuse or drop, gives none)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return "\n".join(m["content"] for m in prompt if isinstance(m, dict) and isinstance(m.get("content"), str))
    return ""


def corpus_key(cfg) -> str:
    """Names the embedded tokenizer trained on these files (changes when a file does)."""
    parts = [cfg.env.prompt_column, cfg.env.answer_column]
    for f in sorted(expand_files(cfg.env.data_files + cfg.env.eval_files)):
        st = os.stat(f)
        parts.append(f"{os.path.abspath(f)}:{st.st_size}:{st.st_mtime_ns}")
    return "dataset-" + hashlib.sha1("|".join(parts).encode()).hexdigest()[:12]


CORPUS_RUN = 1024
"""The embedded tokenizer learns from runs of non-space characters cut to this length: its training
time grows faster than linearly with the longest (a megabyte-long run stalled it for minutes)."""


def corpus_texts(texts) -> list[str]:
    """The texts a tokenizer trains on: those within `MAX_PROMPT_BYTES` (a longer prompt is refused
    or dropped by the row checks), their runs of non-space characters cut to `CORPUS_RUN`."""
    long_run = re.compile(r"\S{%d,}" % (CORPUS_RUN + 1))
    return [long_run.sub(lambda m: m.group(0)[:CORPUS_RUN], t) for t in texts if not too_large(t)]


def corpus(cfg) -> list[str]:
    """Every prompt and answer of the train and eval files (the embedded tokenizer's training text)."""
    out = []
    for files in (cfg.env.data_files, cfg.env.eval_files):
        if files:
            rows = load_rows(files, "train", cfg.model.cache_dir)
            out += corpus_texts(prompt_text(p) for p in rows[cfg.env.prompt_column])
            if cfg.env.answer_column in rows.column_names:
                out += corpus_texts(str(a) for a in rows[cfg.env.answer_column] if a is not None)
    return out


@dataclass
class Group:
    prompt: object                      # the row's prompt: text or messages (what reward functions get)
    request: Request
    columns: dict                       # the row's other columns
    completions: dict = field(default_factory=dict)  # index -> Completion


@dataclass(frozen=True, kw_only=True)
class DatasetSettings:
    """How a `DatasetEnv` plays its rows (`from_config`: a run's keys; tests set what they exercise)."""
    group_size: int
    prompt_column: str = "prompt"
    max_new_tokens: int = 8
    temperature: float = 1.0
    reward_workers: int = 0
    """Threads scoring groups while the rollout goes on (0: inline)."""
    prefetch_prompts: int = 0
    """Rows of the order whose prompt ids one thread builds ahead (0: when the group starts)."""

    @classmethod
    def from_config(cls, cfg) -> "DatasetSettings":
        return cls(group_size=cfg.rollout.group_size, prompt_column=cfg.env.prompt_column,
                   max_new_tokens=cfg.engine.max_new_tokens, temperature=cfg.engine.temperature,
                   reward_workers=cfg.env.reward_workers, prefetch_prompts=cfg.env.prefetch_prompts)


class DatasetEnv(Env):
    def __init__(self, tokenizer, rows, rewards: RewardSet, settings: DatasetSettings, *, seed: int,
                 chat: ChatFormat | None = None, eval_rows=None, choices: list[str] | None = None):
        """`rows`: a `datasets.Dataset`; `seed`: this rank's (each epoch's order); `choices`: the
        answers a constrained completion picks from (env.answer_choices), or None."""
        if len(rows) == 0:
            raise ValueError("the dataset has no rows")
        self.tokenizer, self.rows, self.rewards, self.eval_rows = tokenizer, rows, rewards, eval_rows
        self.data_source: tuple[list[str], str] | None = None  # (data files, split), set by from_config
        self.settings, self.group_size, self.seed = settings, settings.group_size, seed
        self.chat = chat or ChatFormat(tokenizer, "none")
        self.eos_id = tokenizer.eos_token_id
        self.constraint = None if choices is None else Constraint(  # " 7": the answer as a word after the prompt
            slots=[[tokenizer.encode(" " + c, add_special_tokens=False) for c in choices]], eos_id=self.eos_id,
            texts=[[" " + c for c in choices]])
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)
        self._groups: dict[int, Group] = {}
        self._pending: set = set()                  # keys handed out and not yet answered
        self._scoring: dict[int, Future] = {}       # group -> its samples, being scored
        self._done: dict[int, list[Sample]] = {}
        self._pool = ThreadPoolExecutor(settings.reward_workers, thread_name_prefix="colocate-reward") \
            if settings.reward_workers > 0 else None
        self._prompts = ThreadPoolExecutor(1, thread_name_prefix="colocate-prompts") \
            if settings.prefetch_prompts > 0 else None
        self._ahead: dict[int, Future] = {}         # row index -> its prompt ids, being built
        self._counts = dict.fromkeys(("completions", "tokens", "truncated"), 0)
        self.dropped: dict[str, float] = {}  # rows dropped when opened (env.bad_rows=skip), by reason

    @classmethod
    def from_config(cls, cfg, tokenizer, seed: int) -> "DatasetEnv":
        env = cfg.env
        rewards = RewardSet(env.reward, env.reward_weights, answer_column=env.answer_column, limits=reward_limits(cfg))
        chat = ChatFormat(tokenizer, cfg.model.chat_template)
        eval_rows, eval_scan = open_rows(cfg, "eval_files", chat.ids) if env.eval_files else (None, RowScan())
        rows, scan = open_rows(cfg, "data_files", chat.ids)
        choices = sorted({str(a) for a in rows[env.answer_column]}) if env.answer_choices else None
        made = cls(tokenizer, rows, rewards, DatasetSettings.from_config(cfg), seed=seed, chat=chat,
                   eval_rows=eval_rows, choices=choices)
        made.data_source = (env.data_files, env.split)
        made.dropped = {**{f"dropped/{r}": float(n) for r, n in scan.counts.items()},
                        **{f"dropped_eval/{r}": float(n) for r, n in eval_scan.counts.items()}}
        return made

    @classmethod
    def check(cls, cfg) -> None:
        """The keys among themselves; with env.tools or env.environment the episodes are an agent's
        (`checks.check_agent`), without them the agent keys would be ignored; env.processes is refused."""
        check_dataset_keys(cfg.env)
        if is_agent(cfg):
            check_agent(cfg, "env.tools / env.environment")
        else:
            refuse_agent_keys(cfg, "env.name=dataset without env.tools or env.environment plays single turns",
                              AGENT_KEYS[2:])
        if cfg.env.processes > 0:
            raise ConfigError(f"env.processes={cfg.env.processes} with env.name=dataset: each copy would walk its "
                              "own epoch of the rows; the dataset env builds prompts ahead on a thread instead "
                              "(env.prefetch_prompts) and scores on env.reward_workers")

    @classmethod
    def preflight(cls, cfg) -> None:
        """The files load and hold usable rows, the reward functions import (`dataset_files`); an
        agent's tools import (`checks.check_agent_tools`)."""
        check_dataset(cfg)
        check_agent_tools(cfg)

    @classmethod
    def check_resume(cls, saved: list[dict], cfg) -> None:
        """A dataset run resumes only on the data files it was saved with: its position indexes their
        rows, so other files (even with as many rows) would silently train on other prompts."""
        fingerprints = {state.get("data") for state in saved} - {None}
        if fingerprints and fingerprints != {data_fingerprint(cfg.env.data_files, cfg.env.split)}:
            raise ResumeError("env.data_files hold other contents than when this checkpoint was saved; "
                              "resume with those files, or start a new metrics.run_dir")

    @classmethod
    def corpus_key(cls, cfg) -> str:
        return corpus_key(cfg)

    @classmethod
    def corpus(cls, cfg) -> list[str]:
        return corpus(cfg)

    # ------------------------------------------------------------------ order and resume

    def _permutation(self, epoch: int) -> list[int]:
        import numpy as np
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows)).tolist()

    def next_row(self) -> dict:
        """The next row of this epoch's order (a new epoch reshuffles)."""
        return self.rows[self._next_index()]

    def _next_index(self) -> int:
        if self.position >= len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        index = self._order[self.position]
        self.position += 1
        return index

    def _prompt_ids(self, index: int, prompt) -> list[int]:
        """Row `index`'s prompt ids (prefetched, or built now from its `prompt`), then the next
        rows' queued."""
        if self._prompts is None:
            return self.chat.ids(prompt)
        future = self._ahead.pop(index, None) or self._prompts.submit(self.chat.ids, prompt)
        for pos in range(self.position, min(self.position + self.settings.prefetch_prompts, len(self._order))):
            if self._order[pos] not in self._ahead:  # this epoch's order only: the next one is not drawn yet
                self._ahead[self._order[pos]] = self._prompts.submit(self._build_ids, self._order[pos])
        return future.result()

    def _build_ids(self, index: int) -> list[int]:
        return self.chat.ids(self.rows[index][self.settings.prompt_column])

    @functools.cached_property
    def fingerprint(self) -> str:
        """`data_fingerprint` of the files this env was built from ("" without files), hashed when a
        checkpoint first needs it, not at every start."""
        return data_fingerprint(*self.data_source) if self.data_source else ""

    def state_dict(self) -> dict:
        """Epoch and position in its order (groups still in play when a checkpoint is taken restart
        afresh on resume, as in every env)."""
        return {"epoch": self.epoch, "position": self.position, "rows": len(self.rows),
                **({"data": self.fingerprint} if self.fingerprint else {})}

    def load_state_dict(self, state: dict) -> None:
        if state.get("rows", len(self.rows)) != len(self.rows):
            raise ValueError(f"the checkpoint's dataset had {state['rows']} rows, this one {len(self.rows)}")
        if self.fingerprint and state.get("data", self.fingerprint) != self.fingerprint:
            raise ValueError("the checkpoint's data files had other contents than these")
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)
        for future in self._ahead.values():  # prefetched for the old position
            future.cancel()
        self._ahead.clear()

    # ------------------------------------------------------------------ Env protocol

    def start_group(self, group_id: int) -> None:
        index = self._next_index()
        row = self.rows[index]
        prompt = row[self.settings.prompt_column]
        request = Request(prompt_ids=self._prompt_ids(index, prompt), max_new_tokens=self.settings.max_new_tokens,
                          temperature=self.settings.temperature, constraint=self.constraint)
        columns = {k: v for k, v in row.items() if k != self.settings.prompt_column}
        self._groups[group_id] = Group(prompt, request, columns)
        self._pending.update((group_id, i) for i in range(self.group_size))

    def requests(self) -> list[tuple[Hashable, Request]]:
        return [(key, self._groups[key[0]].request) for key in sorted(self._pending)]

    def step(self, completions: dict[Hashable, Completion]) -> None:
        for key, completion in completions.items():
            self._pending.remove(key)
            group = self._groups[key[0]]
            group.completions[key[1]] = completion
            if len(group.completions) == self.group_size:
                del self._groups[key[0]]
                if self._pool is None:
                    self._done[key[0]] = self._score(key[0], group)
                else:
                    self._scoring[key[0]] = self._pool.submit(self._score, key[0], group)

    def pop_finished(self) -> list[Sample]:
        """Scored groups, in group order. With nothing left for the engine to answer, waits for the
        scoring threads (there is nothing else to do)."""
        if self._scoring and not self._pending and not self._done:
            wait(list(self._scoring.values()), return_when=FIRST_COMPLETED)
        for gid in [g for g, f in self._scoring.items() if f.done()]:
            self._done[gid] = self._scoring.pop(gid).result()  # a RewardError ends the run here
        out = []
        for gid in sorted(self._done):
            out.extend(self._done.pop(gid))
        return out

    def data_stats(self) -> dict[str, float]:
        return dict(self.dropped)

    def close(self) -> None:
        self.rewards.close()
        for pool in (self._pool, self._prompts):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    def metrics(self) -> dict[str, float]:
        c = self._counts
        n = max(c["completions"], 1)
        out = {**self.rewards.take_error_counts(), "completion_tokens_mean": c["tokens"] / n,
               "truncated_rate": c["truncated"] / n, "epoch": float(self.epoch)}
        self._counts = dict.fromkeys(c, 0)
        return out

    # ------------------------------------------------------------------ rewards

    def texts_of(self, completions: list[Completion]) -> list[str]:
        return decode_texts(self.tokenizer, [[t for t in c.token_ids if t != self.eos_id] for c in completions])

    def reward_inputs(self, prompt, texts: list[str]) -> tuple[list, list]:
        """(prompts, completions) as TRL passes them: strings, or messages with the completion as
        one assistant message."""
        if is_messages(prompt):
            return [prompt] * len(texts), [[{"role": "assistant", "content": t}] for t in texts]
        return [prompt] * len(texts), list(texts)

    def _score(self, group_id: int, group: Group) -> list[Sample]:
        completions = [group.completions[i] for i in range(self.group_size)]
        prompts, outs = self.reward_inputs(group.prompt, self.texts_of(completions))
        columns = {k: [v] * len(completions) for k, v in group.columns.items()}
        rewards, bad = self.rewards.score(prompts, outs, columns)
        self._counts["completions"] += len(completions)
        self._counts["tokens"] += sum(len(c.token_ids) for c in completions)
        self._counts["truncated"] += sum(c.finish_reason == "length" for c in completions)
        return [Sample(prompt_ids=group.request.prompt_ids, completion=c, reward=r, group_key=group_id,
                       info={"reward_error": b}) for c, r, b in zip(completions, rewards, bad)]

    # ------------------------------------------------------------------ held-out evaluation

    def evaluate(self, engine, eval_cfg, out_dir: str | None = None) -> dict[str, float]:
        """Every eval row once (or `eval.max_samples`) at `eval.temperature`: mean reward, accuracy
        (full marks from every reward function: for 0/1 functions, correct), mean completion tokens,
        and the unusable reward results. The samples go to `<out_dir>/dataset-eval-v<version>.jsonl`."""
        if self.eval_rows is None:
            return {}
        n = len(self.eval_rows) if not eval_cfg.max_samples else min(eval_cfg.max_samples, len(self.eval_rows))
        rows = self.eval_rows.select(range(n))
        prompts = rows[self.settings.prompt_column]
        requests = [Request(prompt_ids=self.chat.ids(p), max_new_tokens=self.settings.max_new_tokens,
                            temperature=eval_cfg.temperature, constraint=self.constraint) for p in prompts]
        completions = engine.generate(requests)
        texts = self.texts_of(completions)
        training_counts = self.rewards.take_error_counts()
        rewards = []
        for prompt, text, row in zip(prompts, texts, rows):  # one call per row: a message list per prompt
            p, c = self.reward_inputs(prompt, [text])
            columns = {k: [v] for k, v in row.items() if k != self.settings.prompt_column}
            rewards.append(self.rewards.score(p, c, columns)[0][0])
        eval_errors = self.rewards.take_errors()
        self.rewards.restore_error_counts(training_counts)  # training's counts go on unchanged
        full = sum(self.rewards.weights)
        if out_dir:
            self._write_samples(out_dir, engine.version, prompts, texts, rewards)
        return {"mean_reward": sum(rewards) / n, "accuracy": sum(r >= full - 1e-9 for r in rewards) / n,
                "mean_length": sum(len(c.token_ids) for c in completions) / n, "samples": float(n),
                "reward_errors": float(eval_errors)}

    def _write_samples(self, out_dir: str, version: int, prompts, texts, rewards) -> None:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"dataset-eval-v{version}.jsonl"), "w") as f:
            for p, t, r in zip(prompts, texts, rewards):
                f.write(json.dumps({"prompt": p, "completion": t, "reward": r}) + "\n")
