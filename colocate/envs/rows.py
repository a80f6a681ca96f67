"""Row checks of the dataset env's files: every row is looked at once, streamed, when the files are opened.

A row is unusable when its prompt is missing or null, neither text nor a list of chat messages,
empty or only whitespace, over `MAX_PROMPT_BYTES` (before any tokenizer sees it), longer in tokens
than the model's context less `engine.max_new_tokens`,
or when its answer is null and the rewards need one. `env.bad_rows` says what happens then:
`error` (default) refuses the files at start-up with one line naming the file, its own line
number and the column; `skip` drops the rows and counts them by reason (`data/dropped/<reason>`).

Rows are read from the memory-mapped Arrow table in batches of the columns checked, never all at
once. The file line of a row is found only when a message needs it, by reading the files again
in the order `datasets` concatenated them (`locate`).
"""
from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, field

MAX_PROMPT_BYTES = 1 << 20
"""A prompt over this many bytes (~250,000 tokens of text, beyond the context of the models here) is
refused (or dropped) without tokenizing it: the embedded tokenizer's training would stall on it."""

REASONS = ("missing_prompt", "not_text", "empty_prompt", "missing_answer", "too_long", "too_large")
"""Why a row is unusable (`data/dropped/<reason>`)."""

WHAT = {"missing_prompt": "is missing or null",
        "not_text": "is neither text nor a list of {role, content} chat messages",
        "empty_prompt": "is empty or only whitespace",
        "missing_answer": "is missing or null (the rewards compare against it)",
        "too_long": "is longer than the model's context allows",
        "too_large": f"is over {MAX_PROMPT_BYTES >> 20} MiB (rows.MAX_PROMPT_BYTES), more than any model's context here"}

DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv")
BATCH = 1024


def expand_files(files: list[str]) -> list[str]:
    """`env.data_files` with each directory replaced by the data files under it (sorted, recursive)."""
    out = []
    for f in files:
        if not os.path.isdir(f):
            out.append(f)
            continue
        for root, dirs, names in os.walk(f):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            out += [os.path.join(root, n) for n in sorted(names)
                    if n.lower().endswith(DATA_SUFFIXES) and not n.startswith(".")]
    return out


def too_large(text: str) -> bool:
    """Over `MAX_PROMPT_BYTES` in UTF-8 (a character is at most 4 bytes: shorter text is not encoded)."""
    return len(text) > MAX_PROMPT_BYTES // 4 and len(text.encode("utf-8", "surrogatepass")) > MAX_PROMPT_BYTES


def row_fault(prompt, answer, needs_answer: bool) -> str | None:
    """The reason a row cannot be used (no tokenizer needed), or None."""
    if prompt is None:
        return "missing_prompt"
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                          and isinstance(m.get("content"), str) for m in prompt):
        text = "".join(m["content"] for m in prompt)
    else:
        return "not_text"
    if not text.strip():
        return "empty_prompt"
    if too_large(text):
        return "too_large"
    if needs_answer and answer is None:
        return "missing_answer"
    return None


@dataclass
class RowScan:
    """What a scan found: every unusable row's index and reason, and the count per reason."""
    bad: list = field(default_factory=list)          # [(row index, reason)] in row order
    counts: dict = field(default_factory=dict)       # reason -> rows

    def add(self, index: int, reason: str) -> None:
        self.bad.append((index, reason))
        self.counts[reason] = self.counts.get(reason, 0) + 1

    def keep(self, num_rows: int) -> list[int]:
        """Indices of the usable rows."""
        drop = {i for i, _ in self.bad}
        return [i for i in range(num_rows) if i not in drop]


@dataclass
class RowRules:
    """What a usable row is, for one run."""
    prompt_column: str
    answer_column: str
    needs_answer: bool
    max_prompt_tokens: int | None = None   # None: the length is not checked
    prompt_ids: object = None              # prompt -> token ids (`ChatFormat.ids`); loaded on demand
    template_margin: int = 64              # tokens a chat template may add around one message


def could_be_too_long(prompt, rules: RowRules) -> bool:
    """Whether the prompt needs tokenizing: a token covers at least one UTF-8 byte, so a prompt whose
    bytes (plus the chat template's margin per message) fit the budget fits it in tokens too."""
    if rules.max_prompt_tokens is None:
        return False
    messages = prompt if isinstance(prompt, list) else [{"content": prompt}]
    size = sum(len(m["content"].encode("utf-8", "surrogatepass")) + rules.template_margin for m in messages)
    return size > rules.max_prompt_tokens


def scan_rows(rows, rules: RowRules, stop_at_first: bool = False) -> RowScan:
    """Every row of a `datasets.Dataset`, in batches of the checked columns only."""
    scan = RowScan()
    columns = [rules.prompt_column] + ([rules.answer_column] if rules.needs_answer else [])
    view = rows.select_columns(columns)
    index = 0
    for batch in view.iter(batch_size=BATCH):
        answers = batch[rules.answer_column] if rules.needs_answer else [None] * len(batch[rules.prompt_column])
        for prompt, answer in zip(batch[rules.prompt_column], answers):
            reason = row_fault(prompt, answer, rules.needs_answer)
            if reason is None and could_be_too_long(prompt, rules):
                reason = "too_long" if len(rules.prompt_ids(prompt)) > rules.max_prompt_tokens else None
            if reason is not None:
                scan.add(index, reason)
                if stop_at_first:
                    return scan
            index += 1
    return scan


def records(file: str):
    """(line number, record number) of each record of one file, in the order `datasets` reads them:
    JSON lines skip blank lines, a CSV record starts after its header, a JSON array or a parquet
    file has no lines to name (its record number instead)."""
    suffix = os.path.splitext(file)[1].lower()
    if suffix == ".jsonl" or (suffix == ".json" and not _is_json_array(file)):
        with open(file, "rb") as f:
            number = 0
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    yield line_no, number
                    number += 1
        return
    if suffix == ".csv":
        with open(file, newline="", encoding="utf-8", errors="replace") as f:
            reader = csv.reader(f)
            next(reader, None)
            start, number = reader.line_num + 1, 0
            for _ in reader:
                yield start, number
                start, number = reader.line_num + 1, number + 1
        return
    for number in range(_count_records(file, suffix)):
        yield None, number


def _is_json_array(file: str) -> bool:
    with open(file, "rb") as f:
        return f.read(64).lstrip().startswith(b"[")


def _count_records(file: str, suffix: str) -> int:
    if suffix == ".parquet":
        import pyarrow.parquet as pq
        return pq.ParquetFile(file).metadata.num_rows
    with open(file, encoding="utf-8") as f:
        data = json.load(f)
    return len(data) if isinstance(data, list) else 0


def first_bad_json(files: list[str]) -> str | None:
    """'FILE line L column C: what' for the first line of the JSON / JSON-lines files that is not a
    JSON object (read line by line: `datasets` names only a row of its own parser chunk), or None."""
    for file in files:
        suffix = os.path.splitext(file)[1].lower()
        if suffix not in (".json", ".jsonl"):
            continue
        if suffix == ".json" and _is_json_array(file):
            with open(file, "rb") as f:
                fault = _json_fault(f.read(), list)
            if fault:
                return f"{file} {fault}"
            continue
        with open(file, "rb") as f:
            for line_no, line in enumerate(f, 1):
                fault = _json_fault(line, dict) if line.strip() else None
                if fault:
                    return f"{file} line {line_no}{fault.partition('line 1')[2]}"
    return None


def _json_fault(data: bytes, kind: type) -> str | None:
    """'line L column C: not valid JSON (why)' or 'line 1: ...' of one JSON text that should be a
    `kind` (a file's array of rows, a JSON line's object), or None."""
    try:
        record = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        return "line 1: not UTF-8 text"
    except json.JSONDecodeError as e:
        return f"line {e.lineno} column {e.colno}: not valid JSON ({e.msg})"
    if not isinstance(record, kind):
        return f"line 1: a JSON {type(record).__name__}, not {'an array of rows' if kind is list else 'an object of columns'}"
    return None


def locate(files: list[str], index: int) -> str:
    """'FILE line L' (or 'FILE record R') of row `index` of the files' concatenation."""
    seen = 0
    for file in files:
        for line_no, number in records(file):
            if seen == index:
                return f"{file} line {line_no}" if line_no is not None else f"{file} record {number + 1}"
            seen += 1
    return f"{', '.join(files)} row {index + 1}"
