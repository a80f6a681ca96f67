#!/usr/bin/env bash
# The README's user commands, in order, from a fresh clone (issue 56): Install, Run (check, train,
# eval, export, help), a second train after eval (not refused for it), the custom-env example of
# docs/envs.md, the dataset preset ("your own task"), then the test command. Each command must
# succeed; the script stops at the first that does not and names it.
#
#   scripts/readme_commands.sh [--short] [REPO]      (REPO: default this checkout)
#
# Full: a fresh venv, the README's installs (needs the network: PyTorch's CPU index and PyPI), the
# trainings at their presets' lengths and the CPU test suite: ~25 min on 2 cores.
# --short: what CI may run (68 s on an idle 2-core VM, 2026-11-29): no installs (a venv over this python3's packages,
# the clone installed in it with --no-deps), 20 steps per training, no test suite.
# Not run: tensorboard (a server), the GPU presets, several nodes, profiling, eval_diplomacy.py.
set -euo pipefail
short=0
if [ "${1:-}" = "--short" ]; then short=1; shift; fi
repo="$(cd "${1:-$(dirname "$0")/..}" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
git clone --quiet "$repo" "$work/colocate"
cd "$work/colocate"

step() {  # run one README command, echoed; a failure names it
  echo "== $*" >&2
  "$@" || { echo "readme_commands: FAILED (exit $?): $*" >&2; exit 1; }
}

if [ "$short" = 1 ]; then
  python3 -m venv --system-site-packages "$work/venv"
  # python3 may be a venv itself, whose packages --system-site-packages does not see: put its
  # site-packages first on the new venv's path (its setuptools too, for the editable install)
  parent=$(python3 -c "import site; print(site.getsitepackages()[0])")
  child=$("$work/venv/bin/python" -c "import site; print(site.getsitepackages()[0])")
  [ "$parent" = "$child" ] || echo "import sys; sys.path.insert(0, '$parent')" > "$child/0-parent-env.pth"
  source "$work/venv/bin/activate"
  pip install --quiet --no-deps --no-build-isolation -e .
  steps=(--learner.num_steps=20)
else
  python3 -m venv "$work/venv"
  source "$work/venv/bin/activate"
  # README, Install:
  step pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
  step pip install -e ".[test]" -c constraints.txt
  steps=()
fi

# README, Run:
step colocate check --config configs/cpu-tiny.yaml --rollout.group_size=16 > /dev/null
step colocate train --config configs/cpu-tiny.yaml --learner.lr=3e-3 ${steps[@]+"${steps[@]}"}
step colocate eval --run runs/cpu-tiny > /dev/null
test -f runs/cpu-tiny/evals/adapter/metrics.json
step colocate export --run runs/cpu-tiny --merge --out exported/cpu-tiny
step colocate check --help learner > /dev/null
if [ "$short" = 0 ]; then  # the figure the README gives: 0.14 -> 0.98
  python3 -c "import json; s = json.load(open('runs/cpu-tiny/summary.json')); assert s['reward_end'] >= 0.9, s"
fi
# The eval does not hold the directory: the same train again, replacing the run, keeps the eval
step colocate train --config configs/cpu-tiny.yaml --overwrite --learner.num_steps=5
test -f runs/cpu-tiny/evals/adapter/metrics.json

# docs/envs.md, the custom env's worked example; README, Your own task (the dataset preset):
step colocate train --config configs/cpu-tiny.yaml --metrics.run_dir=runs/guessing-game \
  --env.name=examples.guessing_game:GuessingGameEnv "--env.options={max_number: 4}" \
  --env.reward_target=0.4 --metrics.reward_drop_alert=0.25 ${steps[@]+"${steps[@]}"}
step colocate train --config configs/cpu-dataset-tiny.yaml ${steps[@]+"${steps[@]}"}
step colocate eval --run runs/cpu-dataset-tiny > /dev/null

if [ "$short" = 0 ]; then
  # README, the tests (as CI installs them):
  step pip install -e ".[test,trackers]" -c constraints.txt
  step python3 -m pytest -q -m "not gpu" --timeout=900 tests
fi
echo "readme_commands: every command succeeded" >&2
