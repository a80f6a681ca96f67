"""Rollout worker: one engine call per round across all games; stragglers do not hold a batch back."""
from colocate.data import Completion, Request, Sample
from colocate.rollout.worker import RolloutWorker


class SlowGroupEnv:
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

    def metrics(self):
        return {}


class CountingEngine:
    version = 0

    def __init__(self):
        self.calls = []

    def generate(self, requests):
        self.calls.append(len(requests))
        return [Completion([3], [-0.5], None, self.version) for _ in requests]


def test_one_engine_call_per_round_across_games():
    engine = CountingEngine()
    worker = RolloutWorker(SlowGroupEnv(slow_every=100), engine, groups_per_batch=8)
    batch, stats, _ = worker.collect()
    assert engine.calls == [16] and batch.num_sequences == 16  # 8 games x 2, one call


def test_without_oversampling_a_straggler_holds_the_batch():
    engine = CountingEngine()
    worker = RolloutWorker(SlowGroupEnv(), engine, groups_per_batch=4)
    batch, _, _ = worker.collect()
    assert len(engine.calls) == 20  # group 3 needs 20 rounds
    assert sorted(set(batch.rewards.tolist())) == [0.0, 1.0, 2.0, 3.0]


def test_oversampling_ships_when_enough_groups_finish_and_carries_stragglers():
    engine = CountingEngine()
    worker = RolloutWorker(SlowGroupEnv(), engine, groups_per_batch=4, oversample=2)
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
