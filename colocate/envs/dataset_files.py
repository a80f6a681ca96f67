"""The dataset env's files: loading them with `datasets`, checking every row when they open
(`rows.py`), their fingerprint for resume, the embedded tokenizer's corpus from them (`corpus`,
`corpus_key`), and the checks `DatasetEnv.preflight` runs before any
model is built (the files exist and load, the split has rows, the columns are there and of the right
kind, every reward function imports). Each preflight failure is one `ConfigError` line naming the key.
"""
from __future__ import annotations

import hashlib
import os
import re
import sys

from colocate.config_checks import ConfigError
from colocate.envs.rows import (WHAT, RowRules, RowScan, expand_files, first_bad_json, locate, scan_rows,
                                too_large)

BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
"""File extension -> `datasets` builder."""



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


def data_fingerprint(files: list[str], split: str) -> str:
    """Digest of the train files' contents, in the order their rows are read, and the split: a
    resumed run's position indexes these rows, so a resume must find the same ones
    (`DatasetEnv.check_resume`; ~1 s per GB)."""
    digest = hashlib.blake2b(split.encode(), digest_size=12)
    for path in sorted(expand_files(files)):
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()



def check_data_files(key: str, files: list[str]) -> None:
    """Each file exists (a directory stands for the data files under it), and all are of one kind
    `datasets` reads."""
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


def check_prompt_column(key: str, rows, cfg) -> None:
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


def check_dataset(cfg) -> None:
    """env.name=dataset: the files load, the split is not empty, the columns are there and of the
    right kind, every reward function imports and scores the first row."""
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


def reward_limits(cfg):
    """The run's bounds on a reward function's calls (`rewards.RewardLimits`) from env.*."""
    from colocate.rewards import RewardLimits
    e = cfg.env
    return RewardLimits(max_errors=e.max_reward_errors, timeout_s=e.reward_timeout_s, max_abs=e.reward_max_abs,
                        workers=max(1, e.reward_workers))


def check_reward_call(cfg, name: str, fn, row: dict) -> None:
    """A user's reward function, called on the first row as the dataset env calls it (an agent's
    rewards also get each episode's environment: checked at run time)."""
    from colocate.rewards import RewardRow, check_reward
    if ":" not in name or row is None or cfg.env.tools or cfg.env.environment:
        return
    env = cfg.env
    columns = {k: v for k, v in row.items() if k != env.prompt_column}
    problem = check_reward(name, fn, RewardRow(row[env.prompt_column], row.get(env.answer_column), columns),
                           reward_limits(cfg))
    if problem:
        raise ConfigError(f"env.reward: {problem}")


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


def lazy_prompt_ids(cfg):
    """prompt -> token ids as the env will compute them; the tokenizer is loaded on the first call
    (only a prompt that may be too long for the model needs it)."""
    chat = []

    def prompt_ids(prompt) -> list[int]:
        if not chat:
            from colocate.chat import ChatFormat
            from colocate.models import load_tokenizer
            tokenizer = load_tokenizer(cfg.model, lambda: corpus(cfg), corpus_key(cfg))  # the dataset env's
            chat.append(ChatFormat(tokenizer, cfg.model.chat_template))
        return chat[0].ids(prompt)
    return prompt_ids


def check_rows(key: str, cfg):
    """Every row of env.<key> (`envs/rows.py`): under env.bad_rows=error the first unusable one is
    the error; under skip the dropped rows are counted in one line (stdout, rank 0) -> the usable rows."""
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
