"""DiplomacyEnv end to end with scripted policies (random legal, empty, garbage, free text)."""
import random

import pytest

from colocate.config import Config
from colocate.data import Completion, group_advantages
from colocate.envs.diplomacy import DiplomacyEnv, DiplomacySettings, corpus, random_legal_completion
from colocate.envs.diplomacy import game as dg
from colocate.envs.diplomacy.game import StateCacheError
from colocate.models import train_tokenizer
from tests.conftest import fields_left_at_default

CACHE = dg.__file__.replace("game.py", "states.jsonl")


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(corpus(num_games=2, last_year=1904))


def run(env, policy, group_ids):
    for g in group_ids:
        env.start_group(g)
    samples, calls = [], 0
    while True:
        keyed = env.requests()
        if not keyed:
            break
        calls += 1
        assert calls < 200
        env.step({k: policy(k, r) for k, r in keyed})
        samples += env.pop_finished()
    return samples


def random_policy(seed=0):
    rng = random.Random(seed)
    return lambda key, request: random_legal_completion(request, rng)


def text_completion(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    return Completion(token_ids=ids, logprobs=[0.0] * len(ids), allowed_ids=None, version=0)


def test_groups_anchor_keys_and_rewards(tokenizer):
    env = DiplomacyEnv(tokenizer, DiplomacySettings(group_size=4, horizon_years=1), seed=0)
    samples = run(env, random_policy(), [0, 1])
    assert samples and all(s.is_anchor for s in samples)
    keys = {}
    for s in samples:
        keys.setdefault(s.group_key, []).append(s)
    assert set(keys) == {(g, p) for g in (0, 1) for p in dg.POWERS}  # all 7 can order at S1901M
    for group in keys.values():
        assert len(group) == 4 and len({s.info["continuation"] for s in group}) == 4
        assert len({tuple(s.prompt_ids) for s in group}) == 1  # the shared fork state
        for s in group:
            alive = 1  # nobody is eliminated within one year of the opening
            assert s.reward == pytest.approx(s.info["sc_delta"] / 3 + 0.5 * alive)
    advantages = group_advantages(samples)
    assert len(advantages) == len(samples)
    metrics = env.metrics()
    # under the constraint only a repeated build/disband site is invalid (see prompt.py)
    assert metrics["invalid_order_rate"] < 0.02 and metrics["phases_processed"] >= 16
    assert metrics["continuations_finished"] == 8 and metrics["prompt_tokens_mean"] > 100
    assert metrics["sc_delta_mean"] >= 0  # neutral centres only get captured in 1901
    assert env.metrics()["completions"] == 0  # counters reset


def test_without_unit_labels_the_same_choices_play_the_same_games(tokenizer):
    """The format changes the tokens, not the game: the same pick per slot gives the same orders."""
    runs = {}
    for unit_labels in (True, False):
        env = DiplomacyEnv(tokenizer, DiplomacySettings(group_size=2, horizon_years=2, unit_labels=unit_labels), seed=3,
                           start_states=dg.load_state_cache(CACHE))
        samples = run(env, random_policy(seed=5), [0, 1])
        metrics = env.metrics()
        assert metrics["garbled_lines_per_completion"] == 0 and metrics["invalid_order_rate"] < 0.02
        runs[unit_labels] = (samples, metrics)
    (full, m_full), (short, m_short) = runs[True], runs[False]
    assert [(s.group_key, s.reward, s.info["sc_delta"]) for s in full] == \
        [(s.group_key, s.reward, s.info["sc_delta"]) for s in short]
    assert m_full["phases_processed"] == m_short["phases_processed"]
    tokens = {k: sum(len(s.completion.token_ids) for s in v[0]) for k, v in runs.items()}
    assert tokens[False] < 0.8 * tokens[True]


def test_unlisted_supports_shorten_prompts_not_the_game(tokenizer):
    """list_supports=False: the same constraint per request (every legal order, supports included),
    so the same picks play the same games; only the prompts shrink."""
    runs = {}
    for list_supports in (True, False):
        settings = DiplomacySettings(group_size=2, horizon_years=1, unit_labels=False, list_supports=list_supports)
        env = DiplomacyEnv(tokenizer, settings, seed=3, start_states=dg.load_state_cache(CACHE))
        rng, prompts, slots, samples = random.Random(5), [], [], []
        env.start_group(0)
        while True:
            keyed = env.requests()
            if not keyed:
                break
            prompts += [len(r.prompt_ids) for _, r in keyed]
            slots += [r.constraint.slots for _, r in keyed]
            env.step({k: random_legal_completion(r, rng) for k, r in keyed})
            samples += env.pop_finished()
        runs[list_supports] = (prompts, slots, [(s.group_key, s.reward) for s in samples])
    (p_full, s_full, r_full), (p_short, s_short, r_short) = runs[True], runs[False]
    assert s_full == s_short and r_full == r_short and len(p_full) == len(p_short)
    assert sum(p_short) < 0.8 * sum(p_full)


def test_requests_come_per_phase_for_powers_that_can_order(tokenizer):
    env = DiplomacyEnv(tokenizer, DiplomacySettings(group_size=2, horizon_years=2), seed=1)
    env.start_group(7)
    policy = random_policy(1)
    seen_adjustment = False
    while True:
        keyed = env.requests()
        if not keyed:
            break
        by_cont = {}
        for (gid, index, power), request in keyed:
            by_cont.setdefault(index, set()).add(power)
            game = env._groups[gid].continuations[index].game
            assert game.get_orderable_locations(power)
            assert request.constraint is not None and request.max_new_tokens >= len(request.constraint.slots)
        for index, powers in by_cont.items():
            game = env._groups[7].continuations[index].game
            expected = {p for p in dg.POWERS if game.get_orderable_locations(p)}
            if game.phase_type == "A":
                seen_adjustment = True
                surplus = {p for p in dg.POWERS
                           if len(game.powers[p].centers) != len(game.powers[p].units)}
                expected &= surplus
            assert powers == expected
        env.step({k: policy(k, r) for k, r in keyed})
    assert seen_adjustment and len(env.pop_finished()) > 0


def test_train_later_phases_share_key_and_reward(tokenizer):
    env = DiplomacyEnv(tokenizer, DiplomacySettings(group_size=3, horizon_years=1, train_later_phases=True), seed=2)
    samples = run(env, random_policy(2), [5])
    anchors = [s for s in samples if s.is_anchor]
    later = [s for s in samples if not s.is_anchor]
    assert len(anchors) == 3 * 7 and later
    reward = {(s.info["continuation"], s.info["power"]): s.reward for s in anchors}
    for s in later:
        assert s.group_key == (5, s.info["power"]) and s.info["phase_index"] > 0
        assert s.reward == reward[(s.info["continuation"], s.info["power"])]


def test_empty_completions_hold_everything_and_stall_stops(tokenizer):
    env = DiplomacyEnv(tokenizer, DiplomacySettings(group_size=2, horizon_years=5, stall_years=1), seed=3,
                       start_states=dg.load_state_cache(CACHE))
    eos = tokenizer.eos_token_id
    samples = run(env, lambda k, r: Completion([eos], [0.0], None, 0), [0])
    metrics = env.metrics()
    assert metrics["invalid_order_rate"] == 1.0 and metrics["stall_stops"] == 2
    assert metrics["phases_processed"] <= 2 * 4  # one year of holds, not five
    assert all(s.info["sc_delta"] == 0 for s in samples)


def test_garbage_and_free_text_never_crash(tokenizer):
    rng = random.Random(4)
    vocab = len(tokenizer)

    def garbage(key, request):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        return Completion(ids, [0.0] * len(ids), None, 0, finish_reason="length")

    env = DiplomacyEnv(tokenizer, DiplomacySettings(group_size=2, horizon_years=1, use_constraint=False), seed=4)
    samples = run(env, garbage, [0, 1])
    assert samples and env.metrics()["invalid_order_rate"] > 0.9

    env = DiplomacyEnv(tokenizer, DiplomacySettings(group_size=2, horizon_years=1, use_constraint=False), seed=5)
    env.start_group(0)
    keyed = env.requests()
    assert all(r.constraint is None and r.max_new_tokens == env.settings.max_new_tokens for _, r in keyed)
    free = {"FRANCE": "1. a par -> bur\nF BRE - MAO\nA MAR - SPA\n"}
    env.step({k: text_completion(tokenizer, free.get(k[2], "")) for k, _ in keyed})
    france = env._groups[0].continuations[0].game.powers["FRANCE"]
    assert sorted(france.units) == ["A BUR", "A SPA", "F MAO"]
    assert env.metrics()["invalid_order_rate"] == pytest.approx(1 - 3 / 22)


def test_state_cache_start_and_from_config(tokenizer, tmp_path):
    cfg = Config()
    cfg.env.name = "diplomacy"
    cfg.env.state_cache = CACHE
    cfg.env.horizon_years = 1
    cfg.rollout.group_size = 3
    env = DiplomacyEnv.from_config(cfg, tokenizer, seed=6)
    samples = run(env, random_policy(6), [0])
    assert {s.info["fork_phase"] for s in samples} != {"S1901M"}
    assert all(s.completion.token_ids[-1] == tokenizer.eos_token_id for s in samples)
    bad = tmp_path / "states.jsonl"
    bad.write_text('{"name": "S1901M"}\n')
    cfg.env.state_cache = str(bad)
    with pytest.raises(StateCacheError, match=str(bad)):
        DiplomacyEnv.from_config(cfg, tokenizer, seed=0)


def test_with_the_hf_engine_and_tiny_model(tokenizer):
    """The env's constraints drive the reference engine: every completion is a legal order set."""
    import torch
    from colocate.config import ModelConfig
    from colocate.engine.hf import HFEngine
    from colocate.models import build_model
    model = build_model(ModelConfig(shape="tiny"), tokenizer)
    engine = HFEngine(model, tokenizer, seed=0)
    env = DiplomacyEnv(tokenizer, DiplomacySettings(group_size=2, horizon_years=1, max_new_tokens=160), seed=7)
    env.start_group(0)
    keyed = env.requests()  # the fork phase: 2 continuations x 7 powers, one engine call
    completions = engine.generate([r for _, r in keyed])
    for c in completions:
        assert c.finish_reason == "stop" and c.token_ids[-1] == tokenizer.eos_token_id
        assert len(c.allowed_ids) == len(c.token_ids) and max(c.logprobs) <= 1e-6
        assert torch.isfinite(torch.tensor(c.logprobs)).all()
    env.step({k: c for (k, _), c in zip(keyed, completions)})
    metrics = env.metrics()
    assert metrics["invalid_order_rate"] == 0.0 and metrics["garbled_lines_per_completion"] == 0.0
    assert metrics["phases_processed"] == 2


def test_diplomacy_settings_come_from_their_config_keys():
    cfg = Config()
    e = cfg.env
    e.horizon_years, e.stall_years, e.train_later_phases, e.use_constraint = 3, 5, True, False
    e.unit_labels, e.list_supports = False, False
    cfg.rollout.group_size, cfg.engine.max_new_tokens, cfg.engine.temperature = 6, 100, 0.7
    settings = DiplomacySettings.from_config(cfg)
    assert settings == DiplomacySettings(group_size=6, horizon_years=3, stall_years=5, train_later_phases=True,
                                         use_constraint=False, unit_labels=False, list_supports=False,
                                         max_new_tokens=100, temperature=0.7)
    assert fields_left_at_default(settings) == []
