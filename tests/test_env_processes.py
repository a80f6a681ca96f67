"""`env.processes`: the env's copies in worker processes play what the in-process env plays, every
group comes back once, and failures, metrics, state and config refusals are handled."""
import pytest

from colocate.config import Config
from colocate.config_checks import ConfigError, validate
from colocate.data import Completion, Request, Sample
from colocate.engine.base import Engine
from colocate.envs.base import Env
from colocate.envs.processes import EnvProcesses, EnvProcessError
from colocate.rollout.worker import RolloutSettings, RolloutWorker
from tests.test_rollout_worker import BarrierEngine, ShuffledStreamEngine, _samples, dip_tokenizer  # noqa: F401


def dip_cfg() -> Config:
    cfg = Config()
    cfg.env.name, cfg.env.horizon_years, cfg.env.unit_labels, cfg.env.state_cache = "diplomacy", 1, False, ""
    cfg.rollout.group_size = 2
    return cfg


def test_one_process_plays_the_in_process_env_games(dip_tokenizer):
    from colocate.envs.diplomacy import DiplomacyEnv
    cfg = dip_cfg()

    def play(env):
        worker = RolloutWorker(env, BarrierEngine(), RolloutSettings(groups_per_batch=3))
        return [worker.collect()[0] for _ in range(2)]

    here = play(DiplomacyEnv.from_config(cfg, dip_tokenizer, seed=7))
    env = EnvProcesses(DiplomacyEnv, cfg, dip_tokenizer, seed=7, num=1)  # its copy's seed: 7 * 1 + 0
    try:
        there = play(env)
        assert env.group_size == 2 and env.state_dict() is None  # Diplomacy keeps no resume state
    finally:
        env.close()
    for a, b in zip(here, there):
        assert a.num_sequences == b.num_sequences == 3 * 2 * 7
        assert _samples(a) == _samples(b)


def test_two_processes_stream_every_group_once_with_tables_built(dip_tokenizer):
    from colocate.envs.diplomacy import DiplomacyEnv
    env = EnvProcesses(DiplomacyEnv, dip_cfg(), dip_tokenizer, seed=3, num=2)
    engine = ShuffledStreamEngine(seed=4)
    submitted = []
    submit = engine.submit
    engine.submit = lambda requests: (submitted.extend(requests), submit(requests))[1]
    try:
        worker = RolloutWorker(env, engine, RolloutSettings(groups_per_batch=3, oversample=1, stream=True))
        completions = 0
        for _ in range(3):
            batch, stats, _ = worker.collect()
            assert batch.num_sequences == 3 * 2 * 7 and not engine.pending
            assert 0 <= stats["invalid_order_rate"] <= 1
            completions += stats["completions"]  # the env's metrics, merged over the two copies
        assert engine.partial_polls > 0  # it streamed
        assert completions == len(submitted)  # each answered request was stepped once, in its copy
    finally:
        env.close()
    # every request reached the engine with its automaton built in its copy
    assert submitted and all("_table" in r.constraint.__dict__ for r in submitted if r.constraint.slots)


def test_settle_and_has_news(dip_tokenizer):
    from colocate.envs.diplomacy import DiplomacyEnv
    env = EnvProcesses(DiplomacyEnv, dip_cfg(), dip_tokenizer, seed=5, num=2)
    try:
        for g in range(4):
            env.start_group(g)
        env.settle()
        assert not env.has_news()  # everything owed has been filed
        keyed = env.requests()
        assert {k[0] for k, _ in keyed} == {0, 1, 2, 3} and len(keyed) == 4 * 2 * 7
        assert env.requests() == keyed  # asked again: the same requests, until answered
        with pytest.raises(KeyError, match="not requested"):
            env.step({(9, 0, "FRANCE"): Completion([1], [0.0], None, 0)})
    finally:
        env.close()


class OneRoundEnv(Env):
    """Groups of 2 requests that finish once both are answered."""
    group_size = 2

    @classmethod
    def from_config(cls, cfg, tokenizer, seed):
        return cls()

    def __init__(self):
        self.waiting, self.done = {}, []

    def start_group(self, group_id):
        self.waiting.update({(group_id, i): Request([1, 2], 1) for i in range(2)})

    def requests(self):
        return list(self.waiting.items())

    def step(self, completions):
        for key, c in completions.items():
            del self.waiting[key]
            self.done.append(Sample([1, 2], c, float(key[1]), key[0]))

    def pop_finished(self):
        pending = {key[0] for key in self.waiting}
        out = [s for s in self.done if s.group_key not in pending]
        self.done = [s for s in self.done if s.group_key in pending]
        return out


class RaisingEnv(OneRoundEnv):
    """Raises in step for group 1."""

    def step(self, completions):
        if any(key[0] == 1 for key in completions):
            raise ValueError("user code failed on group 1")
        super().step(completions)


def test_a_copy_that_raises_stops_with_its_traceback():
    env = EnvProcesses(RaisingEnv, Config(), None, seed=0, num=2)
    try:
        for g in range(2):
            env.start_group(g)
        env.settle()
        env.step({k: Completion([3], [0.0], None, 0) for k, _ in env.requests()})
        with pytest.raises(EnvProcessError, match="(?s)env process 1 .*raised.*user code failed on group 1"):
            env.settle()
    finally:
        env.close()


def test_merged_metrics_are_what_one_env_reports(dip_tokenizer):
    """Groups 0-1 then 2-3 reported apart and merged == one env reporting all four."""
    from colocate.envs.diplomacy import DiplomacyEnv, DiplomacySettings
    from tests.test_diplomacy_env import random_policy, run

    def env():
        settings = DiplomacySettings(group_size=3, horizon_years=2, unit_labels=False)
        return DiplomacyEnv(dip_tokenizer, settings, seed=1)

    apart = env()
    run(apart, random_policy(2), [0, 1])
    first = apart.metrics()
    run(apart, random_policy(3), [2, 3])
    second = apart.metrics()
    together = env()
    run(together, random_policy(2), [0, 1])
    run(together, random_policy(3), [2, 3])
    whole = together.metrics()
    merged = DiplomacyEnv.merge_metrics([first, second])
    assert merged.keys() == whole.keys()
    for key in [k for k in whole if not k.endswith("_ms") and "_ms_" not in k]:  # timings differ per run
        assert merged[key] == pytest.approx(whole[key], rel=1e-9, abs=1e-12), key



def test_the_default_merge_by_the_env_s_declared_counts():
    class Counted(Env):
        MEAN_OVER = {"rate": "n"}
        COUNTS = ("errors",)
    parts = [{"rate": 1.0, "n": 1.0, "errors": 2.0, "len_max": 5.0, "other": 1.0},
             {"rate": 0.0, "n": 3.0, "errors": 1.0, "len_max": 9.0, "other": 3.0}, {"rate": 0.0, "n": 0.0}]
    assert Counted.merge_metrics(parts) == {"rate": 0.25, "n": 4.0, "errors": 3.0, "len_max": 9.0, "other": 2.0}
    assert Env.merge_metrics([{"a": 1.0, "b": 4.0}, {"a": 3.0}]) == {"a": 2.0, "b": 4.0}  # undeclared: the mean


class FixedAnswer(Engine):
    """Answers every request with one text."""
    version = 0

    def __init__(self, tokenizer, text: str = "", ids: list[int] | None = None):
        self.ids = ids or tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]

    def generate(self, requests):
        return [Completion(list(self.ids), [-1.0] * len(self.ids), None, 0) for _ in requests]


def merged_equals_whole(make, plays) -> None:
    """Each play's metrics from its own copy, merged, are what one env that played them all reports
    (played by the env loop: the rollout worker would read and reset the metrics itself)."""
    from tests.test_diplomacy_env import run

    def policy(engine):
        return lambda key, request: engine.generate([request])[0]
    parts, whole_env, first = [], make(), 0
    for engine, groups in plays:
        part_env = make()
        run(part_env, policy(engine), range(groups))
        parts.append(part_env.metrics())
        run(whole_env, policy(engine), range(first, first + groups))
        first += groups
    whole = whole_env.metrics()
    assert whole and all(parts)
    merged = type(whole_env).merge_metrics(parts)
    assert merged.keys() == whole.keys()
    for key in whole:
        assert merged[key] == pytest.approx(whole[key], rel=1e-12), (key, parts)


def test_arithmetic_metrics_merge_to_the_whole(tiny_tokenizer):
    from colocate.envs.arithmetic import ArithmeticEnv

    def make():
        return ArithmeticEnv(tiny_tokenizer, group_size=2, max_operand=9, max_new_tokens=8, temperature=1.0,
                             use_constraint=False, seed=0)
    # 2 invalid completions and 6 valid ones: 0.25 invalid, where a mean of the copies' rates says 0.5
    merged_equals_whole(make, [(FixedAnswer(tiny_tokenizer, "x"), 1), (FixedAnswer(tiny_tokenizer, "5"), 3)])


def test_agent_metrics_merge_to_the_whole(tiny_tokenizer):
    from tests.test_agent import CALL, ScriptedEngine, agent_fixtures, make_env
    tok = tiny_tokenizer
    merged_equals_whole(lambda: make_env(tok, tools=[agent_fixtures.add], max_new_tokens=200, max_model_len=600),
                        [(ScriptedEngine(tok, [CALL, " 5"]), 1), (ScriptedEngine(tok, [" 7"]), 3)])


def test_agent_metrics_count_whole_groups_only(tiny_tokenizer):
    """An episode that finished in a group still in play counts once its group is scored, so a copy
    holding half-played groups merges to what one env reports, and shares stay within 0..1."""
    from tests.test_agent import ScriptedEngine, agent_fixtures, make_env
    tok = tiny_tokenizer
    engine = ScriptedEngine(tok, [" 7"])

    def make():
        return make_env(tok, tools=[agent_fixtures.add], max_new_tokens=200, max_model_len=600)

    def half(env, group):  # one episode of the group answers and finishes; its partner waits
        env.start_group(group)
        key, request = [(k, r) for k, r in env.requests() if k[0] == group][0]
        env.step({key: engine.generate([request])[0]})

    def whole(env, group):
        from tests.test_diplomacy_env import run
        run(env, lambda k, r: engine.generate([r])[0], [group])

    a, b, one = make(), make(), make()
    whole(a, 0), half(a, 1), whole(b, 2)
    whole(one, 0), whole(one, 2), half(one, 1)  # last: playing a whole group plays every waiting request
    parts, together = [a.metrics(), b.metrics()], one.metrics()
    assert together["episodes"] == 4 and together["finish/stop"] == 1.0
    assert type(one).merge_metrics(parts) == pytest.approx(together)


@pytest.mark.parametrize("overrides, message", [
    ({"env.name": "dataset"}, "each copy would walk its own epoch"),
    ({"env.name": "arithmetic"}, "resumes exactly"),
])
def test_config_refuses_processes_where_they_change_meaning(overrides, message):
    """The env's rules (`envs.check_env`: the dataset env's own, then env.processes against the
    rollout mode) refuse what the config's own checks let through."""
    from colocate.envs import check_env
    cfg = Config()
    cfg.env.processes = 2
    cfg.env.data_files = ["x.jsonl"]
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    validate(cfg)
    with pytest.raises(ConfigError, match=message):
        check_env(cfg, outside_world=False)
    cfg.env.name = "arithmetic"
    cfg.rollout.oversample_groups, cfg.learner.max_policy_lag = 2, 2
    validate(cfg)
    check_env(cfg, outside_world=False)  # oversampled: the order is timing's anyway


class BigEnv(OneRoundEnv):
    """Requests and samples of ~1 MB pickled each, far past a pipe's buffer."""

    def start_group(self, group_id):
        self.waiting.update({(group_id, i): Request(list(range(200_000)), 1) for i in range(2)})

    def step(self, completions):
        for key, c in completions.items():
            del self.waiting[key]
            self.done.append(Sample([1], c, 1.0, key[0]))


def test_large_messages_both_ways_do_not_deadlock():
    """Four ~2 MB steps sent without reading: the copy keeps reading while its replies wait."""
    import threading
    env = EnvProcesses(BigEnv, Config(), None, seed=0, num=1)
    big = Completion(list(range(200_000)), [0.0] * 200_000, None, 0)
    result = {}

    def play():
        for g in range(4):
            env.start_group(g)
        env.settle()
        for g in range(4):  # each step's reply (a 1 MB sample) waits while the next step is sent
            env.step({k: big for k, _ in env.requests() if k[0] == g})
        env.settle()
        result["samples"] = len(env.pop_finished())

    thread = threading.Thread(target=play, daemon=True)
    thread.start()
    thread.join(timeout=120)
    try:
        assert result.get("samples") == 8, "the pipes deadlocked"
    finally:
        if not thread.is_alive():
            env.close()


class CountingEnv(OneRoundEnv):
    """Counts its started groups: resume state and data facts per copy."""

    def __init__(self):
        super().__init__()
        self.started = 0

    def start_group(self, group_id):
        super().start_group(group_id)
        self.started += 1

    def state_dict(self):
        return {"started": self.started}

    def load_state_dict(self, state):
        self.started = state["started"]

    def data_stats(self):
        return {"rows": 10.0}


def test_resume_state_is_one_state_per_copy_and_data_stats_the_first_copys():
    env = EnvProcesses(CountingEnv, Config(), None, seed=0, num=2)
    try:
        for g in range(5):  # copy 0 gets groups 0, 2, 4; copy 1 gets 1, 3
            env.start_group(g)
        assert env.state_dict() == {"env_processes": [{"started": 3}, {"started": 2}]}
        env.load_state_dict({"env_processes": [{"started": 7}, {"started": 8}]})
        assert env.state_dict() == {"env_processes": [{"started": 7}, {"started": 8}]}
        with pytest.raises(ValueError, match="env of 1 processes, this run has env.processes=2"):
            env.load_state_dict({"env_processes": [{"started": 1}]})
        assert env.data_stats() == {"rows": 10.0}
    finally:
        env.close()


def within(seconds: float, fn):
    """fn() in a thread -> its result; fails (instead of hanging the suite) past `seconds`."""
    import threading
    out = {}
    thread = threading.Thread(target=lambda: out.update(value=fn()), daemon=True)
    thread.start()
    thread.join(timeout=seconds)
    assert "value" in out, f"still blocked after {seconds} s"
    return out["value"]


class UnpicklableEnv(OneRoundEnv):
    def pop_finished(self):
        out = super().pop_finished()
        for sample in out:
            sample.info = {"fn": lambda: None}  # cannot cross a pipe
        return out


def test_a_reply_that_cannot_be_pickled_is_an_error_not_a_hang():
    env = EnvProcesses(UnpicklableEnv, Config(), None, seed=0, num=1)
    try:
        env.start_group(0)
        env.settle()
        env.step({k: Completion([3], [0.0], None, 0) for k, _ in env.requests()})

        def settle():
            with pytest.raises(EnvProcessError, match="(?s)raised.*pickle"):
                env.settle()
            return True
        assert within(60, settle)
    finally:
        env.close()


def test_copies_leave_stop_signals_to_the_rank_and_a_dead_copy_is_named():
    import os
    import signal
    env = EnvProcesses(OneRoundEnv, Config(), None, seed=0, num=2)
    try:
        os.kill(env._procs[0].pid, signal.SIGTERM)  # graceful stop: the rank finishes its step first
        os.kill(env._procs[1].pid, signal.SIGINT)
        for g in range(2):
            env.start_group(g)
        env.settle()
        assert len(env.requests()) == 4  # both copies still answer
        os.kill(env._procs[1].pid, signal.SIGKILL)
        env._procs[1].join(timeout=10)

        def next_calls():
            with pytest.raises(EnvProcessError, match=r"env process 1 \(OneRoundEnv\) is gone \(exit code -9"):
                env.start_group(3)
                env.settle()
            return True
        assert within(60, next_calls)
    finally:
        env.close()


class OneAtATimeEngine:
    """Streams one answer per poll, so requests stay in flight when a batch ships."""
    version = 0

    def __init__(self):
        self.pending, self.next = {}, 0

    def submit(self, requests):
        tickets = list(range(self.next, self.next + len(requests)))
        self.next += len(requests)
        self.pending.update(zip(tickets, requests))
        return tickets

    def poll(self, wait_all=False, wake=None):
        taken = list(self.pending)[: len(self.pending) if wait_all else 1]
        return [(t, Completion([3], [0.0], None, 0, finish_reason="stop")) for t in taken if self.pending.pop(t)]

    def stats(self):
        return {}


def test_inflight_ships_with_the_replacement_groups_already_in_the_engine():
    """update=inflight: the groups that replace the completed ones are in the engine before the
    batch ships (the copies' first requests are waited for), so the update finds it working."""
    env = EnvProcesses(OneRoundEnv, Config(), None, seed=0, num=2)
    engine = OneAtATimeEngine()
    try:
        worker = RolloutWorker(env, engine, RolloutSettings(groups_per_batch=2, inflight=True))
        for _ in range(3):
            batch, _, _ = worker.collect()
            assert batch.num_sequences == 4
            in_engine = {key[0] for key, _ in worker._in_flight.values()}
            assert len(in_engine) >= 2 and set(worker._live) <= in_engine | {g for g in worker._complete}
    finally:
        env.close()


def test_a_resume_with_another_env_processes_is_refused_before_launch():
    """Each copy's state resumes its own groups: the saved number of copies must be this run's,
    checked with the checkpoint (exit 2 before any model), not when the env loads it."""
    from colocate.checkpoint import CheckpointError
    from colocate.launch import check_same_env
    cfg = Config()
    saved_in_process = {"inference": {"0": {"env": {"rng": [1, 2]}}}}
    saved_two = {"inference": {"0": {"env": {"env_processes": [{"rng": 1}, {"rng": 2}]}}}}
    stateless = {"inference": {"0": {"env": None}}}
    check_same_env(cfg, saved_in_process, "ckpt")
    check_same_env(cfg, stateless, "ckpt")
    with pytest.raises(CheckpointError, match=r"^ckpt: saved with env.processes=2, this run has env.processes=0"):
        check_same_env(cfg, saved_two, "ckpt")
    cfg.env.processes = 2
    check_same_env(cfg, saved_two, "ckpt")
    check_same_env(cfg, stateless, "ckpt")  # Diplomacy keeps no state: any number resumes
    with pytest.raises(CheckpointError, match="saved with env.processes=0, this run has env.processes=2"):
        check_same_env(cfg, saved_in_process, "ckpt")


def unguarded_script(tmp_path, lines: str):
    """Run a script that starts an env's copies at import time (no main guard) -> the finished process."""
    import os
    import subprocess
    import sys
    script = tmp_path / "unguarded.py"
    script.write_text("from colocate.config import Config\nfrom colocate.envs.processes import EnvProcesses\n"
                      "from tests.test_env_processes import OneRoundEnv\n" + lines)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, str(script)], cwd=repo, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": repo})


def test_a_script_without_a_main_guard_is_told_why_its_copies_died(tmp_path):
    """A copy of an env class the script itself defines runs the script again (spawn), which starts
    the env again while the copy is still starting and kills it: the script is told the cause
    instead of only the exit code."""
    out = unguarded_script(tmp_path, "class ScriptEnv(OneRoundEnv):\n    pass\n\n"
                                     "EnvProcesses(ScriptEnv, Config(), None, seed=0, num=1).close()\n")
    assert out.returncode != 0
    assert "EnvProcessError: env process 0 (ScriptEnv) is gone" in out.stderr, out.stderr[-2000:]
    assert 'under `if __name__ == "__main__":`' in out.stderr.splitlines()[-1], out.stderr[-2000:]


def test_an_importable_env_needs_no_main_guard(tmp_path):
    """An env class from a module of its own: its copies do not run the script again
    (`lifecycle.spawn_without_main`), so even a script without a main guard works."""
    out = unguarded_script(tmp_path, "EnvProcesses(OneRoundEnv, Config(), None, seed=0, num=1).close()\n")
    assert out.returncode == 0, out.stderr[-2000:]


def run_script(tmp_path, body: str, timeout: float = 120, **popen):
    """Run `body` as a script's main (guarded) from the repo root -> the finished process."""
    import os
    import subprocess
    import sys
    script = tmp_path / "script.py"
    script.write_text("from colocate.config import Config\nfrom colocate.envs.processes import EnvProcesses\n"
                      "from tests.test_env_processes import *\n\nif __name__ == '__main__':\n"
                      + "".join(f"    {line}\n" for line in body.strip().splitlines()))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, str(script)], cwd=repo, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": repo}, **popen)


def test_a_rank_that_fails_with_its_env_open_still_exits():
    """An uncaught error leaves the env referenced (the traceback, a global) until interpreter exit;
    the copies ignore SIGTERM, so multiprocessing's exit join would wait forever unless the pipes are
    closed first."""
    import pathlib
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        out = run_script(pathlib.Path(tmp), """
env = EnvProcesses(RaisingEnv, Config(), None, seed=0, num=2)
for g in range(2):
    env.start_group(g)
env.settle()
env.step({k: Completion([3], [0.0], None, 0) for k, _ in env.requests()})
env.settle()
""", timeout=90)
    assert out.returncode == 1 and "user code failed on group 1" in out.stderr, out.stderr[-2000:]


def test_a_stop_signal_while_the_copies_start_does_not_kill_them(tmp_path):
    """Ctrl-C reaches the whole process group; a copy still importing (before it ignores stop signals
    itself) must survive it, and the rank's own handler must see it."""
    out = run_script(tmp_path, """
import multiprocessing, os, signal, threading
seen = []
signal.signal(signal.SIGINT, lambda *_: seen.append("SIGINT"))

def interrupt_the_copies():  # at once: they are still importing
    while not multiprocessing.active_children():
        pass
    for child in multiprocessing.active_children():
        os.kill(child.pid, signal.SIGINT)
    os.kill(os.getpid(), signal.SIGINT)
threading.Thread(target=interrupt_the_copies, daemon=True).start()
env = EnvProcesses(OneRoundEnv, Config(), None, seed=0, num=2)
for g in range(2):
    env.start_group(g)
env.settle()
print(len(env.requests()), seen)
env.close()
""")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "4 ['SIGINT']", out.stdout


class GarbledFinishEnv(OneRoundEnv):
    """pop_finished returns None while no group has finished, then a bare dict once."""

    def pop_finished(self):
        return super().pop_finished() or (None if self.waiting else {"not": "a list"})


def test_garbled_pop_finished_from_a_copy_is_counted_not_a_crash():
    """Counted at most once per `pop_finished()` call, as in-process: many groups started at once (a
    garbled reply to each start) must not add up to the error limit."""
    env = EnvProcesses(GarbledFinishEnv, Config(), None, seed=0, num=2)
    try:
        calls = []
        pop = env.pop_finished
        env.pop_finished = lambda: (calls.append(1), pop())[1]
        worker = RolloutWorker(env, FixedAnswer(None, ids=[3]),
                               RolloutSettings(groups_per_batch=8, oversample=4, max_env_errors=3))
        for _ in range(2):
            calls.clear()
            batch, stats, _ = worker.collect()
            assert batch.num_sequences == 16 and 0 < stats["env_errors"] <= len(calls)
    finally:
        env.close()


def test_has_news_turns_true_when_a_copy_replies():
    """A streamed poll returns early on has_news: it must see a reply that arrived unasked."""
    import time
    env = EnvProcesses(OneRoundEnv, Config(), None, seed=0, num=2)
    try:
        env.settle()
        assert not env.has_news()
        env.start_group(0)
        deadline = time.monotonic() + 60
        while not env.has_news():
            assert time.monotonic() < deadline, "the copy's reply never showed as news"
            time.sleep(0.01)
        assert len(env.requests()) == 2 and not env.has_news()  # taken: no longer news
    finally:
        env.close()


def test_a_streamed_poll_is_told_to_wake_on_the_env_s_news(dip_tokenizer):
    """The rollout worker hands `env.has_news` to every streamed poll, and to no barrier poll."""
    from colocate.envs.diplomacy import DiplomacyEnv

    class Recording(ShuffledStreamEngine):
        def poll(self, wait_all=False, wake=None):
            self.wakes.add((wait_all, wake))
            return super().poll(wait_all, wake)
    env = EnvProcesses(DiplomacyEnv, dip_cfg(), dip_tokenizer, seed=3, num=2)
    try:
        for stream, expected in ((True, {(False, env.has_news)}), (False, {(True, None)})):
            engine = Recording(seed=0)
            engine.wakes = set()
            settings = RolloutSettings(groups_per_batch=2, oversample=1, stream=stream,
                                       first_group_id=0 if stream else 100)
            RolloutWorker(env, engine, settings).collect()
            assert engine.wakes == expected, stream
    finally:
        env.close()


def test_a_tool_using_agent_plays_whole_episodes_in_copies():
    """The calculator agent (tools on threads in each copy): every episode calls the tool, gets its
    result back in a copy, answers, and its group comes back once; metrics merge over the copies.
    A copy scores a group when it ends, which may fall in the collect before the one whose batch
    takes it (an extra group started for oversampling): the episodes counted per collect vary with
    timing, their sum over the collects covers every group delivered; the per-episode means do not."""
    import os
    from colocate.config import load_config
    from colocate.envs import env_corpus, env_type
    from colocate.models import load_tokenizer
    from tests.test_agent import ScriptedEngine
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(repo, "configs", "cpu-calculator-agent.yaml"))
    tok = load_tokenizer(cfg.model, *reversed(env_corpus(cfg)))
    script = ['<tool_call>{"name": "calculator", "arguments": {"expression": "12 + 30"}}</tool_call>', "answer 42"]
    env = EnvProcesses(env_type(cfg), cfg, tok, seed=0, num=2)
    try:
        worker = RolloutWorker(env, ScriptedEngine(tok, script), RolloutSettings(groups_per_batch=3, oversample=1))
        scored = []
        for _ in range(2):
            batch, stats, _ = worker.collect()
            assert batch.num_sequences == 3 * cfg.rollout.group_size and stats["env_errors"] == 0
            scored.append(stats["episodes"])
            if stats["episodes"]:  # every episode scored called the tool once, had its result, answered
                assert stats["tool_call_rate"] == 1.0 and stats["tool_calls_per_episode"] == 1.0, stats
                assert stats["finish/stop"] == 1.0 and stats["turns_per_episode"] == 2.0, stats
            assert stats["tool_error_rate"] == 0.0
        # whole groups, from both copies' counts: at least the two batches' groups
        assert sum(scored) >= 2 * 3 * cfg.rollout.group_size and sum(scored) % cfg.rollout.group_size == 0, scored
    finally:
        env.close()


def test_copies_of_an_importable_env_do_not_run_the_main_module_again(monkeypatch, tmp_path):
    """A rank's main module (`colocate.train`, here a stand-in that leaves a mark when run) is not run
    again in the env's copies when the env class lives in a module of its own
    (`lifecycle.spawn_without_main`); the rank's `__main__` is left as it was."""
    import importlib
    import sys
    marker = tmp_path / "imported"
    (tmp_path / "colocate_fake_rank_main.py").write_text(f"open({str(marker)!r}, 'a').write('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    main = importlib.import_module("colocate_fake_rank_main")
    marker.unlink()
    monkeypatch.setitem(sys.modules, "__main__", main)
    env = EnvProcesses(OneRoundEnv, Config(), None, seed=0, num=1)  # returns once the copy has built its env
    try:
        env.start_group(0)
        env.settle()
        assert len(env.requests()) == 2
    finally:
        env.close()
    assert not marker.exists()
    assert main.__spec__.name == "colocate_fake_rank_main" and sys.modules["__main__"] is main
