"""Reward functions: the built-ins, a TRL-signature function by path, weights, and bad results
counted, logged once and, past the limit in a row, fatal."""
import math

import pytest

from colocate.rewards import RewardError, RewardLimits, RewardSet, boxed, exact, gsm8k

USER_MODULE = '''
calls = []

def length_score(prompts, completions, **columns):
    """TRL's signature: every column arrives as a keyword, one value per completion."""
    calls.append((list(prompts), list(completions), {k: list(v) for k, v in columns.items()}))
    return [float(len(c)) * w for c, w in zip(completions, columns["weight"])]

def raises(prompts, completions, **columns):
    raise ValueError("judge offline")

def short(prompts, completions, **columns):
    return [1.0] * (len(completions) - 1)

def nan_and_none(prompts, completions, **columns):
    return [float("nan"), None] + [1.0] * (len(completions) - 2)

not_callable = 3
'''


@pytest.fixture()
def user_rewards(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib
    import sys
    sys.modules.pop("my_rewards", None)
    return importlib.import_module("my_rewards")


@pytest.mark.parametrize("completion,answer,score", [
    ("so 3 + 4 = 7", "3 + 4 = <<3+4=7>>7\n#### 7", 1.0),
    ("the answer is 1,234.", "#### 1234", 1.0),
    ("7 then 8", "#### 7", 0.0),
    ("no number", "#### 7", 0.0),
    ("-5", "#### -5", 1.0),
    ("٧", "#### 7", 0.0),          # ASCII digits only
])
def test_gsm8k_takes_the_last_number(completion, answer, score):
    assert gsm8k(["p"], [completion], answer=[answer]) == [score]


def test_boxed_and_exact():
    assert boxed(["p"] * 3, ["x \\boxed{\\frac{1}{2}}", "\\boxed{3}", "3"], answer=["\\frac{1}{2}", "\\boxed{3}", "3"]) \
        == [1.0, 1.0, 0.0]
    assert exact(["p"] * 2, [" 7 ", "7."], answer=["7", "7"]) == [1.0, 0.0]
    chat = [[{"role": "assistant", "content": " 7"}]]  # TRL's conversational completions
    assert exact([[{"role": "user", "content": "p"}]], chat, answer=["7"]) == [1.0]


def test_trl_signature_function_by_path_gets_every_column(user_rewards):
    rewards = RewardSet(["my_rewards:length_score", "exact"], [0.5, 2.0], answer_column="label")
    total, bad = rewards.score(["q", "q"], ["ab", "abcd"], {"label": ["ab", "x"], "weight": [1.0, 3.0]})
    assert total == [0.5 * 2 + 2.0, 0.5 * 12]
    assert bad == [False, False]
    prompts, completions, columns = user_rewards.calls[-1]
    assert prompts == ["q", "q"] and completions == ["ab", "abcd"]
    assert columns == {"label": ["ab", "x"], "weight": [1.0, 3.0]}


@pytest.mark.parametrize("name,bad", [("raises", [True] * 4), ("short", [True] * 4),
                                      ("nan_and_none", [True, True, False, False])])
def test_bad_results_score_zero_are_counted_and_logged_once(user_rewards, name, bad, capsys):
    rewards = RewardSet([f"my_rewards:{name}", "exact"], [])
    for _ in range(2):
        total, flags = rewards.score(["p"] * 4, ["7", "7", "7", "7"], {"answer": ["7"] * 4})
        assert flags == bad
        assert all(math.isfinite(t) for t in total)
        assert total == [1.0 if b else 2.0 for b in bad]  # the faulty function contributes 0
    assert rewards.take_errors() == 2 * sum(bad) and rewards.take_errors() == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if f"my_rewards:{name}" in line]
    assert len(lines) == 1, err  # two calls, one line
    assert "completion='7'" in lines[0] and "rollout/reward_errors" in lines[0]


def test_too_many_bad_results_in_a_row_stop_the_run(user_rewards):
    rewards = RewardSet(["my_rewards:raises"], [], limits=RewardLimits(max_errors=5))
    rewards.score(["p"] * 4, ["a"] * 4, {"answer": ["a"] * 4})  # 4 in a row: under the limit
    with pytest.raises(RewardError, match=r"max_reward_errors=5\); the last raised ValueError: judge offline "
                                          r"\(rollout/reward_errors/raised\)$"):  # each word once
        rewards.score(["p"] * 4, ["a"] * 4, {"answer": ["a"] * 4})


def test_a_good_sample_resets_the_run_of_errors(user_rewards):
    rewards = RewardSet(["my_rewards:nan_and_none"], [], limits=RewardLimits(max_errors=3))
    for _ in range(5):  # two bad, two good per call: never more than 2 in a row
        rewards.score(["p"] * 4, ["a"] * 4, {"answer": ["a"] * 4})
    assert rewards.take_errors() == 10


def test_unknown_or_uncallable_paths_are_refused(user_rewards):
    from colocate.objects import ObjectPathError
    for path in ("my_rewards:missing", "no_such_module_xyz:f", "my_rewards:not_callable"):
        with pytest.raises(ObjectPathError):
            RewardSet([path], [])


def test_a_reward_that_exits_is_refused_before_launch_without_promising_the_run_goes_on():
    """Before launch a BaseException on the first row is a refusal: no "the run goes on" in it."""
    from colocate.rewards import RewardRow, check_reward

    def exits(prompts, completions, **columns):
        raise SystemExit(3)
    problem = check_reward("my_rewards:exits", exits, RewardRow("add 1 and 2", "3", {}), RewardLimits())
    assert "raised SystemExit: 3 (a BaseException, caught in the reward's box)" in problem, problem
    assert "goes on" not in problem
