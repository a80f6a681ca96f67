"""The learner's warm-up (`Learner.warm_up`, `learner.prewarm`): the synthetic batch it trains on
while the engines start, and the snapshot that puts back exactly what that update changed, so the
run trains bit for bit as without it."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from colocate.data import TrajectoryBatch


def synthetic_batch(vocab: int, num_tokens: int, completion_len: int, group_size: int, version: int) -> TrajectoryBatch:
    """About `num_tokens` tokens of sequences whose prompt and completion are `completion_len` long,
    in groups of `group_size` sharing a prompt (what prefix sharing folds), with random ids from a
    fixed seed (the global RNG is not drawn from) and advantages of both signs: the warm-up's batch."""
    c = max(1, min(completion_len, num_tokens // 2))
    n = max(1, num_tokens // (2 * c))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (n, c), generator=g)
    prompts = prompts[torch.arange(n) // max(group_size, 1) * max(group_size, 1)]  # one prompt per group
    tokens = torch.cat([prompts, torch.randint(0, vocab, (n, c), generator=g)], dim=1).flatten()
    return TrajectoryBatch(tokens=tokens.int(), seq_lens=torch.full((n,), 2 * c, dtype=torch.int32),
                           prompt_lens=torch.full((n,), c, dtype=torch.int32),
                           behaviour_logprobs=torch.full((n * c,), -math.log(vocab)),
                           advantages=torch.tensor([1.0 if i % 2 else -1.0 for i in range(n)]),
                           rewards=torch.zeros(n), versions=torch.full((n,), version, dtype=torch.int32))


@dataclass(frozen=True)
class Snapshot:
    """What a warm-up update may change, to put back exactly: the adapter, AdamW's state, the RNG
    (dropout draws from it) and the module mode."""
    params: list[torch.Tensor]
    optimizer_state: dict
    rng: torch.Tensor
    cuda_rng: torch.Tensor | None
    training: bool

    @classmethod
    def capture(cls, learner: "Learner") -> "Snapshot":
        state = {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                 for p, s in learner.optimizer.state.items()}
        on_gpu = learner.device.type == "cuda"
        return cls([p.detach().clone() for p in learner.params], state, torch.get_rng_state(),
                   torch.cuda.get_rng_state(learner.device) if on_gpu else None, learner.model.training)

    def restore(self, learner: "Learner") -> None:
        learner.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, saved in zip(learner.params, self.params):
                p.copy_(saved)
        learner.optimizer.state.clear()
        learner.optimizer.state.update(self.optimizer_state)
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, learner.device)
        learner.model.train(self.training)
