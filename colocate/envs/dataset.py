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
from colocate.envs.base import Env
from colocate.envs.rows import WHAT, RowRules, RowScan, expand_files, locate, scan_rows
from colocate.rewards import RewardLimits, RewardSet

BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
"""File extension -> `datasets` builder."""


def decode_texts(tokenizer, id_lists: list[list[int]]) -> list[str]:
    """`tokenizer.decode` of each list, in one call to the Rust tokenizer when that is the same
    text (a fast tokenizer without transformers' space clean-up): it decodes the lists in parallel
    without the GIL, so a group's rewards do not hold up the thread that feeds the engine (half of
    `decode`'s time per answer is transformers' wrapper)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return [tokenizer.decode(ids) for ids in id_lists]
    return backend.decode_batch(id_lists, skip_special_tokens=False)


def builder_of(files: list[str]) -> str:
    files = expand_files(files)
    kinds = {BUILDERS.get(os.path.splitext(f)[1].lower()) for f in files}
    if None in kinds or len(kinds) != 1:
        raise ValueError(f"{files}: expected files of one kind among {', '.join(sorted(BUILDERS))}")
    return kinds.pop()


def load_rows(files: list[str], split: str, cache_dir: str):
    """A memory-mapped `datasets.Dataset` of `files` (the `split` expression names their split)."""
    import datasets  # only this env needs it
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # a bad file is reported once, by the caller
    base = re.match(r"\w+", split)
    name = base.group(0) if base else "train"
    return datasets.load_dataset(builder_of(files), data_files={name: expand_files(files)}, split=split,
                                 cache_dir=os.path.join(cache_dir, "datasets"))


def split_offset(files: list[str], split: str, cache_dir: str) -> int:
    """Index in the files' concatenation of the split's first row (`train[100:]` -> 100)."""
    base = re.match(r"\w+", split)
    if base is None or base.group(0) == split:
        return 0
    import datasets
    total = len(load_rows(files, base.group(0), cache_dir))
    return datasets.ReadInstruction.from_spec(split).to_absolute({base.group(0): total})[0].from_ or 0


def reward_limits(cfg) -> RewardLimits:
    e = cfg.env
    return RewardLimits(max_errors=e.max_reward_errors, timeout_s=e.reward_timeout_s, max_abs=e.reward_max_abs,
                        workers=max(1, e.reward_workers))


class BadRowError(ValueError):
    """A row the run cannot use under env.bad_rows=error; the message names file, line and column."""


def row_rules(cfg, prompt_ids) -> RowRules:
    """What a usable row is for this run; `prompt_ids` tokenizes a prompt as the env will."""
    from colocate.models import model_context
    env = cfg.env
    needs_answer = bool([r for r in env.reward if ":" not in r] or env.answer_choices)
    return RowRules(env.prompt_column, env.answer_column, needs_answer,
                    max_prompt_tokens=model_context(cfg) - cfg.engine.max_new_tokens, prompt_ids=prompt_ids)


def bad_row_message(cfg, key: str, rows, index: int, reason: str, rules: RowRules) -> str:
    """One line: the key, the file and its line, the column, what is wrong and what to do."""
    files = expand_files(getattr(cfg.env, key))
    split = cfg.env.split if key == "data_files" else "train"
    where = locate(files, split_offset(files, split, cfg.model.cache_dir) + index)
    column = rules.answer_column if reason == "missing_answer" else rules.prompt_column
    what = WHAT[reason]
    if reason == "too_long":
        n = len(rules.prompt_ids(rows[index][rules.prompt_column]))
        what = (f"has {n} tokens, more than the model's context less engine.max_new_tokens="
                f"{cfg.engine.max_new_tokens} ({rules.max_prompt_tokens})")
    return (f"env.{key}: {where}, column {column!r}: the {'answer' if column != rules.prompt_column else 'prompt'} "
            f"{what}; fix the row, or set env.bad_rows=skip to drop such rows and count them")


def open_rows(cfg, key: str, prompt_ids) -> tuple[object, RowScan]:
    """The rows of `env.<key>` with every row checked (`rows.py`) -> (usable rows, what was found).
    Under env.bad_rows=error the first bad row raises `BadRowError`; under skip the bad rows are dropped."""
    split = cfg.env.split if key == "data_files" else "train"
    rows = load_rows(getattr(cfg.env, key), split, cfg.model.cache_dir)
    rules = row_rules(cfg, prompt_ids)
    scan = scan_rows(rows, rules, stop_at_first=cfg.env.bad_rows == "error")
    if scan.bad and cfg.env.bad_rows == "error":
        raise BadRowError(bad_row_message(cfg, key, rows, *scan.bad[0], rules))
    if scan.bad:
        rows = rows.select(scan.keep(len(rows)))
    return rows, scan


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


def data_fingerprint(files: list[str], split: str) -> str:
    """Digest of the train files' contents, in the order their rows are read, and the split: a
    resumed run's position indexes these rows, so a resume must find the same ones
    (`launch.check_same_data`; ~1 s per GB)."""
    digest = hashlib.blake2b(split.encode(), digest_size=12)
    for path in sorted(expand_files(files)):
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()


def corpus(cfg) -> list[str]:
    """Every prompt and answer of the train and eval files (the embedded tokenizer's training text)."""
    out = []
    for files in (cfg.env.data_files, cfg.env.eval_files):
        if files:
            rows = load_rows(files, "train", cfg.model.cache_dir)
            out += [prompt_text(p) for p in rows[cfg.env.prompt_column]]
            if cfg.env.answer_column in rows.column_names:
                out += [str(a) for a in rows[cfg.env.answer_column] if a is not None]
    return out


@dataclass
class Group:
    prompt: object                      # the row's prompt: text or messages (what reward functions get)
    request: Request
    columns: dict                       # the row's other columns
    completions: dict = field(default_factory=dict)  # index -> Completion


class DatasetEnv(Env):
    def __init__(self, tokenizer, rows, rewards: RewardSet, *, group_size: int, prompt_column: str,
                 max_new_tokens: int, temperature: float, seed: int, chat: ChatFormat | None = None,
                 eval_rows=None, reward_workers: int = 0, choices: list[str] | None = None,
                 prefetch_prompts: int = 0):
        if len(rows) == 0:
            raise ValueError("the dataset has no rows")
        self.tokenizer, self.rows, self.rewards, self.eval_rows = tokenizer, rows, rewards, eval_rows
        self.data_source: tuple[list[str], str] | None = None  # (data files, split), set by from_config
        self.group_size, self.prompt_column = group_size, prompt_column
        self.max_new_tokens, self.temperature, self.seed = max_new_tokens, temperature, seed
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
        self._pool = ThreadPoolExecutor(reward_workers, thread_name_prefix="colocate-reward") \
            if reward_workers > 0 else None
        self.prefetch_prompts = prefetch_prompts
        self._prompts = ThreadPoolExecutor(1, thread_name_prefix="colocate-prompts") if prefetch_prompts > 0 else None
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
        made = cls(tokenizer, rows, rewards, choices=choices,
                   group_size=cfg.rollout.group_size, prompt_column=env.prompt_column,
                   max_new_tokens=cfg.engine.max_new_tokens, temperature=cfg.engine.temperature, seed=seed,
                   chat=chat, eval_rows=eval_rows, reward_workers=env.reward_workers,
                   prefetch_prompts=env.prefetch_prompts)
        made.data_source = (env.data_files, env.split)
        made.dropped = {**{f"dropped/{r}": float(n) for r, n in scan.counts.items()},
                        **{f"dropped_eval/{r}": float(n) for r, n in eval_scan.counts.items()}}
        return made

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
        for pos in range(self.position, min(self.position + self.prefetch_prompts, len(self._order))):
            if self._order[pos] not in self._ahead:  # this epoch's order only: the next one is not drawn yet
                self._ahead[self._order[pos]] = self._prompts.submit(self._build_ids, self._order[pos])
        return future.result()

    def _build_ids(self, index: int) -> list[int]:
        return self.chat.ids(self.rows[index][self.prompt_column])

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
        prompt = row[self.prompt_column]
        request = Request(prompt_ids=self._prompt_ids(index, prompt), max_new_tokens=self.max_new_tokens,
                          temperature=self.temperature, constraint=self.constraint)
        columns = {k: v for k, v in row.items() if k != self.prompt_column}
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
        prompts = rows[self.prompt_column]
        requests = [Request(prompt_ids=self.chat.ids(p), max_new_tokens=self.max_new_tokens,
                            temperature=eval_cfg.temperature, constraint=self.constraint) for p in prompts]
        completions = engine.generate(requests)
        texts = self.texts_of(completions)
        training_counts = self.rewards.take_error_counts()
        rewards = []
        for prompt, text, row in zip(prompts, texts, rows):  # one call per row: a message list per prompt
            p, c = self.reward_inputs(prompt, [text])
            columns = {k: [v] for k, v in row.items() if k != self.prompt_column}
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
