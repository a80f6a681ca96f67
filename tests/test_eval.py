"""Held-out evaluation: the HF engine's greedy path, the inference rank's evaluations in
TensorBoard and summary.json, and `python -m colocate.eval` scoring a checkpoint (or the base
model) exactly as the run did."""
import json
import os
import subprocess
import sys

import pytest
import torch

from colocate.data import Request
from tests.conftest import REPO


def test_temperature_zero_is_greedy(tiny_cfg, tiny_tokenizer, tiny_policy):
    from colocate.engine.hf import HFEngine
    prompt = tiny_tokenizer.encode("add 1 and 2 ; answer :")
    runs = [HFEngine(tiny_policy, tiny_tokenizer, seed=seed).generate(
        [Request(prompt_ids=prompt, max_new_tokens=4, temperature=0.0)] * 3) for seed in (0, 1)]
    assert len({tuple(c.token_ids) for run in runs for c in run}) == 1  # no randomness at all
    ids = torch.tensor([prompt])
    with torch.no_grad():
        first = int(tiny_policy(ids).logits[0, -1].argmax())
    assert runs[0][0].token_ids[0] == first
    sampled = HFEngine(tiny_policy, tiny_tokenizer, seed=0).generate(
        [Request(prompt_ids=prompt, max_new_tokens=4, temperature=1.0)] * 8)
    assert all(lp <= 0 for c in sampled for lp in c.logprobs)


def run_eval_cli(args, tmp_path, capsys):
    """`python -m colocate.eval ARGS` as a call (its `main`, what the module runs) -> the JSON it printed."""
    from colocate.eval import main
    capsys.readouterr()
    main(["--config", "configs/cpu-dataset-tiny.yaml", f"--model.cache_dir={tmp_path / 'cache'}",
          f"--metrics.run_dir={tmp_path / 'run'}", *args])
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_run_evaluates_and_the_cli_scores_the_checkpoint_alike(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)  # the config's data files are relative to the working directory
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.conftest import torchrun
    run_dir = tmp_path / "run"
    torchrun(["--config", "configs/cpu-dataset-tiny.yaml", "--learner.num_steps=4", "--eval.every=2",
              "--checkpoint.enabled=true", f"--metrics.run_dir={run_dir}", f"--model.cache_dir={tmp_path / 'cache'}"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [e["version"] for e in summary["eval"]] == [0, 2, 4] and summary["eval_final"]["version"] == 4
    acc = EventAccumulator(str(run_dir / "tb" / "inference"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/accuracy")] == [0, 2, 4]
    assert {"eval/mean_reward", "eval/mean_length", "rollout/reward_errors"} <= set(acc.Tags()["scalars"])
    assert os.path.exists(run_dir / "eval" / "dataset-eval-v4.jsonl")
    base = run_eval_cli([], tmp_path, capsys)
    assert base["version"] == 0 and base["metrics"] == pytest.approx(
        {k: v for k, v in summary["eval"][0].items() if k not in ("version", "eval_s")})
    trained = run_eval_cli(["--checkpoint", str(run_dir / "checkpoints" / "step-000004")], tmp_path, capsys)
    assert trained["version"] == 4 and trained["metrics"] == pytest.approx(
        {k: v for k, v in summary["eval_final"].items() if k not in ("version", "eval_s")})
    assert json.loads((run_dir / "evals" / "step-000004" / "metrics.json").read_text())["metrics"] == trained["metrics"]
    adapter = run_eval_cli(["--checkpoint", str(run_dir / "adapter")], tmp_path, capsys)  # the run's final adapter alike
    assert adapter["version"] == 4 and adapter["metrics"] == trained["metrics"]


def test_cli_bad_checkpoint_is_one_line_and_exit_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "colocate.eval", "--config", "configs/cpu-dataset-tiny.yaml",
                          "--checkpoint", str(tmp_path / "nope")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "checkpoint error" in out.stderr
