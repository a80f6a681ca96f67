"""Agent episodes (`envs/agent.py`, `tools.py`): an episode with two tool calls trains exactly the
sampled ids and the tool messages tokenized by hand (raw text and a chat template), with the loss mask
on the policy spans only; every bad tool call kind becomes a tool message and a count, and the
episode plays on; TRL-style tools and environment classes run unchanged, alone and through the
config (the dataset env's rows and rewards); the learner's loss and LoRA gradients of masked
episodes equal an independent right-padded reference with the same mask, flat and in prefix trees."""
import copy
import time

import pytest
import torch

from colocate.chat import ChatFormat
from colocate.data import Completion, Sample, build_batch
from colocate.engine.base import Engine
from colocate.config import Config
from colocate.envs.agent import AgentEnv, AgentSettings, agent_settings
from colocate.rewards import RewardSet
from colocate.rollout.worker import RolloutSettings, RolloutWorker
from colocate.tools import TOOL_ERROR_KINDS, ToolRunnerSettings
from tests import agent_fixtures
from tests.conftest import CompletionView, fields_left_at_default, right_padded_logits


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
    """Answers turn k of every episode with script[k], as ids with made-up log-probs, and records
    what it sampled. k comes from the EOS tokens in the request: `prompt_eos` in the prompt, then
    `turn_eos` per turn played (the policy's, and a chat template's tool message ends with one too)."""

    def __init__(self, tokenizer, script: list[str], prompt_eos: int = 0, turn_eos: int = 1):
        self.tokenizer, self.script, self.sampled = tokenizer, script, []
        self.prompt_eos, self.turn_eos = prompt_eos, turn_eos

    def generate(self, requests):
        eos = self.tokenizer.eos_token_id
        out = []
        for r in requests:
            turn = (r.prompt_ids.count(eos) - self.prompt_eos) // self.turn_eos
            ids = self.tokenizer.encode(self.script[turn], add_special_tokens=False) + [eos]
            finish = "length" if len(ids) > r.max_new_tokens else "stop"
            ids = ids[: r.max_new_tokens]
            logprobs = [-0.1 * (i + 1) for i in range(len(ids))]
            self.sampled.append((list(r.prompt_ids), ids))
            out.append(Completion(token_ids=ids, logprobs=logprobs, allowed_ids=None, version=3, finish_reason=finish))
        return out


def make_env(tokenizer, *, tools=(), environment=None, rewards=None, rows=None, group_size=2, chat=None, **settings):
    runner = ToolRunnerSettings(timeout_s=settings.pop("timeout_s", 2.0), max_output_chars=200)
    return AgentEnv(tokenizer, Rows(rows or [{"prompt": "add 2 and 3 ; answer :", "answer": "5"}]),
                    rewards or RewardSet(["gsm8k"], []), AgentSettings(runner=runner, **settings),
                    group_size=group_size, tools=tools, environment=environment,
                    chat=chat or ChatFormat(tokenizer, "none"))


CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


CALL_2 = '<tool_call>{"name": "add", "arguments": {"a": 5, "b": 4}}</tool_call>'
CHAT_TEMPLATE = (  # Qwen-shaped: tool schemas in a system turn, tool messages as a user turn, EOS <|im_end|>
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t['function']['name'] }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m['content'] }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_tokenizer(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = CHAT_TEMPLATE
    return tok


# What each format puts between the policy's EOS and its next turn, written out by hand.
HAND_BUILT = {
    "raw": ("add 2 and 3 and 4 ; answer :", "\n<tool_response>\n{}\n</tool_response>\n"),
    "chat": ("<|im_start|>system\n# Tools\nadd\n<|im_end|>\n<|im_start|>user\nadd 2 and 3 and 4 ; answer :<|im_end|>\n"
             "<|im_start|>assistant\n",
             "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
}


@pytest.mark.parametrize("fmt", ["raw", "chat"])
def test_two_call_episode_trains_the_hand_built_sequence(tiny_tokenizer, fmt):
    """Two tool calls then an answer: every trained sequence equals the prompt, the three sampled
    turns and the two tool messages as tokenized by hand; the mask is True on exactly the sampled
    turns; each request was the previous ids plus the new spans (nothing re-rendered)."""
    tok = chat_tokenizer(tiny_tokenizer) if fmt == "chat" else tiny_tokenizer
    chat = ChatFormat(tok, "auto" if fmt == "chat" else "none")
    env = make_env(tok, tools=[agent_fixtures.add], max_new_tokens=200, max_model_len=800, chat=chat,
                   rows=[{"prompt": "add 2 and 3 and 4 ; answer :", "answer": "9"}])
    engine = ScriptedEngine(tok, [CALL, CALL_2, " 9"], **({"prompt_eos": 2, "turn_eos": 2} if fmt == "chat" else {}))
    batch, stats, _ = RolloutWorker(env, engine, RolloutSettings(groups_per_batch=2)).collect()
    eos = [tok.eos_token_id]
    prompt_text, tool_text = HAND_BUILT[fmt]
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    prompt = encode(prompt_text)
    turns = [encode(CALL) + eos, encode(CALL_2) + eos, encode(" 9") + eos]
    results = [encode(tool_text.format("5")), encode(tool_text.format("9"))]
    spans = [(turns[0], True), (results[0], False), (turns[1], True), (results[1], False), (turns[2], True)]
    completion = [t for ids, _ in spans for t in ids]
    mask = [policy for ids, policy in spans for _ in ids]
    assert batch.num_sequences == 4 and batch.prompt_lens.tolist() == [len(prompt)] * 4
    assert batch.tokens.tolist() == (prompt + completion) * 4
    assert batch.loss_mask.tolist() == mask * 4
    lp = [-0.1 * (i + 1) if policy else 0.0 for ids, policy in spans for i in range(len(ids))]
    torch.testing.assert_close(batch.behaviour_logprobs, torch.tensor(lp * 4))
    requests = sorted(p for p, _ in engine.sampled)  # episodes move on as their tools answer, in any order
    assert requests == sorted([prompt] * 4 + [prompt + turns[0] + results[0]] * 4  # 2 groups x 2 episodes
                              + [prompt + turns[0] + results[0] + turns[1] + results[1]] * 4)
    assert batch.rewards.tolist() == [1.0] * 4 and stats["tool_call_rate"] == 1.0
    assert stats["accuracy"] == 1.0 and stats["turns_per_episode"] == 3.0 and stats["tool_calls_per_episode"] == 2.0
    assert stats["policy_tokens_per_episode"] == sum(mask) and stats["env_tokens_per_episode"] == len(mask) - sum(mask)
    assert batch.versions.tolist() == [3] * 4


BAD_CALLS = {
    "unknown_tool": '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
    "invalid_json": '<tool_call>{"name": "add", "arguments": {"a": 2,</tool_call>',
    "wrong_arguments": '<tool_call>{"name": "add", "arguments": {"x": 1}}</tool_call>',
    "raised": '<tool_call>{"name": "explode", "arguments": {"reason": "why"}}</tool_call>',
    "timeout": '<tool_call>{"name": "sleepy", "arguments": {"seconds": 30}}</tool_call>',
    "output_too_long": '<tool_call>{"name": "repeat", "arguments": {"text": "ab", "times": 500}}</tool_call>',
    # issue 52: text any policy can write, and tools that end in ways a plain `except Exception` misses
    "too_deep": "<tool_call>" + "[" * 1200 + "</tool_call>",
    "too_large": '<tool_call>{"name": "add", "arguments": {"a": ' + "9" * 4301 + ', "b": 1}}</tool_call>',
    "base_exception": '<tool_call>{"name": "quit_now", "arguments": {"code": 5}}</tool_call>',
    "unrenderable": '<tool_call>{"name": "returns_a_set", "arguments": {"n": 3}}</tool_call>',
}
BAD_TOOLS = [agent_fixtures.add, agent_fixtures.explode, agent_fixtures.sleepy, agent_fixtures.repeat,
             agent_fixtures.quit_now, agent_fixtures.returns_a_set]
LONG = {"max_new_tokens": 6000, "max_model_len": 12000}  # the 4,301 digits are a token each here


def test_every_bad_call_kind_is_a_tool_message_and_a_count(tiny_tokenizer):
    tok = tiny_tokenizer
    env = make_env(tok, tools=BAD_TOOLS, group_size=len(BAD_CALLS), timeout_s=0.5, **LONG)
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
        assert message["role"] == "tool", (kind, message)
        if kind == "output_too_long":  # the output is kept, cut to tool_max_output_chars
            assert message["content"] == "ab" * 100 + " ...[output truncated]"
        else:
            assert message["content"].startswith("error:"), (kind, message)
    metrics = env.metrics()
    assert {k: metrics[f"tool_errors/{k}"] for k in TOOL_ERROR_KINDS} == {**dict.fromkeys(TOOL_ERROR_KINDS, 0.0),
                                                                        **dict.fromkeys(kinds, 1.0)}


@pytest.mark.parametrize("kind", list(BAD_CALLS))
def test_an_episode_plays_on_after_a_bad_call(tiny_tokenizer, kind):
    """Through the rollout worker: the bad call's message is the env span, the next turn is played
    and the episode is trained and scored like any other."""
    tok = tiny_tokenizer
    env = make_env(tok, tools=BAD_TOOLS, timeout_s=0.5, **LONG)
    engine = ScriptedEngine(tok, [BAD_CALLS[kind], " 5"])
    batch, stats, _ = RolloutWorker(env, engine, RolloutSettings(groups_per_batch=1)).collect()
    assert batch.num_sequences == 2 and stats["finish/stop"] == 1.0 and stats["turns_per_episode"] == 2.0
    assert stats[f"tool_errors/{kind}"] == 2.0 and stats["tool_error_rate"] == 1.0
    assert batch.rewards.tolist() == [1.0, 1.0]
    n, p = int(batch.seq_lens[0]), int(batch.prompt_lens[0])
    ids, mask = batch.tokens[p:n].tolist(), batch.loss_mask[: n - p].tolist()
    first = len(tok.encode(BAD_CALLS[kind], add_special_tokens=False)) + 1
    env_span = [t for t, m in zip(ids[first:], mask[first:]) if not m]
    assert all(mask[:first]) and mask[first:first + len(env_span)] == [False] * len(env_span) and all(
        mask[first + len(env_span):])
    expected = "ab" * 100 + " ...[output truncated]" if kind == "output_too_long" else "error:"
    assert expected in tok.decode(env_span)


SHOWN = {  # what the policy reads for each outcome (issue 52: once all of these read "timed out")
    "too_deep": "error: invalid tool call: nested 1200 deep (at most 32)",
    "too_large": "error: invalid tool call: an integer of 4301 digits (at most 100)",
    "base_exception": "error: SystemExit: 5",
    "unrenderable": "error: tool 'returns_a_set' returned a dict that cannot be shown as text (TypeError: Object of "
                    "type set is not JSON serializable)",
    "unprintable": "error: tool 'returns_unprintable' returned a Unprintable that cannot be shown as text "
                   "(ValueError: no text for this)",
}


@pytest.mark.parametrize("kind", list(SHOWN))
def test_each_outcome_is_shown_as_what_it_was_at_once_and_quietly(tiny_tokenizer, kind, capfd):
    """Model text out of bounds, a tool raising SystemExit, a result json.dumps or str() cannot
    render: each is its own kind and message, answered without waiting out the timeout, and nothing
    reaches stderr (no thread traceback)."""
    tok = tiny_tokenizer
    call = BAD_CALLS.get(kind, '<tool_call>{"name": "returns_unprintable", "arguments": {"n": 1}}</tool_call>')
    env = make_env(tok, tools=BAD_TOOLS + [agent_fixtures.returns_unprintable], timeout_s=30.0, **LONG)
    t0 = time.monotonic()
    engine = ScriptedEngine(tok, [call, " 5"])
    batch, stats, _ = RolloutWorker(env, engine, RolloutSettings(groups_per_batch=1)).collect()
    assert time.monotonic() - t0 < 20  # not the 30 s timeout
    assert stats[f"tool_errors/{'unrenderable' if kind == 'unprintable' else kind}"] == 2.0
    assert stats["tool_errors/timeout"] == 0.0 and batch.num_sequences == 2
    n, p = int(batch.seq_lens[0]), int(batch.prompt_lens[0])
    assert f"<tool_response>\n{SHOWN[kind]}\n</tool_response>" in tok.decode(batch.tokens[p:n].tolist())
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err, err


def test_model_text_of_any_shape_is_a_call_or_a_kind():
    """parse_hermes never raises: the issue's two crashers, a string-encoded deep payload, an
    oversize call, and the bounds' edges."""
    from colocate.tools import MAX_CALL_CHARS, MAX_JSON_DEPTH, parse_hermes
    wrap = "<tool_call>{}</tool_call>".format
    cases = {
        "[" * 1200: "too_deep",
        '{"name": "add", "arguments": {"a": ' + "9" * 4301 + "}}": "too_large",
        '{"name": "add", "arguments": "' + "[" * 1200 + '"}': "too_deep",  # arguments as a JSON string
        '{"name": "add", "arguments": {"a": "' + "x" * MAX_CALL_CHARS + '"}}': "too_large",
        '{"name": "add", "arguments": {"a": ' + "[" * (MAX_JSON_DEPTH - 2) + "]" * (MAX_JSON_DEPTH - 2) + "}}": None,
        '{"name": "add", "arguments": {"a": ' + "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1) + "}}": "too_deep",
        '{"name": "add", "arguments": {"a": "[[[[' + "[" * 100 + '"}}': None,  # brackets inside a string
        '{"name": "add", "arguments": {"a": 1e999}}': None,  # a float overflows to inf: a value, not an error
        "\ud800": "invalid_json",
    }
    for text, kind in cases.items():
        (call,) = parse_hermes(wrap(text))
        assert call.error == kind, (text[:40], call)


def test_hung_calls_leave_a_bounded_number_of_threads(tiny_tokenizer):
    """500 calls of a tool that never returns, through episodes: each is answered timeout at its
    deadline, hung workers are abandoned, replaced and counted, and the threads alive never exceed
    tool_workers + MAX_ABANDONED (a thread per call left 501)."""
    import threading

    from colocate.calls import MAX_ABANDONED
    tok = tiny_tokenizer
    hang = '<tool_call>{"name": "hang", "arguments": {"n": 1}}</tool_call>'
    runner = ToolRunnerSettings(timeout_s=0.05, max_output_chars=200, max_workers=3)
    env = AgentEnv(tok, Rows([{"prompt": "add 2 and 3 ; answer :", "answer": "5"}]), RewardSet(["gsm8k"], []),
                   AgentSettings(runner=runner, max_turns=11, max_tool_calls=50, max_new_tokens=1000,
                                 max_model_len=60000), group_size=10, tools=[agent_fixtures.hang])
    agent_fixtures.RELEASE.clear()
    earlier = set(threading.enumerate())  # idle workers of other tests' envs
    tool_threads = lambda: sum(t.name == "colocate-tool" and t not in earlier  # noqa: E731
                               for t in threading.enumerate())
    seen, done = [], threading.Event()
    sampler = threading.Thread(target=lambda: [seen.append(tool_threads()) or time.sleep(0.001)
                                               for _ in iter(done.is_set, True)])
    sampler.start()
    try:
        engine = ScriptedEngine(tok, [hang * 5] * 10 + [" 5"])  # 10 episodes x 10 turns x 5 calls
        batch, stats, _ = RolloutWorker(env, engine, RolloutSettings(groups_per_batch=1)).collect()
        assert stats["tool_calls"] == 500.0 and stats["tool_errors/timeout"] == 500.0
        assert stats["tool_workers_abandoned"] >= 3 and 0 < stats["tool_workers_hung"] <= 3 + MAX_ABANDONED
        assert max(seen) <= 3 + MAX_ABANDONED, max(seen)
    finally:
        done.set()
        sampler.join()
        agent_fixtures.RELEASE.set()
        env.close()
    deadline = time.monotonic() + 10
    while tool_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tool_threads() == 0  # released, every worker exits


def test_an_episode_tool_time_is_bounded_by_its_budget(tiny_tokenizer):
    """env.tool_budget_s: a 1 s tool with a 0.3 s timeout and a 0.5 s budget: the first call times
    out at 0.3 s, the second at what is left (0.2 s), the third is answered over_budget unrun."""
    tok = tiny_tokenizer
    sleep = '<tool_call>{"name": "sleepy", "arguments": {"seconds": 1}}</tool_call>'
    runner = ToolRunnerSettings(timeout_s=0.3, max_output_chars=200, budget_s=0.5)
    env = AgentEnv(tok, Rows([{"prompt": "add 2 and 3 ; answer :", "answer": "5"}]), RewardSet(["gsm8k"], []),
                   AgentSettings(runner=runner, max_turns=4, max_new_tokens=200, max_model_len=2000), group_size=2,
                   tools=[agent_fixtures.sleepy])
    t0 = time.monotonic()
    engine = ScriptedEngine(tok, [sleep, sleep, sleep, " 5"])
    batch, stats, _ = RolloutWorker(env, engine, RolloutSettings(groups_per_batch=1)).collect()
    assert time.monotonic() - t0 < 0.5 + 2.0  # the budget and the machine's slack, not 3 timeouts
    assert stats["tool_errors/timeout"] == 4.0 and stats["tool_errors/over_budget"] == 2.0
    text = tok.decode(batch.tokens[: int(batch.seq_lens[0])].tolist())
    assert "timed out after 0.3s" in text and "env.tool_budget_s=0.5s) is spent" in text
    env.close()


def test_limits_end_episodes_cleanly(tiny_tokenizer):
    """max_turns, max_tool_calls and max_model_len end an episode (the last as truncated)."""
    tok = tiny_tokenizer
    for settings, reason in [({"max_turns": 1}, "max_turns"), ({"max_tool_calls": 0}, "max_tool_calls"),
                             ({"max_model_len": 150}, "truncated")]:
        env = make_env(tok, tools=[agent_fixtures.add], max_new_tokens=200, **{"max_model_len": 600, **settings})
        engine = ScriptedEngine(tok, [CALL, CALL, CALL])
        batch, stats, _ = RolloutWorker(env, engine, RolloutSettings(groups_per_batch=1)).collect()
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
    engine = ScriptedEngine(tok, [inc, CALL, inc, "done"])
    batch, stats, _ = RolloutWorker(env, engine, RolloutSettings(groups_per_batch=1)).collect()
    assert engine.sampled[0][0] == tok.encode("count (count to 4)", add_special_tokens=False)
    assert batch.rewards.tolist() == [1.0, 1.0] and stats["tool_calls_per_episode"] == 3.0
    assert sum(stats[f"tool_errors/{k}"] for k in TOOL_ERROR_KINDS) == 0.0 and stats["tool_error_rate"] == 0.0
    n = int(batch.seq_lens[0])
    text = tok.decode(batch.tokens[:n].tolist())  # each tool's own answer went back: 2, then add's 5, then 4
    assert [m.split("\n")[1] for m in text.split("<tool_response>")[1:]] == ["2", "5", "4"]


def test_an_environment_get_reward_is_boxed_counted_and_named(tiny_tokenizer, capfd):
    """get_reward() is user code like a reward function: its NaN is counted (non_finite), named by
    the class, and the episode keeps the reward functions' value."""
    from colocate.objects import load_object
    tok = tiny_tokenizer
    env = make_env(tok, environment=load_object("tests.agent_fixtures:NanCounter"),
                   rewards=RewardSet(["tests.agent_fixtures:counter_reward"], []), rows=[{"prompt": "count", "target": 2}],
                   max_new_tokens=200, max_model_len=900)
    inc = '<tool_call>{"name": "increment", "arguments": {"step": 2}}</tool_call>'
    engine = ScriptedEngine(tok, [inc, "done"])
    batch, stats, _ = RolloutWorker(env, engine, RolloutSettings(groups_per_batch=1)).collect()
    assert batch.rewards.tolist() == [1.0, 1.0] and stats["reward_errors/non_finite"] == 2.0
    assert "reward function tests.agent_fixtures:NanCounter.get_reward returned float nan" in capfd.readouterr().err


def test_trl_tools_and_environment_from_the_config(tiny_cfg, tiny_tokenizer, tmp_path):
    """env.name dataset with env.tools, env.environment and a TRL reward by path: the dataset env's
    rows and reward combine with both (AgentEnv.from_config, as a run builds it)."""
    import dataclasses
    import json

    from colocate.envs import make_env as make_run_env
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": "count", "target": t}) + "\n" for t in (4, 6)))
    env_cfg = dataclasses.replace(tiny_cfg.env, name="dataset", data_files=[str(path)], answer_column="target",
                                  reward=["tests.agent_fixtures:counter_reward"], tools=["tests.agent_fixtures:add"],
                                  environment="tests.agent_fixtures:Counter", max_turns=4)
    engine_cfg = dataclasses.replace(tiny_cfg.engine, max_new_tokens=200, max_model_len=900)
    cfg = dataclasses.replace(tiny_cfg, env=env_cfg, engine=engine_cfg,
                              rollout=dataclasses.replace(tiny_cfg.rollout, group_size=2))
    env = make_run_env(cfg, tiny_tokenizer, seed=0)
    assert isinstance(env, AgentEnv) and set(env.tools) == {"add"} and env.environment is agent_fixtures.Counter
    inc = '<tool_call>{"name": "increment", "arguments": {"step": 2}}</tool_call>'
    engine = ScriptedEngine(tiny_tokenizer, [inc, inc, "done"])
    batch, stats, _ = RolloutWorker(env, engine, RolloutSettings(groups_per_batch=2)).collect()
    prompts = {tiny_tokenizer.decode(p) for p, _ in engine.sampled[:4]}
    assert prompts == {"count (count to 4)", "count (count to 6)"}
    starts = [0] + batch.seq_lens.cumsum(0).tolist()[:-1]
    rewards = {(tiny_tokenizer.decode(batch.tokens[s:s + int(p)].tolist()), float(r))
               for s, p, r in zip(starts, batch.prompt_lens, batch.rewards)}
    assert rewards == {("count (count to 4)", 1.0), ("count (count to 6)", 0.0)}  # two increments of 2 reach 4


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
    from colocate.learner.passes import forward_backward
    from colocate.learner.stats import BATCH_COUNTS, MICRO_BATCH_STATS, by_name
    counts = by_name(learner._global_counts(batch, 0.0, 0), BATCH_COUNTS)  # the step's own normalizers
    passes = forward_backward(learner, work, len(work), batch.num_sequences, counts["tokens"])
    grads = {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.requires_grad}
    return passes.sums[MICRO_BATCH_STATS.index("loss")], grads, passes.model_tokens


def reference_loss_and_grads(learner, batch, mask):
    """Right-padded rows, logits at every completion position, the loss with `mask` as its weights."""
    from colocate.kernels import LossBatch, LossSpec, grpo_loss
    from colocate.learner.packing import set_attention
    set_attention(learner.model, "sdpa")
    learner.model.zero_grad(set_to_none=True)
    view = CompletionView(batch, learner.pad_id, "cpu")
    logits = right_padded_logits(learner.model.get_base_model(), view)
    loss, _ = grpo_loss(logits, LossBatch(view.targets, mask, batch.behaviour_logprobs, batch.advantages[view.seq_ids],
                                          seq_ids=view.seq_ids, num_seqs=batch.num_sequences,
                                          num_tokens=float(mask.sum())),
                        LossSpec(norm=learner.cfg.loss.norm, max_len=learner.cfg.engine.max_new_tokens, impl="torch"))
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


def test_sampler_gap_counts_only_trained_choices_of_the_current_version(tiny_cfg, tiny_tokenizer):
    """learner/sampler_logprob_gap (updates_per_batch > 1): mean |learner - sampler| over the policy
    tokens with a choice of the sequences this version sampled. Behaviour log-probs are the learner's
    own plus 0.25 there, plus other offsets on env spans, forced tokens and an older version's
    sequences: the gap is 0.25 (to fp32 rounding of log-probs near -5)."""
    from colocate.config import load_config
    from colocate.learner.learner import Learner
    from colocate.learner.passes import start_logprobs
    from colocate.topology import Topology
    from colocate.models import build_policy
    from tests.test_prefix_sharing import randomize_adapter
    cfg = load_config(None, {"model": {"cache_dir": tiny_cfg.model.cache_dir}, "loss": {"impl": "torch"},
                             "learner": {"fsdp": False, "updates_per_batch": 2, "max_policy_lag": 1}})
    topo = Topology(rank=0, world_size=1, local_rank=0, num_inference=0, num_learners=1,
                    device=torch.device("cpu"), backend="gloo")
    learner = Learner(cfg, topo, build_policy(cfg, tiny_tokenizer, "meta"), tiny_tokenizer)
    randomize_adapter(learner.model)
    learner.model.float()
    learner.version = 3
    batch = episode_batch(len(tiny_tokenizer), seed=5)
    targets = CompletionView(batch, learner.pad_id, "cpu").targets
    choice = torch.arange(len(targets)) % 3 != 0  # every third token forced, the rest a choice of 2
    allowed = torch.full((len(targets), 2), -1, dtype=torch.int32)
    allowed[:, 0] = targets
    allowed[choice, 1] = ((targets[choice] + 1) % len(tiny_tokenizer)).int()
    batch.allowed_ids = allowed
    batch.versions = torch.tensor([3, 3, 3, 2, 2, 2], dtype=torch.int32)  # group 1: the previous version
    own = start_logprobs(learner, batch)
    seq = torch.repeat_interleave(torch.arange(batch.num_sequences), batch.completion_lens)
    current = seq < 3
    counted = current & batch.loss_mask & choice
    offset = torch.where(counted, 0.25, 0.0) + torch.where(~batch.loss_mask, 3.0, 0.0) + \
        torch.where(~choice, 2.0, 0.0) + torch.where(~current, 1.0, 0.0)
    batch.behaviour_logprobs = own - offset
    stats = learner.train_step(batch)
    assert stats["sampler_gap_tokens"] == int(counted.sum()) > 0
    assert abs(stats["sampler_logprob_gap"] - 0.25) < 1e-5


def test_agent_settings_come_from_their_config_keys():
    """One episode's limits, sampling, tool parser and runner, and the prompt column (env.prompt_column)."""
    cfg = Config()
    e = cfg.env
    e.max_turns, e.max_tool_calls, e.tool_parser, e.prompt_column = 6, 3, "other", "question"
    e.tool_timeout_s, e.tool_max_output_chars, e.tool_workers, e.tool_budget_s = 3.0, 100, 2, 20.0
    cfg.engine.max_new_tokens, cfg.engine.temperature, cfg.engine.max_model_len = 100, 0.7, 900
    settings = agent_settings(cfg)
    assert settings == AgentSettings(max_turns=6, max_tool_calls=3, max_new_tokens=100, temperature=0.7,
                                     max_model_len=900, tool_parser="other", prompt_column="question",
                                     runner=ToolRunnerSettings(timeout_s=3.0, max_output_chars=100, max_workers=2,
                                                               budget_s=20.0))
    assert fields_left_at_default(settings) == [] and fields_left_at_default(settings.runner) == []
