"""The trainer benchmark's workload: synthetic Diplomacy-like trajectories, and the useful FLOPs of a step.

Synthetic trajectories, Diplomacy-like: groups of `--group-size` samples share one prompt; prompts are
a shared instruction (260 tokens) + a board shared by the 7 powers of a game (120-180) + the
power's own part, 400-600 tokens in all; completions 30-100 tokens. Unconstrained (full-vocabulary
GRPO loss), beta = 0 (no reference pass), behaviour log-probs near the model's.

MFU = (4 * P_blocks * T + 4 * P_head * N + 6 * n_layers * H_q * d_head * sum_i L_i^2)
      / (step_time * num_gpus * peak)
  T tokens (prompt + completion, no padding) and N completion tokens over all ranks; P_blocks the
  decoder blocks' frozen parameters (every token: forward + input-gradient GEMMs = 2 + 2 FLOPs per
  parameter; frozen weights need no weight gradients); P_head the lm_head's, applied only at
  completion positions; attention: causal QK^T and PV (2 L^2 H d per layer forward) times 3 for
  forward + backward; L_i the sequence lengths. LoRA and elementwise FLOPs are not counted. peak =
  790e12 (bf16 dense, measured on an H200 of this workplace). The baseline is scored with the same
  useful FLOPs (its padding is waste, not work).
"""
from __future__ import annotations

import torch

PEAK_FLOPS = 790e12


# ---- synthetic trajectories ---------------------------------------------------------------------

class SyntheticVocab:
    """Stands in for a tokenizer: random-init shapes need only a size and the special ids."""
    pad_token_id = 0
    eos_token_id = 1

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size


def diplomacy_like_batch(num_seqs: int, vocab: int, group_size: int, seed: int, scale: float = 1.0,
                         behaviour_logprob: float = -11.9):
    """Packed TrajectoryBatch: shared instruction, per-game board, per-power part; G samples per prompt."""
    from colocate.data import TrajectoryBatch
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(2, vocab, (max(1, int(n)),), generator=g)

    def uniform(lo, hi):
        return int(lo * scale + torch.randint(0, max(1, int((hi - lo) * scale) + 1), (1,), generator=g))

    instruction = ids(260 * scale)
    tokens, seq_lens, prompt_lens = [], [], []
    while len(seq_lens) < num_seqs:
        board = ids(uniform(120, 180))
        for _power in range(7):
            own = ids(uniform(400, 600) - len(instruction) - len(board))
            prompt = torch.cat([instruction, board, own])
            for _ in range(group_size):
                if len(seq_lens) == num_seqs:
                    break
                completion = ids(uniform(30, 100))
                tokens.append(torch.cat([prompt, completion]))
                seq_lens.append(len(prompt) + len(completion))
                prompt_lens.append(len(prompt))
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    prompt_lens_t = torch.tensor(prompt_lens, dtype=torch.int32)
    n = int((seq_lens_t - prompt_lens_t).sum())
    return TrajectoryBatch(
        tokens=torch.cat(tokens).int(), seq_lens=seq_lens_t, prompt_lens=prompt_lens_t,
        behaviour_logprobs=behaviour_logprob + 0.1 * torch.randn(n, generator=g),
        advantages=torch.randn(num_seqs, generator=g), rewards=torch.rand(num_seqs, generator=g),
        versions=torch.zeros(num_seqs, dtype=torch.int32))


# ---- FLOPs ----------------------------------------------------------------------------------------

def step_flops(model_config, p_blocks: int, batch_stats: dict) -> float:
    """Useful FLOPs of one learner step over all ranks (see the module docstring)."""
    head = model_config.vocab_size * model_config.hidden_size
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    attention = 6 * model_config.num_hidden_layers * model_config.num_attention_heads * head_dim
    return (4 * p_blocks * batch_stats["tokens"] + 4 * head * batch_stats["completion_tokens"]
            + attention * batch_stats["sum_sq_len"])


def batch_stats(batch) -> dict:
    """Sizes of one rank's batch: what the FLOPs count, and what padding to batches of 4 would take."""
    lens = batch.seq_lens.long()
    return {"sequences": int(lens.numel()), "tokens": int(lens.sum()),
            "completion_tokens": int(batch.num_completion_tokens), "sum_sq_len": int((lens * lens).sum()),
            "padded4_tokens": int(sum(int(lens[i:i + 4].max()) * len(lens[i:i + 4]) for i in range(0, len(lens), 4)))}
