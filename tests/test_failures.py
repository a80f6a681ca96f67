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


def rank_process(job_pid: int, rank: int):
    """The process of global rank `rank` of the `colocate train` whose pid is `job_pid`."""
    import psutil
    for p in psutil.Process(job_pid).children(recursive=True):
        if "colocate.train" in p.cmdline() and p.environ().get("RANK") == str(rank):
            return p
    pytest.fail(f"no rank {rank} under pid {job_pid}")


@pytest.mark.slow
def test_a_rank_killed_by_a_signal_is_named_and_its_run_dir_is_held_until_then(tmp_path):
    """kill -9 of the inference rank (what the out-of-memory killer does): `colocate train` names
    the rank, the signal and the last checkpoint in one line and exits 128 + 9. While the job
    lives, a second `colocate train` into its directory (even with --overwrite) is refused in one
    line naming it, and deletes nothing."""
    from tests.test_stop_signals import finish, read_until, start_train
    run = tmp_path / "run"
    args = [f"--metrics.run_dir={run}", "--checkpoint.enabled=true", "--checkpoint.every=2"]
    proc = start_train(args, tmp_path)
    seen = read_until(proc, r"\] step 5/300 ")
    second = subprocess.run([sys.executable, "-m", "colocate.cli", "train", "--config", "configs/cpu-tiny.yaml",
                             f"--model.cache_dir={tmp_path / 'cache'}", *args, "--overwrite"], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    import socket
    assert second.returncode == 2 and second.stderr.count("\n") == 1, second
    assert (f"colocate: config error: metrics.run_dir={str(run)!r} is in use by pid {proc.pid} (colocate train) on "
            f"{socket.gethostname()}, started ") in second.stderr, second.stderr
    assert (run / "config.yaml").is_file() and (run / "tb").is_dir()  # nothing deleted (written once, at the start)
    rank_process(proc.pid, 0).kill()
    code, out, err = finish(proc, seen)
    newest = sorted(os.listdir(run / "checkpoints"))[-1]
    assert code == 128 + 9, (code, out[-3000:], err)
    assert err == (f"colocate: failed: rank 0 (inference) was killed by SIGKILL (often the out-of-memory killer); "
                   f"last checkpoint: {run / 'checkpoints' / newest}\n"), err


@pytest.mark.slow
def test_a_rank_that_leaves_with_os_exit_is_named(tmp_path):
    """A rank's own `os._exit(7)` mid-run (user code can): one line naming it, exit 7."""
    from tests.test_stop_signals import finish, start_train
    proc = start_train([f"--metrics.run_dir={tmp_path / 'run'}"], tmp_path,
                       env={"COLOCATE_FAULT": "exit:rank=1:step=3:code=7"})
    code, out, err = finish(proc)
    assert code == 7, (code, out[-3000:], err)
    assert "] step 3/300 " in out and "] step 4/300 " not in out, out[-3000:]
    assert err == ("colocate: failed: rank 1 (learner) exited with code 7 and no error (an os._exit or a library's "
                   "exit in its code); last checkpoint: none (checkpoint.enabled is false)\n"), err


def test_docs_list_the_lines_a_run_ends_with():
    """docs/errors.md's "How a run ends" rows are what `scripts/bad_inputs.py` makes of the code's lines now."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bad_inputs", os.path.join(REPO, "scripts", "bad_inputs.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with open(os.path.join(REPO, "docs", "errors.md")) as f:
        doc = f.read()
    rows = script.end_rows()
    assert len(rows) == 8 and all(row in doc for row in rows), "docs/errors.md is stale: run `python scripts/bad_inputs.py`"
