"""The probe benchmark (benchmarks/probe.py) on the CPU: every variant it can build on cpu-tiny runs,
its record holds host figures only (no CUDA events, no cotenant), and every variant scores the
probe as the run's learner does."""
import argparse
import json
import os

from benchmarks import probe
from tests.conftest import REPO


def test_probe_profile_times_each_variant_and_scores_the_probe_alike(tiny_cfg, tiny_tokenizer, tmp_path):
    parser = argparse.ArgumentParser()
    probe.add_args(parser)
    # prefix trees on, so the flat variant is a build of its own; cpu-tiny has compile off: no_compile is as_run
    args = parser.parse_args(["--config", os.path.join(REPO, "configs", "cpu-tiny.yaml"), "--iters", "2",
                              "--warmup", "1", "--train-steps", "2",
                              "--set", f"model.cache_dir={tiny_cfg.model.cache_dir}", "model.compile_cache_dir=",
                              "learner.prefix_sharing=tree", "--partial", str(tmp_path / "partial.json")])
    args.quick = True
    record = probe.run(args)
    figures, ran = record["figures"], ("as_run", "eager", "no_fsdp", "flat")
    assert [s.split(":")[0] for s in record["skipped"]] == ["no_compile"]
    for name in ran:
        assert figures[f"probe_host_ms_{name}"] > 0 and f"probe_device_ms_{name}" not in figures
        assert (f"train_step_host_ms_{name}" in figures) == (name != "eager")  # eager: the probe only
        assert (f"rider_host_ms_{name}" in figures) == (name != "eager")  # the step with the probe riding, beside
        assert (f"rider_host_ms_se_{name}" in figures) == (name != "eager")  # two pairs: a standard error
        assert f"probe_host_ms_{name}_vs_as_run" in record["ratios"] or name == "as_run"
    assert not [k for k in figures if "cotenant" in k or "device" in k] and not record["traces"]
    assert set(json.loads((tmp_path / "partial.json").read_text())["figures"]) <= set(figures)  # each build's
    # Same weights (one seed), same tokens, the adapter put back after the train steps: the variants
    # differ only in the order of float32 roundings (FSDP's gathered views or plain tensors, the tree's
    # SDPA mask or one causal sequence, compiled graphs or eager). canary_bound is the arithmetic of
    # exactly that, two implementations at one compute dtype: 4 (2^-24 + sqrt(K) 2^-24) sqrt(L) x the
    # logits' RMS, a few 1e-6 nats here, on the statistic the canary checks (the mean over the probe).
    assert 0 < figures["probe_gap_bound"] < 1e-4
    assert figures["probe_gap_as_run"] == 0.0
    for name in ran:
        assert figures[f"probe_gap_{name}"] <= figures["probe_gap_bound"], name


def test_a_trace_goes_into_a_folder_made_for_it(tmp_path):
    """`--trace-dir` may name a folder that does not exist yet (the session script's does not): the
    trace is written there instead of failing the variant after its figures were timed."""
    import torch

    from benchmarks.common import trace_call
    out = tmp_path / "traces" / "probe-as_run.json"
    summary = trace_call(lambda: torch.ones(4).sum(), False, str(out))
    assert out.exists() and json.loads(out.read_text())["traceEvents"] and "gc" in summary


def test_traced_pairs_trace_each_step_and_leave_the_adapter_as_it_was(tiny_cfg, tiny_tokenizer):
    """The rider's GPU work comes from traced pairs of train steps (plain, ridden): each step traced
    once, and the steps put the adapter back (every variant scores the same one). On the CPU there is
    no GPU work to sum: 0 ms each."""
    import torch

    from colocate.canary import probe_ids
    from colocate.learner.learner import Learner
    from colocate.models import build_policy
    with probe.one_learner(False) as topo:
        learner = Learner(tiny_cfg, topo, build_policy(tiny_cfg, tiny_tokenizer, "meta"), tiny_tokenizer)
        adapter = [p for p in learner.model.parameters() if p.requires_grad]
        before = [p.full_tensor().clone() for p in adapter]
        plain, ridden = probe.traced_pairs(learner, probe_ids(tiny_tokenizer), 2, cuda=False)
        same = all(torch.equal(p.full_tensor(), b) for p, b in zip(adapter, before))
    assert plain == [0.0, 0.0] and ridden == [0.0, 0.0]
    assert same
