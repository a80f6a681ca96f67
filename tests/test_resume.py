"""Resume reproduces the run: a checkpointed cpu-tiny job killed with kill -9 (every process) at a
random step after a checkpoint, then resumed, against the same job uninterrupted. Every batch keeps
its prompts (none skipped, none trained twice); at max_policy_lag 0 also every reward and loss;
TensorBoard shows each step once."""
import json
import os
import random
import re
import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.resume_fixtures import read_record

STEPS, EVERY, GROUPS = 10, 3, 16  # GROUPS: cpu-tiny's rollout.groups_per_step (one inference rank)
ARGS = ["--config", "configs/cpu-tiny.yaml", "--checkpoint.enabled=true", f"--checkpoint.every={EVERY}",
        "--checkpoint.keep=5", f"--learner.num_steps={STEPS}", "--env.name=tests.resume_fixtures:RecordingArithmeticEnv"]


def launch(args: list[str], tmp_path, record, nproc: int = 2) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m",
           "colocate.train", *ARGS, f"--model.cache_dir={tmp_path / 'cache'}", *args]
    env = {**os.environ, "COLOCATE_TEST_RECORD": str(record),
           "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    return out


def kill_after(proc: subprocess.Popen, step: int) -> str:
    """kill -9 the whole job (torchrun and both ranks) once the learner logged `step` (1-based)."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if re.search(rf"\] step {step}/{STEPS} ", line):
            break
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    return "".join(lines)


def learner_rewards_in_tensorboard(run_dir, purge: bool = True) -> list[tuple[int, float]]:
    """(step, value) of learner/reward as TensorBoard shows it (purged steps left out), or with
    `purge` off every event the files hold."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator
    acc = EventAccumulator(str(run_dir / "tb" / "learner"), size_guidance={SCALARS: 0}, purge_orphaned_data=purge)
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("learner/reward")]


@pytest.mark.slow
@pytest.mark.parametrize("lag", [0, 1])
def test_kill_9_and_resume_replays_every_batch(tmp_path, lag):
    lag_arg = f"--learner.max_policy_lag={lag}"
    whole = tmp_path / "whole"
    finish(launch([lag_arg, f"--metrics.run_dir={whole}"], tmp_path, tmp_path / "whole.tsv"))

    run = tmp_path / "run"
    # after the first checkpoint, between two (so the killed run logged steps the resumed one redoes)
    kill_step = random.choice([s for s in range(EVERY + 1, STEPS - 1) if s % EVERY])
    killed = kill_after(launch([lag_arg, f"--metrics.run_dir={run}"], tmp_path, tmp_path / "killed.tsv"), kill_step)
    out = finish(launch([lag_arg, f"--metrics.run_dir={run}", "--resume"], tmp_path, tmp_path / "resumed.tsv"))
    start = int(re.search(r"resuming from \S+ \(step (\d+)\)", out).group(1))
    why = f"lag {lag}, killed after step {kill_step}, resumed from step {start}\n{killed[-2000:]}\n{out[-3000:]}"
    assert start % EVERY == 0 and EVERY <= start <= kill_step + 1, why
    last_logged = max(int(n) for n in re.findall(rf"\] step (\d+)/{STEPS} ", killed))

    # the same prompts batch for batch: the resumed run plays batches start.. again, none skipped
    whole_groups, resumed_groups = read_record(tmp_path / "whole.tsv"), read_record(tmp_path / "resumed.tsv")
    assert [g for g, _ in whole_groups] == list(range(STEPS * GROUPS)), why
    assert [g for g, _ in resumed_groups] == list(range(start * GROUPS, STEPS * GROUPS)), why
    assert resumed_groups == whole_groups[start * GROUPS:], why

    a = json.loads((whole / "summary.json").read_text())
    b = json.loads((run / "summary.json").read_text())
    assert a["steps"] == b["steps"] == STEPS, why
    if lag == 0:  # the same samples: the same rewards and losses step for step
        assert b["rewards"] == a["rewards"] and b["losses"] == a["losses"], why
    else:  # batches start .. start + lag - 1 were sampled again, with the checkpoint's adapter
        assert b["rewards"][:start] == a["rewards"][:start], why

    # TensorBoard: steps start..last_logged - 1 are in both runs' files, shown once (the resumed value)
    held = [s for s, _ in learner_rewards_in_tensorboard(run, purge=False)]
    assert all(held.count(s) == 2 for s in range(start, last_logged)), (held, why)
    shown = learner_rewards_in_tensorboard(run)
    assert [s for s, _ in shown] == list(range(STEPS)), (shown, why)
    assert [v for _, v in shown] == pytest.approx(b["rewards"], rel=1e-6), why  # float32 in the events


@pytest.mark.slow
def test_two_engines_resume_exactly(tmp_path):
    """gpu-1-gsm8k.yaml's layout (two inference ranks, one learner): each engine checkpoints its own
    rollout state, so a job killed after step 5 and resumed plays the same groups and, at lag 0 (the
    same samples), gives every reward and loss of the job run whole."""
    engines = ["--topology.num_inference=2", "--topology.num_learners=1", "--learner.max_policy_lag=0"]
    whole, run = tmp_path / "whole", tmp_path / "run"
    def job(run_dir, record, *more):
        return launch([*engines, f"--metrics.run_dir={run_dir}", *more], tmp_path, tmp_path / record, nproc=3)
    finish(job(whole, "whole.tsv"))
    killed = kill_after(job(run, "killed.tsv"), 5)
    out = finish(job(run, "resumed.tsv", "--resume"))
    start = int(re.search(r"resuming from \S+ \(step (\d+)\)", out).group(1))
    why = f"resumed from step {start}\n{killed[-2000:]}\n{out[-3000:]}"
    assert start == EVERY, why  # the checkpoint of step 3; step 6's was not reached
    # the batches from `start` on, each group once, each one the whole job's (the engines' lines interleave)
    played, whole_played = read_record(tmp_path / "resumed.tsv"), set(read_record(tmp_path / "whole.tsv"))
    assert len(set(played)) == len(played) == (STEPS - start) * GROUPS and set(played) <= whole_played, why
    a = json.loads((whole / "summary.json").read_text())
    b = json.loads((run / "summary.json").read_text())
    assert (b["rewards"], b["losses"]) == (a["rewards"], a["losses"]), why


@pytest.mark.parametrize("earlier", [True, False], ids=["earlier-run", "empty-dir"])
def test_resume_without_a_checkpoint_is_refused_in_one_line(monkeypatch, tmp_path, capsys, earlier):
    """`--resume` where no checkpoint exists stops before the ranks get a config (as HF Trainer's
    resume_from_checkpoint=True does), saying where it looked and how to start afresh, and leaves
    the directory as it was."""
    from colocate import cli, launcher
    from tests.test_cli import handed_over, no_torchrun_env
    no_torchrun_env(monkeypatch)
    ranks = []  # torchrun starts beside the checks; its ranks must get no config
    monkeypatch.setattr(launcher, "run_torchrun", lambda args, launch: ranks.append(handed_over(args)[1]) or 2)
    run = tmp_path / "run"
    run.mkdir()
    if earlier:  # what a run with checkpoints off leaves
        (run / "config.yaml").write_text("x: 1\n")
        (run / "summary.json").write_text("{}")
        (run / "adapter").mkdir()
    before = sorted(os.listdir(run))
    code = cli.main(["train", "--config", "configs/cpu-tiny.yaml", f"--metrics.run_dir={run}",
                     f"--model.cache_dir={tmp_path / 'cache'}", "--resume"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"no checkpoint found in {run / 'checkpoints'}" in err[0] and "leave out --resume" in err[0], err
    assert sorted(os.listdir(run)) == before and ranks == [None]
