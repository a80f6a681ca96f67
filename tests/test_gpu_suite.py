"""The GPU suite's runner (tests/gpu_suite.py), on the CPU: runs start at most N at a time, each
ends with its output, and what a run leaves behind is killed and named."""
import os
import sys
import time

from tests.gpu_suite import REPO, GpuJobs, Job, job_table, run_pids, share_overrides, slots


def py(code: str) -> list:
    return [sys.executable, "-c", code]


def test_runs_share_the_slots_and_each_ends_with_its_output(tmp_path):
    # each run writes its start and end times; with 2 slots no three overlap
    jobs = [Job(f"j{i}", py(f"import time; t=time.time(); time.sleep(0.5); print('j{i}', t, time.time())"), 60,
                expected_s=i) for i in range(4)]
    runner = GpuJobs(jobs, 2, tmp_path)
    spans = []
    for i in range(4):
        run = runner.result(f"j{i}")
        assert run.returncode == 0 and run.stray == [] and run.output.startswith(f"j{i}"), run.output
        spans.append(tuple(map(float, run.output.split()[1:3])))
    runner.close()
    for t, _ in spans:  # at any run's start, at most the other slot is busy
        assert sum(a <= t < b for a, b in spans) <= 2


def test_what_a_run_leaves_behind_is_killed_and_named(tmp_path):
    # the run's command starts a child in a session of its own (as torchrun does with its ranks) and exits
    leaver = py("import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
                "start_new_session=True)")
    runner = GpuJobs([Job("leaver", leaver, 60), Job("slow", py("import time; time.sleep(600)"), 1)], 2, tmp_path,
                     grace_s=1.0)
    left = runner.result("leaver")
    assert left.returncode == 0 and len(left.stray) == 1 and run_pids(str(tmp_path / "leaver")) == []
    slow = runner.result("slow")  # past its limit: killed, and said so
    assert slow.returncode == -9 and "killed at its 1 s limit" in slow.output
    runner.close()


def test_runs_are_sized_from_the_card_and_what_is_free(monkeypatch):
    gib = 2**30
    assert share_overrides(139 * gib) == ["--engine.gpu_memory_utilization=0.086", "--engine.kv_cache_gib=1.0"]
    monkeypatch.setenv("COLOCATE_GPU_JOBS", "8")
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert slots(130 * gib) == 4 and slots(45 * gib) == 1 and slots(40 * gib) == 0  # 32 GiB kept for in-process tests
    monkeypatch.setenv("COLOCATE_GPU_JOBS", "1")
    assert slots(130 * gib) == 1


def test_a_run_that_cannot_start_is_reported_not_waited_for(tmp_path):
    """A command that does not exist: its reader gets the reason at once, not a wait to its limit."""
    runner = GpuJobs([Job("missing", ["/nonexistent/python"], 60)], 1, tmp_path, grace_s=0.0)
    try:
        runner.result("missing")
        raise AssertionError("a run that never started read as finished")
    except RuntimeError as e:
        assert "never started" in str(e)
    runner.close()


def test_readers_of_the_runs_come_last_in_any_order(monkeypatch):
    """The tests that read a vLLM run are ordered after the in-process ones (the runs go on in the
    background meanwhile), also in a shuffled order; the others keep their relative order."""
    from tests.conftest import pytest_collection_modifyitems

    class Item:
        def __init__(self, name, job):
            self.name, self.nodeid, self.job = name, name, job

        def get_closest_marker(self, marker):
            return {"gpu_job": self.job, "gpu": True, "timeout": True}.get(marker) or None

    items = [Item(f"t{i}", i % 3 == 0) for i in range(9)]
    pytest_collection_modifyitems(None, items)
    assert [i.name for i in items] == ["t1", "t2", "t4", "t5", "t7", "t8", "t0", "t3", "t6"]
    monkeypatch.setenv("PYTEST_SHUFFLE_SEED", "3")
    pytest_collection_modifyitems(None, items)
    assert all(i.job for i in items[-3:]) and not any(i.job for i in items[:-3])


def test_a_process_that_overwrote_its_environment_is_still_its_runs(tmp_path):
    """vLLM's engine core renames itself with setproctitle, which overwrites the memory its
    environment is read from: its run is known by its parent, and after the parent is gone by what
    the runner saw while the run lived (the child here starts with an empty environment)."""
    from tests.gpu_suite import run_of
    child = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
             "env={}, start_new_session=True); time.sleep(5)")
    runner = GpuJobs([Job("renamed", py(child), 60)], 1, tmp_path, grace_s=0.5)
    marker = str(tmp_path / "renamed")
    deadline = time.monotonic() + 4
    while len(run_pids(marker)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = run_pids(marker)
    assert len(pids) == 2 and all(run_of(p) == marker for p in pids)  # the child by its parent's marker
    left = runner.result("renamed")  # the parent has exited: the child is known as seen, and killed
    assert left.returncode == 0 and len(left.stray) == 1 and run_pids(marker) == []
    runner.close()


def test_the_fp8_runs_take_their_lora_mode_with_a_correction_the_config_check_passes(tmp_path):
    """learn-fp8, canary-fp8 and their -merged twins (tests/test_vllm_gpu.py reads them): vLLM's
    online FP8 in slot or merged mode with TIS, a config `colocate train` accepts (FP8 without a
    correction is refused)."""
    from colocate.config import load_config, parse_overrides
    table = job_table(tmp_path, 139 * 2**30)
    for name in ("learn-fp8", "canary-fp8", "learn-fp8-merged", "canary-fp8-merged"):
        cmd = table[name].cmd
        keys = [a for a in cmd if a.startswith("--") and "." in a.partition("=")[0]]
        _, overrides, _ = parse_overrides(keys)
        cfg = load_config(os.path.join(REPO, cmd[cmd.index("--config") + 1]), overrides)
        mode = "merged" if name.endswith("-merged") else "slot"
        assert (cfg.engine.kind, cfg.engine.quantization, cfg.engine.lora_mode, cfg.loss.tis_cap) == \
            ("vllm", "fp8", mode, 2.0), name
    assert table["canary-fp8"].env["CANARY_TEST_FAULT"] == table["canary-fp8-merged"].env["CANARY_TEST_FAULT"] \
        == "vllm-skip"
