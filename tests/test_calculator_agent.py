"""The calculator agent example (examples/calculator_agent.py) on CPU, without training: what its
constraint leaves to the policy (call or answer, operator, operands; answers quote the latest
observation), the reward, and one scripted episode through the rollout worker: the tool's real
result comes back as the env span and the right answer scores 1. The learning run itself is
measured (profiles/README.md) and on a GPU tested by tests/test_agent_gpu.py."""
import dataclasses

import pytest

from colocate.data import Completion
from colocate.engine.base import Engine
from colocate.rollout.worker import RolloutSettings, RolloutWorker

PATH = "examples.calculator_agent:CalculatorEnv"


def build(tiny_cfg, tmp_path):
    from colocate.envs import env_corpus, make_env
    from colocate.models import load_tokenizer
    cfg = dataclasses.replace(
        tiny_cfg, env=dataclasses.replace(tiny_cfg.env, name=PATH, options={"low": 10, "high": 99}, max_turns=3,
                                          max_tool_calls=2),
        engine=dataclasses.replace(tiny_cfg.engine, max_new_tokens=40, max_model_len=256),
        model=dataclasses.replace(tiny_cfg.model, cache_dir=str(tmp_path / "cache")),
        rollout=dataclasses.replace(tiny_cfg.rollout, group_size=2))
    key, corpus_fn = env_corpus(cfg)
    tokenizer = load_tokenizer(cfg.model, corpus_fn, key)
    return make_env(cfg, tokenizer, seed=0), tokenizer


class RightAgent(Engine):
    """Turn 1: the right call (checked against the constraint); turn 2: answer with the tool's result."""

    def __init__(self, env, tokenizer):
        self.env, self.tokenizer = env, tokenizer

    def generate(self, requests):
        from examples.calculator_agent import CALL, NUMBER, OPS
        out = []
        for r in requests:
            text = self.tokenizer.decode(r.prompt_ids)
            word, a, b = text.split()[0], *NUMBER.findall(text)[:2]
            result = text.split("<tool_response>\n")[1].split("\n")[0] if "<tool_response>" in text else None
            answer = CALL.format(a=a, op=OPS[word], b=b) if result is None else f"answer {result}"
            assert answer in r.constraint.texts[0]
            ids = self.tokenizer.encode(answer, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            out.append(Completion(ids, [-1.0] * len(ids), None, 0))
        return out


def test_the_constraint_leaves_the_call_and_its_arguments_to_the_policy(tiny_cfg, tmp_path):
    from examples.calculator_agent import CALL
    env, _ = build(tiny_cfg, tmp_path)
    env.start_group(0)
    (key, request), _ = env.requests()
    episode = env._episodes[key]
    a, b = episode.prompt.split()[1], episode.prompt.split()[3]
    texts = set(request.constraint.texts[0])
    assert {f"answer {a}", f"answer {b}"} <= texts  # answering at once is allowed (and wrong)
    assert {CALL.format(a=x, op=op, b=y) for x in (a, b) for op in "+*" for y in (a, b)} <= texts
    episode.messages += [{"role": "assistant", "content": "..."}, {"role": "tool", "name": "calculator",
                                                                   "content": "3995"}]
    after = set(env.turn_constraint(episode).texts[0])
    assert {t for t in after if t.startswith("answer")} == {"answer 3995"}  # quotes the latest observation
    assert CALL.format(a="3995", op="*", b=a) in after  # another call may use the result


def test_final_answer_reward():
    from examples.calculator_agent import final_answer
    completions = ["<tool_call>...</tool_call>\n<tool_response>\n132\n</tool_response>\nanswer 132",
                   "answer 47", "answer 132 and more", "no answer"]
    assert final_answer(None, completions, answer=["132", "132", "132", "132"]) == [1.0, 0.0, 0.0, 0.0]


def test_a_right_episode_scores_one(tiny_cfg, tmp_path):
    env, tokenizer = build(tiny_cfg, tmp_path)
    batch, stats, _ = RolloutWorker(env, RightAgent(env, tokenizer), RolloutSettings(groups_per_batch=2)).collect()
    assert batch.rewards.tolist() == [1.0] * 4
    assert stats["tool_call_rate"] == 1.0 and stats["accuracy"] == 1.0 and stats["turns_per_episode"] == 2.0


@pytest.mark.slow
def test_a_short_torchrun_run_logs_the_agent_curves_and_a_zero_sampler_gap(tmp_path):
    """4 steps under torchrun (the episodes' loss mask crosses the transport): the agent scalars are
    in TensorBoard, and with K = 2 at lag 0 the HF engine's log-probs of the policy spans equal the
    learner's (both fp32 on this CPU, different kernels: rounding only)."""
    from tests.conftest import torchrun
    from tests.test_vllm_gpu import tb_scalars
    run_dir = tmp_path / "run"
    torchrun(["--config", "configs/cpu-calculator-agent.yaml", "--learner.num_steps=4", "--learner.max_policy_lag=0",
              "--learner.updates_per_batch=2", f"--metrics.run_dir={run_dir}", f"--model.cache_dir={tmp_path / 'cache'}"])
    rollout = tb_scalars(str(run_dir / "tb" / "inference"))
    for tag in ("tool_call_rate", "accuracy", "tool_calls_per_episode", "tool_error_rate", "env_tokens_per_episode"):
        assert len(rollout[f"rollout/{tag}"]) == 4, tag
    learner = tb_scalars(str(run_dir / "tb" / "learner"))
    assert min(learner["learner/sampler_gap_tokens"]) > 0
    assert max(learner["learner/sampler_logprob_gap"]) < 1e-4
