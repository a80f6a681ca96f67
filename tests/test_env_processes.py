"""`env.processes`: the env's copies in worker processes play what the in-process env plays, every
group comes back once, and failures, metrics, state and config refusals are handled."""
import pytest

from colocate.config import Config
from colocate.config_checks import ConfigError, validate
from colocate.data import Completion, Request, Sample
from colocate.envs.base import Env
from colocate.envs.processes import EnvProcesses, EnvProcessError
from colocate.rollout.worker import RolloutWorker
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
        worker = RolloutWorker(env, BarrierEngine(), groups_per_batch=3)
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
        worker = RolloutWorker(env, engine, groups_per_batch=3, oversample=1, stream=True)
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


class RaisingEnv(Env):
    """Raises in step for group 1; otherwise one-request groups of 2 that finish at once."""
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
            if key[0] == 1:
                raise ValueError("user code failed on group 1")
            del self.waiting[key]
            self.done.append(Sample([1, 2], c, 1.0, key[0]))

    def pop_finished(self):
        out, self.done = self.done, []
        return out


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
    from colocate.envs.diplomacy import DiplomacyEnv
    from tests.test_diplomacy_env import random_policy, run

    def env():
        return DiplomacyEnv(dip_tokenizer, group_size=3, horizon_years=2, unit_labels=False, seed=1)

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
    assert Env.merge_metrics([{"a": 1.0, "b": 4.0}, {"a": 3.0}]) == {"a": 2.0, "b": 4.0}


@pytest.mark.parametrize("overrides, message", [
    ({"env.name": "dataset"}, "each copy would walk its own epoch"),
    ({"env.name": "arithmetic"}, "resumes exactly"),
])
def test_config_refuses_processes_where_they_change_meaning(overrides, message):
    cfg = Config()
    cfg.env.processes = 2
    cfg.env.data_files = ["x.jsonl"]
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)
    cfg.env.name = "arithmetic"
    cfg.rollout.oversample_groups, cfg.learner.max_policy_lag = 2, 2
    validate(cfg)  # oversampled: the order is timing's anyway


class BigEnv(RaisingEnv):
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


class CountingEnv(RaisingEnv):
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
        assert env.state_dict() == {"processes": [{"started": 3}, {"started": 2}]}
        env.load_state_dict({"processes": [{"started": 7}, {"started": 8}]})
        assert env.state_dict() == {"processes": [{"started": 7}, {"started": 8}]}
        with pytest.raises(ValueError, match="env.processes=2"):
            env.load_state_dict({"processes": [{"started": 1}]})
        assert env.data_stats() == {"rows": 10.0}
    finally:
        env.close()
