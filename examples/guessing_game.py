"""A two-turn guessing game: the worked example of a custom environment (docs/envs.md).

The env picks a secret number in 1..max_number. Turn 1: the policy guesses. The env answers
"higher", "lower" or "correct"; unless correct, turn 2 shows the conversation so far and the policy
guesses again. Reward: 1 for a first-turn hit, 0.5 for a second-turn hit, else 0.

Train it with

    colocate train --config configs/cpu-tiny.yaml --metrics.run_dir=runs/guessing-game \\
        --env.name=examples.guessing_game:GuessingGameEnv --env.options='{max_number: 4}' \\
        --env.reward_target=0.4 --metrics.reward_drop_alert=0.25

(from the repository root, so `examples` imports; docs/envs.md gives the figures to expect). Every continuation of a group plays against
the same secret, so GRPO compares guesses under the same conditions. Both turns are trained: the
first-turn sample of each continuation is the group's anchor (it enters the group's mean and
std), the second-turn sample gets the advantage of its continuation without counting twice.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Hashable

from colocate.chat import ChatFormat
from colocate.constraint import Constraint
from colocate.data import Completion, Request, Sample
from colocate.envs.base import Env


@dataclass
class Episode:
    """One continuation: its prompt so far and the (prompt ids, completion) of each turn played."""
    prompt: str
    turns: list = field(default_factory=list)
    reward: float | None = None


class GuessingGameEnv(Env):
    def __init__(self, tokenizer, *, group_size: int, max_number: int = 4, max_new_tokens: int = 4,
                 temperature: float = 1.0, seed: int = 0, chat: ChatFormat | None = None):
        self.tokenizer, self.group_size, self.max_number = tokenizer, group_size, max_number
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.chat = chat or ChatFormat(tokenizer, "none")
        self.rng = random.Random(seed)
        self.eos_id = tokenizer.eos_token_id
        guesses = [f" {n}" for n in range(1, max_number + 1)]
        # only well-formed guesses are sampled, so every completion parses (as the arithmetic env)
        self.constraint = Constraint(slots=[[tokenizer.encode(g, add_special_tokens=False) for g in guesses]],
                                     eos_id=self.eos_id, texts=[guesses])
        self._secret: dict[int, int] = {}
        self._episodes: dict[tuple[int, int], Episode] = {}

    @classmethod
    def from_config(cls, cfg, tokenizer, seed: int) -> "GuessingGameEnv":
        return cls(tokenizer, group_size=cfg.rollout.group_size, max_new_tokens=cfg.engine.max_new_tokens,
                   temperature=cfg.engine.temperature, seed=seed,
                   chat=ChatFormat(tokenizer, cfg.model.chat_template), **cfg.env.options)

    @classmethod
    def corpus(cls, cfg) -> list[str]:
        """The embedded tokenizer learns the game's words."""
        n = cfg.env.options.get("max_number", 4)
        return [first_prompt(n) + f" {g} ; {w} ; guess again :" for g in range(1, n + 1)
                for w in ("higher", "lower", "correct")]

    def start_group(self, group_id: int) -> None:
        self._secret[group_id] = self.rng.randint(1, self.max_number)
        for i in range(self.group_size):
            self._episodes[(group_id, i)] = Episode(first_prompt(self.max_number))

    def requests(self) -> list[tuple[Hashable, Request]]:
        return [(key, Request(prompt_ids=self.chat.ids(ep.prompt), max_new_tokens=self.max_new_tokens,
                              temperature=self.temperature, constraint=self.constraint))
                for key, ep in self._episodes.items() if ep.reward is None]

    def step(self, completions: dict[Hashable, Completion]) -> None:
        for key, completion in completions.items():
            ep = self._episodes[key]
            ep.turns.append((self.chat.ids(ep.prompt), completion))
            text = self.tokenizer.decode([t for t in completion.token_ids if t != self.eos_id]).strip()
            guess, secret = int(text), self._secret[key[0]]  # the constraint allows only numbers
            if guess == secret:
                ep.reward = 1.0 if len(ep.turns) == 1 else 0.5
            elif len(ep.turns) == 2:
                ep.reward = 0.0
            else:
                hint = "higher" if secret > guess else "lower"
                ep.prompt = f"{ep.prompt} {guess} ; {hint} ; guess again :"

    def pop_finished(self) -> list[Sample]:
        out = []
        for gid in list(self._secret):
            keys = [(gid, i) for i in range(self.group_size)]
            if any(self._episodes[k].reward is None for k in keys):
                continue
            del self._secret[gid]
            for key in keys:
                ep = self._episodes.pop(key)
                out += [Sample(prompt_ids=ids, completion=c, reward=ep.reward, group_key=gid, is_anchor=turn == 0,
                               info={"turn": turn}) for turn, (ids, c) in enumerate(ep.turns)]
        return out

    def state_dict(self) -> dict:
        version, internal, gauss = self.rng.getstate()
        return {"rng": [version, list(internal), gauss]}

    def load_state_dict(self, state: dict) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))


def first_prompt(max_number: int) -> str:
    return f"guess a number from 1 to {max_number} :"
