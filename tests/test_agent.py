"""Agent episodes (`envs/agent.py`, `tools.py`): an episode is one trajectory whose trained ids are
exactly the sampled ids and the env-span ids, with the loss mask on the policy spans only; every bad
tool call kind becomes a tool message and a count; TRL-style tools and environment classes run
unchanged; the learner's loss and LoRA gradients of masked episodes equal an independent
right-padded reference with the same mask, flat and in prefix trees."""
import time

import pytest
import torch

from colocate.chat import ChatFormat
from colocate.data import Completion, Sample, build_batch
from colocate.engine.base import Engine
from colocate.envs.agent import AgentEnv, AgentSettings
from colocate.rewards import RewardSet
from colocate.rollout.worker import RolloutWorker
from colocate.tools import TOOL_ERROR_KINDS, ToolRunnerSettings
from tests import agent_fixtures
from tests.conftest import CompletionView, right_padded_logits


class Rows:
    """The row source an AgentEnv draws from (the dataset env in a run): rows in a cycle."""

    def __init__(self, rows):
        self.rows, self.position = rows, 0

    def next_row(self) -> dict:
        row = self.rows[self.position % len(self.rows)]
        self.position += 1
        return row

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class ScriptedEngine(Engine):
    """Answers turn k of every episode with script[k] (k = EOS tokens already in the request), as
    ids with made-up log-probs, and records what it sampled."""

    def __init__(self, tokenizer, script: list[str]):
        self.tokenizer, self.script, self.sampled = tokenizer, script, []

    def generate(self, requests):
        eos = self.tokenizer.eos_token_id
        out = []
        for r in requests:
            turn = r.prompt_ids.count(eos)
            ids = self.tokenizer.encode(self.script[turn], add_special_tokens=False) + [eos]
            finish = "length" if len(ids) > r.max_new_tokens else "stop"
            ids = ids[: r.max_new_tokens]
            logprobs = [-0.1 * (i + 1) for i in range(len(ids))]
            self.sampled.append((list(r.prompt_ids), ids))
            out.append(Completion(token_ids=ids, logprobs=logprobs, allowed_ids=None, version=3, finish_reason=finish))
        return out


def make_env(tokenizer, *, tools=(), environment=None, rewards=None, rows=None, group_size=2, **settings):
    runner = ToolRunnerSettings(timeout_s=settings.pop("timeout_s", 2.0), max_output_chars=200)
    return AgentEnv(tokenizer, Rows(rows or [{"prompt": "add 2 and 3 ; answer :", "answer": "5"}]),
                    rewards or RewardSet(["gsm8k"], []), AgentSettings(runner=runner, **settings),
                    group_size=group_size, tools=tools, environment=environment, chat=ChatFormat(tokenizer, "none"))


CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def test_episode_trains_exactly_the_sampled_and_env_ids(tiny_tokenizer):
    tok = tiny_tokenizer
    env = make_env(tok, tools=[agent_fixtures.add], max_new_tokens=200, max_model_len=600)
    engine = ScriptedEngine(tok, [CALL, " 5"])
    batch, stats, _ = RolloutWorker(env, engine, groups_per_batch=2).collect()
    env_ids = env.format.tool_ids([type("R", (), {"content": "5"})()])  # the tool message, tokenized once
    turns = [ids for _, ids in engine.sampled]
    first, second = turns[0], turns[-1]
    prompt = tok.encode("add 2 and 3 ; answer :", add_special_tokens=False)
    start = 0
    for seq in range(batch.num_sequences):
        n = int(batch.seq_lens[seq])
        assert batch.tokens[start:start + n].tolist() == prompt + first + env_ids + second
        start += n
    comp = len(first) + len(env_ids) + len(second)
    assert batch.num_completion_tokens == 4 * comp
    mask = [True] * len(first) + [False] * len(env_ids) + [True] * len(second)
    assert batch.loss_mask.tolist() == mask * 4
    lp = [-0.1 * (i + 1) for i in range(len(first))] + [0.0] * len(env_ids) + \
         [-0.1 * (i + 1) for i in range(len(second))]
    torch.testing.assert_close(batch.behaviour_logprobs, torch.tensor(lp * 4))
    # the second turn's request was the first turn's ids plus the env span, never re-rendered
    assert engine.sampled[-1][0] == prompt + first + env_ids
    assert batch.rewards.tolist() == [1.0] * 4 and stats["tool_call_rate"] == 1.0
    assert stats["accuracy"] == 1.0 and stats["turns_per_episode"] == 2.0
    assert batch.versions.tolist() == [3] * 4


BAD_CALLS = {
    "unknown_tool": '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
    "invalid_json": '<tool_call>{"name": "add", "arguments": {"a": 2,</tool_call>',
    "wrong_arguments": '<tool_call>{"name": "add", "arguments": {"x": 1}}</tool_call>',
    "raised": '<tool_call>{"name": "explode", "arguments": {"reason": "why"}}</tool_call>',
    "timeout": '<tool_call>{"name": "sleepy", "arguments": {"seconds": 30}}</tool_call>',
}


def test_every_bad_call_kind_is_a_tool_message_and_a_count(tiny_tokenizer):
    tok = tiny_tokenizer
    env = make_env(tok, tools=[agent_fixtures.add, agent_fixtures.explode, agent_fixtures.sleepy],
                   group_size=len(BAD_CALLS), timeout_s=0.5, max_new_tokens=64, max_model_len=512)
    env.start_group(0)
    keys = [k for k, _ in env.requests()]
    kinds = list(BAD_CALLS)
    sampled = {k: tok.encode(BAD_CALLS[kind], add_special_tokens=False) + [tok.eos_token_id] for k, kind in zip(keys, kinds)}
    env.step({k: Completion(ids, [-1.0] * len(ids), None, 0) for k, ids in sampled.items()})
    t0 = time.monotonic()
    ready: set = set()
    while len(ready) < len(keys) and time.monotonic() - t0 < 5:  # each episode moves on as its tools answer
        ready |= {k for k, _ in env.requests()}  # blocks only while no episode is ready
        time.sleep(0.01)
    assert ready == set(keys)  # the sleeper was abandoned at its timeout
    for key, kind in zip(keys, kinds):
        message = env._episodes[key].messages[-1]
        assert message["role"] == "tool" and message["content"].startswith("error:"), (kind, message)
    metrics = env.metrics()
    assert {k: metrics[f"tool_errors/{k}"] for k in TOOL_ERROR_KINDS} == {**dict.fromkeys(TOOL_ERROR_KINDS, 0.0),
                                                                        **dict.fromkeys(kinds, 1.0)}


def test_limits_end_episodes_cleanly(tiny_tokenizer):
    """max_turns, max_tool_calls and max_model_len end an episode (the last as truncated)."""
    tok = tiny_tokenizer
    for settings, reason in [({"max_turns": 1}, "max_turns"), ({"max_tool_calls": 0}, "max_tool_calls"),
                             ({"max_model_len": 150}, "truncated")]:
        env = make_env(tok, tools=[agent_fixtures.add], max_new_tokens=200, **{"max_model_len": 600, **settings})
        engine = ScriptedEngine(tok, [CALL, CALL, CALL])
        batch, stats, _ = RolloutWorker(env, engine, groups_per_batch=1).collect()
        assert stats[f"finish/{reason}"] == 1.0, (reason, stats)
        assert int(batch.seq_lens.max()) <= settings.get("max_model_len", 600)


def test_trl_style_tools_and_environment_run_unchanged(tiny_tokenizer):
    """A TRL environment class by path: reset(**row) extends the prompt, its public method is a tool,
    the TRL-signature reward reads the instances; a plain function tool sits beside it."""
    from colocate.objects import load_object
    tok = tiny_tokenizer
    rewards = RewardSet(["tests.agent_fixtures:counter_reward"], [])
    env = make_env(tok, tools=[load_object("tests.agent_fixtures:add")],
                   environment=load_object("tests.agent_fixtures:Counter"), rewards=rewards,
                   rows=[{"prompt": "count", "target": 4}], max_new_tokens=200, max_model_len=900)
    assert {s["function"]["name"] for s in env.format.schemas} == {"add", "increment"}
    inc = '<tool_call>{"name": "increment", "arguments": {"step": 2}}</tool_call>'
    engine = ScriptedEngine(tok, [inc, inc, "done"])
    batch, stats, _ = RolloutWorker(env, engine, groups_per_batch=1).collect()
    assert engine.sampled[0][0] == tok.encode("count (count to 4)", add_special_tokens=False)
    assert batch.rewards.tolist() == [1.0, 1.0] and stats["tool_calls_per_episode"] == 2.0
    assert stats["tool_errors/unknown_tool"] == 0.0


# ---- the learner: masked episodes against an independent reference --------------------------------

def episode_batch(vocab: int, seed: int):
    """2 groups x 3 episodes: a shared prompt, then policy / env / policy / env / policy spans."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for group in range(2):
        prompt = torch.randint(2, vocab, (7 + group,), generator=g).tolist()
        for _ in range(3):
            ids, mask = [], []
            for span, policy in enumerate([True, False, True, False, True]):
                n = int(torch.randint(2, 6, (1,), generator=g))
                ids += torch.randint(2, vocab, (n,), generator=g).tolist()
                mask += [policy] * n
            lp = [(-3 - float(torch.rand(1, generator=g))) if m else 0.0 for m in mask]
            samples.append(Sample(prompt, Completion(ids, lp, None, 0, loss_mask=mask), float(torch.rand(1, generator=g)),
                                  group))
    return build_batch(samples, torch.randn(len(samples), generator=g).tolist())


def learner_loss_and_grads(learner, batch, mode: str):
    from colocate.learner.packing import resolve_attention, set_attention
    lc = learner.cfg.learner
    lc.prefix_sharing, lc.micro_batch_tokens = mode, 100_000
    learner.attention = resolve_attention(lc.attention, learner.device, mode)
    set_attention(learner.model, learner.attention)
    learner.model.zero_grad(set_to_none=True)
    work = learner.micro_batches(batch)
    counts = learner._global_counts(batch, 0.0, 0)  # the step's own normalizers: trained tokens first
    totals, tokens = learner._forward_backward(work, len(work), batch.num_sequences, float(counts[0]))
    grads = {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.requires_grad}
    return totals[0], grads, tokens


def reference_loss_and_grads(learner, batch, mask):
    """Right-padded rows, logits at every completion position, the loss with `mask` as its weights."""
    from colocate.kernels import grpo_loss
    from colocate.learner.packing import set_attention
    set_attention(learner.model, "sdpa")
    learner.model.zero_grad(set_to_none=True)
    view = CompletionView(batch, learner.pad_id, "cpu")
    logits = right_padded_logits(learner.model.get_base_model(), view)
    loss, _ = grpo_loss(logits, view.targets, mask, batch.behaviour_logprobs, batch.advantages[view.seq_ids],
                        norm=learner.cfg.loss.norm, seq_ids=view.seq_ids, num_seqs=batch.num_sequences,
                        max_len=learner.cfg.engine.max_new_tokens, num_tokens=float(mask.sum()), impl="torch")
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("norm", ["dapo", "grpo"])
def test_episode_loss_and_grads_equal_the_flat_reference(tiny_cfg, tiny_tokenizer, norm):
    from tests.test_prefix_sharing import _learner
    learner = _learner(tiny_cfg, tiny_tokenizer, beta=0.0, norm=norm)
    learner.model.float()
    batch = episode_batch(len(tiny_tokenizer), seed=3)
    loss_ref, grads_ref = reference_loss_and_grads(learner, batch, batch.loss_mask)
    loss_all, grads_all = reference_loss_and_grads(learner, batch, torch.ones_like(batch.loss_mask))
    assert not torch.allclose(loss_all, loss_ref)  # the env spans would change the loss: the mask matters
    scale = max(float(g.abs().max()) for g in grads_ref.values())
    for mode in ("off", "tree"):
        loss, grads, tokens = learner_loss_and_grads(learner, batch, mode)
        torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=0)
        for name, g in grads_ref.items():
            assert float(g.abs().max()) > 0, name
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6 * scale, msg=name)
        if mode == "tree":  # the three episodes of a group forward their prompt once
            assert tokens <= int(batch.seq_lens.sum()) - 2 * 7 - 2 * 8  # prompts of 7 and 8 tokens
