"""The worked example of a custom env (examples/guessing_game.py): two turns, rewards by turn,
loaded by path through `env.name`, and trained under torchrun."""
import json

import pytest

from colocate.data import Completion
from colocate.engine.base import Engine

PATH = "examples.guessing_game:GuessingGameEnv"


class Guesser(Engine):
    """Guesses 1 on the first turn and 2 on the second."""

    def __init__(self, tokenizer):
        self.tokenizer, self.prompts = tokenizer, []

    def generate(self, requests):
        out = []
        for r in requests:
            text = self.tokenizer.decode(r.prompt_ids)
            self.prompts.append(text)
            ids = self.tokenizer.encode(" 2" if "guess again" in text else " 1", add_special_tokens=False)
            ids.append(self.tokenizer.eos_token_id)
            out.append(Completion(token_ids=ids, logprobs=[0.0] * len(ids), allowed_ids=None, version=0))
        return out


def load_env(tiny_cfg, tokenizer, max_number=4, group_size=3):
    from colocate.config import load_config
    from colocate.envs import make_env
    cfg = load_config(None, {"model": {"cache_dir": tiny_cfg.model.cache_dir},
                             "env": {"name": PATH, "options": {"max_number": max_number}},
                             "rollout": {"group_size": group_size, "batch_size": group_size * 16}})
    return make_env(cfg, tokenizer, seed=0)


def test_custom_env_by_path_is_built_with_its_options(tiny_cfg, tiny_tokenizer):
    from examples.guessing_game import GuessingGameEnv
    env = load_env(tiny_cfg, tiny_tokenizer, max_number=3)
    assert type(env) is GuessingGameEnv and env.max_number == 3 and env.group_size == 3


def test_two_turns_reward_a_first_hit_more_than_a_second(tiny_cfg, tiny_tokenizer):
    env = load_env(tiny_cfg, tiny_tokenizer)
    engine = Guesser(tiny_tokenizer)
    for g in range(12):
        env.start_group(g)
    secrets = dict(env._secret)
    samples = []
    for _ in range(2):  # at most two turns
        keyed = env.requests()
        env.step(dict(zip([k for k, _ in keyed], engine.generate([r for _, r in keyed]))))
        samples += env.pop_finished()
    assert env.requests() == [] and not env._secret
    for s in samples:
        secret = secrets[s.group_key]
        assert s.reward == {1: 1.0, 2: 0.5}.get(secret, 0.0)
        assert s.is_anchor == (s.info["turn"] == 0)
        if s.info["turn"] == 1:  # the second prompt holds the first guess and the hint
            assert "1 ; higher ; guess again :" in tiny_tokenizer.decode(s.prompt_ids)
    assert {len([s for s in samples if s.group_key == g and s.is_anchor]) for g in secrets} == {3}


@pytest.mark.slow
def test_custom_env_trains_under_torchrun(tmp_path):
    from tests.conftest import torchrun
    run_dir = tmp_path / "run"
    torchrun(["--config", "configs/cpu-tiny.yaml", f"--env.name={PATH}", "--env.options={max_number: 4}",
              "--learner.num_steps=3", f"--metrics.run_dir={run_dir}", f"--model.cache_dir={tmp_path / 'cache'}"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["env"] == PATH
