"""The e2e profile's steady-state figures, from synthetic role timelines with known answers."""
import os

import pytest

from benchmarks.e2e import steady_state
from colocate.learner.step_report import TimelineRow


def named(rows: list[list[float]]) -> list[dict]:
    """Timeline rows as `summary.json` holds them."""
    return [TimelineRow(*row).to_json() for row in rows]


def learner_rows(step_s: float, train_s: float, steps: int, lag: float = 1.0):
    """Steps of `step_s` seconds, each waiting first and training its last `train_s` seconds; the
    adapter gather takes 20 ms and the send 10 ms."""
    return [[i * step_s, (i + 1) * step_s - train_s, (i + 1) * step_s, (i + 1) * step_s, lag, 0.02, 0.01]
            for i in range(steps)]


def test_steady_state_leaves_out_warmup_and_measures_busy_fractions():
    rows = learner_rows(10.0, 9.0, 6)
    rows[0] = [0.0, 50.0, 59.0, 60.0, 0.0, 0.02, 0.01]  # a long first step (engine warm-up): must not count
    for i in range(1, 6):
        rows[i] = [x + 50.0 if j < 4 else x for j, x in enumerate(rows[i])]
    # one inference rank collecting 6 s of every 10 s step after warm-up, 600 tokens a batch
    inference = [{"batches": [{"collect_start": 60.0 + 10 * i, "collect_end": 66.0 + 10 * i, "out_tokens": 600.0,
                               "phases": 10.0 + i, "wait_version_s": 0.5} for i in range(5)],
                  "gpu_util": [[60.0 + t, 50.0] for t in range(40)] + [[0.0, 100.0]]}]
    summary = {"timeline": named(rows), "gpu_util": [[70.0 + t, 90.0] for t in range(30)] + [[1.0, 0.0]]}
    out = steady_state(summary, inference, warmup=2)
    # window: end of step 1 (70 s) -> end of step 5 (110 s), 4 measured steps
    assert out["measured_steps"] == 4
    assert out["seconds_per_step"] == pytest.approx(10.0)
    assert out["steps_per_hour"] == pytest.approx(360.0)
    assert out["learner_busy_fraction"] == pytest.approx(0.9)
    assert out["learner_wait_s_mean"] == pytest.approx(1.0)
    assert out["inference_busy_fraction"] == pytest.approx(0.6)  # collects 70-76, 80-86, 90-96, 100-106
    rates = (out["rollout_out_tokens_per_s_per_engine"], out["rollout_out_tokens_per_s_all_engines"])
    assert rates == pytest.approx((4 * 600 / 40, 4 * 600 / 40))  # one engine: its rate is the whole
    two = steady_state(summary, inference * 2, warmup=2)  # two engines (on one GPU or two): their rates add
    assert two["rollout_out_tokens_per_s_all_engines"] == pytest.approx(2 * two["rollout_out_tokens_per_s_per_engine"])
    assert out["learner_nvml_busy"] == pytest.approx(0.9)      # the sample at t=1 is outside the window
    assert out["inference_nvml_busy"] == pytest.approx(0.5)
    assert out["policy_lag_mean"] == pytest.approx(1.0)
    assert out["adapter_gather_ms_mean"] == pytest.approx(20.0)
    assert out["adapter_send_ms_mean"] == pytest.approx(10.0)
    assert out["rollout_phases"] == pytest.approx((11 + 12 + 13 + 14) / 4)  # batch 0 (60-66 s) is warm-up
    assert out["rollout_wait_version_s"] == pytest.approx(0.5)
    assert "rollout_step_ms" not in out  # these batches count no engine steps
    # steady: the same queue at 70 s and 110 s (-1: this timeline has no batch record for step 0)
    assert out["queue_batches_start"] == pytest.approx(-1.0) and out["queue_batches_end"] == pytest.approx(-1.0)


def test_queue_figures_show_a_drained_backlog():
    """Inference ran 3 batches ahead during warm-up (lag 2 style), then the learner, faster than a
    batch, drains them: the queue falls over the window, so its seconds per step are not steady."""
    rows = learner_rows(5.0, 4.5, 8)                          # steps end at 5, 10, ..., 40 s
    batches = [{"collect_start": 0.0, "collect_end": 2.0 * (i + 1), "out_tokens": 1.0} for i in range(6)]
    batches += [{"collect_start": 12.0 + 8 * i, "collect_end": 20.0 + 8 * i, "out_tokens": 1.0} for i in range(3)]
    out = steady_state({"timeline": named(rows)}, [{"batches": batches}], warmup=2)
    # at 10 s: 5 batches done, 2 steps -> 3 queued; at 40 s: 6 + 3 = 9 done (20, 28, 36), 8 steps -> 1
    assert out["queue_batches_start"] == pytest.approx(3.0)
    assert out["queue_batches_end"] == pytest.approx(1.0)


def test_engine_step_figures_are_totals_over_the_window_batches():
    """Collect time and answer tokens per engine step over the batches inside the window: sums over
    sums (a 6 s batch of 300 steps and a 4 s batch of 100 are 25 ms a step, not the mean 26.7)."""
    rows = learner_rows(10.0, 9.0, 4)
    batches = [{"collect_start": 1.0, "collect_end": 9.0, "collect_s": 8.0, "steps": 50.0, "out_tokens": 1.0},  # warm-up
               {"collect_start": 21.0, "collect_end": 27.0, "collect_s": 6.0, "steps": 300.0, "out_tokens": 600.0},
               {"collect_start": 31.0, "collect_end": 35.0, "collect_s": 4.0, "steps": 100.0, "out_tokens": 1000.0}]
    out = steady_state({"timeline": named(rows)}, [{"batches": batches}], warmup=2)
    assert out["rollout_step_ms"] == pytest.approx(1e3 * 10.0 / 400)
    assert out["rollout_tokens_per_step"] == pytest.approx(1600 / 400)


def test_steady_state_needs_more_steps_than_warmup():
    with pytest.raises(ValueError, match="warmup"):
        steady_state({"timeline": named(learner_rows(1.0, 0.5, 2))}, [], warmup=2)


def test_job_settings_with_variants():
    from benchmarks.e2e import job_settings, parse_variants
    variants = parse_variants(["nocheck:engine.validate_grammars=false",
                               "os4:rollout.oversample_groups=4, learner.max_policy_lag=2"])
    assert variants == {"nocheck": ["engine.validate_grammars=false"],
                        "os4": ["rollout.oversample_groups=4", "learner.max_policy_lag=2"]}
    assert job_settings("sync", 1) == (0, ["rollout.oversample_groups=0"])
    assert job_settings("async", None) == (None, [])  # the config's lag
    lag, extra = job_settings("async-stream+nocheck+os4", 1, ["engine.max_num_batched_tokens=1024"], variants)
    # the variant's settings come after the stream settings, so they win on the command line
    assert lag == 1 and extra == ["rollout.stream=true", "engine.max_num_batched_tokens=1024",
                                  "engine.validate_grammars=false", "rollout.oversample_groups=4",
                                  "learner.max_policy_lag=2"]
    for bad_job in ("async-stream+missing", "fast", "async-fast"):
        with pytest.raises(SystemExit):
            job_settings(bad_job, 1, [], variants)
    for bad_spec in ("nocolon", "name:", "name:novalue"):
        with pytest.raises(SystemExit):
            parse_variants([bad_spec])


def test_repeated_jobs_get_their_own_keys():
    from benchmarks.e2e import job_keys
    assert job_keys("async-stream, async-stream+os8,async-stream+os8,async-stream,") == [
        ("async-stream", "async-stream"), ("async-stream+os8", "async-stream+os8"),
        ("async-stream+os8#2", "async-stream+os8"), ("async-stream#2", "async-stream")]


def test_a_baseline_tree_job_has_the_settings_of_the_same_job():
    from benchmarks.e2e import job_keys, job_settings
    assert job_settings("async@base", 2) == job_settings("async", 2)
    assert job_settings("sync-stream@base", None) == job_settings("sync-stream", None)
    assert job_keys("async,async@base,async@base") == [("async", "async"), ("async@base", "async@base"),
                                                       ("async@base#2", "async@base")]


def test_a_failed_job_is_recorded_and_the_others_still_run(monkeypatch, tmp_path):
    """A job whose run fails (a lever that crashes on this machine) leaves its error in the record;
    the next jobs run, and the figures come from the first async job that finished."""
    import argparse

    import benchmarks.e2e as e2e
    parser = argparse.ArgumentParser()
    e2e.add_args(parser)
    args = parser.parse_args(["--order", "async+bad,async,async+good", "--variant", "bad:x.y=1", "good:x.y=2",
                              "--partial", str(tmp_path / "partial.json")])
    ran = []

    def run_job(args, lag, run_dir, extra, tree):
        ran.append(extra)
        if extra == ["x.y=1"]:
            raise RuntimeError("e2e run (lag None) failed, log x.log:\nCUDA error")
        return {"steps_per_hour": 100.0 if not extra else 120.0}

    monkeypatch.setattr(e2e, "run_job", run_job)
    monkeypatch.setattr(e2e.tempfile, "mkdtemp", lambda prefix="": str(tmp_path))  # no run dirs left in /tmp
    record = e2e.run(args)
    assert ran == [["x.y=1"], [], ["x.y=2"]]
    assert record["failed"]["async+bad"]["error"].endswith("CUDA error")
    assert list(record["runs"]) == ["async", "async+good"]
    assert record["figures"]["async_steps_per_hour"] == 100.0
    assert record["ratios"] == {"steps_per_hour_async+good_over_async": pytest.approx(1.2)}


def test_a_baseline_tree_job_keeps_the_callers_packages_importable(monkeypatch, tmp_path):
    from benchmarks.e2e import job_env
    monkeypatch.setenv("PYTHONPATH", "/opt/site")
    assert job_env(str(tmp_path))["PYTHONPATH"] == f"{tmp_path}:/opt/site"  # the tree's code first
    assert job_env("")["PYTHONPATH"] == "/opt/site"
    monkeypatch.delenv("PYTHONPATH")
    assert job_env(str(tmp_path))["PYTHONPATH"] == str(tmp_path)


def test_canary_figures_are_the_window_probes_of_each_side():
    """The learner's probe time from the timeline (canary_s, 0: the version was not scored) and the
    engines' from the batch records (canary_ms, only on a batch that read a probe), both past the
    warm-up steps; the ms never enter the per-batch rollout means."""
    rows = [row + [canary_s, device_ms] for row, canary_s, device_ms in
            zip(learner_rows(10.0, 9.0, 5), [0.9, 0.5, 0.002, 0.0, 0.004], [0.0, 9.0, 2.0, 1.0, 0.0])]
    batches = [{"collect_start": 1.0 + 10 * i, "collect_end": 6.0 + 10 * i, "out_tokens": 1.0, "canary_ms": ms}
               for i, ms in enumerate([30.0, 20.0, 6.0, 2.0])]
    batches.append({"collect_start": 41.0, "collect_end": 46.0, "out_tokens": 1.0})  # no probe read
    out = steady_state({"timeline": named(rows)}, [{"batches": batches}], warmup=2)
    # window 20-50 s: steps 2-4 (learner probes at steps 2 and 4), batches from 21 s on
    assert out["canary_probes"] == 2 and out["canary_engine_probes"] == 2
    assert out["canary_learner_ms_mean"] == pytest.approx(3.0)
    assert out["canary_learner_ms_median"] == pytest.approx(3.0)
    assert out["canary_engine_ms_mean"] == pytest.approx(4.0)
    assert out["canary_engine_ms_median"] == pytest.approx(4.0)
    assert out["canary_learner_device_ms_mean"] == pytest.approx(1.5)  # steps 2 and 3 read one
    assert "rollout_canary_ms" not in out


def test_canary_figures_are_zero_counts_when_the_canary_is_off():
    batches = [{"collect_start": 21.0, "collect_end": 26.0, "out_tokens": 1.0}]
    out = steady_state({"timeline": named(learner_rows(10.0, 9.0, 4))}, [{"batches": batches}], warmup=2)
    assert out["canary_probes"] == 0 and out["canary_engine_probes"] == 0
    assert not [k for k in out if k.startswith("canary_") and k.endswith(("_mean", "_median"))]


def test_alternating_jobs_pair_up_in_order():
    """A,B,B,A,A,B: pairs (A1,B1), (B2,A2), (A3,B3), each A over B; mean, standard error, pooled."""
    from benchmarks.e2e import job_keys, paired_figures
    keyed = job_keys("on,off,off,on,on,off")
    times = dict(zip([key for key, _ in keyed], [1.1, 1.0, 1.2, 1.32, 1.0, 1.0]))
    runs = {key: {"seconds_per_step": t} for key, t in times.items()}
    out = paired_figures(runs, keyed)
    name = "seconds_per_step_on_over_off"
    assert out[f"{name}_pairs"] == [1.1, 1.1, 1.0]
    assert out[f"{name}_pair_mean"] == pytest.approx(3.2 / 3)
    # stdev of (1.1, 1.1, 1.0): sqrt(((1/30)^2 * 2 + (1/15)^2) / 2) = sqrt(1/300); over sqrt(3): 1/30
    assert out[f"{name}_pair_se"] == pytest.approx(1 / 30)
    assert out[f"{name}_pooled"] == pytest.approx((1.1 + 1.32 + 1.0) / (1.0 + 1.2 + 1.0))


def test_pairs_leave_out_a_failed_run_and_an_unpaired_last_one():
    from benchmarks.e2e import job_keys, paired_figures
    keyed = job_keys("on,off,off,on,on")
    runs = {"on": {"seconds_per_step": 1.2}, "off": {"seconds_per_step": 1.0}, "on#2": {"seconds_per_step": 2.0},
            "on#3": {"seconds_per_step": 3.0}}  # off#2 failed: its pair goes; on#3 has no pair
    out = paired_figures(runs, keyed)
    assert out["seconds_per_step_on_over_off_pairs"] == [1.2]
    assert out["seconds_per_step_on_over_off_pair_se"] is None
    assert out["seconds_per_step_on_over_off_pooled"] == pytest.approx(1.2)


@pytest.mark.parametrize("order", ["on,on,off,off", "on,off,other,on", "on,on", "on"])
def test_no_pairs_unless_two_jobs_alternate(order):
    from benchmarks.e2e import job_keys, paired_figures
    keyed = job_keys(order)
    assert paired_figures({key: {"seconds_per_step": 1.0} for key, _ in keyed}, keyed) == {}


def test_a_warm_job_runs_first_and_counts_nowhere(monkeypatch, tmp_path):
    """async+on@warm runs with async+on's settings, before the others, and is kept apart: the figures,
    ratios and pairs come from the counted jobs only."""
    import argparse

    import benchmarks.e2e as e2e
    parser = argparse.ArgumentParser()
    e2e.add_args(parser)
    args = parser.parse_args(["--order", "async+on@warm,async+on,async+off,async+off,async+on", "--variant",
                              "on:sync.canary_every=1", "off:sync.canary_every=0"])
    ran = []

    def run_job(args, lag, run_dir, extra, tree):
        ran.append((os.path.basename(run_dir), extra))
        return {"seconds_per_step": 9.0 if "warm" in os.path.basename(run_dir) else 1.1 if extra == ["sync.canary_every=1"] else 1.0,
                "step_s_even_mean": 1.0, "step_s_parity_gap_frac": 0.01, "step_s_parity_gap_frac_se": 0.005}

    monkeypatch.setattr(e2e, "run_job", run_job)
    monkeypatch.setattr(e2e.tempfile, "mkdtemp", lambda prefix="": str(tmp_path))  # no run dirs left in /tmp
    record = e2e.run(args)
    assert ran[0] == ("async_on@warm", ["sync.canary_every=1"]) and len(ran) == 5
    assert list(record["warm"]) == ["async+on@warm"]
    assert list(record["runs"]) == ["async+on", "async+off", "async+off#2", "async+on#2"]
    assert record["figures"]["async+on_seconds_per_step"] == 1.1
    assert record["figures"]["seconds_per_step_async+on_over_async+off_pairs"] == [1.1, 1.1]
    # every counted job's parity gap, as the pairs; the other figures only from the first job
    parity = [k for k in record["figures"] if "_step_s_" in k]
    assert sorted(parity) == sorted([f"{job}_step_s_parity_gap_frac{se}" for job in record["runs"] for se in ("", "_se")]
                                    + ["async+on_step_s_even_mean"])


def rows_from_seconds(seconds: list[float]) -> list[list[float]]:
    """Timeline rows of steps lasting `seconds`, back to back from t=0."""
    ends = [sum(seconds[:i + 1]) for i in range(len(seconds))]
    return [[end - s, end - s / 2, end - s / 10, end, 1.0, 0.02, 0.01] for s, end in zip(seconds, ends)]


@pytest.mark.parametrize("cost", [0.05, 0.0])
def test_a_cost_on_even_steps_is_their_parity_gap(cost):
    """Steps of 1 s, each parity's noise +-0.02 s in turn (mean 0, known variance), `cost` more on the
    steps that send an even version (timeline row s sends s + 1); two 30 s warm-up steps left out.
    even - odd is the cost exactly; Welch's SE from the noise: each parity's sample variance
    0.02^2 n/(n-1), so SE^2 = 2 * 0.02^2 / (n-1); the fraction is both over the mean step 1 + cost/2.
    The control (no cost) gives 0 with the same SE."""
    n = 12  # measured steps of each parity
    noise = [0.02 if (i // 2) % 2 == 0 else -0.02 for i in range(2 * n)]  # steps 2,3 +; 4,5 -; ...
    seconds = [30.0, 30.0] + [1.0 + (cost if i % 2 == 1 else 0.0) + e for i, e in enumerate(noise)]  # rows 3, 5, ...
    out = steady_state({"timeline": named(rows_from_seconds(seconds))}, [], warmup=2)
    assert out["step_s_even_n"] == n and out["step_s_odd_n"] == n
    assert out["step_s_even_mean"] == pytest.approx(1.0 + cost)
    assert out["step_s_odd_mean"] == pytest.approx(1.0)
    assert out["step_s_even_minus_odd"] == pytest.approx(cost, abs=1e-12)
    se = (2 * 0.02 ** 2 / (n - 1)) ** 0.5
    assert out["step_s_even_minus_odd_se"] == pytest.approx(se)
    assert out["seconds_per_step"] == pytest.approx(1.0 + cost / 2)  # the parities' mean is the step's
    assert out["step_s_parity_gap_frac"] == pytest.approx(cost / (1.0 + cost / 2), abs=1e-12)
    assert out["step_s_parity_gap_frac_se"] == pytest.approx(se / (1.0 + cost / 2))


def test_steps_whose_forward_carried_the_probe_are_keyed_by_the_version_they_started_from():
    """Without LoRA dropout the probe rides a step's first forward (`canary_rode`): row s probes version
    s, the one it starts from, so with `sync.canary_every=2` the rows that rode are the even rows; a
    cost on them is the even parity's."""
    n, cost = 12, 0.05
    seconds = [30.0, 30.0] + [1.0 + (cost if i % 2 == 0 else 0.0) for i in range(2 * n)]  # rows 2, 4, ...
    rows = [row + [0.0, 0.0, s % 2 == 0] for s, row in enumerate(rows_from_seconds(seconds))]
    out = steady_state({"timeline": named(rows)}, [], warmup=2)
    assert out["step_s_even_minus_odd"] == pytest.approx(cost, abs=1e-12) and out["canary_probes"] == n
    # rows_from_seconds trains from a step's middle to its last tenth, 0.4 of its length: a cost c in
    # the step is 0.4 c in its train time, on the same parity
    assert out["train_s_even_minus_odd"] == pytest.approx(0.4 * cost, abs=1e-12)


def test_batch_parity_is_by_the_version_that_sampled_the_batch():
    """Window batches keyed by their record's version (even: probed): 2 s of collect plus 0.1 s on even
    versions, 100 engine steps each; a warm-up batch outside the window and a record without a version
    (a baseline tree's) count nowhere; the version is no rollout mean."""
    rows = learner_rows(10.0, 9.0, 10)  # window: 20 s -> 100 s
    batches = [{"collect_start": 1.0, "collect_end": 9.0, "collect_s": 8.0, "steps": 100.0, "version": 0}]
    for v in range(8):  # versions 0..7, one batch each inside the window
        collect = 2.0 + (0.1 if v % 2 == 0 else 0.0) + (0.01 if v % 4 < 2 else -0.01)
        batches.append({"collect_start": 21.0 + 10 * v, "collect_end": 21.0 + 10 * v + collect,
                        "collect_s": collect, "steps": 100.0, "version": v})
    batches.append({"collect_start": 95.0, "collect_end": 96.0, "collect_s": 1.0, "steps": 100.0})
    for b in batches:
        b["out_tokens"] = 1.0
    out = steady_state({"timeline": named(rows)}, [{"batches": batches}], warmup=2)
    assert out["rollout_collect_s_even_n"] == 4 and out["rollout_collect_s_odd_n"] == 4
    assert out["rollout_collect_s_even_minus_odd"] == pytest.approx(0.1)
    # each parity: +-0.01 twice each, sample variance 0.01^2 * 4/3
    assert out["rollout_collect_s_even_minus_odd_se"] == pytest.approx((2 * 0.01 ** 2 * 4 / 3 / 4) ** 0.5)
    assert out["rollout_collect_s_parity_gap_frac"] == pytest.approx(0.1 / 2.05)
    assert out["rollout_step_ms_even_minus_odd"] == pytest.approx(1.0)  # 0.1 s over 100 engine steps
    assert out["rollout_step_ms_parity_gap_frac"] == pytest.approx(0.1 / 2.05)
    assert "rollout_version" not in out


def test_no_parity_figures_without_two_values_of_each_parity():
    out = steady_state({"timeline": named(learner_rows(1.0, 0.5, 5))}, [], warmup=2)  # steps 2, 3, 4
    assert not [k for k in out if "_even_" in k or "_parity_" in k]


def test_a_job_runs_as_many_processes_as_its_config_unless_nproc_is_given():
    """Without --nproc a job is `colocate train` without it: the config's own inference + learner
    ranks, so a variant that sets topology.num_inference=2 on a one-GPU preset runs 3 processes;
    the variant's overrides come after --set's."""
    from types import SimpleNamespace

    from benchmarks import e2e
    args = SimpleNamespace(nproc=0, config="configs/gpu-1-gsm8k.yaml", steps=10, set=["eval.every=0"])
    cmd = e2e.job_command(args, None, "/tmp/run", ["topology.num_inference=2"])
    assert not any(c.startswith("--nproc") for c in cmd) and "--learner.max_policy_lag" not in " ".join(cmd)
    assert cmd[-2:] == ["--eval.every=0", "--topology.num_inference=2"] and "--metrics.run_dir=/tmp/run" in cmd
    cmd = e2e.job_command(SimpleNamespace(**{**vars(args), "nproc": 2}), 2, "/tmp/run")
    assert "--nproc=2" in cmd and "--learner.max_policy_lag=2" in cmd
