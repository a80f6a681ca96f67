#!/usr/bin/env bash
# Must-show of issue #35: from a fresh clone and a fresh venv, the README's install commands, then
# the README's test command. Usage: scripts/fresh_install_check.sh [REPO (default: this checkout)]
# Takes ~15 min on 2 cores (the install, then the suite); everything lives in a temp directory.
set -euo pipefail
repo="$(cd "${1:-$(dirname "$0")/..}" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
git clone --quiet "$repo" "$work/colocate"
python3 -m venv "$work/venv"
source "$work/venv/bin/activate"
cd "$work/colocate"
# The README's Install section, as written there:
pip install torch==2.13.0
pip install -e ".[test]" -c constraints.txt
colocate --help > /dev/null
# The README's test command:
python3 -m pytest -q -m "not gpu" --timeout=900 tests
