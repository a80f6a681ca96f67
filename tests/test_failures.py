"""How failures reach the user through `colocate train`: a rank failing on user code is one
`colocate: failed:` line naming the function, file and line, with the traceback in a file of the
run directory and no torchrun summary; reward errors are in the step lines and the summary."""
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

DATASET = ["--config", "configs/cpu-dataset-tiny.yaml", "--nproc", "2", "--eval.every=0", "--eval.at_end=false",
           "--metrics.nvml_interval_s=0"]


def colocate_train(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "colocate.cli", "train", *DATASET, f"--model.cache_dir={tmp_path / 'cache'}", *args]
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
def test_a_reward_failing_in_a_rank_is_one_line_and_a_traceback_file(tmp_path):
    run = tmp_path / "run"
    proc = colocate_train([f"--metrics.run_dir={run}", "--learner.num_steps=20", "--env.max_reward_errors=1",
                           "--env.reward=tests.reward_fixtures:breaks_after_its_first_call"], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]  # lifecycle.FAILED_EXIT
    ours = [line for line in out.splitlines() if line.startswith("colocate: ") and "is global rank" not in line]
    assert len(ours) <= 3, out[-4000:]
    failed = [line for line in ours if line.startswith("colocate: failed: ")]
    assert len(failed) == 1, out[-4000:]
    assert "rank 0 (inference): RewardError" in failed[0], failed
    assert "; at breaks_after_its_first_call (tests/reward_fixtures.py:19); " in failed[0], failed
    assert f"traceback in {run / 'failure-rank0.txt'}" in failed[0], failed
    traceback = (run / "failure-rank0.txt").read_text()
    assert "ConnectionError: reward service unreachable" in traceback and "RewardError" in traceback
    for noise in ("Traceback", "torch.distributed", "ChildFailedError", "exitcode", "nanobind", "leaked"):
        assert noise not in out, (noise, out[-4000:])


@pytest.mark.slow
def test_reward_errors_are_in_the_step_lines_and_the_summary(tmp_path):
    run = tmp_path / "run"
    proc = colocate_train([f"--metrics.run_dir={run}", "--learner.num_steps=4",
                           "--env.reward=tests.reward_fixtures:exact_but_raises_on_sevens"], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    steps = [line for line in proc.stdout.splitlines() if "] step " in line]
    shown = sum(int(line.split(" reward errors)")[0].rpartition("(")[2]) for line in steps if "reward errors)" in line)
    # 16 prompts of 8 completions a step from 25 rows, 2 of which raise: some steps have errors
    assert summary["reward_errors"] > 0 and summary["reward_errors"] % 8 == 0, summary
    assert shown == summary["reward_errors"], steps
    printed = [line for line in proc.stdout.splitlines() if "] summary: " in line]
    assert len(printed) == 1 and f"{summary['reward_errors']} samples got no usable reward" in printed[0], printed


def test_reward_errors_travel_with_their_sequences_to_every_learner():
    """A sample's `reward_error` becomes its batch row's flag, which sharding, the wire header and
    concatenation keep with its sequence (the learners' counts sum to the batch's)."""
    import torch

    from colocate.data import Completion, Sample, TrajectoryBatch, build_batch, shard_batch
    from colocate.wire import FIELDS, encode_batch
    samples = [Sample(prompt_ids=[1, 2], completion=Completion(token_ids=[3] * (i + 1), logprobs=[-0.5] * (i + 1),
                                                               allowed_ids=None, version=0),
                      reward=0.0, group_key=0, info={"reward_error": i in (1, 2)}) for i in range(4)]
    batch = build_batch(samples, [0.0] * 4)
    assert batch.reward_errors.tolist() == [False, True, True, False]
    shards = shard_batch(batch, 2)
    assert [int(s.reward_errors.sum()) for s in shards] == [1, 1]
    h, ids, pos = encode_batch(shards[0])[0].tolist(), [], 1
    for _ in range(h[0]):  # (field id, dtype id, ndim, *shape) per field
        ids.append(h[pos])
        pos += 3 + h[pos + 2]
    assert FIELDS[ids[-1]] == "reward_errors"
    assert torch.equal(TrajectoryBatch.concat(shards).reward_errors, batch.reward_errors)
    clean = build_batch(samples[:1], [0.0])  # no errors: no field, and concat fills False
    assert clean.reward_errors is None
    assert TrajectoryBatch.concat([clean, shards[1]]).reward_errors.tolist() == [False, True, False]
