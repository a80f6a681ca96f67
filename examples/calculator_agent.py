"""A tool-using agent that learns on CPU: multi-digit add / multiply with a calculator tool.

Each episode asks "add 47 and 85" or "multiply 12 and 34" (operands 10..99). The tiny model
cannot compute a product in one step; it has a `calculator(expression)` tool (colocate.calculator:
its own parser, no eval). Reward 1 when the episode's last turn is "answer <the right value>".

Train it with (from the repository root, so `examples` imports)

    torchrun --nproc-per-node 2 -m colocate.train --config configs/cpu-calculator-agent.yaml

What the constraint shapes and what is learned. Each turn is one of two forms, in the Hermes format
the env parses: `<tool_call>{"name": "calculator", "arguments": {"expression": "A op B"}}</tool_call>`
with op + or *, or `answer N`. A and B may be any number already in the episode (the prompt's
operands, the tool's results); N quotes a number of the latest observation (the prompt's operands
before any call, the tool's result after one): a pointer, since the tiny tokenizer spells numbers
digit by digit and picking the result's digits over an operand's by reinforcement stalled at about
0.7 accuracy (profiles/README.md). Everything else is the policy's decision, learned from the
reward alone: whether to call the tool or answer at once (with an operand: wrong), which operator
(matching "add" / "multiply"), which operands (the same one twice is wrong), and whether to answer
or call again once the result is there. The untrained model is right about 1 time in 16; the
tool-call rate and the accuracy are logged as rollout/tool_call_rate and rollout/accuracy.

The tokenizer is the embedded one, trained on this task's text (`corpus`): prompts, tool calls,
tool responses and answers, so the tool-call boilerplate is a few tokens and digits are one token
each.
"""
from __future__ import annotations

import random
import re

from colocate.calculator import calculator
from colocate.chat import ChatFormat
from colocate.constraint import Constraint
from colocate.envs.agent import AgentEnv, AgentSettings, Episode, agent_settings
from colocate.rewards import RewardSet

CALL = '<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a} {op} {b}"}}}}</tool_call>'
OPS = {"add": "+", "multiply": "*"}
NUMBER = re.compile(r"\d+")
ANSWER = re.compile(r"answer (\d+)")


def task(rng: random.Random, low: int, high: int) -> dict:
    word = rng.choice(sorted(OPS))
    a, b = rng.randint(low, high), rng.randint(low, high)
    value = a + b if word == "add" else a * b
    return {"prompt": f"{word} {a} and {b}\n", "answer": str(value)}


def final_answer(prompts, completions, answer, **kwargs) -> list[float]:
    """TRL signature: 1.0 when the last turn is exactly "answer <value>"."""
    out = []
    for text, want in zip(completions, answer):
        found = ANSWER.findall(text)
        out.append(float(bool(found) and found[-1] == want and text.rstrip().endswith(f"answer {want}")))
    return out


class TaskRows:
    """Random tasks as rows (the dataset env's role): seeded, with a JSON resume state."""

    def __init__(self, seed: int, low: int, high: int):
        self.rng, self.low, self.high = random.Random(seed), low, high

    def next_row(self) -> dict:
        return task(self.rng, self.low, self.high)

    def state_dict(self) -> dict:
        version, internal, gauss = self.rng.getstate()
        return {"rng": [version, list(internal), gauss]}

    def load_state_dict(self, state: dict) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))


class CalculatorEnv(AgentEnv):
    def __init__(self, tokenizer, settings: AgentSettings, *, group_size: int, seed: int, low: int = 10,
                 high: int = 99):
        """`low`, `high` (env.options): the operands' range."""
        super().__init__(tokenizer, TaskRows(seed, int(low), int(high)),
                         RewardSet(["examples.calculator_agent:final_answer"], []), settings,
                         group_size=group_size, tools=[calculator], chat=ChatFormat(tokenizer, "none"))

    @classmethod
    def from_config(cls, cfg, tokenizer, seed: int) -> "CalculatorEnv":
        return cls(tokenizer, agent_settings(cfg), group_size=cfg.rollout.group_size, seed=seed, **cfg.env.options)

    @classmethod
    def corpus(cls, cfg) -> list[str]:
        """Rendered episodes: prompts, every call form, tool responses and answers."""
        rng = random.Random(0)
        lines = []
        for _ in range(3000):
            row = task(rng, 10, 99)
            a, b = NUMBER.findall(row["prompt"])
            op = rng.choice(sorted(OPS.values()))
            lines.append(row["prompt"] + CALL.format(a=a, op=op, b=b) + f"\n<tool_response>\n{row['answer']}\n"
                         f"</tool_response>\nanswer {row['answer']}")
        return lines

    def turn_constraint(self, episode: Episode) -> Constraint:
        """A tool call over the numbers seen so far, or an answer quoting a number of the latest
        observation (the prompt before any call, then the last tool message)."""
        tool_messages = [m["content"] for m in episode.messages if m["role"] == "tool"]
        seen = list(dict.fromkeys(NUMBER.findall(episode.prompt) + [n for t in tool_messages
                                                                     for n in NUMBER.findall(t)]))
        latest = NUMBER.findall(tool_messages[-1] if tool_messages else episode.prompt)
        texts = [CALL.format(a=a, op=op, b=b) for a in seen for op in OPS.values() for b in seen]
        texts += [f"answer {n}" for n in dict.fromkeys(latest)]
        encode = self.tokenizer.encode
        return Constraint(slots=[[encode(t, add_special_tokens=False) for t in texts]], eos_id=self.eos_id,
                          texts=[texts])
