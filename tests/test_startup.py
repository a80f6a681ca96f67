"""The start-up: each rank's timeline, merged on learner rank 0 (any world), the learner's warm-up
that leaves the run bit for bit as it was, the compile caches' variables, the steady-state busy
shares and the engine kernel's warm-up call."""
import json
import math
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from colocate.startup import (CHECK_PHASES, MARKS, LAUNCH_ENV, Timeline, cache_line, compile_cache_env, compile_line,
                              compile_record, first_step_line, merge)
from tests.conftest import REPO, free_port

ROLE_MARKS = {"inference": ("rank_start", "checks_done", "ranks_up", "model_ready", "engine_constructed",
                            "engine_warm", "first_batch"),
              "learner": ("rank_start", "checks_done", "ranks_up", "model_ready", "learner_probe_warm", "learner_warm",
                          "first_batch", "first_step_end")}


def marked(origin: float, role: str, seconds: list[float]) -> Timeline:
    t = Timeline(origin)
    for name, s in zip(ROLE_MARKS[role], seconds):
        t.mark(name, origin + s)
    return t


def four_ranks() -> dict:
    """2 inference + 2 learners; learner rank 1 (global 3) knows a later launch than the others."""
    return {0: ("inference", marked(1000.0, "inference", [1, 5, 6, 8, 30, 31, 40])),
            1: ("inference", marked(1000.0, "inference", [1, 6, 6.5, 9, 35, 36, 44])),
            2: ("learner", marked(1000.0, "learner", [1, 5, 6, 12, 16, 20, 45, 47])),
            3: ("learner", marked(1002.0, "learner", [0, 3, 4, 9, 14, 18, 43, 45]))}


def test_merge_counts_from_the_earliest_launch_and_names_the_phases():
    record = merge(four_ranks())
    assert record["origin_unix"] == 1000.0
    assert record["ranks"]["3"]["model_ready"] == 11.0  # 1002 + 9, from the job's launch
    assert record["marks"]["engine_constructed"] == 35.0 and record["marks"]["first_step_end"] == 47.0
    p = record["phases"]
    # checks: the last rank's; engine: the slowest inference rank's model -> engine; the learner's on learner rank 0
    assert (p["first_step"], p["checks"], p["engine"]) == (47.0, 6.0, 26.0)
    assert (p["learner_warmup"], p["first_batch_wait"], p["step_1"]) == (8.0, 25.0, 2.0)
    assert first_step_line(record) == ("colocate: first step after 47.0 s (checks 6.0, engine 26.0, "
                                       "learner warm-up 8.0, waiting for the first batch 25.0)")


def test_without_a_warm_up_the_wait_counts_from_the_model():
    ranks = {0: ("inference", marked(0.0, "inference", [1, 2, 3, 4, 10, 11, 12])),
             1: ("learner", Timeline(0.0, {"checks_done": 2.0, "model_ready": 5.0, "first_batch": 12.5,
                                           "first_step_end": 13.0}))}
    p = merge(ranks)["phases"]
    assert (p["learner_warmup"], p["first_batch_wait"]) == (0.0, 7.5)


def test_the_launchers_check_phases_are_seconds_in_order_and_absent_without_a_launcher():
    """startup.json's `launcher_phases`: from the handover's phase ends (unix) on any rank, each phase's
    seconds since the one before, the first since the launch; they add up to the handover's time. A
    run without `colocate train` (no rank had them) has none."""
    assert "launcher_phases" not in merge(four_ranks())
    ranks = four_ranks()
    ends = {name: 1000.0 + 0.5 * (i + 1) for i, name in enumerate(CHECK_PHASES)}
    ranks[1][1].checks.update(ends)
    ranks[1][1].mark("launch_checked", ends["handover"])
    record = merge({r: (role, Timeline.from_json(t.to_json())) for r, (role, t) in ranks.items()})  # as sent
    assert list(record["launcher_phases"].items()) == [(name, 0.5) for name in CHECK_PHASES]
    assert sum(record["launcher_phases"].values()) == record["marks"]["launch_checked"] == 0.5 * len(CHECK_PHASES)


def test_the_compile_record_reads_dynamos_counters(monkeypatch):
    """startup.json's `learner_compile`: graphs, compile seconds, both caches' hits and misses and the
    AOTAutograd traces begun but not finished, as Dynamo counted them; nothing when no graph was
    compiled."""
    from collections import Counter, defaultdict
    import torch._dynamo.utils as utils
    counters = defaultdict(Counter)
    monkeypatch.setattr(utils, "counters", counters)
    monkeypatch.setattr(utils, "calculate_time_spent", lambda: {"entire_frame_compile": 12.3456,
                                                                 "backend_compile": 4.25, "gc": 0.1})
    assert compile_record() == {}
    counters["stats"]["unique_graphs"] = 4
    counters["frames"]["total"] = 7
    counters["inductor"].update(fxgraph_cache_hit=3, fxgraph_cache_miss=1)
    counters["aot_autograd"].update(autograd_cache_hit=2, total=5, ok=4)
    record = compile_record()
    assert record == {"graphs": 4, "frames": 7, "compile_s": 12.346, "backend_compile_s": 4.25, "fx_cache_hit": 3,
                      "fx_cache_miss": 1, "aot_cache_hit": 2, "aot_cache_miss": 0, "aot_abandoned": 1}
    assert compile_line(record) == ("colocate: learner compile: 4 graphs, 12.3 s, 8.1 s tracing (inductor cache "
                                    "3 hit / 1 miss, AOTAutograd cache 2 hit / 0 miss, 1 traces abandoned)")
    monkeypatch.setattr(utils, "calculate_time_spent", lambda: {})  # a torch that times nothing: no seconds, no NaN
    assert "compile_s" not in compile_record()
    assert compile_line(compile_record()).startswith("colocate: learner compile: 4 graphs (inductor cache 3 hit")


def test_a_mark_keeps_its_first_time_and_unknown_marks_are_refused():
    t = Timeline(0.0)
    t.mark("first_batch", 3.0)
    t.mark("first_batch", 9.0)
    assert t.marks == {"first_batch": 3.0}
    assert Timeline.from_json(json.loads(json.dumps(t.to_json()))) == t
    with pytest.raises(ValueError, match="unknown start-up mark 'engine_ready'"):
        t.mark("engine_ready")


def test_a_mark_made_before_the_rank_has_a_timeline_is_kept_by_its_first(monkeypatch):
    """The rank's head start marks `engine_prestart` before `main` begins the timeline: `begin`
    keeps it (once: a later timeline of the process starts without it)."""
    from colocate import startup
    monkeypatch.setattr(startup, "_PROCESS", None)
    monkeypatch.setattr(startup, "_BEFORE", {})
    startup.mark("engine_prestart")
    with pytest.raises(ValueError, match="unknown start-up mark"):
        startup.mark("engine_ready")
    first = startup.begin({})
    assert list(first.marks) == ["rank_start", "engine_prestart"] and first.marks["engine_prestart"] <= time.time()
    startup.mark("checks_done")
    assert list(startup.begin({}).marks) == ["rank_start"] and "checks_done" in first.marks


def _exchange_worker(rank: int, port: int, out: str) -> None:
    """One rank of a 2 inference + 2 learner world: the inference ranks and learner rank 1 send
    their marks, learner rank 0 receives them in the loops' order (inference ranks after their
    first shards, learners after the first step) and merges."""
    from colocate import startup
    from colocate.topology import Topology
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **{LAUNCH_ENV: "1000.0"})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4)
    topo = Topology(rank=rank, world_size=4, local_rank=rank, num_inference=2, num_learners=2,
                    device=torch.device("cpu"), backend="gloo", transport_group=dist.group.WORLD)
    role, mine = four_ranks()[rank]
    timeline = startup.begin()
    timeline.marks = dict(mine.marks)
    if rank != topo.sync_src:
        startup.send_marks(topo)
    else:
        got = startup.receive_marks(topo, topo.inference_ranks)
        got.update(startup.receive_marks(topo, topo.learner_ranks[1:]))
        got[rank] = timeline
        with open(out, "w") as f:
            json.dump(startup.merge({r: (topo.roles[r], t) for r, t in got.items()}), f)
    dist.destroy_process_group()


def test_learner_rank_0_gathers_every_ranks_marks_in_any_world(tmp_path):
    out = str(tmp_path / "startup.json")
    mp.start_processes(_exchange_worker, args=(free_port(), out), nprocs=4, join=True, start_method="fork")
    with open(out) as f:
        got = json.load(f)
    want = merge(four_ranks())  # every rank's own origin is the launch it was given; the marks are absolute
    assert got["ranks"] == want["ranks"] and got["phases"] == want["phases"] and got["marks"] == want["marks"]
    assert got["launch"] == "colocate train"


def test_compiled_blocks_run_the_probe_through_the_training_graphs(monkeypatch, compile_configs, tiny_cfg,
                                                                   tiny_tokenizer):
    """With learner.compile the canary's probe rides the warm-up's update as it rides each step's first
    forward, so after the warm-up a step with the probe compiles nothing new; a probe of its own (LoRA
    dropout's) keeps autograd on, so its graphs are the training ones, while a gradient-free probe
    compiles graphs of its own (a `requires_grad` guard fails on every block). Dynamo frames counted."""
    from torch._dynamo.testing import CompileCounter
    from colocate.learner import fsdp
    from colocate.topology import Topology
    from tests.test_packing import random_batch
    counter = CompileCounter()
    monkeypatch.setattr(fsdp, "apply_compile", blocks_compiled_with(counter))
    torch._dynamo.reset()
    topo = Topology(rank=0, world_size=1, local_rank=0, num_inference=0, num_learners=1,
                    device=torch.device("cpu"), backend="gloo")
    learner, vocab = _learner(tiny_cfg.model.cache_dir, {"learner": {"compile": True}}, topo)
    probe = list(range(2, 40))
    learner.warm_up(probe=probe)
    warmed = counter.frame_count
    batch = random_batch(vocab, SHAPES, seed=0)
    batch.versions[:] = learner.version
    learner.train_step(batch, probe)
    assert warmed > 0 and counter.frame_count == warmed and learner.probe_scored is not None
    learner.score_probe(probe)  # its own shape: at most the frames of one more length
    own = counter.frame_count
    learner.score_probe(probe)
    assert counter.frame_count == own
    monkeypatch.setattr(learner.cfg.learner, "compile", False)  # the probe without gradients: graphs of its own
    learner.score_probe(probe)
    assert counter.frame_count > own
    torch._dynamo.reset()


def test_colocate_train_gives_its_ranks_the_launch_and_its_pid_then_takes_them_back(monkeypatch):
    import time
    from colocate import handover, launcher
    seen = {}
    launch = launcher.Launch(0, cmd=[sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"])
    monkeypatch.setattr(launcher, "train_command", lambda argv: launch)
    monkeypatch.setattr(launcher, "run_torchrun", lambda args, job: seen.update(os.environ) or 0)
    monkeypatch.delenv(LAUNCH_ENV, raising=False)
    saved = dict(os.environ)  # the ranks' environment (launch_env) stays in this process after a launch
    before = time.time()
    try:
        assert launcher.train(["--config", "x.yaml"]) == 0
        assert LAUNCH_ENV not in os.environ and handover.LAUNCHER_ENV not in os.environ
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert float(seen[LAUNCH_ENV]) <= before and seen[handover.LAUNCHER_ENV] == str(os.getpid())


# -------------------------------------------------------------------------------- the run's record

def test_a_run_writes_its_timeline_in_order_and_reports_busy_shares_from_step_2(learning_run):
    record = json.loads((learning_run.run_dir / "startup.json").read_text())
    summary = json.loads((learning_run.run_dir / "summary.json").read_text())
    assert summary["startup"] == record and summary["busy_from_step"] == 2
    assert "launcher_phases" not in record  # plain torchrun: no launcher, no checks of its own
    assert {row["role"] for row in record["ranks"].values()} == {"inference", "learner"}
    for rank, row in record["ranks"].items():
        names = [m for m in MARKS if m in row]
        # every mark of its role, learner_warm included; the probe rides the warm-up's update (no dropout)
        assert names == [m for m in ROLE_MARKS[row["role"]] if m != "learner_probe_warm"], rank
        seconds = [row[m] for m in names]
        assert seconds == sorted(seconds) and seconds[0] >= 0, (rank, row)
    lines = [line for line in learning_run.stdout.splitlines() if "colocate: first step after" in line]
    assert len(lines) == 1 and lines[0].endswith(first_step_line(record))
    # the ranks' compile cache variables: under the default directory, but for those this environment sets
    default = "~/.cache/colocate"
    assert cache_line(default, compile_cache_env(default, dict(os.environ))) in learning_run.stdout.splitlines()


# -------------------------------------------------------------------------------- caches

def test_compile_caches_go_under_one_directory_unless_the_user_set_one(tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    root = str(tmp_path / "c")
    env = {"TRITON_CACHE_DIR": "/mine/triton", "TORCHINDUCTOR_CACHE_DIR": default_cache_dir()}  # torch's own
    got = compile_cache_env(root, env)
    assert got == env == {"VLLM_CACHE_ROOT": f"{root}/vllm", "TORCHINDUCTOR_CACHE_DIR": f"{root}/inductor",
                          "TRITON_CACHE_DIR": "/mine/triton"}
    assert cache_line(root, got) == ("colocate: compile caches: VLLM_CACHE_ROOT=" + f"{root}/vllm, "
                                     f"TORCHINDUCTOR_CACHE_DIR={root}/inductor, TRITON_CACHE_DIR=/mine/triton")
    fresh = compile_cache_env("~/x", {})
    assert cache_line("~/x", fresh).startswith(f"colocate: compile caches in {os.path.expanduser('~/x')} (vllm/")
    assert compile_cache_env("", {}) == {"VLLM_CACHE_ROOT": "", "TORCHINDUCTOR_CACHE_DIR": "", "TRITON_CACHE_DIR": ""}


# -------------------------------------------------------------------------------- steady state

def test_inference_busy_share_counts_collect_time_inside_the_steady_window():
    from colocate.rollout.loop import steady_busy
    batches = [{"collect_start": 0.0, "collect_end": 10.0}, {"collect_start": 12.0, "collect_end": 20.0},
               {"collect_start": 25.0, "collect_end": 29.0}]
    # from 15 to 35: 5 s of the second batch and the whole third (4 s) over 20 s
    assert steady_busy(batches, 15.0, 35.0) == pytest.approx(9.0 / 20.0)
    assert steady_busy(batches, None, 35.0) is None
    assert steady_busy(batches, 30.0, 35.0) is None  # nothing collected after the first adapter: one step


def test_learner_steady_state_starts_after_the_first_step():
    import time
    from colocate.learner.summary import SteadyState
    t = time.perf_counter() - 10.0
    steady = SteadyState.since((t, 4.0), busy_s=9.0, steps_run=6)
    assert steady.busy_s == 5.0 and steady.steps == 5 and 10.0 <= steady.wall_s < 60.0
    assert SteadyState.since((t, 4.0), busy_s=4.0, steps_run=1) == SteadyState()
    assert SteadyState.since(None, busy_s=4.0, steps_run=3) == SteadyState()


# -------------------------------------------------------------------------------- the learner's warm-up

SHAPES = [(9, 3), (14, 1), (5, 6), (11, 4), (7, 2), (12, 5)]


def _learner(cache_dir: str, extra: dict, topo):
    from colocate.config import load_config
    from colocate.envs import env_corpus
    from colocate.learner.learner import Learner
    from colocate.models import build_policy, load_tokenizer
    learner_keys = {"lr": 1e-2, "micro_batch_tokens": 32, "fsdp": False, **extra.get("learner", {})}
    cfg = load_config(os.path.join(REPO, "configs/cpu-tiny.yaml"), {
        "model": {"cache_dir": cache_dir}, "lora": {"rank": 3, "alpha": 6.0, **extra.get("lora", {})},
        "learner": learner_keys, "loss": {"impl": "torch", **extra.get("loss", {})}})
    tok = load_tokenizer(cfg.model, *reversed(env_corpus(cfg)))
    return Learner(cfg, topo, build_policy(cfg, tok, "meta"), tok), len(tok)


def blocks_compiled_with(backend):
    """`fsdp.apply_compile` with another Dynamo backend (no inductor: a CPU test's seconds)."""
    import functools
    from colocate.learner import fsdp
    return functools.partial(fsdp.apply_compile, backend=backend)


def _trained(cache_dir: str, extra: dict, topo, warm: bool, steps: int = 3, probes: bool = False) -> dict:
    """`steps` train steps with or without a warm-up first (and with `probes`, the canary's probe as
    the learner loop runs it: riding each step's first forward, or with LoRA dropout a forward of its
    own after the step) -> adapter, optimizer state, RNG after them."""
    from tests.test_packing import random_batch
    learner, vocab = _learner(cache_dir, extra, topo)
    torch.manual_seed(7)
    if warm:
        calls = []
        step = learner.optimizer.step
        learner.optimizer.step = lambda *a, **k: calls.append(1) or step(*a, **k)
        learner.warm_up(probe=list(range(2, 40)))  # the canary's forward too (a probe of 38 ids)
        learner.optimizer.step = step
        assert calls == [1] and not learner.optimizer.state and learner.version == 0  # it stepped, then put back
        assert all(p.grad is None for p in learner.params)
    for i in range(steps):
        batch = random_batch(vocab, SHAPES, seed=i)
        batch.versions[:] = learner.version
        learner.train_step(batch, list(range(2, 40)) if probes else None)
        if probes and not learner.rides_probe:
            learner.score_probe(list(range(2, 40)))
    return {"adapter": {n: t.clone() for n, t in learner.lora_state().items()},
            "optimizer": learner.optimizer.state_dict(), "rng": torch.get_rng_state()}


def assert_identical(a: dict, b: dict) -> None:
    assert list(a["adapter"]) == list(b["adapter"])
    for name in a["adapter"]:
        assert torch.equal(a["adapter"][name], b["adapter"][name]), name
    sa, sb = a["optimizer"], b["optimizer"]
    assert sa["param_groups"] == sb["param_groups"] and sa["state"].keys() == sb["state"].keys()
    for key, state in sa["state"].items():
        assert state.keys() == sb["state"][key].keys()
        for field, value in state.items():
            assert torch.equal(value, sb["state"][key][field]), (key, field)
    assert torch.equal(a["rng"], b["rng"])


WARM_UP_VARIANTS = [
    {"lora": {"dropout": 0.1}},  # dropout draws from the RNG the warm-up must put back
    {"learner": {"updates_per_batch": 2, "prefix_sharing": "tree"}, "loss": {"beta": 0.04}},
]


@pytest.mark.parametrize("extra", WARM_UP_VARIANTS, ids=["dropout", "two_updates_tree_kl"])
def test_warm_up_leaves_adapter_optimizer_and_rng_bit_identical(tiny_cfg, tiny_tokenizer, extra):
    from colocate.topology import Topology
    topo = Topology(rank=0, world_size=1, local_rank=0, num_inference=0, num_learners=1,
                    device=torch.device("cpu"), backend="gloo")
    cache = tiny_cfg.model.cache_dir
    assert_identical(_trained(cache, extra, topo, warm=True), _trained(cache, extra, topo, warm=False))


def _fsdp_worker(rank: int, port: int, cache_dir: str, out: str, learner_keys: dict) -> None:
    from colocate.topology import Topology
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # forked after in-process training: the parent's thread pool does not come along
    dist.init_process_group("gloo", rank=rank, world_size=2)
    topo = Topology(rank=rank, world_size=2, local_rank=rank, num_inference=0, num_learners=2,
                    device=torch.device("cpu"), backend="gloo", learner_group=dist.new_group([0, 1]))
    extra = {"learner": {"fsdp": True, **learner_keys}}
    if learner_keys.get("compile"):  # the probe's autograd path, its graphs run eagerly (no inductor)
        from colocate.learner import fsdp
        fsdp.apply_compile = blocks_compiled_with("eager")  # this forked worker's own module
    # the warm-up, and the canary's forward after every step (autograd on, no backward): neither
    # leaves a trace in FSDP's state that changes the next steps
    assert_identical(_trained(cache_dir, extra, topo, warm=True, probes=True),
                     _trained(cache_dir, extra, topo, warm=False))
    open(f"{out}.{rank}", "w").write("ok")
    dist.destroy_process_group()


@pytest.mark.parametrize("learner_keys", [{}, {"activation_checkpointing": True, "reshard_after_forward": False},
                                          {"activation_checkpointing": True, "updates_per_batch": 2},
                                          {"compile": True}],
                         ids=["plain", "ac-kept-gathered", "ac-two-updates", "compiled"])
def test_warm_up_and_probes_under_fsdp_leave_the_sharded_adapter_exactly_as_without(tmp_path, tiny_cfg,
                                                                                      tiny_tokenizer, learner_keys):
    out = str(tmp_path / "ok")
    mp.start_processes(_fsdp_worker, args=(free_port(), tiny_cfg.model.cache_dir, out, learner_keys), nprocs=2,
                       join=True, start_method="fork")
    assert [open(f"{out}.{r}").read() for r in range(2)] == ["ok", "ok"]


def _shared_gpu_sender(monkeypatch, overrides: dict) -> list:
    """`engine.table.make_sender` on learner rank 0 of a GPU shared with the engines, its IPC ring
    recorded -> what happened, in order: ("ipc", handshake in the background) and "warm-up"."""
    from types import SimpleNamespace
    from colocate.config import load_config
    from colocate.engine import table
    events = []
    monkeypatch.setattr(table, "IpcSender", lambda *a, background=False, **k: events.append(("ipc", background)))
    monkeypatch.setattr(table, "resolve_kind", lambda kind, topo: kind)
    cfg = load_config(os.path.join(REPO, "configs/cpu-tiny.yaml"), overrides)
    topo = SimpleNamespace(rank=1, sync_src=1, shared_gpu=True, sync_group=None, device=torch.device("cpu"))
    table.make_sender(cfg, topo, spec=None, before_join=lambda: events.append("warm-up"))
    return events


def test_the_warm_up_runs_beside_the_engines_start_unless_they_size_from_free_memory(monkeypatch):
    # vLLM sizing its KV cache from the GPU's free memory (its start-up profile): the warm-up waits
    # for the handshake, which returns once the engines have started
    assert _shared_gpu_sender(monkeypatch, {"engine": {"kind": "vllm"}}) == [("ipc", False), "warm-up"]
    # a fixed KV cache (engine.kv_cache_gib), or the HF engine: the handshake runs on a thread meanwhile
    fixed = {"engine": {"kind": "vllm", "kv_cache_gib": 2.0}}
    assert _shared_gpu_sender(monkeypatch, fixed) == [("ipc", True), "warm-up"]
    assert _shared_gpu_sender(monkeypatch, {"engine": {"kind": "hf"}}) == [("ipc", True), "warm-up"]


def test_a_failed_handshake_in_the_background_is_raised_where_the_sender_is_used(monkeypatch):
    from colocate import channel
    from colocate.wire import LoraSpec

    def refused(*a, **k):
        raise RuntimeError("an engine died before it took the ring")
    monkeypatch.setattr(channel, "share_cuda_buffer", lambda ring: {})
    monkeypatch.setattr(channel, "broadcast_json", refused)
    spec = LoraSpec.of({"a": torch.zeros(2, 3)})
    sender = channel.IpcSender(spec, src=0, group=None, device=torch.device("cpu"), slots=2, background=True)
    with pytest.raises(RuntimeError, match="engine died"):
        sender.send(torch.zeros(6), 1, channel.RunFlags(0))
    with pytest.raises(RuntimeError, match="engine died"):  # at once: without the background the constructor raises
        channel.IpcSender(spec, src=0, group=None, device=torch.device("cpu"), slots=2)


def test_the_synthetic_batch_fills_the_budget_in_groups_that_share_a_prompt():
    from colocate.learner.warmup import synthetic_batch
    b = synthetic_batch(vocab=50, num_tokens=64, completion_len=8, group_size=4, version=3)
    assert b.num_sequences == 4 and int(b.seq_lens.sum()) == 64 and b.num_completion_tokens == 32
    prompts = b.tokens.view(4, 16)[:, :8]
    assert all(torch.equal(prompts[0], prompts[i]) for i in range(4))  # one group of four
    assert set(b.advantages.tolist()) == {1.0, -1.0} and b.versions.tolist() == [3] * 4
    assert torch.equal(b.behaviour_logprobs, torch.full((32,), -math.log(50)))  # a ratio near 1: unclipped
    assert synthetic_batch(vocab=50, num_tokens=5, completion_len=8, group_size=4, version=0).num_sequences == 1


# -------------------------------------------------------------------------------- the engine's kernels

def test_the_logprob_kernel_runs_per_logits_dtype_and_row_count_at_engine_start(monkeypatch, capsys):
    """A Qwen vocabulary (a multiple of vLLM's 64-column padding) has one row stride: the warm-up runs
    one and two rows in each dtype (the strides of other vocabularies: tests/test_constraint_masks.py)."""
    from colocate.engine import vllm_logprobs
    from colocate.kernels import sampled_logprob as kernel
    calls = []
    monkeypatch.setattr(kernel, "sampled_logprob", lambda logits, ids: calls.append(
        (tuple(logits.shape), logits.dtype, str(logits.device), tuple(ids.shape), ids.dtype)))
    assert vllm_logprobs.warm_up(151936, "cpu")
    assert calls == [((rows, 151936), dtype, "cpu", (rows,), torch.int64)
                     for dtype in (torch.float32, torch.bfloat16) for rows in (1, 2)]

    def broken(logits, ids):
        raise RuntimeError("no GPU")
    monkeypatch.setattr(kernel, "sampled_logprob", broken)
    assert not vllm_logprobs.warm_up(8, "cpu")
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["colocate: engine.logprob_kernel warm-up failed (RuntimeError: no GPU); the kernel compiles "
                   "in the first rollouts instead"]


def test_startup_profile_sets_step_1_beside_the_median_of_the_later_steps():
    from benchmarks.startup import step_figures
    ends = [{"step_end": t} for t in (100.0, 101.0, 103.0, 104.5, 106.0)]  # later steps: 1, 2, 1.5, 1.5
    assert step_figures(ends, step_1=3.0) == {"median_step": 1.5, "step_1_over_median": 2.0}
    assert step_figures(ends[:1], step_1=3.0) == {}
