"""A synthetic task with a verifiable reward: small-integer addition, exact-answer reward.

Prompt: "add 3 and 4 ; answer :"  Completion: " 7" then EOS. Reward 1.0 for the exact sum, else 0.0.
With the constraint on, the sampler may only emit one of the 2 * max_operand + 1 possible sums, so
chance level is 1 / (2 * max_operand + 1) and every completion parses. Without it, a completion
that is not an integer scores 0 and is counted as invalid.

It exists to prove the trainer learns in minutes on a CPU; it deliberately has no multi-turn state.
"""
from __future__ import annotations

import json
import os
import random
import re
from typing import Hashable

from colocate.chat import ChatFormat
from colocate.constraint import Constraint
from colocate.data import Completion, Request, Sample
from colocate.envs.base import Env


def corpus(max_operand: int) -> list[str]:
    """Text the embedded tokenizer is trained on: every prompt and answer."""
    lines = []
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            lines.append(f"{prompt_text(a, b)} {a + b}")
    return lines


def prompt_text(a: int, b: int) -> str:
    return f"add {a} and {b} ; answer :"


ANSWER = re.compile(r"-?[0-9]{1,64}")  # longer is no sum of small operands, and int() refuses past 4,300 digits


def parse_answer(text: str) -> int | None:
    """An optional minus and ASCII digits only (`int()` also takes '७' or '７'), else None."""
    text = text.strip()
    return int(text) if ANSWER.fullmatch(text) else None


class ArithmeticEnv(Env):
    KEYS = {"max_operand": (lambda v: v >= 1, "must be >= 1 (operands are drawn from 0..max_operand)")}

    @classmethod
    def corpus_key(cls, cfg) -> str:
        return f"arithmetic-{cfg.env.max_operand}"

    @classmethod
    def corpus(cls, cfg) -> list[str]:
        return corpus(cfg.env.max_operand)

    @classmethod
    def prompt_bound(cls, cfg) -> int:
        """A prompt is one short line ("add A and B ; answer :")."""
        return 64

    def __init__(self, tokenizer, *, group_size: int, max_operand: int, max_new_tokens: int,
                 temperature: float, use_constraint: bool, seed: int, chat: ChatFormat | None = None):
        self.tokenizer = tokenizer
        self.chat = chat or ChatFormat(tokenizer, "none")
        self.group_size = group_size
        self.max_operand = max_operand
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.rng = random.Random(seed)
        self.eos_id = tokenizer.eos_token_id
        answers = [str(v) for v in range(2 * max_operand + 1)]
        self.constraint = Constraint(
            slots=[[tokenizer.encode(" " + a, add_special_tokens=False) for a in answers]],
            eos_id=self.eos_id, texts=[[" " + a for a in answers]]) if use_constraint else None
        self._pending: dict[Hashable, tuple[list[int], int]] = {}  # key -> (prompt ids, answer)
        self._done: dict[int, list[Sample]] = {}
        self._counts = {"completions": 0, "invalid": 0}

    @classmethod
    def from_config(cls, cfg, tokenizer, seed: int) -> "ArithmeticEnv":
        return cls(tokenizer, group_size=cfg.rollout.group_size, max_operand=cfg.env.max_operand,
                   max_new_tokens=cfg.engine.max_new_tokens, temperature=cfg.engine.temperature,
                   use_constraint=cfg.env.use_constraint, seed=seed,
                   chat=ChatFormat(tokenizer, cfg.model.chat_template))

    def start_group(self, group_id: int) -> None:
        a, b = self.rng.randint(0, self.max_operand), self.rng.randint(0, self.max_operand)
        ids = self.chat.ids(prompt_text(a, b))
        for i in range(self.group_size):
            self._pending[(group_id, i)] = (ids, a + b)
        self._done[group_id] = []

    def requests(self) -> list[tuple[Hashable, Request]]:
        return [(key, Request(prompt_ids=ids, max_new_tokens=self.max_new_tokens,
                              temperature=self.temperature, constraint=self.constraint))
                for key, (ids, _) in self._pending.items()]

    def step(self, completions: dict[Hashable, Completion]) -> None:
        for key, completion in completions.items():
            ids, answer = self._pending.pop(key)
            ids_out = [t for t in completion.token_ids if t != self.eos_id]
            value = parse_answer(self.tokenizer.decode(ids_out))
            self._counts["completions"] += 1
            if value is None:
                self._counts["invalid"] += 1
            reward = 1.0 if value == answer else 0.0
            group_id = key[0]
            self._done[group_id].append(Sample(prompt_ids=ids, completion=completion, reward=reward,
                                               group_key=group_id))

    def pop_finished(self) -> list[Sample]:
        out = []
        for group_id in [g for g, s in self._done.items() if len(s) == self.group_size]:
            out.extend(self._done.pop(group_id))
        return out

    def state_dict(self) -> dict:
        """JSON-able state for checkpoints: the sampler only (between batches nothing is pending,
        except oversampled groups still in play, which a resumed run starts afresh)."""
        version, internal, gauss = self.rng.getstate()
        return {"rng": [version, list(internal), gauss]}

    def load_state_dict(self, state: dict) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))

    def evaluate(self, engine, eval_cfg, out_dir: str | None = None) -> dict[str, float]:
        """Every problem of the task once (all operand pairs, or the first `eval.max_samples`) at
        `eval.temperature`: accuracy (= mean reward), unparseable answers, mean completion tokens.
        The samples go to `<out_dir>/arithmetic-eval-v<version>.jsonl`."""
        pairs = [(a, b) for a in range(self.max_operand + 1) for b in range(self.max_operand + 1)]
        pairs = pairs[:eval_cfg.max_samples] if eval_cfg.max_samples else pairs
        completions = engine.generate([Request(prompt_ids=self.chat.ids(prompt_text(a, b)),
                                               max_new_tokens=self.max_new_tokens, temperature=eval_cfg.temperature,
                                               constraint=self.constraint) for a, b in pairs])
        texts = [self.tokenizer.decode([t for t in c.token_ids if t != self.eos_id]) for c in completions]
        values = [parse_answer(t) for t in texts]
        correct = [float(v == a + b) for v, (a, b) in zip(values, pairs)]
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, f"arithmetic-eval-v{engine.version}.jsonl"), "w") as f:
                for (a, b), text, reward in zip(pairs, texts, correct):
                    f.write(json.dumps({"prompt": prompt_text(a, b), "completion": text, "reward": reward}) + "\n")
        n = len(pairs)
        return {"accuracy": sum(correct) / n, "invalid_rate": sum(v is None for v in values) / n,
                "mean_length": sum(len(c.token_ids) for c in completions) / n, "samples": float(n)}

    MEAN_OVER = {"invalid_rate": "completions"}

    def metrics(self) -> dict[str, float]:
        n = max(self._counts["completions"], 1)
        out = {"invalid_rate": self._counts["invalid"] / n, "completions": float(self._counts["completions"])}
        self._counts = {"completions": 0, "invalid": 0}
        return out
