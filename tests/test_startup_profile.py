"""The startup profile's A/B mode (`benchmarks/startup.py --baseline-tree`: which runs, from which
tree, in which order, and ours over the base), and the clock its figures count from
(`startup.process_start`). No launches: the runs are replaced."""
import argparse
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO


def args_of(*argv: str):
    from benchmarks.startup import add_args
    parser = argparse.ArgumentParser()
    add_args(parser)
    return parser.parse_args(list(argv))


def test_alone_the_profile_runs_cold_then_warm_in_one_cache():
    from benchmarks.startup import plan_runs
    args = args_of()
    assert (args.baseline_tree, args.pairs) == ("", 1)
    assert plan_runs("", 1) == [("cold", "", "cache"), ("warm", "", "cache")]


def test_beside_a_baseline_each_tree_runs_cold_then_the_warm_runs_alternate(tmp_path):
    from benchmarks.startup import plan_runs
    (tmp_path / "colocate").mkdir()
    (tmp_path / "colocate" / "cli.py").write_text("")
    base = str(tmp_path)
    args = args_of("--baseline-tree", base, "--pairs", "2")
    assert plan_runs(args.baseline_tree, args.pairs) == [
        ("base cold", base, "cache-base"), ("ours cold", "", "cache-ours"),
        ("base warm", base, "cache-base"), ("ours warm", "", "cache-ours"),
        ("ours warm#2", "", "cache-ours"), ("base warm#2", base, "cache-base"),
        ("base warm#3", base, "cache-base"), ("ours warm#3", "", "cache-ours"),
        ("ours warm#4", "", "cache-ours"), ("base warm#4", base, "cache-base")]


def test_a_baseline_that_is_no_source_tree_or_no_warm_round_is_refused(tmp_path):
    from benchmarks.startup import plan_runs
    with pytest.raises(SystemExit, match="no colocate/cli.py there"):
        plan_runs(str(tmp_path), 1)
    with pytest.raises(SystemExit, match="--pairs=0: expected at least 1"):
        plan_runs(REPO, 0)


def test_ours_over_the_base_compares_cold_runs_and_the_median_of_the_warm_ones():
    from benchmarks.startup import compare

    def rec(checks, first):
        return {"since_command": {"checks_done": checks, "first_step_end": first}}
    records = {"base cold": rec(8.0, 20.0), "ours cold": rec(6.0, 16.0),
               "base warm": rec(7.0, 12.0), "ours warm": rec(5.0, 9.0), "ours warm#2": rec(5.5, 10.0),
               "base warm#2": rec(7.4, 13.0)}
    got = compare(records)
    assert got["cold_checks_done_ours_over_base"] == 0.75 and got["cold_first_step_end_ours_over_base"] == 0.8
    assert got["warm_checks_done_ours_s"] == 5.25 and got["warm_checks_done_base_s"] == 7.2
    assert got["warm_checks_done_ours_over_base"] == round(5.25 / 7.2, 3)
    assert got["warm_first_step_end_ours_over_base"] == round(9.5 / 12.5, 3)
    assert compare({"ours cold": rec(6.0, 16.0)}) == {}  # nothing to set it beside


def test_each_tree_runs_from_its_own_directory_with_its_code_first(monkeypatch, tmp_path):
    """The profile's run loop over replaced launches: the base's runs start in its tree, each tree
    has its own compile cache (a cold run is cold for both), and the record carries the ratios."""
    import benchmarks.startup as startup
    (tmp_path / "colocate").mkdir()
    (tmp_path / "colocate" / "cli.py").write_text("")
    seen = []

    def launch(args, run_dir, cache_dir, tree=""):
        seen.append((os.path.basename(run_dir), os.path.basename(cache_dir), tree))
        first = 10.0 if tree else 8.0
        marks = {"checks_done": first / 2, "first_step_end": first}
        return {"marks": marks, "since_command": marks, "phases": {"checks": first / 2}, "command_wall_s": first}
    monkeypatch.setattr(startup, "launch", launch)
    record = startup.run(args_of("--baseline-tree", str(tmp_path)))
    base = str(tmp_path)
    assert seen == [("base-cold", "cache-base", base), ("ours-cold", "cache-ours", ""),
                    ("base-warm", "cache-base", base), ("ours-warm", "cache-ours", ""),
                    ("ours-warm_2", "cache-ours", ""), ("base-warm_2", "cache-base", base)]
    assert record["ratios"]["warm_first_step_end_ours_over_base"] == 0.8
    assert record["figures"]["ours_warm#2_checks"] == 4.0


def test_runs_are_compared_on_the_benchmarks_clock_whatever_origin_a_tree_counts_from():
    """A tree whose launch time is early (an older tree's psutil create_time) reports its marks late by as much;
    since the command both trees' marks are the same unix times."""
    from benchmarks.startup import side_by_side, since_command
    early = {"origin_unix": 999.7, "marks": {"rank_start": 1.0, "checks_done": 5.3, "first_step_end": 9.3}}
    exact = {"origin_unix": 1000.0, "marks": {"rank_start": 1.3, "checks_done": 5.0, "first_step_end": 9.0}}
    assert since_command(early, 999.9) == since_command(exact, 999.9) == {"checks_done": 5.1, "first_step_end": 9.1}
    rows = side_by_side({"base": {**early, "since_command": since_command(early, 999.9), "phases": {}},
                         "ours": {**exact, "since_command": since_command(exact, 999.9), "phases": {},
                                  "launcher_phases": {"parse": 0.25, "env": 1.5}}})
    assert [r.split()[:3] for r in rows if r.startswith("command")] == [["command", "->", "checks_done"],
                                                                      ["command", "->", "first_step_end"]]
    # the launcher's check phases in their order, where a run has them (the base's tree had none)
    assert [r.split() for r in rows if r.startswith("launcher")] == [["launcher", "parse", "-", "0.25"],
                                                                    ["launcher", "env", "-", "1.50"]]


def test_the_launch_clock_is_the_process_start_to_a_clock_tick():
    """psutil's create_time counts from a boot time in whole seconds: up to 1 s early, which every
    start-up mark then carries. `process_start` of a child lies between the parent's clock just
    before it started the child and the child's own clock, each read within one tick (/proc/uptime
    and the start tick are in 1/CLK_TCK units)."""
    if not os.path.exists("/proc/uptime"):
        pytest.skip("Linux /proc only")
    tick = 1 / os.sysconf("SC_CLK_TCK")
    before = time.time()
    out = subprocess.run([sys.executable, "-c", "import time; from colocate.startup import process_start; "
                          "t = time.time(); print(process_start(), t)"], capture_output=True, text=True,
                         cwd=REPO, check=True).stdout.split()
    started, child_now = map(float, out)
    assert before - 2 * tick <= started <= child_now + 2 * tick


def test_importtime_runs_every_process_under_it_and_keeps_each_ones_heaviest_imports(monkeypatch, tmp_path):
    """--importtime: the launch gets PYTHONPROFILEIMPORTTIME and torchrun's per-rank stderr files;
    the record keeps, per process, the top-level imports' total and the heaviest (cumulative ms)."""
    import json

    import benchmarks.startup as startup
    run_dir = str(tmp_path / "warm")
    log = ("import time: self [us] | cumulative | imported package\n"
           "import time:      2000 |     900000 |   torch._C\n"
           "import time:     10000 |    1200000 | torch\n"
           "import time:       500 |      30000 | yaml\n"
           "colocate: a line of the run\n")
    seen = {}

    def fake_run(cmd, stdout, env, **kwargs):
        seen.update(cmd=cmd, env=env)
        stdout.write(log)
        os.makedirs(run_dir)
        timeline = {"origin_unix": 1.0, "marks": {"checks_done": 2.0}, "phases": {"step_1": 0.1}}
        for name, data in (("startup.json", timeline), ("summary.json", {"timeline": []})):
            with open(os.path.join(run_dir, name), "w") as f:
                json.dump(data, f)
        ranks = os.path.join(f"{run_dir}-ranks", "id_x", "attempt_0", "1")
        os.makedirs(ranks)
        with open(os.path.join(ranks, "stderr.log"), "w") as f:
            f.write(log.replace("| torch\n", "| colocate.learner.learner\n"))
        return subprocess.CompletedProcess(cmd, 0)
    monkeypatch.setattr(startup.subprocess, "run", fake_run)
    record = startup.launch(args_of("--importtime"), run_dir, str(tmp_path / "cache"))
    assert seen["env"]["PYTHONPROFILEIMPORTTIME"] == "1"
    assert seen["cmd"][-4:] == ["--log-dir", f"{run_dir}-ranks", "--redirects", "2"]
    assert record["imports"] == {"launcher": {"total_ms": 1230, "heaviest_ms": {"torch": 1200, "yaml": 30}},
                                 "local rank 1": {"total_ms": 1230,
                                                  "heaviest_ms": {"colocate.learner.learner": 1200, "yaml": 30}}}
    assert startup.import_lines({"warm": record}, top=1) == [
        "[imports] warm launcher: 1.23 s; torch 1.20",
        "[imports] warm local rank 1: 1.23 s; colocate.learner.learner 1.20"]
