"""The dataset env: groups of G samples of one prompt, seeded epochs restored on resume, rewards
inline or on threads, bad reward results counted in `metrics`, and the held-out evaluation."""
import json

import pytest

from colocate.config import Config, EvalConfig
from colocate.data import Completion
from colocate.engine.base import Engine
from colocate.envs.dataset import DatasetEnv, DatasetSettings, load_rows
from colocate.rewards import RewardLimits, RewardSet
from tests.conftest import fields_left_at_default


class ScriptedEngine(Engine):
    """Answers each prompt with `answer(prompt text, temperature)`, then EOS."""

    def __init__(self, tokenizer, answer):
        self.tokenizer, self.answer, self.requests = tokenizer, answer, []

    def generate(self, requests):
        self.requests += requests
        out = []
        for r in requests:
            ids = self.tokenizer.encode(self.answer(self.tokenizer.decode(r.prompt_ids), r.temperature),
                                        add_special_tokens=False) + [self.tokenizer.eos_token_id]
            out.append(Completion(token_ids=ids, logprobs=[0.0] * len(ids), allowed_ids=None, version=self.version))
        return out


def true_sum(prompt: str, temperature: float = 1.0) -> str:
    words = prompt.split()
    return " " + str(int(words[1]) + int(words[3]))


def write_rows(path, n):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"add {i} and 1 ; answer :", "answer": str(i + 1), "id": i}) + "\n")
    return str(path)


def make_env(tokenizer, tmp_path, n=5, group_size=4, reward=("exact",), seed=0, eval_rows=None, choices=None, **kw):
    """`kw`: `DatasetSettings` fields, `max_errors` and `limits` (the reward functions' bounds)."""
    rows = load_rows([write_rows(tmp_path / "train.jsonl", n)], "train", str(tmp_path / "cache"))
    limits = RewardLimits(max_errors=kw.pop("max_errors", 100), **kw.pop("limits", {}))
    return DatasetEnv(tokenizer, rows, RewardSet(list(reward), [], limits=limits),
                      DatasetSettings(group_size=group_size, max_new_tokens=4, **kw), seed=seed, eval_rows=eval_rows,
                      choices=choices)


def play(env, engine, groups):
    """Start `groups` groups and play them to the end -> their samples."""
    for g in groups:
        env.start_group(g)
    keyed = env.requests()
    env.step(dict(zip([k for k, _ in keyed], engine.generate([r for _, r in keyed]))))
    out = []
    while len(out) < len(groups) * env.group_size:
        out += env.pop_finished()
    return out


def ids_of(sample):
    return tuple(sample.prompt_ids)


def test_a_group_is_g_samples_of_one_prompt_scored_by_the_reward(tiny_tokenizer, tmp_path):
    env = make_env(tiny_tokenizer, tmp_path)
    engine = ScriptedEngine(tiny_tokenizer, lambda p, t: true_sum(p) if "add 2" not in p else " 9")
    samples = play(env, engine, range(5))
    assert len(samples) == 20
    by_group = {}
    for s in samples:
        by_group.setdefault(s.group_key, []).append(s)
    prompts = {tiny_tokenizer.decode(g[0].prompt_ids) for g in by_group.values()}
    assert prompts == {f"add {i} and 1 ; answer :" for i in range(5)}  # one epoch: each row once
    for group in by_group.values():
        assert len({ids_of(s) for s in group}) == 1 and len(group) == 4
        wrong = "add 2" in tiny_tokenizer.decode(group[0].prompt_ids)
        assert [s.reward for s in group] == [0.0 if wrong else 1.0] * 4


def test_epochs_reshuffle_and_resume_restores_the_position(tiny_tokenizer, tmp_path):
    engine = ScriptedEngine(tiny_tokenizer, true_sum)
    env = make_env(tiny_tokenizer, tmp_path, n=5, group_size=2, seed=3)
    first = [ids_of(s) for s in play(env, engine, range(7))][::2]  # one epoch and two rows into the next
    assert len(set(first[:5])) == 5 and env.epoch == 1
    state = json.loads(json.dumps(env.state_dict()))  # what a checkpoint keeps
    after = [ids_of(s) for s in play(env, engine, range(7, 13))][::2]
    resumed = make_env(tiny_tokenizer, tmp_path, n=5, group_size=2, seed=3)
    resumed.load_state_dict(state)
    assert [ids_of(s) for s in play(resumed, engine, range(7, 13))][::2] == after
    fresh = make_env(tiny_tokenizer, tmp_path, n=5, group_size=2, seed=3)
    assert [ids_of(s) for s in play(fresh, engine, range(6))][::2] != after  # the position mattered
    assert first[:5] != first[5:] + after[:3]  # epoch 1 is another permutation than epoch 0


def test_the_state_names_its_data_and_another_data_is_refused(tiny_tokenizer, tmp_path):
    env = make_env(tiny_tokenizer, tmp_path, n=5)
    assert "data" not in env.state_dict()  # built without files (no digest): nothing to compare
    env.fingerprint = "digest-a"
    state = json.loads(json.dumps(env.state_dict()))
    assert state["data"] == "digest-a"
    other = make_env(tiny_tokenizer, tmp_path, n=5)
    other.fingerprint = "digest-b"
    with pytest.raises(ValueError, match="other contents"):
        other.load_state_dict(state)
    other.fingerprint = "digest-a"
    other.load_state_dict(state)


def test_prefetched_prompts_are_the_same_prompts_in_the_same_order(tiny_tokenizer, tmp_path):
    """env.prefetch_prompts: built ahead on the prompt thread, across an epoch's end and a resume
    mid-epoch, the groups get the prompts (and the env the position) they get without it."""
    engine = ScriptedEngine(tiny_tokenizer, true_sum)
    plain = make_env(tiny_tokenizer, tmp_path, n=5, group_size=2, seed=3)
    ahead = make_env(tiny_tokenizer, tmp_path, n=5, group_size=2, seed=3, prefetch_prompts=3)
    for groups in (range(3), range(3, 8)):  # the second call crosses into epoch 1
        assert [ids_of(s) for s in play(ahead, engine, groups)] == [ids_of(s) for s in play(plain, engine, groups)]
        assert ahead.state_dict() == plain.state_dict()
    assert ahead._ahead, "the next rows are queued"
    state = plain.state_dict()
    for env in (plain, ahead):
        play(env, engine, range(20, 22))  # moves on; the resume goes back
        env.load_state_dict(state)
    assert [ids_of(s) for s in play(ahead, engine, range(8, 12))] == [ids_of(s) for s in play(plain, engine, range(8, 12))]


def test_rewards_on_threads_give_the_inline_result(tiny_tokenizer, tmp_path):
    engine = ScriptedEngine(tiny_tokenizer, lambda p, t: true_sum(p) if "add 1" not in p else " 0")
    inline = play(make_env(tiny_tokenizer, tmp_path), engine, range(5))
    threaded = play(make_env(tiny_tokenizer, tmp_path, reward_workers=2), engine, range(5))
    key = lambda s: (s.group_key, ids_of(s))  # noqa: E731
    assert sorted((key(s), s.reward) for s in inline) == sorted((key(s), s.reward) for s in threaded)


def test_bad_reward_results_are_counted_in_metrics(tiny_tokenizer, tmp_path, monkeypatch):
    (tmp_path / "flaky_reward.py").write_text(
        "def score(prompts, completions, id, **columns):\n"
        "    return [float('nan') if i == 2 else 1.0 for i in id]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make_env(tiny_tokenizer, tmp_path, reward=["flaky_reward:score"], max_errors=4)  # a group: 4 in a row
    samples = play(env, ScriptedEngine(tiny_tokenizer, true_sum), range(5))
    assert env.metrics()["reward_errors"] == 4 and env.metrics()["reward_errors"] == 0
    assert sorted(s.reward for s in samples) == [0.0] * 4 + [1.0] * 16
    from colocate.rewards import RewardError
    env = make_env(tiny_tokenizer, tmp_path, reward=["flaky_reward:score"], max_errors=3)
    with pytest.raises(RewardError, match="max_reward_errors=3"):
        play(env, ScriptedEngine(tiny_tokenizer, true_sum), range(5))


def collect(env, engine, groups: int):
    """One batch through the rollout worker: what the learner's loss gets."""
    from colocate.rollout.worker import RolloutSettings, RolloutWorker
    return RolloutWorker(env, engine, RolloutSettings(groups_per_batch=groups)).collect()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sleeping_reward_is_cut_at_its_limit_and_counted(tiny_tokenizer, tmp_path, capfd, workers):
    """A reward that sleeps 60 s per call, env.reward_timeout_s=0.5: each call ends at its limit,
    its samples score 0 from it, are counted under reward_errors/timeout, and the line names it."""
    import time
    env = make_env(tiny_tokenizer, tmp_path, reward=["tests.agent_fixtures:reward_sleeps"], reward_workers=workers,
                   limits={"timeout_s": 0.5})
    t0 = time.monotonic()
    batch, stats, _ = collect(env, ScriptedEngine(tiny_tokenizer, true_sum), 2)
    assert time.monotonic() - t0 < 2 * 0.5 + 5.0  # two calls at their limit and the machine's slack, not 120 s
    assert batch.rewards.tolist() == [0.0] * 8
    assert stats["reward_errors"] == 8.0 and stats["reward_errors/timeout"] == 8.0
    err = capfd.readouterr().err
    assert ("reward function tests.agent_fixtures:reward_sleeps gave no answer within env.reward_timeout_s=0.5s"
            in err and "rollout/reward_errors/timeout" in err), err
    env.close()


@pytest.mark.parametrize("fn,bad", [("reward_huge", 4), ("reward_first_huge", 1)])
def test_a_huge_reward_is_counted_and_never_reaches_the_loss(tiny_tokenizer, tmp_path, fn, bad):
    """1e308 is finite but overflows the group's statistics (issue 52: reward inf, loss nan): past
    env.reward_max_abs it scores 0 from the function, is counted as out_of_range, and the batch's
    rewards and advantages stay finite."""
    import torch
    env = make_env(tiny_tokenizer, tmp_path, reward=[f"tests.agent_fixtures:{fn}"])
    batch, stats, _ = collect(env, ScriptedEngine(tiny_tokenizer, true_sum), 1)
    assert sorted(batch.rewards.tolist()) == [0.0] * bad + [1.0] * (4 - bad)
    assert torch.isfinite(batch.advantages).all()
    assert stats["reward_errors/out_of_range"] == float(bad) and stats["reward_errors/non_finite"] == 0.0


def test_a_reward_raising_systemexit_is_caught_counted_and_named(tiny_tokenizer, tmp_path, capfd):
    env = make_env(tiny_tokenizer, tmp_path, reward=["tests.agent_fixtures:reward_exits"])
    batch, stats, _ = collect(env, ScriptedEngine(tiny_tokenizer, true_sum), 1)
    assert batch.rewards.tolist() == [0.0] * 4 and stats["reward_errors/base_exception"] == 4.0
    assert "reward function tests.agent_fixtures:reward_exits raised SystemExit: 5" in capfd.readouterr().err


def test_a_reward_that_always_hangs_stops_naming_it(tiny_tokenizer, tmp_path):
    """Every call times out: max_reward_errors samples in a row stop the rollout with one message
    naming the function and the fault (not a stall)."""
    from colocate.rewards import RewardError
    from tests import agent_fixtures
    agent_fixtures.RELEASE.clear()
    env = make_env(tiny_tokenizer, tmp_path, reward=["tests.agent_fixtures:reward_hangs"], max_errors=6,
                   limits={"timeout_s": 0.2})
    try:
        with pytest.raises(RewardError, match=r"^reward tests.agent_fixtures:reward_hangs gave no usable value for 7 "
                                              r"samples in a row \(env.max_reward_errors=6\); the last gave no answer"):
            collect(env, ScriptedEngine(tiny_tokenizer, true_sum), 2)
    finally:
        agent_fixtures.RELEASE.set()  # the abandoned calls return
        env.close()


def test_evaluate_scores_every_eval_row_greedily(tiny_tokenizer, tmp_path):
    eval_rows = load_rows([write_rows(tmp_path / "eval.jsonl", 4)], "train", str(tmp_path / "cache"))
    env = make_env(tiny_tokenizer, tmp_path, eval_rows=eval_rows)
    engine = ScriptedEngine(tiny_tokenizer, lambda p, t: true_sum(p) if "add 0" not in p else " 5 5")
    out = env.evaluate(engine, EvalConfig(temperature=0.0), out_dir=str(tmp_path / "out"))
    assert out["accuracy"] == 0.75 and out["mean_reward"] == 0.75 and out["samples"] == 4
    assert out["mean_length"] == pytest.approx(sum(len(tiny_tokenizer.encode(true_sum(f"add {i} and 1")))
                                                   for i in range(1, 4)) / 4 + (len(tiny_tokenizer.encode(" 5 5")) + 4) / 4)
    assert {r.temperature for r in engine.requests} == {0.0} and len(engine.requests) == 4
    assert env.evaluate(engine, EvalConfig(max_samples=2))["samples"] == 2
    lines = (tmp_path / "out" / "dataset-eval-v0.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[0])["reward"] in (0.0, 1.0)
    assert make_env(tiny_tokenizer, tmp_path).evaluate(engine, EvalConfig()) == {}  # no eval files


def test_answer_choices_constrain_sampling_to_the_answers(tiny_tokenizer, tmp_path):
    env = make_env(tiny_tokenizer, tmp_path, n=3, choices=["1", "2", "3"])
    env.start_group(0)
    (_, request), *_ = env.requests()
    assert sorted(request.constraint.texts[0]) == [" 1", " 2", " 3"]
    free = make_env(tiny_tokenizer, tmp_path, n=3)
    free.start_group(0)
    assert free.requests()[0][1].constraint is None


@pytest.mark.slow
def test_resumed_training_draws_the_prompts_it_would_have_drawn(tmp_path):
    """Two epochs of the 25-row file in 6 steps; the resumed half continues at the saved position
    (a different prompt order would change the rewards and losses). With prefix trees (each group's
    samples share their prompt), so their packing is exact across a resume too, and TensorBoard
    holds both token counts."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tests.test_checkpoint import assert_resume_reproduces_uninterrupted_run
    assert_resume_reproduces_uninterrupted_run(tmp_path, ["--config", "configs/cpu-dataset-tiny.yaml",
                                                          "--eval.every=0", "--eval.at_end=false",
                                                          "--learner.prefix_sharing=tree"])
    state = json.loads((tmp_path / "b" / "checkpoints" / "step-000006" / "trainer_state.json").read_text())
    assert state["inference"]["0"]["env"]["epoch"] >= 1  # the run crossed into a reshuffled epoch
    acc = EventAccumulator(str(tmp_path / "a" / "tb" / "learner"))
    acc.Reload()
    forwarded = [e.value for e in acc.Scalars("learner/tokens_forwarded")]
    flat = [e.value for e in acc.Scalars("learner/tokens_flat_equivalent")]
    assert len(forwarded) == len(flat) == 6
    assert all(0 < f < x for f, x in zip(forwarded, flat)), (forwarded, flat)


def test_decode_texts_is_the_tokenizers_decode(tiny_tokenizer):
    """One call to the Rust tokenizer gives `decode`'s text; where transformers would clean up
    spaces (which the Rust side does not) each answer goes through `decode`."""
    import random
    from types import SimpleNamespace

    from colocate.envs.dataset import decode_texts
    rng = random.Random(0)
    id_lists = [[rng.randrange(len(tiny_tokenizer)) for _ in range(rng.randrange(0, 40))] for _ in range(12)]
    id_lists.append(tiny_tokenizer.encode("a , b . c", add_special_tokens=False))
    expected = [tiny_tokenizer.decode(ids) for ids in id_lists]
    assert not tiny_tokenizer.clean_up_tokenization_spaces and decode_texts(tiny_tokenizer, id_lists) == expected
    cleaning = SimpleNamespace(backend_tokenizer=tiny_tokenizer.backend_tokenizer, clean_up_tokenization_spaces=True,
                               decode=lambda ids: "clean:" + tiny_tokenizer.decode(ids))
    assert decode_texts(cleaning, id_lists) == ["clean:" + t for t in expected]


def test_dataset_settings_come_from_their_config_keys():
    cfg = Config()
    cfg.rollout.group_size, cfg.env.prompt_column, cfg.env.reward_workers, cfg.env.prefetch_prompts = 3, "question", 2, 5
    cfg.engine.max_new_tokens, cfg.engine.temperature = 100, 0.7
    settings = DatasetSettings.from_config(cfg)
    assert settings == DatasetSettings(group_size=3, prompt_column="question", max_new_tokens=100, temperature=0.7,
                                       reward_workers=2, prefetch_prompts=5)
    assert fields_left_at_default(settings) == []


def test_a_prompt_over_the_byte_cap_is_unusable_and_never_reaches_the_tokenizer():
    """A megabyte-long single word stalled the embedded tokenizer's training for minutes before any row
    check ran: the row check refuses it by its size alone, and the tokenizer's corpus leaves it out
    (and cuts long runs of other texts)."""
    from colocate.envs.dataset_files import CORPUS_RUN, corpus_texts
    from colocate.envs.rows import MAX_PROMPT_BYTES, RowRules, row_fault, scan_rows

    class Rows:  # the `datasets.Dataset` calls scan_rows makes
        def __init__(self, prompts):
            self.prompts = prompts

        def select_columns(self, columns):
            return self

        def iter(self, batch_size):
            yield {"prompt": self.prompts}

    huge, fits = "x" * (MAX_PROMPT_BYTES + 1), "é" * (MAX_PROMPT_BYTES // 2)  # 2 bytes a character: exactly the cap
    assert row_fault(huge, None, False) == "too_large" and row_fault(fits, None, False) is None

    def no_tokenizer(prompt):
        raise AssertionError("tokenized")
    scan = scan_rows(Rows(["add 1 and 2", huge]), RowRules("prompt", "answer", False, 2044, no_tokenizer))
    assert scan.bad == [(1, "too_large")]
    long_word = "y" * (CORPUS_RUN * 3)
    assert corpus_texts(["add 1 and 2", huge, f"a {long_word} b"]) == ["add 1 and 2", f"a {'y' * CORPUS_RUN} b"]
