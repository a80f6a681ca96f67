"""Shared fixtures (a tiny tokenizer + model built once per session in a temp cache) and the
right-padded reference layout the learner's packed path is checked against."""
import dataclasses
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from colocate.data import TrajectoryBatch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_interpreted(test_file: str) -> str:
    """Run `test_file` as a script under Triton's interpreter (chosen when `triton.jit` decorates a
    kernel, so it must be on before the kernel module is imported) -> its last line of output."""
    import subprocess
    import sys
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, os.path.abspath(test_file)], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.strip().splitlines()[-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fields_left_at_default(record) -> list[str]:
    """The fields of a settings record that hold their default. A test that sets every key a
    `from_config` reads off its default expects none: a key forgotten there would show up here."""
    left = []
    for f in dataclasses.fields(record):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if getattr(record, f.name) == default:
            left.append(f.name)
    return left


def torchrun(args: list[str], nproc: int = 2, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`torchrun -m colocate.train ARGS` on this machine (`env` added to this process's); it must succeed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "colocate.train", *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@dataclasses.dataclass(frozen=True)
class FinishedRun:
    run_dir: Path
    stdout: str
    stderr: str


LEARNING_STEPS = 80


TRACKERS = ("wandb", "mlflow", "trackio")


def tracker_env(root: Path) -> dict:
    """Where each tracker writes offline, under `root` (tests/test_trackers.py reads it back)."""
    return {"WANDB_MODE": "offline", "WANDB_DIR": str(root), "WANDB_SILENT": "true",
            "MLFLOW_TRACKING_URI": (root / "mlruns").as_uri(), "MLFLOW_ALLOW_FILE_STORE": "true",
            "TRACKIO_DIR": str(root / "trackio")}


@pytest.fixture(scope="session")
def learning_run(tmp_path_factory) -> FinishedRun:
    """cpu-tiny as configured (lag 1, the canary at every version) for `LEARNING_STEPS` steps with
    adapter checksums on and every installed tracker beside TensorBoard (offline, `tracker_env`),
    under torchrun: one run that every test of a healthy learning run reads (the reward improves:
    test_train_cpu; the canary never alerts: test_canary; every tracker holds every step:
    test_trackers)."""
    import importlib.util
    tmp = tmp_path_factory.mktemp("learning")
    loggers = ["tensorboard", *(t for t in TRACKERS if importlib.util.find_spec(t) is not None)]
    proc = torchrun(["--config", "configs/cpu-tiny.yaml", f"--learner.num_steps={LEARNING_STEPS}",
                     f"--metrics.run_dir={tmp / 'run'}", f"--model.cache_dir={tmp / 'cache'}",
                     "--sync.check_checksum=true", f"--metrics.loggers={','.join(loggers)}"],
                    env=tracker_env(tmp / "trackers"))
    return FinishedRun(tmp / "run", proc.stdout, proc.stderr)


@pytest.fixture(scope="session")
def tiny_cfg(tmp_path_factory):
    from colocate.config import load_config
    cache = tmp_path_factory.mktemp("cache")
    return load_config(os.path.join(REPO, "configs", "cpu-tiny.yaml"), {"model": {"cache_dir": str(cache)}})


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_cfg):
    from colocate.envs import env_corpus
    from colocate.models import load_tokenizer
    key, fn = env_corpus(tiny_cfg)
    return load_tokenizer(tiny_cfg.model, fn, key)


@pytest.fixture()
def tiny_policy(tiny_cfg, tiny_tokenizer):
    from colocate.models import build_policy
    return build_policy(tiny_cfg, tiny_tokenizer, torch.device("cpu"))


# -- an independent reference layout: right-padded rows, lm_head on gathered completion positions --
class CompletionView:
    """Right-padded model inputs of a micro-batch plus its completion-row bookkeeping."""

    def __init__(self, mb: TrajectoryBatch, pad_id: int, device):
        seq_lens, prompt_lens = mb.seq_lens.tolist(), mb.prompt_lens.tolist()
        width = max(seq_lens)
        self.input_ids = torch.full((len(seq_lens), width), pad_id, dtype=torch.long)
        self.attention_mask = torch.zeros((len(seq_lens), width), dtype=torch.long)
        rows, cols, seq_ids = [], [], []
        offset = 0
        for r, (n, p) in enumerate(zip(seq_lens, prompt_lens)):
            self.input_ids[r, :n] = mb.tokens[offset:offset + n].long()
            self.attention_mask[r, :n] = 1
            # completion token at position t is predicted by the hidden state at t - 1
            rows += [r] * (n - p)
            cols += list(range(p - 1, n - 1))
            seq_ids += [r] * (n - p)
            offset += n
        self.input_ids = self.input_ids.to(device)
        self.attention_mask = self.attention_mask.to(device)
        self.rows = torch.tensor(rows, dtype=torch.long, device=device)          # [N]
        self.cols = torch.tensor(cols, dtype=torch.long, device=device)          # [N]
        self.seq_ids = torch.tensor(seq_ids, dtype=torch.long, device=device)    # [N]
        self.targets = self.input_ids[self.rows, self.cols + 1]                  # [N]


def right_padded_logits(causal_lm, view: CompletionView) -> torch.Tensor:
    """[N, V] logits at completion positions of a right-padded view (unsharded models only)."""
    hidden = causal_lm.model(input_ids=view.input_ids, attention_mask=view.attention_mask).last_hidden_state
    return causal_lm.lm_head(hidden[view.rows, view.cols])


def pytest_collection_modifyitems(config, items):
    """Every GPU test carries its own `@pytest.mark.timeout`: a hung one is then named and cut at its
    limit instead of stalling the suite (`-m gpu -rA` says which test did what). With
    `PYTEST_SHUFFLE_SEED=N` the tests run in an order shuffled by N (no test may depend on another's
    order: the GPU suite's runs and its check of the card are made for any order)."""
    seed = os.environ.get("PYTEST_SHUFFLE_SEED")
    if seed:
        import random
        random.Random(int(seed)).shuffle(items)
    # The tests that read the suite's vLLM runs last: the runs start with the first GPU test and go
    # on in the background while the in-process tests run; a reader first would wait for its run.
    items[:] = [i for i in items if not i.get_closest_marker("gpu_job")] + \
        [i for i in items if i.get_closest_marker("gpu_job")]
    untimed = [item.nodeid for item in items
               if item.get_closest_marker("gpu") and not item.get_closest_marker("timeout")]
    if untimed:
        raise pytest.UsageError(f"GPU tests without @pytest.mark.timeout: {', '.join(untimed)}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report on its test (`item.rep_call`): the GPU check below skips a failed test."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


@pytest.fixture(autouse=True)
def fresh_startup_timeline(monkeypatch):
    """Each test starts with no start-up timeline in the process and no mark waiting for one
    (`startup.mark` before `begin` keeps it for the next timeline begun: another test's)."""
    from colocate import startup
    monkeypatch.setattr(startup, "_PROCESS", None)
    monkeypatch.setattr(startup, "_BEFORE", {})


@pytest.fixture()
def compile_configs():
    """`fsdp.apply_compile` sets Dynamo's configs for the process: a test that compiles
    gets them back as they were after it, through the configs' own `patch` (a monkeypatch's undo
    deletes a config module's key, which hides it from every later reader)."""
    dynamo = torch._dynamo.config
    with dynamo.patch(specialize_float=dynamo.specialize_float, nested_graph_breaks=dynamo.nested_graph_breaks):
        yield


@pytest.fixture(scope="session")
def gpu_jobs(request, tmp_path_factory):
    """The vLLM runs of the selected tests marked `gpu_job(NAME)`, started together at the session's
    start (tests/gpu_suite.py); a test reads its own with `gpu_jobs.result(NAME)`. None without
    CUDA or vLLM (those tests skip), or when the GPU has too little free memory for one run."""
    import importlib.util
    names = {m.args[0] for item in request.session.items for m in item.iter_markers("gpu_job")}
    if not names or not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None:
        yield None
        return
    from tests.gpu_suite import GpuJobs, job_table, slots
    free, total = torch.cuda.mem_get_info(0)
    num_slots = slots(free)
    if num_slots < 1:
        yield None
        return
    root = tmp_path_factory.mktemp("gpu-runs")
    table = job_table(root, total)
    runner = GpuJobs([table[n] for n in sorted(names)], num_slots, root)
    yield runner
    runner.close()


SMALL_SEGMENT = 2 << 20
"""What a test may leave in CUDA's caching allocator: one segment of its small pool (2 MiB, which
holds any allocation under 1 MiB), where a module keeps a small buffer for good (the bulk loss
kernel's row counters). Anything a vLLM run would miss is larger."""


@pytest.fixture(autouse=True)
def gpu_left_as_found(request):
    """Every GPU test leaves the card as it found it: pytest's own process holds no more of CUDA's
    caching allocator than before the test (after dropping what can be dropped), and no process the
    test started is still on the GPU. Otherwise the test is named here (a vLLM engine started later
    would find the memory taken); a test that failed is not checked (its traceback holds its tensors). The first GPU test also starts the suite's vLLM runs (`gpu_jobs`)."""
    if request.node.get_closest_marker("gpu") is None or not torch.cuda.is_available():
        yield
        return
    from tests.gpu_suite import describe, gpu_processes, held_bytes
    request.getfixturevalue("gpu_jobs")
    before, procs = held_bytes(), gpu_processes()
    yield
    call = getattr(request.node, "rep_call", None)
    if call is None or call.failed:  # its traceback keeps the test's tensors alive: the failure says enough
        return
    after, left = held_bytes(), {p: b for p, b in gpu_processes().items() if p not in procs}
    problems = []
    if after > before + SMALL_SEGMENT:
        problems.append(f"pytest's process holds {(after - before) / 2**20:.0f} MiB more of the GPU than before "
                        "(tensors the test kept alive)")
    if left:
        problems.append("left processes on the GPU: " + ", ".join(
            f"{describe(pid)} with {used / 2**20:.0f} MiB" for pid, used in left.items()))
    assert not problems, f"{request.node.nodeid}: " + "; ".join(problems)

