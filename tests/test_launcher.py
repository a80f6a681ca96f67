"""The launcher (`colocate train` / `colocate check`): a config error is refused before torch is
imported; the user's code it calls while checking (in a forked child, `colocate/child.py`) cannot
end, break or move it; the config is checked once per launch, and a rank loads the launcher's
resolved config only when its SHA-256 matches."""
import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

from colocate import cli, launch, launcher, rank_config
from tests.conftest import REPO
from tests.test_cli import handed_over
from tests.test_engine_table import fake_vllm  # noqa: F401 - a fixture

DATASET = os.path.join(REPO, "configs", "cpu-dataset-tiny.yaml")


def no_torchrun_env(monkeypatch):
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
                "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(key, raising=False)


@pytest.mark.parametrize("command", ["train", "check"])
def test_a_config_error_is_refused_before_torch_is_imported(tmp_path, command):
    """Issue 63 item 7: a mistyped key (or file) waited 8-24 s for torch to import."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"base: {os.path.join(REPO, 'configs', 'cpu-tiny.yaml')}\nmodel:\n  shap: tiny\n")
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for args in (["--config", str(bad)], ["--config", os.path.join(REPO, "configs", "cpu-tiny.yaml"), "--learner.lrr=1"],
                 ["--config", str(tmp_path / "missing.yaml")],
                 *([["--config", str(bad), "--gpu-memory", "80GiB"]] if command == "check" else [])):
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "colocate.cli", command, *args], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=120)
        imported = [line.rpartition("|")[2].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
        said = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
        assert proc.returncode == 2 and len(said) == 1 and said[0].startswith("colocate: config error: "), proc.stderr[-2000:]
        assert "colocate.config" in imported  # the listing is real
        heavy = [m for m in imported if m.split(".")[0] in ("torch", "transformers", "peft", "datasets")]
        assert not heavy, heavy[:5]


def test_a_forked_child_relays_its_output_and_says_how_it_ended(capsys):
    """`child.run_in_child`: the work's prints reach this process's streams in order, its result
    comes back; a raise is the refusal's line and code; an end the work did not choose (os._exit, a
    signal) comes back without a result and without an own end."""
    import signal

    from colocate.child import run_in_child

    def work():
        print("out 1")
        print("err 1", file=sys.stderr)
        return "the result"
    ended = run_in_child(work, lambda e: (7, f"refused: {e}"))
    assert (ended.code, ended.result, ended.own_end) == (0, "the result", True)
    assert capsys.readouterr() == ("out 1\n", "err 1\n")
    ended = run_in_child(lambda: 1 / 0, lambda e: (7, f"refused: {type(e).__name__}"))
    assert (ended.code, ended.result, ended.own_end) == (7, None, True)
    assert capsys.readouterr().err == "refused: ZeroDivisionError\n"
    assert run_in_child(lambda: os._exit(0), lambda e: (7, "")) == type(ended)(0, None, False)
    assert run_in_child(lambda: os.kill(os.getpid(), signal.SIGKILL), lambda e: (7, "")).code == -signal.SIGKILL


def user_module(tmp_path, monkeypatch, name: str, body: str) -> str:
    """A reward module of the user's in `tmp_path` (on sys.path) -> the reward's path."""
    score = "" if "def score" in body else "\n\ndef score(prompts, completions, **columns):\n    return [0.0] * len(completions)\n"
    (tmp_path / f"{name}.py").write_text(body + score)
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{name}:score"


def train(monkeypatch, tmp_path, *args: str) -> tuple[int, list]:
    """`colocate train ARGS` in this process, torchrun replaced -> (exit code, torchrun's arguments
    with the resolved config's text)."""
    no_torchrun_env(monkeypatch)
    started = []

    def fake_torchrun(argv, launch):
        text = handed_over(argv)[1]
        if text is not None:  # the checks passed: the ranks start
            started.append((argv, text.decode()))
        return 0
    monkeypatch.setattr(launcher, "run_torchrun", fake_torchrun)
    code = cli.main(["train", *args, f"--model.cache_dir={tmp_path / 'cache'}"])
    return code, started


def test_the_checks_count_gpus_without_initialising_cuda(tmp_path, monkeypatch):
    """Issue 60: the launcher's checks read the GPUs through NVML (`torch.cuda.device_count`);
    `torch.cuda.is_available` initialises the CUDA driver, seconds on a GPU machine before any
    rank starts. Here NVML "sees" one 80 GiB GPU and every call that would initialise CUDA fails;
    engine.kind=auto (the presets' default) is resolved for this machine by the checks too."""
    import torch

    from colocate import gpu_budget, preflight

    def initialises(*args, **kwargs):
        raise AssertionError("the checks initialised CUDA")
    no_torchrun_env(monkeypatch)
    for name in ("is_available", "_lazy_init", "init", "get_device_properties", "mem_get_info"):
        monkeypatch.setattr(torch.cuda, name, initialises)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(gpu_budget, "gpu_total_bytes", lambda index=0: 80 * gpu_budget.GIB)
    cfg = launch.parse_config(["--config", os.path.join(REPO, "configs", "cpu-tiny.yaml"), "--engine.kind=auto",
                               f"--metrics.run_dir={tmp_path / 'run'}"], 2)[0]
    assert preflight.gpu_count(cfg) == 1
    plan = preflight.preflight(cfg, 2, 2)
    assert plan.estimates_gib  # planned for the GPU NVML counted


def test_the_launchers_heavy_imports_are_made_without_collections_and_frozen(tmp_path, monkeypatch):
    """`import_frozen` (the meta model's packages, before the checking child forks): the collector
    is off while the module imports, the heap is frozen after (neither the child nor the launcher's
    later collections walk it), the collector's state is as it was; an imported module is left be."""
    import gc
    probe = "import gc\n\nCOLLECTING = gc.isenabled()\nHEAP = [[i] for i in range(1000)]\n"
    (tmp_path / "frozen_probe.py").write_text(probe)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        gc.unfreeze()
        launch.import_frozen("frozen_probe")
        import frozen_probe
        assert not frozen_probe.COLLECTING and gc.isenabled() and gc.get_freeze_count() > 0
        gc.unfreeze()
        gc.disable()
        launch.import_frozen("frozen_probe")  # imported already: nothing to do
        assert gc.get_freeze_count() == 0 and not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()
        sys.modules.pop("frozen_probe", None)


def test_a_frozen_heap_is_unfrozen_before_the_interpreters_teardown(tmp_path):
    """A rank that exits with SystemExit (bad input: one line, exit 2) tears the interpreter down:
    nanobind (triton's bindings) would report every frozen object of its own as leaked."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", "import triton\nfrom colocate.lifecycle import freeze_heap\n"
                           "freeze_heap()\nraise SystemExit(2)"], capture_output=True, text=True, env=env, timeout=120)
    assert (proc.returncode, proc.stderr) == (2, "")


def test_a_reward_that_ends_its_process_does_not_end_the_launcher(tmp_path, monkeypatch, capsys):
    """Issue 63 item 2: `os._exit(0)` in a reward made `colocate train` exit 0 with no word."""
    monkeypatch.chdir(REPO)
    reward = user_module(tmp_path, monkeypatch, "user_exits", "import os\n\n\ndef score(*args, **kwargs):\n"
                         "    os._exit(0)\n")
    code, started = train(monkeypatch, tmp_path, "--config", DATASET, f"--env.reward={reward}",
                          f"--metrics.run_dir={tmp_path / 'run'}")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and started == [] and len(err) == 1, err
    assert err[0].startswith("colocate: failed: the checks before launch ended without a result (their process "
                             "exited with code 0): user code they call"), err


def test_a_reward_module_that_patches_json_leaves_the_launcher_whole(tmp_path, monkeypatch, capsys):
    """Issue 63 item 2: a reward module patching `json` at import broke the launcher (torchrun)."""
    monkeypatch.chdir(REPO)
    dumps, loads = json.dumps, json.loads
    reward = user_module(tmp_path, monkeypatch, "user_patches_json",
                         "import json\n\njson.dumps = json.loads = lambda *a, **k: 'garbage'")
    code, started = train(monkeypatch, tmp_path, "--config", DATASET, f"--env.reward={reward}",
                          f"--metrics.run_dir={tmp_path / 'run'}")
    assert code == 0 and len(started) == 1, capsys.readouterr().err
    assert json.dumps is dumps and json.loads is loads and "user_patches_json" not in sys.modules
    assert f"- {reward}" in started[0][1]  # the resolved config the ranks get


def test_a_reward_module_that_changes_directory_moves_nothing(tmp_path, monkeypatch, capsys):
    """Issue 63 item 2: a reward module calling `os.chdir` at import made the relative `--config` "not
    found"; every path is absolute before any user code runs, and the launcher stays where it was."""
    (tmp_path / "data.jsonl").write_text('{"prompt": "add 1 and 2 ; answer :", "answer": "3"}\n')
    (tmp_path / "run.yaml").write_text(f"base: {DATASET}\nenv:\n  data_files: [data.jsonl]\n  eval_files: []\n")
    reward = user_module(tmp_path, monkeypatch, "user_moves", "import os\n\nos.chdir('/')")
    monkeypatch.chdir(tmp_path)
    code, started = train(monkeypatch, tmp_path, "--config", "run.yaml", f"--env.reward={reward}",
                          "--metrics.run_dir=runs/here", "--eval.at_end=false")
    assert code == 0 and len(started) == 1, capsys.readouterr().err
    assert os.getcwd() == str(tmp_path)
    import yaml
    resolved = yaml.safe_load(started[0][1])
    assert resolved["env"]["data_files"] == [str(tmp_path / "data.jsonl")]
    assert resolved["metrics"]["run_dir"] == str(tmp_path / "runs" / "here")
    assert resolved["model"]["cache_dir"] == str(tmp_path / "cache")


def resolved_rank_args(tmp_path, monkeypatch) -> list[str]:
    """A rank's arguments from `colocate train` (rank 0 of 2, as torchrun starts it)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    cfg, _ = launch.parse_config(["--config", os.path.join(REPO, "configs", "cpu-tiny.yaml"),
                                  f"--metrics.run_dir={tmp_path / 'run'}", "--learner.lr=3e-3"], 2)
    return rank_config.write_resolved(launch.config_text(cfg))


def test_a_rank_loads_the_checked_config_and_refuses_one_that_changed(tmp_path, monkeypatch, capsys):
    """Issue 60, one check: the rank takes the launcher's config as it is (no check runs again), and
    refuses it in one line when the file is not the one whose SHA-256 it was given."""
    import colocate.preflight
    monkeypatch.setattr(colocate.preflight, "preflight", lambda *a, **k: pytest.fail("a rank checked again"))
    args = resolved_rank_args(tmp_path, monkeypatch)
    cfg, resume, check_only = rank_config.configure(args)
    assert cfg.learner.lr == 3e-3 and cfg.metrics.run_dir == str(tmp_path / "run") and resume is None
    assert not check_only and not (tmp_path / "run").exists()
    path = args[0].partition("=")[2]
    with open(path, "a") as f:
        f.write("# edited\n")
    with pytest.raises(SystemExit) as exit_info:
        rank_config.configure(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"colocate: config error: --resolved-config={path}: its SHA-256 is ") and \
        "`colocate train` checked (the file changed after the checks)" in err[0], err
    os.remove(path)


def test_a_rank_of_colocate_train_waits_for_the_handover_and_marks_its_time(tmp_path, monkeypatch):
    """Issue 60, overlap: the rank is given a path that does not exist yet and waits there; once the
    launcher hands the checked config over, the rank loads it and marks `launch_checked` at the
    handover's time (after its own start)."""
    import threading

    from colocate import handover, startup
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(handover.LAUNCHER_ENV, str(os.getppid()))
    cfg, _ = launch.parse_config(["--config", os.path.join(REPO, "configs", "cpu-tiny.yaml"),
                                  f"--metrics.run_dir={tmp_path / 'run'}", "--learner.lr=3e-3"], 2)
    path = handover.place()
    timeline = startup.begin({})
    later = threading.Timer(0.2, handover.hand_over, (path, launch.config_text(cfg), {"parse": 1.0, "env": 2.0}))
    later.start()
    try:
        got, resume, _ = rank_config.configure([f"--resolved-config={path}"])
    finally:
        later.join()
    assert got.learner.lr == 3e-3 and resume is None and not (tmp_path / "run").exists()
    assert timeline.marks["launch_checked"] == handover.read_record(path)["checked_unix"] > timeline.marks["rank_start"]
    assert list(timeline.checks.items()) == [("parse", 1.0), ("env", 2.0)]  # the check phases, for startup.json
    handover.remove(path)


def test_a_wait_ends_on_the_config_a_refusal_the_launchers_end_or_its_limit(tmp_path):
    from colocate import handover
    path = str(tmp_path / "config.yaml")
    assert handover.wait(path, os.getppid(), wait_s=0.05) == handover.LATE
    assert handover.wait(path, os.getppid() + 1, wait_s=5) == handover.GONE  # another parent: the launcher ended
    handover.refuse(path)
    assert handover.wait(path, os.getppid()) == handover.REFUSED
    os.remove(path + handover.REFUSAL)
    handover.hand_over(path, "learner: {}\n")
    assert handover.wait(path, os.getppid()) == handover.READY
    with open(path, "rb") as f:
        assert handover.read_record(path)["sha256"] == handover.digest(f.read())


def test_an_inference_rank_imports_its_engine_while_it_waits_for_the_checks(fake_vllm, monkeypatch):
    """`train.main` starts the engine's imports before the rank waits for the launcher's checks, on
    the inference ranks the launcher names (`handover.ENGINE_IMPORTS_ENV`) only; a learner never
    imports vLLM."""
    import time

    from colocate import handover, train
    seen = []

    def waiting(argv):  # the rank's wait: the import shows up meanwhile, then the launcher refuses
        deadline = time.monotonic() + 60
        while "vllm.entrypoints.llm" not in sys.modules and time.monotonic() < deadline and os.environ["RANK"] == "0":
            time.sleep(0.01)
        seen.append("vllm.entrypoints.llm" in sys.modules)
        raise SystemExit(2)
    monkeypatch.setattr(train, "configure", waiting)
    monkeypatch.setenv(handover.ENGINE_IMPORTS_ENV, "vllm:0")
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit):
            train.main([])
        seen.append("vllm" in sys.modules)
    assert seen == [False, False, True, True]


def test_colocate_train_names_the_ranks_that_import_their_engine_early(tmp_path, monkeypatch):
    """From the parsed config, before the checks: the inference ranks as `place_roles` places them
    and the engine they build; nothing for an engine without early imports, an elastic world or a
    layout the checks refuse."""
    from colocate import preflight

    def parsed(*overrides):
        return launch.parse_config(["--config", os.path.join(REPO, "configs", "cpu-tiny.yaml"),
                                    f"--metrics.run_dir={tmp_path / 'run'}", *overrides], 4)[0]
    assert launcher.engine_imports(parsed("--engine.kind=vllm"), 4, 4) == "vllm:0,1"  # no GPU: no server
    monkeypatch.setattr(preflight, "gpu_count", lambda cfg: 2)
    # engine.prestart: each inference rank's server on its engine's GPU, counted per node (2 nodes of 2 below)
    assert launcher.engine_imports(parsed("--engine.kind=vllm"), 4, 4) == "vllm:0,1:prestart=0,1"
    assert launcher.engine_imports(parsed("--engine.kind=vllm", "--topology.placement=interleaved"),
                                   4, 2) == "vllm:0,2:prestart=0,0"
    assert launcher.engine_imports(parsed("--engine.kind=vllm", "--engine.prestart=false"), 4, 4) == "vllm:0,1"
    assert launcher.engine_imports(parsed("--engine.kind=vllm", "--engine.prestart=false",
                                          "--topology.placement=interleaved"), 4, 2) == "vllm:0,2"
    assert launcher.engine_imports(parsed(), 4, 4) == ""  # cpu-tiny's engine.kind=hf
    assert launcher.engine_imports(parsed("--engine.kind=vllm"), None, 4) == ""
    assert launcher.engine_imports(parsed("--engine.kind=vllm"), 4, 3) == ""  # not a whole number of nodes


SLOW_CHECKS = """import sys, time
from colocate import cli, launch
checks = launch.resolved_text
launch.resolved_text = lambda c: (time.sleep(float(sys.argv[1])), checks(c))[1]  # the forked child's checks
sys.exit(cli.main(sys.argv[2:]))
"""
"""`colocate train` with checks that take argv[1] seconds longer (the checking child is a fork: it
runs the patched function; the ranks are torchrun's processes, untouched)."""


@pytest.mark.slow
def test_the_ranks_start_before_the_checks_end_and_a_refusal_stops_them_quietly(tmp_path):
    """Issue 60, overlap: torchrun starts beside the checks. With checks slowed by 3 s the ranks
    start before the config is handed over (startup.json: every rank's `rank_start` before
    `launch_checked`) and the run trains. A refusal after the ranks started is the check's one
    line and exit 2, nothing else printed, and the ranks build and write nothing. Two launches of
    cpu-tiny (one step; ~10 s and ~6 s on 2 cores)."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = tmp_path / "run"
    common = [sys.executable, "-c", SLOW_CHECKS, "3", "train", "--config", "configs/cpu-tiny.yaml",
              f"--metrics.run_dir={run}", f"--model.cache_dir={tmp_path / 'cache'}", "--eval.at_end=false"]
    proc = subprocess.run([*common, "--learner.num_steps=1"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = json.loads((run / "startup.json").read_text())["ranks"]
    assert len(ranks) == 2 and all(r["rank_start"] < r["launch_checked"] <= r["checks_done"] for r in ranks.values())
    from colocate.startup import CHECK_PHASES
    phases = json.loads((run / "startup.json").read_text())["launcher_phases"]  # the slowed checks, ahead of preflight
    assert list(phases) == list(CHECK_PHASES) and phases["check_imports"] >= 3.0
    before = sorted(os.listdir(run))
    refused = subprocess.run(common, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    err = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and refused.stdout == "" and len(err) == 1, refused.stderr[-3000:]
    assert "holds an earlier run" in err[0] and sorted(os.listdir(run)) == before


class FakeStore:
    """torchrun's store as `rank_config.checked_once` uses it."""

    def __init__(self):
        self.values = {}

    def set(self, key, value):
        self.values[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.values[key]


def test_under_plain_torchrun_local_rank_0_checks_and_the_others_take_its_config(tmp_path, monkeypatch):
    """`torchrun -m colocate.train --config ...` (the tests, the README): local rank 0 checks, the
    node's other ranks load what it resolved from torchrun's store and check nothing."""
    import colocate.preflight
    store, checks = FakeStore(), []
    monkeypatch.setattr(rank_config, "node_store", lambda: store)
    real = colocate.preflight.preflight
    monkeypatch.setattr(colocate.preflight, "preflight", lambda *a, **k: checks.append(1) or real(*a, **k))
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["--config", os.path.join(REPO, "configs", "cpu-tiny.yaml"), f"--metrics.run_dir={tmp_path / 'run'}",
            f"--model.cache_dir={tmp_path / 'cache'}", "--learner.lr=3e-3"]
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", rank)
        cfg, resume, _ = rank_config.configure(argv)
        assert cfg.learner.lr == 3e-3 and resume is None and cfg.model.cache_dir == str(tmp_path / "cache")
    assert checks == [1]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit):  # a refusal leaves the others a word to exit on
        rank_config.configure([*argv, "--engine.temperature=.nan"])
    assert store.values["colocate/checked-config/node0"] == rank_config.REFUSED.encode()


@pytest.mark.slow
def test_a_launch_runs_the_config_checks_once(tmp_path):
    """Issue 60: `colocate train` checks once (its child), the ranks not again; plain torchrun checks
    once too (local rank 0). Counted by the reward's pre-launch probe call. Two one-step launches of
    cpu-dataset-tiny (~25 s each on 2 cores)."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    common = ["--config", "configs/cpu-dataset-tiny.yaml", "--env.reward=tests.reward_fixtures:counts_its_checks",
              "--learner.num_steps=1", "--eval.at_end=false", f"--model.cache_dir={tmp_path / 'cache'}"]
    for name, cmd in (("colocate", [sys.executable, "-m", "colocate.cli", "train", "--nproc", "2"]),
                      ("torchrun", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                    "--nproc-per-node=2", "-m", "colocate.train"])):
        log = tmp_path / f"{name}.checks"
        proc = subprocess.run([*cmd, *common, f"--metrics.run_dir={tmp_path / name}"], cwd=REPO, capture_output=True,
                              text=True, timeout=600, env={**env, "COLOCATE_TEST_CHECKS": str(log)})
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert len(log.read_text().splitlines()) == 1, (name, log.read_text())


# -- the catalogue's launcher rows (docs/errors.md, `scripts/bad_inputs.py`) -------------------------
LAUNCH_CASES = [
    ("reward ends its process", "a reward calling os._exit(0)", "train",
     "import os\n\n\ndef score(*args, **kwargs):\n    os._exit(0)\n",
     "colocate: failed: the checks before launch ended without a result (their process exited with code 0)"),
    ("reward module exits at import", "sys.exit(3) in a reward module", "train", "import sys\n\nsys.exit(3)\n",
     "colocate: failed: the checks before launch raised SystemExit: 3; at <module> ("),
    ("resolved config changed", "a rank's --resolved-config file edited", "rank", "edited",
     "`colocate train` checked (the file changed after the checks)"),
    ("resolved config missing", "a rank's --resolved-config file removed", "rank", "missing", "cannot be read"),
    ("resolved config and more", "--resolved-config with other arguments", "rank", "extra", "comes alone"),
    ("resolved config never handed over", "a rank of `colocate train` whose launcher sent no word in its wait",
     "rank", "late", "no checked config came from `colocate train`"),
]
"""(id, input shown, where: the launcher's checks or a rank, what: a reward module's source or how the
rank's resolved config is spoiled, text the one line must contain)."""


def launcher_case(source: str, tmp: str) -> int:
    """`colocate train` (torchrun replaced) on cpu-dataset-tiny with the reward module `source`."""
    with open(os.path.join(tmp, "user_launch_case.py"), "w") as f:
        f.write(source)
    sys.modules.pop("user_launch_case", None)
    sys.path.insert(0, tmp)
    saved = launcher.run_torchrun, {k: os.environ.pop(k) for k in ("WORLD_SIZE", "RANK") if k in os.environ}
    launcher.run_torchrun = lambda args, job: 0
    data = [os.path.join(REPO, "examples", "data", f"addition-{s}.jsonl") for s in ("train", "eval")]
    try:
        return cli.main(["train", "--config", DATASET, "--env.reward=user_launch_case:score", f"--env.data_files={data[0]}",
                         f"--env.eval_files={data[1]}", f"--metrics.run_dir={tmp}/run", f"--model.cache_dir={tmp}/cache"])
    finally:
        launcher.run_torchrun = saved[0]
        os.environ.update(saved[1])
        sys.path.remove(tmp)


def rank_case(what: str, tmp: str) -> int:
    """A rank (WORLD_SIZE=2, RANK=0 set by the caller) given a resolved config spoiled as `what` says
    ("late": a rank of `colocate train` waiting for a handover that does not come, its wait shortened)."""
    if what == "late":
        return late_rank_case()
    cfg, _ = launch.parse_config(["--config", os.path.join(REPO, "configs", "cpu-tiny.yaml"),
                                  f"--metrics.run_dir={tmp}/run"], 2)
    args = rank_config.write_resolved(launch.config_text(cfg))
    path = args[0].partition("=")[2]
    if what == "edited":
        with open(path, "a") as f:
            f.write("# edited\n")
    os.remove(path) if what == "missing" else None
    try:
        rank_config.configure([*args, "--learner.lr=1"] if what == "extra" else args)
    except SystemExit as e:
        return e.code
    finally:
        if os.path.exists(path):
            os.remove(path)
    return 0


def late_rank_case() -> int:
    from colocate import handover
    path, saved = handover.place(), handover.WAIT_S
    handover.WAIT_S = 0.05
    try:
        rank_config.configure([f"--resolved-config={path}"])
    except SystemExit as e:
        return e.code
    finally:
        handover.WAIT_S = saved
        handover.remove(path)
    return 0


def run_launch_case(where: str, what: str, tmp: str) -> tuple[int, str]:
    """(exit code, stderr) of one launcher case in the directory `tmp`."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = launcher_case(what, tmp) if where == "train" else rank_case(what, tmp)
    return code, err.getvalue()


@pytest.mark.parametrize("case_id,shown,where,what,expected", LAUNCH_CASES, ids=[c[0] for c in LAUNCH_CASES])
def test_each_launcher_case_is_one_line(case_id, shown, where, what, expected, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    code, err = run_launch_case(where, what, str(tmp_path))
    lines = err.strip().splitlines()
    assert code == (1 if where == "train" else 2) and len(lines) == 1 and expected in lines[0], (code, err)


def test_the_catalogue_lists_every_launcher_case():
    from tests.test_bad_input import catalogue
    rows = catalogue()
    assert [c[0] for c in LAUNCH_CASES if c[0] not in rows] == [], "run `python scripts/bad_inputs.py`"
