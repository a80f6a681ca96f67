"""Observability: TensorBoard namespaces per role, profiler traces per role, alerts, flame graphs."""
import glob
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from colocate.config_schema import MetricsConfig
from colocate.metrics import CollapseMonitor, MetricsWriter, StallWatchdog, percentiles
from tests.conftest import REPO


def read_scalar_tags(event_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(event_dir)
    acc.Reload()
    return set(acc.Tags()["scalars"])


@pytest.mark.slow
def test_profiled_cpu_run_writes_every_namespace_and_a_trace_per_role(tmp_path):
    run = tmp_path / "obsrun"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "colocate.train",
           "--config", "configs/cpu-tiny.yaml", "--learner.num_steps=8", f"--metrics.run_dir={run}",
           f"--model.cache_dir={tmp_path / 'cache'}", "--metrics.profile=true", f"--metrics.profile_dir={tmp_path}",
           "--metrics.nvml_interval_s=0.2"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    tags = read_scalar_tags(str(run / "tb" / "inference")) | read_scalar_tags(str(run / "tb" / "learner"))
    for namespace in ("rollout", "engine", "learner", "sync", "system"):
        assert any(t.startswith(namespace + "/") for t in tags), (namespace, sorted(tags))
    for tag in ("rollout/poll_latency_s_p95", "rollout/group_latency_s_p50", "rollout/games_per_s",
                "rollout/invalid_rate", "engine/decode_tokens_per_s", "engine/prefill_tokens_per_s",
                "engine/batch_size", "learner/loss", "learner/kl", "learner/clip_fraction", "learner/grad_norm",
                "learner/tokens_per_s", "sync/broadcast_ms", "sync/apply_ms", "system/cpu_percent_host",
                # the collapse watch (docs/design.md): entropy, importance ratios, groups with no signal, lr
                "learner/entropy", "learner/ratio", "learner/ratio_max", "learner/zero_adv_fraction",
                "learner/grad_norm_max", "learner/lr"):
        assert tag in tags, tag
    for role in ("inference", "learner"):
        traces = glob.glob(str(tmp_path / "obsrun" / f"{role}-rank*.pt.trace.json"))
        assert len(traces) == 1, (role, os.listdir(tmp_path / "obsrun"))
        with open(traces[0]) as f:
            trace = json.load(f)
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert f"{'rollout/collect' if role == 'inference' else 'learner/train_step'}" in names


def test_stall_watchdog_alerts_once(capsys):
    writer = MetricsWriter("unused", "inference", enabled=False)
    dog = StallWatchdog(writer, timeout_s=0.2, what="trajectory produced")
    dog.start()
    time.sleep(1.5)
    dog.stop()
    err = capsys.readouterr().err
    assert err.count("ALERT stalled: no trajectory produced") == 1


class FailingWriter(MetricsWriter):
    """A TensorBoard writer on a disk that filled up."""

    def scalars(self, namespace, values, step, **kwargs):
        raise OSError(28, "No space left on device")


def test_a_monitor_thread_failure_reaches_the_role_loop():
    from types import SimpleNamespace

    from colocate.metrics import role_monitors
    cfg = SimpleNamespace(nvml_interval_s=0.05, stall_timeout_s=0.0)
    writer = FailingWriter("unused", "learner", enabled=True, tensorboard=False)
    with role_monitors(cfg, writer, gpu_index=None, what="x") as role:
        deadline = time.time() + 5
        while role.sampler.error is None and time.time() < deadline:
            time.sleep(0.05)
        with pytest.raises(RuntimeError, match="colocate-system-sampler failed: OSError.*No space left"):
            role.check()


def test_percentiles():
    assert percentiles([], "x") == {}
    p = percentiles([float(i) for i in range(101)], "lat")
    assert p == {"lat_p50": 50.0, "lat_p95": 95.0}


def ptrace_allowed() -> bool:
    if shutil.which("py-spy") is None:
        return False
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
    try:
        time.sleep(0.3)
        return subprocess.run(["py-spy", "dump", "--pid", str(child.pid)], capture_output=True,
                              timeout=20).returncode == 0
    finally:
        child.kill()


@pytest.mark.slow
def test_flamegraph_script_writes_one_svg_per_rank(tmp_path):
    if not ptrace_allowed():
        pytest.skip("py-spy missing or ptrace not permitted here (needs CAP_SYS_PTRACE)")
    out = tmp_path / "fg"
    cmd = ["bash", "scripts/flamegraph.sh", "--duration", "4", "--out", str(out), "--",
           sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "colocate.train",
           "--config", "configs/cpu-tiny.yaml", "--learner.num_steps=150", f"--metrics.run_dir={tmp_path / 'run'}",
           f"--model.cache_dir={tmp_path / 'cache'}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for rank in (0, 1):
        svg = out / f"rank{rank}.svg"
        assert svg.exists() and svg.stat().st_size > 1000
        assert "<svg" in svg.read_text()[:2000]


def _run_with_fault(tmp_path, fault, *args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "colocate.train",
           "--config", "configs/cpu-tiny.yaml", f"--metrics.run_dir={tmp_path / 'run'}",
           f"--model.cache_dir={tmp_path / 'cache'}", "--metrics.nvml_interval_s=0", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLOCATE_FAULT": fault})


@pytest.mark.slow
def test_nonfinite_loss_skips_the_update_then_stops_after_k(tmp_path):
    # NaN from step 2 on, limit 3: steps 2, 3, 4 are skipped and alerted, then the run stops.
    proc = _run_with_fault(tmp_path, "nan:from=2", "--learner.num_steps=10", "--metrics.max_nonfinite_steps=3",
                           "--topology.timeout_s=30")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count("ALERT nonfinite_loss") == 3, out[-3000:]
    assert "3 non-finite losses in a row" in out
    tags = read_scalar_tags(str(tmp_path / "run" / "tb" / "learner"))
    assert "alerts/nonfinite_loss" in tags and "learner/mfu" in tags
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "run" / "tb" / "learner"))
    acc.Reload()
    skipped = {e.step: e.value for e in acc.Scalars("learner/skipped_update")}
    assert skipped[0] == skipped[1] == 0.0 and skipped[2] == skipped[3] == 1.0, skipped


def test_kernel_summary_counts_overlapping_streams_once_and_sorts_families():
    from benchmarks.common import kernel_family, kernel_summary
    kernels = [("sm90_xmma_gemm_bf16bf16_bf16f32", 0.0, 10.0),          # compute stream
               ("ncclDevKernel_AllGather_RING_LL", 5.0, 20.0),           # overlaps it on another stream
               ("pytorch_flash::flash_fwd_kernel", 30.0, 35.0),
               ("triton_poi_fused_add_mul_0", 40.0, 42.0),
               ("_grpo_rows_kernel", 50.0, 55.0),
               ("void at::native::vectorized_elementwise_kernel", 60.0, 61.0)]
    s = kernel_summary(kernels, wall_us=100.0, top=3)
    assert s["gpu_busy_ms"] == pytest.approx((20 + 5 + 2 + 5 + 1) / 1e3)  # [0, 20) once, not 10 + 15
    assert s["gpu_idle_fraction"] == pytest.approx(1 - 33 / 100)
    assert s["family_ms"] == pytest.approx({"nccl": 0.015, "gemm": 0.010, "attention": 0.005, "grpo_loss": 0.005,
                                            "inductor_triton": 0.002, "other": 0.001})
    assert list(s["family_ms"])[:2] == ["nccl", "gemm"]
    assert [n for n, _ in s["top_kernels_ms"]] == ["ncclDevKernel_AllGather_RING_LL", "sm90_xmma_gemm_bf16bf16_bf16f32",
                                                   "pytorch_flash::flash_fwd_kernel"]
    assert kernel_family("nvjet_hsh_256x128_2cta") == "gemm"
    # idle gaps between the union's intervals, longest first, named by the kernels around them:
    # [20, 30) after the all-gather (it ended last), [35, 40), [42, 50), [55, 60)
    assert s["longest_gaps_ms"] == [[pytest.approx(0.010), "ncclDevKernel_AllGather_RING_LL",
                                     "pytorch_flash::flash_fwd_kernel"],
                                    [pytest.approx(0.008), "triton_poi_fused_add_mul_0", "_grpo_rows_kernel"],
                                    [pytest.approx(0.005), "pytorch_flash::flash_fwd_kernel", "triton_poi_fused_add_mul_0"]]
    assert s["gaps_over_100us"] == {"count": 0, "ms": 0.0}  # all shorter than 0.1 ms
    wide = kernel_summary([("a", 0.0, 1.0), ("b", 301.0, 302.0), ("c", 352.0, 353.0)], wall_us=400.0)
    assert wide["gaps_over_100us"] == {"count": 1, "ms": pytest.approx(0.3)}
    # a short kernel nested in a long one (another stream): the gap after them follows the long one
    nested = kernel_summary([("long", 0.0, 50.0), ("short", 10.0, 20.0), ("next", 60.0, 61.0)], wall_us=61.0)
    assert nested["longest_gaps_ms"] == [[pytest.approx(0.010), "long", "next"]]
    assert kernel_summary([], wall_us=50.0)["gpu_idle_fraction"] == 1.0


@pytest.mark.slow
def test_trainer_profile_traces_a_variant_step(tmp_path):
    """The trainer benchmark's --trace-variant (one more profiled step, its summary and Chrome trace),
    and its gathered (learner.reshard_after_forward=false) variant."""
    import gzip
    out = tmp_path / "trainer.json"
    cmd = [sys.executable, "scripts/benchmark.py", "--profile", "trainer", "--quick", "--budgets", "256",
           "--sdpa-budget", "0", "--ac-budget", "0", "--gathered-budget", "256",
           "--trace-variant", " packed-256,nope", "--trace-host",
           "--trace-dir", str(tmp_path), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    # Its correctness (two ranks equal one) is tests/test_fsdp_cpu.py's; here: it runs and is reported.
    assert record["figures"]["gathered-256_tokens_per_s"] > 0
    assert [v["name"] for v in record["variants"]] == ["padded", "packed-256", "gathered-256"]
    assert "trace nope: no variant of that name ran" in record["skipped"]
    trace = record["traces"]["packed-256"]
    assert trace["wall_ms"] > 0 and trace["median_step_ms"] > 0
    assert trace["num_kernels"] == 0 and trace["gpu_idle_fraction"] == 1.0  # CPU: no GPU kernels to count
    assert trace["host_gaps"] == [] and trace["gc"]["count"] >= 0  # no GPU gaps; GC pauses counted
    with gzip.open(tmp_path / "trace-packed-256-rank0.json.gz", "rt") as f:
        assert "traceEvents" in json.load(f)


def test_gap_host_context_names_what_the_host_did_in_the_longest_gaps():
    from benchmarks.common import gap_host_context, idle_gaps
    kernels = [("a", 0.0, 10.0), ("b", 5.0, 20.0), ("c", 120.0, 130.0), ("d", 135.0, 140.0)]
    busy, gaps = idle_gaps(kernels)
    assert busy == 35.0 and [(s, e) for s, e, _, _ in gaps] == [(20.0, 120.0), (130.0, 135.0)]
    host = [("learner/pack", 15.0, 125.0), ("aten::cat", 30.0, 50.0), ("gc gen 2", 60.0, 110.0),
            ("later", 200.0, 210.0)]
    ctx = gap_host_context(kernels, host, gaps=1)
    assert len(ctx) == 1 and ctx[0]["gap_ms"] == pytest.approx(0.1)
    assert (ctx[0]["after"], ctx[0]["before"]) == ("b", "c")
    assert [h[0] for h in ctx[0]["host"]] == ["learner/pack", "gc gen 2", "aten::cat"]  # by gap covered
    assert ctx[0]["host"][0][1:] == [pytest.approx(0.1), pytest.approx(0.11)]


def test_profiler_gpu_work_leaves_out_annotation_spans():
    from types import SimpleNamespace as NS
    from torch.autograd import DeviceType
    from benchmarks.common import profiler_gpu_work

    def ev(name, start, end, device, annotation=False):
        return NS(name=name, time_range=NS(start=start, end=end), device_type=device, is_user_annotation=annotation)
    events = [ev("aten::mm", 0, 5, DeviceType.CPU), ev("nvjet_gemm", 2, 4, DeviceType.CUDA),
              ev("learner/micro_batch", 1, 90, DeviceType.CUDA, annotation=True),  # its GPU-side span
              ev("Memcpy HtoD", 50, 51, DeviceType.CUDA)]
    assert profiler_gpu_work(events) == [("nvjet_gemm", 2, 4), ("Memcpy HtoD", 50, 51)]


def test_gc_pauses_are_timed_and_annotated_in_a_profile():
    import gc
    from torch.profiler import ProfilerActivity, profile
    from benchmarks.common import GcPauses
    with profile(activities=[ProfilerActivity.CPU]) as prof, GcPauses() as pauses:
        gc.collect()
    assert pauses.summary()["count"] >= 1 and pauses.summary()["gen2"] >= 1
    assert any(e.name == "gc gen 2" for e in prof.events())
    seen = pauses.summary()["count"]
    gc.collect()  # after the context: not recorded
    assert pauses.summary()["count"] == seen


def test_summarize_trace_reads_the_gpu_events_of_a_chrome_trace(tmp_path):
    import gzip
    from benchmarks.common import summarize_trace
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},          # host side: ignored
              {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst_256x160", "ts": 100, "dur": 40},
              {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather", "ts": 120, "dur": 40},
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 190, "dur": 10},
              {"ph": "i", "cat": "kernel", "name": "instant", "ts": 150},                      # not a span
              {"ph": "X", "cat": "user_annotation", "name": "gpu_model_runner: forward", "ts": 0, "dur": 300},
              {"ph": "X", "cat": "user_annotation", "name": "gpu_model_runner: forward", "ts": 400, "dur": 200},
              {"ph": "X", "cat": "user_annotation", "name": "gpu_model_runner: sample", "ts": 700, "dur": 50},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 10, "dur": 20}]
    path = tmp_path / "trace.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = summarize_trace(str(path))
    assert s["num_kernels"] == 3
    assert s["wall_ms"] == pytest.approx(0.100)            # first GPU start (100) to last GPU end (200)
    assert s["gpu_busy_ms"] == pytest.approx(0.070)        # [100, 160) + [190, 200)
    assert s["family_ms"] == pytest.approx({"gemm": 0.04, "nccl": 0.04, "other": 0.01})
    # host side: per category, [name, count, summed ms], longest first; kernels and cpu ops not counted
    assert s["host"] == {"user_annotation": [["gpu_model_runner: forward", 2, pytest.approx(0.5)],
                                             ["gpu_model_runner: sample", 1, pytest.approx(0.05)]],
                         "cuda_runtime": [["cudaGraphLaunch", 1, pytest.approx(0.02)]]}
    host_only = tmp_path / "host.pt.trace.json"  # e.g. a vLLM inference role's own process: no GPU work
    host_only.write_text(json.dumps({"traceEvents": events[:1]}))
    s = summarize_trace(str(host_only))
    assert s["num_kernels"] == 0 and s["gpu_idle_fraction"] is None  # no span: neither busy nor idle


class _RecordingEngine:
    can_profile = True

    def __init__(self):
        self.calls = []

    def start_profile(self):
        self.calls.append("start")

    def stop_profile(self):
        self.calls.append("stop")


@pytest.mark.filterwarnings("ignore:Profiler won't be using warmup")
def test_engine_profile_window_follows_the_role_profilers_schedule(tiny_cfg):
    import dataclasses
    from colocate.metrics import EngineProfileWindow, Profilers, engine_profile_dir
    m = dataclasses.replace(tiny_cfg.metrics, profile=True, profile_wait=1, profile_warmup=1, profile_active=2)
    engine = _RecordingEngine()
    window = EngineProfileWindow(m, engine)
    seen = []
    for _ in range(6):  # the role profiler records steps 3 and 4 (1 wait, 1 warm-up, 2 active)
        seen.append(list(engine.calls))
        window.step()
    assert seen == [[], [], ["start"], ["start"], ["start", "stop"], ["start", "stop"]]
    window.stop()
    assert engine.calls == ["start", "stop"]  # stopped once
    early = _RecordingEngine()
    Profilers(EngineProfileWindow(m, early)).stop()  # the run ends before the window
    assert early.calls == []
    m0 = dataclasses.replace(m, profile_wait=0, profile_warmup=0, profile_active=1)
    at_once = _RecordingEngine()
    w = EngineProfileWindow(m0, at_once)
    assert at_once.calls == ["start"]  # the first batch is recorded
    w.stop()
    assert at_once.calls == ["start", "stop"]
    off = _RecordingEngine()
    off.can_profile = False  # e.g. vLLM built without a profile_dir, or the HF engine
    w = EngineProfileWindow(m, off)
    for _ in range(5):
        w.step()
    assert off.calls == []
    from torch.profiler import ProfilerAction, schedule
    for wait, warmup, active in [(1, 1, 2), (0, 0, 1), (0, 2, 3), (3, 0, 1), (2, 1, 1)]:
        cfg = dataclasses.replace(m, profile_wait=wait, profile_warmup=warmup, profile_active=active)
        role = schedule(wait=wait, warmup=warmup, active=active, repeat=1)
        recorded = [i for i in range(8) if role(i) in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)]
        eng = _RecordingEngine()
        w = EngineProfileWindow(cfg, eng)
        running = []
        for i in range(8):  # step i runs between the i-th and the (i+1)-th call of step()
            if eng.calls.count("start") > eng.calls.count("stop"):
                running.append(i)
            w.step()
        assert running == recorded, (wait, warmup, active)
    assert engine_profile_dir(m).endswith(os.path.join(os.path.basename(os.path.normpath(m.run_dir)),
                                                       "inference-engine"))
    assert os.path.isabs(engine_profile_dir(m))
    assert engine_profile_dir(dataclasses.replace(m, profile_engine_steps=0)) == ""
    assert engine_profile_dir(dataclasses.replace(m, profile=False)) == ""


def _feed(monitor, rewards, entropies=None, grads=None):
    """Steps 1.. of synthetic series -> {step: [alert names]} of the steps where alerts started."""
    out = {}
    for i, reward in enumerate(rewards):
        e = entropies[i] if entropies else 1.0
        g = grads[i] if grads else 1.0
        names = [name for name, _ in monitor.update(i + 1, reward, e, g)]
        if names:
            out[i + 1] = names
    return out


def test_reward_drop_alert_fires_once_at_the_window_that_falls_below_the_best():
    """Window 10, fraction 0.5: reward 1 for 100 steps, then 0 from step 101. The window mean is
    (10 - k) / 10 after k bad steps: below 0.5 first at k = 6 (k = 5 gives 0.5, not below; exact
    in binary), so the alert starts at step 106, once; good_step is a window before the last
    healthy step."""
    m = CollapseMonitor(MetricsConfig(alert_window=10, reward_drop_alert=0.5, grad_norm_alert=0))
    fired = _feed(m, [1.0] * 100 + [0.0] * 30)
    assert fired == {106: ["reward_drop"]}
    assert m.healthy_step == 105 and m.good_step == 95
    # the reward coming back re-arms it; a second fall alerts again
    fired = _feed(m, [1.0] * 20 + [0.0] * 10)
    assert list(fired.values()) == [["reward_drop"]]


def test_reward_noise_and_a_slow_climb_raise_no_alert():
    """A learning curve (0.1 -> 0.95) with +-0.1 alternating noise never falls below half its best window."""
    m = CollapseMonitor(MetricsConfig(alert_window=10, reward_drop_alert=0.5))
    rewards = [min(0.95, 0.1 + 0.01 * i) + (0.1 if i % 2 else -0.1) for i in range(300)]
    assert _feed(m, rewards) == {}


def test_entropy_collapse_compares_a_window_with_the_one_before():
    """Window 5, fraction 0.25: a slow halving per window is no collapse; a fall from 1.0 to 0.1
    is. The windows compare once 2 x 5 steps exist: the mean of the last 5 first goes below
    0.25 x the 5 before when 3 of the 5 are 0.1 (0.46 < 0.25 x 1.0 is false; 4 of 5: 0.28 > 0.25;
    all 5: 0.1 < 0.25) -> the alert starts at the 5th low step."""
    slow = [0.5 ** (i / 5) for i in range(40)]
    assert _feed(CollapseMonitor(MetricsConfig(alert_window=5, entropy_alert=0.25, reward_drop_alert=0,
                                               grad_norm_alert=0)), [0.5] * 40, slow) == {}
    m = CollapseMonitor(MetricsConfig(alert_window=5, entropy_alert=0.25, reward_drop_alert=0, grad_norm_alert=0))
    assert _feed(m, [0.5] * 30, [1.0] * 20 + [0.1] * 10) == {25: ["entropy_collapse"]}


def test_grad_norm_spike_is_against_the_median_of_the_previous_window():
    """Window 5, factor 10: norms around 1 (one outlier of 5 inside the window does not move the
    median), a 12 at step 10 alerts, an 8 does not; two spikes in a row alert once."""
    m = CollapseMonitor(MetricsConfig(alert_window=5, grad_norm_alert=10, reward_drop_alert=0))
    grads = [1.0, 1.1, 0.9, 1.0, 1.2, 8.0, 1.0, 0.9, 1.0, 12.0, 13.0, 1.0]
    assert _feed(m, [0.5] * len(grads), None, grads) == {10: ["grad_norm_spike"]}


@pytest.mark.slow
def test_stop_on_collapse_exits_3_with_a_checkpoint_from_before_the_drop(tmp_path):
    """cpu-tiny learns (reward ~0.9 by step 60), then its advantages flip sign from step 80
    (`COLOCATE_FAULT=flip:from=80`): the reward falls, ALERT reward_drop fires, the run writes a
    checkpoint, names the newest one from before the flip in last_good.json (kept although
    checkpoint.keep=1), and `colocate train` exits 3."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "colocate.cli", "train", "--config", "configs/cpu-tiny.yaml", "--nproc", "2",
           "--learner.num_steps=200", f"--metrics.run_dir={run}", f"--model.cache_dir={tmp_path / 'cache'}",
           "--metrics.nvml_interval_s=0", "--metrics.stop_on_collapse=true", "--metrics.alert_window=10",
           "--metrics.reward_drop_alert=0.2", "--learner.scale_lr_by_signal=false",  # this test's own settings
           "--checkpoint.enabled=true", "--checkpoint.every=10", "--checkpoint.keep=1"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLOCATE_FAULT": "flip:from=80"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-4000:]
    assert out.count("ALERT reward_drop") == 1, out[-4000:]
    with open(run / "summary.json") as f:
        collapse = json.load(f)["collapse_step"]
    with open(run / "checkpoints" / "last_good.json") as f:
        good = json.load(f)
    assert 80 < collapse < 200 and good["collapse_step"] == collapse
    assert good["step"] is not None and good["step"] <= 80 and os.path.isdir(good["path"])
    names = sorted(os.listdir(run / "checkpoints"))
    assert f"step-{collapse:06d}" in names and os.path.basename(good["path"]) in names
    assert "alerts/reward_drop" in read_scalar_tags(str(run / "tb" / "learner"))


def test_soak_figures_hold_the_target_only_if_every_later_window_does():
    """benchmarks/soak.py: 100-step windows 0.5, 1, 0.9375, 0.875 (sums exact in binary) -> the target
    0.9 is first reached by the window ending at step 200, and the one at 400 falls below it."""
    from benchmarks.soak import reward_figures
    rewards = [0.5] * 100 + [1.0] * 100 + [0.9375] * 100 + [0.875] * 100
    f = reward_figures(rewards, 0.9)
    assert f["first_window_at_target"] == 200 and f["min_window_after_target"] == 0.875 and not f["held_target"]
    assert reward_figures(rewards[:300], 0.9)["held_target"]


def test_soak_curves_draw_one_line_per_run_through_its_window_means():
    """The soak's SVG: axes, the dashed target, then one polyline per run whose vertices are its
    100-step window means (x = the window's last step, y = reward, on a 560 x 240 plot area)."""
    import xml.etree.ElementTree as ET
    from benchmarks.soak import curves_svg
    runs = [{"name": "a", "seed": 0, "rewards": [0.5] * 100 + [1.0] * 100},
            {"name": "b", "seed": 1, "rewards": [0.0] * 100 + [0.25] * 100}]
    lines = ET.fromstring(curves_svg(runs)).findall("{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == 3 + len(runs)
    assert lines[3].get("points") == "320.0,160.0 600.0,40.0"  # (100, 0.5) and (200, 1.0)
    assert lines[4].get("points") == "320.0,280.0 600.0,220.0"


def test_soak_variants_parse_and_duplicate_names_are_refused():
    """Each variant names its run directories ({name}-seed{seed}): two of one name would share them."""
    import argparse
    from benchmarks.soak import add_args, parse_variant, run
    assert parse_variant("wd:learner.weight_decay=0.5,loss.beta=0") == ("wd", ["learner.weight_decay=0.5",
                                                                              "loss.beta=0"])
    for bad in ("wd", ":learner.lr=1", "wd:"):
        with pytest.raises(SystemExit, match="expected NAME:section.key=value"):
            parse_variant(bad)
    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(["--variant", "a:learner.lr=1", "--variant", "a:learner.lr=2"])
    with pytest.raises(SystemExit, match="variant names must be unique"):
        run(args)


FORK_PROBE = """
import os, sys
sys.path.insert(0, {repo!r})
from colocate.metrics import MetricsWriter, StallWatchdog, SystemSampler
writer = MetricsWriter("unused", "learner", enabled=False)
threads = [SystemSampler(writer, 0.01, None), StallWatchdog(writer, 60.0, "x")]
for t in threads:
    t.start()
pid = os.fork()  # as a reward function using multiprocessing with fork does inside a rank
if pid == 0:
    os._exit(0)
_, status = os.waitpid(pid, 0)
for t in threads:
    t.stop()
    t.join(5)
print("child", os.waitstatus_to_exitcode(status), "alive", [t.is_alive() for t in threads], flush=True)
"""


def test_a_fork_beside_the_monitor_threads_is_silent():
    """The child of a fork stops every inherited thread by calling its `Thread._stop`: a monitor
    thread must not shadow it (a `TypeError` traceback per fork), and stop() still stops it."""
    import subprocess
    import sys

    from tests.conftest import REPO
    proc = subprocess.run([sys.executable, "-c", FORK_PROBE.format(repo=REPO)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout == "child 0 alive [False, False]\n", proc
    assert proc.stderr == "", proc.stderr
