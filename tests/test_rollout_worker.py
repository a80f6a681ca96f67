"""Rollout worker: one engine call per round across all games; stragglers do not hold a batch back;
streaming plays the same games as the phase barrier."""
import hashlib
import random
from types import SimpleNamespace

import pytest

from colocate.config import Config
from colocate.data import Completion, Request, Sample
from colocate.engine.base import Engine
from colocate.envs.base import Env
from colocate.rollout.worker import RolloutSettings, RolloutWorker
from tests.conftest import fields_left_at_default


class SlowGroupEnv(Env):
    """Groups of 2; group g needs `rounds(g)` engine rounds; reward = g (so batches are traceable)."""
    group_size = 2

    def __init__(self, slow_every: int = 4, slow_rounds: int = 20):
        self.left: dict[int, int] = {}
        self.slow_every, self.slow_rounds = slow_every, slow_rounds
        self.done: list[int] = []

    def start_group(self, g):
        self.left[g] = self.slow_rounds if g % self.slow_every == self.slow_every - 1 else 1

    def requests(self):
        return [((g, i), Request(prompt_ids=[1, 2], max_new_tokens=1)) for g in self.left for i in range(2)]

    def step(self, completions):
        for g in {k[0] for k in completions}:
            self.left[g] -= 1
            if self.left[g] == 0:
                del self.left[g]
                self.done.append(g)

    def pop_finished(self):
        out = [Sample([1, 2], Completion([3], [-0.5], None, 0), float(g), g) for g in self.done for _ in range(2)]
        self.done = []
        return out


class CountingEngine(Engine):
    version = 0

    def __init__(self):
        self.calls = []

    def generate(self, requests):
        self.calls.append(len(requests))
        return [Completion([3], [-0.5], None, self.version) for _ in requests]


def test_one_engine_call_per_round_across_games():
    engine = CountingEngine()
    worker = RolloutWorker(SlowGroupEnv(slow_every=100), engine, RolloutSettings(groups_per_batch=8))
    batch, stats, _ = worker.collect()
    assert engine.calls == [16] and batch.num_sequences == 16  # 8 games x 2, one call


def test_without_oversampling_a_straggler_holds_the_batch():
    engine = CountingEngine()
    worker = RolloutWorker(SlowGroupEnv(), engine, RolloutSettings(groups_per_batch=4))
    batch, _, _ = worker.collect()
    assert len(engine.calls) == 20  # group 3 needs 20 rounds
    assert sorted(set(batch.rewards.tolist())) == [0.0, 1.0, 2.0, 3.0]


def test_oversampling_ships_when_enough_groups_finish_and_carries_stragglers():
    engine = CountingEngine()
    worker = RolloutWorker(SlowGroupEnv(), engine, RolloutSettings(groups_per_batch=4, oversample=2))
    batch, stats, _ = worker.collect()
    assert len(engine.calls) == 1  # groups 0, 1, 2, 4 finish in the first round; 3 keeps playing
    assert sorted(set(batch.rewards.tolist())) == [0.0, 1.0, 2.0, 4.0]
    assert stats["groups_carried_over"] == 2  # group 3 (live) and group 5 (complete, waiting)
    seen = set(batch.rewards.tolist())
    for _ in range(6):
        batch, _, _ = worker.collect()
        assert batch.num_sequences == 8
        seen |= set(batch.rewards.tolist())
    assert 3.0 in seen  # the straggler arrived in a later batch
    assert len(worker._live) + len(worker._complete) <= 2 + 4  # bounded


# -- streaming ------------------------------------------------------------------------------------

def legal_choice(request: Request) -> Completion:
    """A deterministic legal policy: the choice depends only on the prompt (so the order in which an
    engine answers cannot change what is played)."""
    from colocate.envs.diplomacy import random_legal_completion
    seed = int(hashlib.sha1(repr(request.prompt_ids).encode()).hexdigest()[:12], 16)
    return random_legal_completion(request, random.Random(seed))


class BarrierEngine(Engine):
    version = 0

    def generate(self, requests):
        return [legal_choice(r) for r in requests]


class ShuffledStreamEngine(Engine):
    """Streams like vLLM: each poll hands back a random non-empty subset of what is pending, in a
    random order; checks that no request is submitted twice and that updates find it idle."""
    version = 0

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.pending: dict[int, Request] = {}
        self.next = 0
        self.polls, self.partial_polls, self.max_pending = 0, 0, 0

    def submit(self, requests):
        tickets = list(range(self.next, self.next + len(requests)))
        self.next += len(requests)
        self.pending.update(zip(tickets, requests))
        self.max_pending = max(self.max_pending, len(self.pending))
        return tickets

    def poll(self, wait_all=False, wake=None):
        if not self.pending:
            return []
        tickets = list(self.pending)
        self.rng.shuffle(tickets)
        take = tickets if wait_all else tickets[:self.rng.randint(1, min(len(tickets), 9))]
        self.polls += 1
        self.partial_polls += len(take) < len(tickets)
        return [(t, legal_choice(self.pending.pop(t))) for t in take]


@pytest.fixture(scope="module")
def dip_tokenizer():
    from colocate.envs.diplomacy import corpus
    from colocate.models import train_tokenizer
    return train_tokenizer(corpus(num_games=2, last_year=1903))


def _samples(batch):
    """Order-free content of a batch: (prompt, completion, reward, advantage) per sequence."""
    rows, offset = [], 0
    for i, n in enumerate(batch.seq_lens.tolist()):
        p = int(batch.prompt_lens[i])
        tokens = batch.tokens[offset:offset + n].tolist()
        rows.append((tuple(tokens[:p]), tuple(tokens[p:]), round(float(batch.rewards[i]), 6)))
        offset += n
    return sorted(rows)


def test_streaming_plays_the_same_games_as_the_phase_barrier(dip_tokenizer):
    from colocate.envs.diplomacy import DiplomacyEnv, DiplomacySettings

    def play(engine, stream):
        settings = DiplomacySettings(group_size=2, horizon_years=1, unit_labels=False)
        env = DiplomacyEnv(dip_tokenizer, settings, seed=11)
        worker = RolloutWorker(env, engine, RolloutSettings(groups_per_batch=3, stream=stream))
        return [worker.collect() for _ in range(2)]  # two batches: nothing may leak between them

    barrier = play(BarrierEngine(), stream=False)
    engine = ShuffledStreamEngine(seed=5)
    streamed = play(engine, stream=True)
    assert engine.partial_polls > 10 and not engine.pending  # it did stream, and drained each batch
    for (b1, s1, _), (b2, s2, _) in zip(barrier, streamed):
        assert b1.num_sequences == b2.num_sequences == 3 * 2 * 7
        assert _samples(b1) == _samples(b2)
        assert s1["polls"] < s2["polls"]  # a barrier poll answers a whole round, a streamed one a few


def test_streaming_with_oversampling_drains_before_returning(dip_tokenizer):
    from colocate.envs.diplomacy import DiplomacyEnv, DiplomacySettings
    env = DiplomacyEnv(dip_tokenizer, DiplomacySettings(group_size=2, horizon_years=1), seed=12)
    engine = ShuffledStreamEngine(seed=6)
    worker = RolloutWorker(env, engine, RolloutSettings(groups_per_batch=2, oversample=2, stream=True))
    for _ in range(3):
        batch, stats, _ = worker.collect()
        assert batch.num_sequences == 2 * 2 * 7 and not engine.pending  # idle: an update may come now


class RewardPatternEnv(SlowGroupEnv):
    """Groups of 2 finishing in one round; group g's rewards are equal (no signal) when
    g % uniform_every == uniform_every - 1, else (0, 1); completions are g % 5 + 1 tokens long."""

    def __init__(self, uniform_every: int = 3):
        super().__init__(slow_every=10**9)
        self.uniform_every = uniform_every

    def pop_finished(self):
        out = []
        for g in self.done:
            n = g % 5 + 1
            for i in range(2):
                reward = 1.0 if g % self.uniform_every == self.uniform_every - 1 else float(i)
                out.append(Sample([1, 2], Completion([3] * n, [-0.5] * n, None, 0), reward, g))
        self.done = []
        return out


def test_dynamic_sampling_drops_uniform_groups_and_fills_the_batch():
    engine = CountingEngine()
    worker = RolloutWorker(RewardPatternEnv(), engine, RolloutSettings(groups_per_batch=4, drop_uniform=True))
    batch, stats, _ = worker.collect()
    assert batch.num_sequences == 8  # the batch is still full
    rewards = batch.rewards.view(4, 2)
    assert bool((rewards[:, 0] != rewards[:, 1]).all())  # every group kept has a signal
    assert stats["dropped_uniform_groups"] >= 1 and stats["kept_uniform_groups"] == 0
    plain, plain_stats, _ = RolloutWorker(RewardPatternEnv(), CountingEngine(),
                                          RolloutSettings(groups_per_batch=4)).collect()
    assert plain_stats["dropped_uniform_groups"] == 0
    assert bool((plain.rewards.view(4, 2)[:, 0] == plain.rewards.view(4, 2)[:, 1]).any())  # off: uniform kept


def test_dynamic_sampling_stops_dropping_past_its_limit():
    from colocate.rollout.worker import DROP_LIMIT
    worker = RolloutWorker(RewardPatternEnv(uniform_every=1), CountingEngine(),
                           RolloutSettings(groups_per_batch=2, drop_uniform=True))
    batch, stats, _ = worker.collect()  # every group is uniform: the call still ends
    assert batch.num_sequences == 4
    assert stats["dropped_uniform_groups"] == DROP_LIMIT * 2 and stats["kept_uniform_groups"] == 2


def test_overlong_buffer_shapes_rewards_by_completion_length():
    from colocate.rollout.worker import overlong_penalty
    max_new, buffer = 5, 2
    worker = RolloutWorker(RewardPatternEnv(uniform_every=10**9), CountingEngine(),
                           RolloutSettings(groups_per_batch=5, overlong_buffer=buffer, max_new_tokens=max_new))
    batch, _, _ = worker.collect()
    lens = batch.completion_lens.tolist()
    raw = [float(i % 2) for i in range(batch.num_sequences)]
    for length, got, r in zip(lens, batch.rewards.tolist(), raw):
        # free up to max_new - buffer tokens, then down linearly to -1 at max_new
        want = r - min(max(length - (max_new - buffer), 0) / buffer, 1.0)
        assert got == pytest.approx(want)
    assert min(lens) <= max_new - buffer < max(lens)  # both sides of the buffer were seen
    assert overlong_penalty(max_new + 3, max_new, buffer) == -1.0 and overlong_penalty(max_new, max_new, 0) == 0.0


# -- no drain (rollout.update=inflight) -------------------------------------------------------------

class DelayedStreamEngine(Engine):
    """Streams like vLLM with requests of different lengths: request t (the t-th submitted) needs
    1 + t % 5 polls; a poll hands back at least one finished request. Records the version at submit
    and at hand-back, and refuses a ticket answered twice."""

    def __init__(self):
        self.version = 0
        self.pending: dict[int, list] = {}  # ticket -> [polls left, request, version at submit]
        self.next, self.answered = 0, set()

    def submit(self, requests):
        tickets = list(range(self.next, self.next + len(requests)))
        self.next += len(requests)
        for t, r in zip(tickets, requests):
            self.pending[t] = [1 + t % 5, r, self.version]
        return tickets

    def poll(self, wait_all=False, wake=None):
        out = []
        while self.pending and (wait_all or not out):
            for t in list(self.pending):
                self.pending[t][0] -= 1
                if self.pending[t][0] == 0:
                    _, r, v = self.pending.pop(t)
                    assert t not in self.answered
                    self.answered.add(t)
                    out.append((t, Completion([r.prompt_ids[-1]], [-0.5], None, v, last_version=self.version)))
        return out


class IdentityEnv(Env):
    """Groups of 2 single-turn requests; sample (g, i) answers prompt [1, 2g + i]: every sample
    names itself."""
    group_size = 2

    def __init__(self):
        self.waiting, self.answers, self.done, self.started = {}, {}, [], []

    def start_group(self, g):
        self.started.append(g)
        for i in range(2):
            self.waiting[(g, i)] = Request(prompt_ids=[1, 2 * g + i], max_new_tokens=1)

    def requests(self):
        return list(self.waiting.items())

    def step(self, completions):
        for key, c in completions.items():
            del self.waiting[key]
            self.answers[key] = c
            g = key[0]
            if all((g, i) in self.answers for i in range(2)):
                self.done.append(g)

    def pop_finished(self):
        out = [Sample([1, 2 * g + i], self.answers.pop((g, i)), float(g), g) for g in self.done for i in range(2)]
        self.done = []
        return out


def _sample_ids(batch):
    """(group, index) of every sequence, read from its prompt."""
    ids, offset = [], 0
    for n, p in zip(batch.seq_lens.tolist(), batch.prompt_lens.tolist()):
        last = int(batch.tokens[offset + p - 1])
        ids.append((last // 2, last % 2))
        offset += n
    return ids


def test_inflight_ships_without_draining_and_loses_nothing():
    """A batch ships with requests still in flight; they finish in a later batch (after the version
    changed under them); no sample or group is lost or shipped twice; the engine stays as full as
    the live groups."""
    env, engine = IdentityEnv(), DelayedStreamEngine()
    worker = RolloutWorker(env, engine, RolloutSettings(groups_per_batch=4, oversample=2, inflight=True))
    shipped, carried_tickets, spans = [], 0, 0.0
    for k in range(8):
        batch, stats, _ = worker.collect()
        ids = _sample_ids(batch)
        assert len(ids) == 8 and len({g for g, _ in ids}) == 4  # whole groups, exactly the batch's
        shipped += ids
        carried_tickets += len(engine.pending)
        assert stats["requests_in_flight"] == len(engine.pending) == len(worker._in_flight)
        assert len(worker._live) == 4 + 2  # every completed group replaced at once
        spans += stats["version_span"]
        engine.version = k + 1  # an update lands between two polls, under the running requests
    assert carried_tickets > 0 and spans > 0  # requests did cross batch boundaries and updates
    assert len(shipped) == len(set(shipped))  # nothing twice
    in_play = {(g, i) for g in worker._live | set(worker._complete) for i in range(2)}
    assert set(shipped) | in_play == {(g, i) for g in env.started for i in range(2)}  # nothing lost
    assert not set(shipped) & in_play


def test_drain_ships_with_nothing_in_flight():
    env, engine = IdentityEnv(), DelayedStreamEngine()
    worker = RolloutWorker(env, engine, RolloutSettings(groups_per_batch=4, oversample=2, stream=True))
    for _ in range(3):
        batch, stats, _ = worker.collect()
        assert not engine.pending and stats["requests_in_flight"] == 0 and stats["version_span"] == 0


def test_rollout_settings_come_from_their_config_keys():
    """Every field from its key (none left at its default): this rank's share of the groups, group
    ids counting from a per-rank base, and rollout.update=inflight as `inflight`."""
    cfg = Config()
    r = cfg.rollout
    r.groups_per_step, r.oversample_groups, r.stream, r.drop_uniform_groups, r.update = 10, 3, True, True, "inflight"
    cfg.env.overlong_buffer, cfg.env.max_reward_errors, cfg.engine.max_new_tokens = 5, 9, 77
    settings = RolloutSettings.from_config(cfg, SimpleNamespace(rank=2, share=lambda total: total // 2))
    assert settings == RolloutSettings(groups_per_batch=5, first_group_id=2_000_000, oversample=3, stream=True,
                                       drop_uniform=True, overlong_buffer=5, max_new_tokens=77, max_env_errors=9,
                                       inflight=True)
    assert fields_left_at_default(settings) == []
