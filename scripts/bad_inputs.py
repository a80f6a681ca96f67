"""Rewrite docs/errors.md: every bad input of `tests/test_bad_input.py` with the one line it gets.

    python scripts/bad_inputs.py            # from the repository root

Each case runs through `colocate.train.configure` (what every rank and `--check` run before any
process group or model exists) in a temporary directory whose path is shown as `<tmp>`.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from colocate.train import configure  # noqa: E402
from tests.test_bad_input import CASES, materialize  # noqa: E402


def message(text, overrides: list[str]) -> tuple[int, str]:
    """(exit code, stderr) of one case, in a fresh temporary directory."""
    with tempfile.TemporaryDirectory() as tmp:
        path, overrides = materialize(text, overrides, Path(tmp))
        argv = ["--config", path, f"--metrics.run_dir={tmp}/run", f"--model.cache_dir={tmp}/cache", *overrides]
        err = io.StringIO()
        code = 0
        with contextlib.redirect_stderr(err):
            try:
                configure(argv)
            except SystemExit as e:
                code = e.code
        return code, err.getvalue().strip().replace(tmp, "<tmp>").replace(str(REPO) + "/", "")


def main() -> None:
    os.environ.update(WORLD_SIZE="2", RANK="0")
    rows = []
    for case_id, text, overrides, _ in CASES:
        code, line = message(text, overrides)
        shown = " ".join(overrides) or ("(the config file)" if text is not None else "")
        rows.append(f"| {case_id} | `{shown}` | {code} | {line.replace('|', '/')} |")
    out = REPO / "docs" / "errors.md"
    out.write_text(
        "# Bad input and its message\n\n"
        "Every case of `tests/test_bad_input.py` (the test asserts each: one line, exit code 2, before any\n"
        "process group or model), with the line it prints, as `python scripts/bad_inputs.py` last wrote\n"
        "them. Overrides apply to `configs/cpu-tiny.yaml` unless the case writes its own config file.\n"
        "Under torchrun every rank exits with 2 and rank 0 prints the line once; torchrun itself then\n"
        "exits with 1 (`python -m colocate.train --config FILE --check` returns the 2 before launch).\n\n"
        "| case | input | exit | message |\n| --- | --- | --- | --- |\n" + "\n".join(rows) + "\n")
    print(f"wrote {out} ({len(rows)} cases)")


if __name__ == "__main__":
    main()
