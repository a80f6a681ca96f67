"""HF reference engine: transformers + peft LoRA, batched sampling with a KV cache, on CPU or GPU.

It is the slow, obviously right twin of the vLLM engine and the embedded default without a GPU.
Decoding is gpt-fast style small functions: `prefill` then `decode_one_token` per step over a
left-padded batch. The constraint is applied as an additive -inf mask over the vocabulary built
from each sequence's `ConstraintState`; the returned log-probs are those of the masked,
temperature-scaled distribution (the learner recomputes exactly this).

Left out on purpose: CUDA graphs, paged KV, prefix sharing (that is vLLM's job).
"""
from __future__ import annotations

import time

import torch

from colocate.constraint import ConstraintState
from colocate.data import Completion, Request
from colocate.engine.base import Engine


def left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ids [B, L] and attention mask [B, L], prompts right-aligned."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long, device=device)
        mask[i, width - len(p):] = 1
    return ids, mask


def sample_one_no_sync(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[B, V] -> [B] by the exponential trick (argmax of p / Exp(1)), no multinomial host sync."""
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    return torch.argmax(probs / q, dim=-1)


class BatchDecode:
    """Per-sequence progress of one decoded batch: sampled ids, their log-probs, the allowed ids of
    each step (constrained sequences only), which sequences finished and why."""

    def __init__(self, requests: list[Request], eos_id: int):
        self.requests, self.eos_id = requests, eos_id
        self.states = [ConstraintState(r.constraint) if r.constraint is not None else None for r in requests]
        self.tokens: list[list[int]] = [[] for _ in requests]
        self.logprobs: list[list[float]] = [[] for _ in requests]
        self.allowed: list[list[list[int]] | None] = [[] if s is not None else None for s in self.states]
        self.finished = [False] * len(requests)
        self.reasons = ["length"] * len(requests)

    def record(self, step: int, choices: list[int], logps: list[float], allowed_now: list) -> None:
        """Append step `step`'s sampled id of every unfinished sequence; a constrained one finishes
        when its constraint is done, a free one on EOS."""
        for i, request in enumerate(self.requests):
            if self.finished[i] or step >= request.max_new_tokens:
                self.finished[i] = True
                continue
            tok = choices[i]
            self.tokens[i].append(tok)
            self.logprobs[i].append(logps[i])
            state = self.states[i]
            if state is not None:
                self.allowed[i].append(allowed_now[i])
                state.advance(tok)
                if state.done:
                    self.finished[i], self.reasons[i] = True, "stop"
            elif tok == self.eos_id:
                self.finished[i], self.reasons[i] = True, "stop"

    def completions(self, version: int) -> list[Completion]:
        return [Completion(token_ids=t, logprobs=lp, allowed_ids=a, version=version, finish_reason=r)
                for t, lp, a, r in zip(self.tokens, self.logprobs, self.allowed, self.reasons)]


class HFEngine(Engine):
    def __init__(self, model, tokenizer, *, device: str | torch.device = "cpu", seed: int = 0,
                 max_batch_size: int = 256):
        self.model = model.eval()  # peft model with the adapter enabled
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.pad_id = tokenizer.pad_token_id
        self.eos_id = tokenizer.eos_token_id
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.context = getattr(getattr(model, "config", None), "max_position_embeddings", None) or 1 << 30
        self.max_batch_size = max_batch_size
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.version = 0
        self._lora = {n: p for n, p in sorted(self.model.named_parameters()) if "lora_" in n}
        self._counters = {"prefill_tokens": 0, "prefill_s": 0.0, "decode_tokens": 0, "decode_s": 0.0,
                          "sequences": 0, "batches": 0}

    # -- weights ---------------------------------------------------------------------------------
    def load_lora(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        missing = set(self._lora) - set(tensors)
        if missing:
            raise KeyError(f"adapter update lacks {len(missing)} tensors, e.g. {sorted(missing)[0]}")
        with torch.no_grad():
            for name, param in self._lora.items():
                param.copy_(tensors[name])
        self.version = version

    def lora_state(self) -> dict[str, torch.Tensor]:
        return self._lora

    def stats(self) -> dict[str, float]:
        """Throughput since the last call: prefill and decode tokens/s, mean batch size."""
        c = self._counters
        out = {"prefill_tokens_per_s": c["prefill_tokens"] / max(c["prefill_s"], 1e-9),
               "decode_tokens_per_s": c["decode_tokens"] / max(c["decode_s"], 1e-9),
               "batch_size": c["sequences"] / max(c["batches"], 1)}
        self._counters = {k: type(v)(0) for k, v in c.items()}
        return out

    def rng_state(self) -> list[int]:
        """Sampler RNG state as JSON-able ints (checkpoints)."""
        return self.generator.get_state().tolist()

    def set_rng_state(self, state: list[int]) -> None:
        self.generator.set_state(torch.tensor(state, dtype=torch.uint8))

    # -- sampling --------------------------------------------------------------------------------
    def generate(self, requests: list[Request]) -> list[Completion]:
        for r in requests:  # a batch is padded to its longest prompt: one overlong prompt would size them all
            if len(r.prompt_ids) + r.max_new_tokens > self.context:
                raise ValueError(f"a prompt of {len(r.prompt_ids)} tokens plus max_new_tokens={r.max_new_tokens} "
                                 f"exceeds the model's context of {self.context} positions (the env must not ask "
                                 "for it; the dataset env's row checks drop or refuse such rows)")
        out: list[Completion] = []
        for start in range(0, len(requests), self.max_batch_size):
            out.extend(self._generate_batch(requests[start:start + self.max_batch_size]))
        return out

    @torch.no_grad()
    def _generate_batch(self, requests: list[Request]) -> list[Completion]:
        from transformers import DynamicCache
        batch = len(requests)
        ids, attn = left_pad([r.prompt_ids for r in requests], self.pad_id, self.device)
        # temperature 0 (evaluation) is greedy: argmax, the log-probs those of temperature 1
        temps = torch.tensor([r.temperature for r in requests], device=self.device).unsqueeze(1)  # [B, 1]
        greedy = temps.squeeze(1) == 0  # [B]
        temps = torch.where(temps > 0, temps, torch.ones_like(temps))
        run = BatchDecode(requests, self.eos_id)
        max_new = max(r.max_new_tokens for r in requests)

        cache = DynamicCache()
        positions = (attn.cumsum(1) - 1).clamp(min=0)
        t0 = time.perf_counter()
        logits = self._forward(ids, attn, positions, cache)  # [B, V] next-token logits
        t1 = time.perf_counter()
        c = self._counters
        c["prefill_tokens"] += int(attn.sum())
        c["prefill_s"] += t1 - t0
        c["sequences"] += batch
        c["batches"] += 1
        for step in range(max_new):
            mask, allowed_now = self._constraint_mask(run.states, run.finished, logits.shape[-1])
            logp = torch.log_softmax(logits.float() / temps + mask, dim=-1)
            choice = sample_one_no_sync(logp.exp(), self.generator)  # [B]
            choice = torch.where(greedy, logp.argmax(dim=-1), choice)
            chosen_logp = logp.gather(1, choice.unsqueeze(1)).squeeze(1)
            run.record(step, choice.tolist(), chosen_logp.tolist(), allowed_now)
            if all(run.finished) or step == max_new - 1:
                break
            attn = torch.cat([attn, torch.ones((batch, 1), dtype=attn.dtype, device=self.device)], 1)
            positions = positions[:, -1:] + 1
            logits = self._forward(choice.unsqueeze(1), attn, positions, cache)
        c["decode_tokens"] += sum(len(t) for t in run.tokens)
        c["decode_s"] += time.perf_counter() - t1
        return run.completions(self.version)

    def _forward(self, ids, attn, positions, cache) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=positions, past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :]

    def _constraint_mask(self, states, finished, vocab: int):
        """Additive mask [B, V] (0 allowed, -inf not) and the allowed id lists of this step."""
        mask = torch.zeros((len(states), vocab), device=self.device)
        allowed_now: list[list[int] | None] = [None] * len(states)
        for i, s in enumerate(states):
            if s is None or finished[i] or s.done:
                continue
            allowed = s.allowed()
            allowed_now[i] = allowed
            row = torch.full((vocab,), float("-inf"), device=self.device)
            row[torch.tensor(allowed, device=self.device)] = 0.0
            mask[i] = row
        return mask, allowed_now
