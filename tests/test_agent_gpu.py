"""The calculator agent (examples/calculator_agent.py) on one GPU with vLLM (vllm==0.25.0): both
roles share cuda:0 (the adapter by CUDA IPC), as configs/gpu-1.yaml does; skipped without CUDA
or vLLM.

  * learns: configs/cpu-calculator-agent.yaml as on the CPU (the embedded tiny model, its
    tokenizer trained on the task), the engine swapped for vLLM: the mean reward of the last 10
    steps reaches env.reward_target (0.9), and the tool-call rate rises from the first steps;
  * parity: the engine's behaviour log-probs of the policy spans against the learner's on the same
    weights, within 0.02 nats (learner/sampler_logprob_gap: updates_per_batch 2 gives the learner's
    start-of-step pass; max_policy_lag 0 makes every sequence one of the current version's; env
    spans and tokens forced by the constraint are out of it).

Each run is a torchrun subprocess (a vLLM engine core is a child process that re-imports the main
module; pytest's stays out of it); the assertions read the run's summary.json and TensorBoard.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm"),
]

ONE_GPU = ["--engine.kind=vllm"]
"""The CPU config's model (tiny, float32) on vLLM, as tests/test_vllm_gpu.py runs cpu-tiny on one GPU."""


def train(tmp_path, *overrides, timeout):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NCCL_CUMEM_ENABLE": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0",
           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "colocate.train", "--config", "configs/cpu-calculator-agent.yaml", *ONE_GPU,
           f"--model.cache_dir={tmp_path / 'cache'}", f"--metrics.run_dir={tmp_path / 'run'}", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=env, timeout=timeout, capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    print(tail[-2000:])
    return json.loads((tmp_path / "run" / "summary.json").read_text())


def tb_scalars(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(logdir)
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def mean(values):
    return sum(values) / len(values)


@pytest.mark.timeout(660)
def test_calculator_agent_learns_with_vllm(tmp_path):
    # 300 steps, not the CPU config's 200: on vLLM (one H200, 2026-11-26) the 10-step mean stood at
    # 0.88 at step 200 of one run and first reached 0.9 near step 110 of another (profiles/README.md)
    summary = train(tmp_path, "--learner.num_steps=300", timeout=600)
    print(json.dumps({k: summary[k] for k in ("steps", "reward_start", "reward_end", "wall_time_s")}))
    assert summary["reached_target"], summary["reward_end"]
    rollout = tb_scalars(str(tmp_path / "run" / "tb" / "inference"))
    calls, accuracy = rollout["rollout/tool_call_rate"], rollout["rollout/accuracy"]
    assert mean(calls[-10:]) > mean(calls[:10]) and mean(accuracy[-10:]) >= 0.9
    assert sum(rollout["rollout/tool_errors/timeout"]) == 0


@pytest.mark.timeout(480)
def test_engine_logprobs_of_policy_spans_match_the_learners(tmp_path):
    steps = 8
    summary = train(tmp_path, "--learner.updates_per_batch=2", "--learner.max_policy_lag=0",
                    f"--learner.num_steps={steps}", timeout=420)
    assert summary["steps"] == steps
    learner = tb_scalars(str(tmp_path / "run" / "tb" / "learner"))
    gap, tokens = learner["learner/sampler_logprob_gap"], learner["learner/sampler_gap_tokens"]
    print(json.dumps({"sampler_logprob_gap": gap, "sampler_gap_tokens": tokens}))
    assert len(gap) == steps and min(tokens) > 0  # every step on-policy, with tokens to compare
    assert max(gap) <= 0.02
