"""GPU tests of the vLLM engine (vllm==0.25.0; one GPU or two, as each test says); skipped cleanly elsewhere.

Each test runs in a subprocess (a vLLM engine core is a child process that re-imports the main
module; pytest's stays out of it) and checks what that run wrote:
  * profiled torchrun train: the engine core's own trace (metrics.profile) holds GPU kernels;
  * torchrun train: 1 inference rank with VLLMEngine + 1 learner, Qwen2.5-0.5B shape, arithmetic,
    in both LoRA modes; every adapter version arrives over the stateless NCCL group with a checksum
    and a read-back of the slot or of the merged weights (the engine raises on any mismatch), and
    the run finishes all its steps; with 3 GPUs, 2 engines + 1 learner, both taking every version;
  * session: one engine, the learner's adapter pushed in place -> checksum, slot == received bytes,
    engine bytes == learner bytes; sync faster than the disk path; vLLM's log-probs of constrained
    completions equal the learner's over `allowed_ids` within 0.02 nats, with no replay failure;
  * log-probs (one GPU): a running engine's sampler calls reach our log-prob kernel, none vLLM's;
  * learning (one GPU): configs/cpu-tiny.yaml with vLLM, both roles on GPU 0 (CUDA IPC), reaches its
    0.9 target with `rollout.update` drain and inflight, and with `engine.constraint_masks: ours`:
    an adapter that never reached the engine,
    or reached it wrong under running requests, would leave the reward at chance (1/9); the sync
    canary's gap stays under its bound at every version;
  * FP8 (one GPU): cpu-tiny with `engine.quantization: fp8` (vLLM's online FP8; the adapter in the
    LoRA slot, or merged and requantized at each update) and TIS (`loss.tis_cap: 2`) reaches the
    same target with the canary under its FP8 bound at every version;
  * the canary (one GPU): an engine that never writes its updates (injected from outside the code,
    `tests/canary_faults`) is caught in both LoRA modes and with FP8 weights in both, exit 3.
vLLM is never imported here (only `importlib.util.find_spec`).
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.gpu_suite import gpu_run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm"),
]
two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs 2 CUDA GPUs")


def run(cmd, timeout, env_extra=None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NCCL_CUMEM_ENABLE": "0", **(env_extra or {})}
    proc = subprocess.run(cmd, cwd=REPO, env=env, timeout=timeout, capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    return tail


def tb_scalars(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(logdir)
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@two_gpus
@pytest.mark.parametrize("lora_mode", ["slot", "merged"])
@pytest.mark.timeout(480)
def test_train_with_vllm_engine_over_torchrun(tmp_path, lora_mode):
    """merged: the worker checks after every update that each adapted weight is bit for bit the
    merge of the received adapter into W0 (the engine raises otherwise)."""
    steps = 3
    run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "colocate.train",
         "--config", "configs/cpu-tiny.yaml", "--model.shape=qwen2.5-0.5b", "--model.dtype=bfloat16",
         f"--model.cache_dir={tmp_path / 'cache'}", "--engine.kind=vllm", "--engine.gpu_memory_utilization=0.5",
         f"--engine.lora_mode={lora_mode}",
         f"--learner.num_steps={steps}", "--learner.attention=sdpa", "--sync.check_checksum=true",
         f"--metrics.run_dir={tmp_path / 'run'}"], timeout=420)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == steps
    sync = tb_scalars(str(tmp_path / "run" / "tb" / "inference"))
    assert sync["sync/version"] == [float(v) for v in range(1, steps + 1)]
    assert sync["sync/checksum_ok"] == [1.0] * steps
    assert all(v > 0 for v in sync["engine/out_tokens_per_s"])


@two_gpus
@pytest.mark.timeout(480)
def test_profiled_run_writes_the_engine_cores_trace(tmp_path):
    """metrics.profile with vLLM: the role traces, plus the engine core's own trace (its GPU work
    runs in that child process) under <profile_dir>/<run>/inference-engine/, with GPU kernels."""
    import glob
    from benchmarks.common import summarize_trace
    run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "colocate.train",
         "--config", "configs/cpu-tiny.yaml", "--model.shape=qwen2.5-0.5b", "--model.dtype=bfloat16",
         f"--model.cache_dir={tmp_path / 'cache'}", "--engine.kind=vllm", "--engine.gpu_memory_utilization=0.5",
         "--learner.num_steps=3", "--learner.attention=sdpa", f"--metrics.run_dir={tmp_path / 'run'}",
         "--metrics.profile=true", "--metrics.profile_wait=0", "--metrics.profile_warmup=1",
         "--metrics.profile_active=1", f"--metrics.profile_dir={tmp_path / 'prof'}"], timeout=420)
    traces = glob.glob(str(tmp_path / "prof" / "run" / "inference-engine" / "*.json*"))
    assert len(traces) == 1, os.listdir(tmp_path / "prof" / "run")  # one window, one engine
    summary = summarize_trace(traces[0])
    print(json.dumps(summary))
    assert summary["num_kernels"] > 0 and summary["family_ms"].get("gemm", 0) > 0


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs 3 CUDA GPUs (2 engines + 1 learner)")
@two_gpus
@pytest.mark.timeout(540)
def test_two_engines_take_every_version(tmp_path):
    """One NCCL broadcast group of the learner and both engines: every version reaches both engines
    bit for bit (checksums) and the run ends. Lag 2: the engines take each version a batch late, so
    the learner waits for its own sends (`wait_sent`) every step."""
    steps = 4
    run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "-m", "colocate.train",
         "--config", "configs/cpu-tiny.yaml", "--model.shape=qwen2.5-0.5b", "--model.dtype=bfloat16",
         f"--model.cache_dir={tmp_path / 'cache'}", "--engine.kind=vllm", "--engine.gpu_memory_utilization=0.5",
         "--topology.num_inference=2", "--topology.num_learners=1",
         "--learner.max_policy_lag=2", f"--learner.num_steps={steps}", "--learner.attention=sdpa",
         "--sync.check_checksum=true", f"--metrics.run_dir={tmp_path / 'run'}"], timeout=480)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == steps
    sync = tb_scalars(str(tmp_path / "run" / "tb" / "inference"))  # inference rank 0's scalars
    assert sync["sync/version"] == [float(v) for v in range(1, steps + 1)]
    assert sync["sync/checksum_ok"] == [1.0] * steps


@two_gpus
@pytest.mark.timeout(480)
def test_session_sync_checksum_and_logprob_parity(tmp_path):
    out = tmp_path / "sync.json"
    run([sys.executable, "scripts/benchmark.py", "--profile", "sync", "--shape", "0.5b", "--iters", "4",
         "--also", "parity", "--budget-s", "300", "--trace-dir", str(tmp_path / "trace"), "--out", str(out)],
        timeout=420)
    rec = json.loads(out.read_text())
    f = {**rec["figures"], **rec["baseline"], **rec["ratios"]}
    assert f["sync/checksum_ok"] and f["sync/slot_matches_received"] and f["sync/engine_bytes_equal_learner"]
    assert f["sync/speedup_vs_disk"] > 1.0
    # the engine core traced the 5 updates' first tokens: GPU kernels, and vLLM's per-step annotation
    # (named by the step's prefill and decode tokens, e.g. "execute_context_1(64)_generation_0(0)")
    (trace,) = f["sync/trace"]
    assert trace["num_kernels"] > 0 and trace["family_ms"].get("gemm", 0) > 0
    steps = [n for n, _, _ in trace["host"]["user_annotation"] if n.startswith("execute_context_1(64)")]
    assert steps and any(n == "cudaGraphLaunch" for n, _, _ in trace["host"]["cuda_runtime"])
    assert f["parity/walk_failures"] == 0
    assert f["parity/engine_errors"] == 0  # no answer cut short by a grammar refusal
    assert f["parity/mean_abs_diff"] <= 0.02
    assert f["parity/free_mean_abs_diff"] <= 0.02 and f["parity_diplomacy/free_mean_abs_diff"] <= 0.02
    assert f["parity/forced_max_abs_logprob"] < 1e-4  # a token that was the only choice has log-prob 0


@pytest.mark.gpu_job("logprob-calls")
@pytest.mark.timeout(1800)  # its run's own limit is tests/gpu_suite.py's; this one covers the wait for a slot
def test_running_engine_takes_log_probs_from_our_kernel(gpu_jobs):
    """One GPU: in a running engine (the dataset rollout's side `ours`, tiny shape, one round) every
    sampler log-prob call reaches our kernel and none falls back to vLLM's function: the patch is
    not only installed but matches the calls vLLM's sampler makes."""
    run = gpu_run(gpu_jobs, "logprob-calls")
    assert run.returncode == 0 and not run.stray, run.tail()
    calls = json.loads((run.dir / "dsroll.json").read_text())["figures"]["detail"]["ours+share"]["logprob_calls"]
    assert calls["ours"] > 0 and calls["vllm"] == 0, calls


@pytest.mark.gpu_job("two-engines")
@pytest.mark.timeout(900)
def test_two_engines_and_the_learner_share_one_gpu(gpu_jobs):
    """Two vLLM engines and the learner on one GPU (`topology.num_inference=2`, 3 processes): every
    version reaches both engines through the shared CUDA IPC ring, checksummed (a mismatch stops the
    run), both engines play their share of every batch, and the canary probes them without an alert."""
    steps = 40
    run = gpu_run(gpu_jobs, "two-engines")
    assert run.returncode == 0 and not run.stray, run.tail()
    summary = json.loads((run.dir / "run" / "summary.json").read_text())
    assert summary["steps"] == steps and summary["num_inference"] == 2 and summary["mismatch_step"] is None
    for rank in (0, 1):  # lag 2: batch k is sampled with version k - 2 or later, so the last with >= steps - 3
        report = json.loads((run.dir / "run" / f"inference-rank{rank}.json").read_text())
        versions = [b["version"] for b in report["batches"]]
        assert len(versions) == steps and versions == sorted(versions) and versions[-1] >= steps - 3, (rank, versions)
    sync = tb_scalars(str(run.dir / "run" / "tb" / "inference"))  # inference rank 0's scalars
    assert sync["sync/version"] == [float(v) for v in range(1, steps + 1)]
    assert sync["sync/checksum_ok"] == [1.0] * steps


@pytest.mark.parametrize("update,masks", [pytest.param(u, m, marks=pytest.mark.gpu_job(f"learn-{u}-{m}"))
                                          for u, m in (("drain", "vllm"), ("inflight", "vllm"), ("drain", "ours"))])
@pytest.mark.timeout(1800)
def test_cpu_tiny_learns_with_vllm_on_one_gpu(gpu_jobs, update, masks):
    """The GPU learning test: the embedded default on vLLM, both roles on one GPU, 300 steps, must
    reach env.reward_target (0.9) in both update modes, and with our constraint masks."""
    run = gpu_run(gpu_jobs, f"learn-{update}-{masks}")
    assert run.returncode == 0 and not run.stray, run.tail()
    # our kernels compile at engine start (`vllm_worker.start_up_compiles`), unseen by vLLM's JIT monitor
    ours = ("_blocks", "_combine", "_advance_and_mask")
    jit_lines = [line for line in run.output.splitlines() if "JIT compilation during inference" in line]
    assert not [line for line in jit_lines if line.split("inference: ")[-1].split(".")[0] in ours], jit_lines
    summary = json.loads((run.dir / "run" / "summary.json").read_text())
    assert summary["steps"] == 300 and summary["reached_target"], {k: summary[k] for k in
                                                                    ("reward_start", "reward_end", "dropped_stale")}
    rollout = tb_scalars(str(run.dir / "run" / "tb" / "inference"))
    assert "rollout/version_span" in rollout and "rollout/requests_in_flight" in rollout
    if update == "drain":
        assert set(rollout["rollout/requests_in_flight"]) == {0.0}
    learner = tb_scalars(str(run.dir / "run" / "tb" / "learner"))  # the collapse watch on the GPU path
    for tag in ("learner/entropy", "learner/grad_norm", "learner/grad_norm_max", "learner/ratio",
                "learner/ratio_max", "learner/zero_adv_fraction", "learner/lr"):
        assert learner.get(tag), tag
    # the sync canary at every version the engine sampled with, always under its bf16 bound: one check
    # per batch at most (300), and at lag 1 the batches are sampled with at least 299 versions (0..298;
    # version 299 too when it reaches the engine before the last batch starts, as in-flight updates let it)
    gaps, bounds = learner["sync/canary_gap"], learner["sync/canary_bound"]
    assert 299 <= len(gaps) <= 300 and all(g <= b for g, b in zip(gaps, bounds)), (len(gaps), max(gaps), min(bounds))
    assert summary["mismatch_step"] is None


@pytest.mark.parametrize("lora_mode", [pytest.param("slot", marks=pytest.mark.gpu_job("learn-fp8")),
                                       pytest.param("merged", marks=pytest.mark.gpu_job("learn-fp8-merged"))])
@pytest.mark.timeout(1800)
def test_cpu_tiny_learns_with_vllm_fp8_and_tis_on_one_gpu(gpu_jobs, lora_mode):
    """The GPU learning test with an FP8 engine (`engine.quantization: fp8`: vLLM's online FP8 of the
    base weights; slot: the adapter beside them in bf16; merged: W0 + BA requantized into them at
    each update, which shows only the updates that cross e4m3's grid) and its correction
    (`loss.tis_cap: 2`): the embedded default still reaches env.reward_target in 300 steps, and the
    canary's gap stays under its FP8 bound (`colocate/canary.py`) at every version: no alert, no stop."""
    run = gpu_run(gpu_jobs, "learn-fp8" + ("-merged" if lora_mode == "merged" else ""))
    assert run.returncode == 0 and not run.stray, run.tail()
    summary = json.loads((run.dir / "run" / "summary.json").read_text())
    assert summary["steps"] == 300 and summary["reached_target"], {k: summary[k] for k in
                                                                    ("reward_start", "reward_end", "dropped_stale")}
    config = (run.dir / "run" / "config.yaml").read_text()
    assert "quantization: fp8" in config and f"lora_mode: {lora_mode}" in config
    learner = tb_scalars(str(run.dir / "run" / "tb" / "learner"))
    gaps, bounds = learner["sync/canary_gap"], learner["sync/canary_bound"]
    assert 299 <= len(gaps) <= 300 and all(g <= b for g, b in zip(gaps, bounds)), (len(gaps), max(gaps), min(bounds))
    assert summary["mismatch_step"] is None and "ALERT canary_mismatch" not in run.output


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("lora_mode", [pytest.param(m, marks=pytest.mark.gpu_job(f"canary-{m}"))
                                       for m in ("slot", "merged", "fp8", "fp8-merged")])
def test_canary_catches_an_engine_that_skips_updates(gpu_jobs, lora_mode):
    """The vLLM worker takes every version but never writes it (`tests/canary_faults`: the LoRA slot,
    or the merged weights, stay at version 0: skipped updates, a stale merged copy). The canary's
    gap grows with the learner's policy until it passes the bf16 bound: ALERT canary_mismatch, and
    `colocate train` exits 3 long before the run's end. fp8: slot mode on FP8 base weights with TIS,
    caught past the FP8 bound (wider, so later than bf16's, still long before the end); fp8-merged:
    the FP8 weights never requantized, caught the same way (the honest run of that engine stays
    under the bound: `test_cpu_tiny_learns_with_vllm_fp8_and_tis_on_one_gpu[merged]`)."""
    run = gpu_run(gpu_jobs, f"canary-{lora_mode}")
    assert run.returncode == 3 and "ALERT canary_mismatch" in run.output and not run.stray, run.tail()
    summary = json.loads((run.dir / "run" / "summary.json").read_text())
    assert summary["mismatch_step"] is not None and summary["steps"] < 200, summary["mismatch_step"]
