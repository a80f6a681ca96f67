"""HF reference engine: transformers + peft LoRA, batched sampling with a KV cache, on CPU or GPU.

It is the slow, obviously right twin of the vLLM engine and the embedded default without a GPU.
Decoding is gpt-fast style small functions: `prefill` then `decode_one_token` per step over a
left-padded batch. The constraint is applied as an additive -inf mask over the vocabulary built
from each sequence's `ConstraintState`; the returned log-probs are those of the masked,
temperature-scaled distribution (the learner recomputes exactly this).

Streaming (`submit` / `poll`): submitted requests are prefilled together as a `Cohort` at the next
poll; a poll advances every cohort `decode_chunk` tokens at a time until a request finishes (all of
them with `wait_all`) and hands back the finished ones; the others stay resumable across polls, so
`rollout.update=inflight` can ship a batch while they run. An adapter update between two polls
(`load_lora`) applies from the next token on: a cohort whose cache was computed by an older version
is prefilled again (prompt + the tokens so far) under the new one first, so every token's
log-prob is exactly pi_v(token | prefix) for the version v recorded for it (`token_versions`).

`quantization="fp8"` samples from base weights and linear inputs rounded through float8 e4m3
(`engine/fp8.py`, vLLM's online FP8 emulated): the CPU path of `engine.quantization: fp8`. With
`lora_mode="merged"` the adapter is merged into those weights at each load and rounded with them,
as vLLM's merged FP8 engine does (`fp8.merge_fp8`); otherwise (and in bf16 or fp32, where merging
changes only the compute dtype's rounding) peft applies it beside the base layer.

Left out on purpose: CUDA graphs, paged KV, prefix sharing (vLLM's job).
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from colocate.config_schema import LORA_MODES, QUANTIZATIONS
from colocate.constraint import ConstraintState
from colocate.data import Completion, Request
from colocate.engine.base import Engine
from colocate.engine.fp8 import emulate_fp8, merge_fp8, merged_fp8_base


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
    """Per-sequence progress of one decoded batch: sampled ids, their log-probs and versions, the
    allowed ids of each step (constrained sequences only), which sequences finished and why."""

    def __init__(self, requests: list[Request], eos_id: int):
        self.requests, self.eos_id = requests, eos_id
        self.states = [ConstraintState(r.constraint) if r.constraint is not None else None for r in requests]
        self.tokens: list[list[int]] = [[] for _ in requests]
        self.logprobs: list[list[float]] = [[] for _ in requests]
        self.versions: list[list[int]] = [[] for _ in requests]
        self.allowed: list[list[list[int]] | None] = [[] if s is not None else None for s in self.states]
        self.finished = [False] * len(requests)
        self.reasons = ["length"] * len(requests)

    def record(self, step: int, choices: list[int], logps: list[float], allowed_now: list, version: int) -> None:
        """Append step `step`'s sampled id of every unfinished sequence; a constrained one finishes
        when its constraint is done, a free one on EOS."""
        for i, request in enumerate(self.requests):
            if self.finished[i] or step >= request.max_new_tokens:
                self.finished[i] = True
                continue
            tok = choices[i]
            self.tokens[i].append(tok)
            self.logprobs[i].append(logps[i])
            self.versions[i].append(version)
            state = self.states[i]
            if state is not None:
                self.allowed[i].append(allowed_now[i])
                state.advance(tok)
                if state.done:
                    self.finished[i], self.reasons[i] = True, "stop"
            elif tok == self.eos_id:
                self.finished[i], self.reasons[i] = True, "stop"

    def is_over(self, i: int) -> bool:
        """Sequence i samples no more (finished, or at its own max_new_tokens)."""
        return self.finished[i] or len(self.tokens[i]) >= self.requests[i].max_new_tokens

    def completion(self, i: int, version: int) -> Completion:
        """Sequence i's completion; `version` names an empty one's (the cohort's)."""
        v = self.versions[i]
        return Completion(token_ids=self.tokens[i], logprobs=self.logprobs[i], allowed_ids=self.allowed[i],
                          version=v[0] if v else version, finish_reason=self.reasons[i],
                          last_version=v[-1] if v else version, token_versions=list(v))


class Cohort:
    """Requests prefilled together and decoded one token per step over a left-padded batch,
    resumable across polls: the KV cache, the next-token logits, the ids fed back so far and the
    adapter version that computed them."""

    def __init__(self, tickets: list[int], requests: list[Request], eos_id: int, pad_id: int, device):
        self.tickets = tickets
        self.run = BatchDecode(requests, eos_id)
        self.prompt_ids, self.prompt_attn = left_pad([r.prompt_ids for r in requests], pad_id, device)
        # temperature 0 (evaluation) is greedy: argmax, the log-probs those of temperature 1
        temps = torch.tensor([r.temperature for r in requests], device=device).unsqueeze(1)  # [B, 1]
        self.greedy = temps.squeeze(1) == 0  # [B]
        self.temps = torch.where(temps > 0, temps, torch.ones_like(temps))
        self.max_new = max(r.max_new_tokens for r in requests)
        self.fed: list[torch.Tensor] = []  # [B] ids sampled at each step (fed back as the next input)
        self.step, self.done, self.version = 0, False, -1
        self.cache = self.attn = self.positions = self.logits = None
        self.handed = [False] * len(requests)  # streamed: completions already handed back


def cache_keyword(model) -> str:
    """The keyword the Hugging Face model inside `model` (peft-wrapped or not) takes its KV cache by:
    `cache` where its forward has it (transformers 5.x, which warns on every call given the older
    name), else `past_key_values`."""
    import inspect

    from transformers import PreTrainedModel
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return "cache" if "cache" in inspect.signature(type(module).forward).parameters else "past_key_values"
    return "past_key_values"


class HFEngine(Engine):
    def __init__(self, model, tokenizer, *, device: str | torch.device = "cpu", seed: int = 0,
                 max_batch_size: int = 256, decode_chunk: int = 4, quantization: str = "none",
                 lora_mode: str = "slot"):
        """`quantization` (engine.quantization): fp8 rounds this engine's copy of the base weights,
        and each base linear's input, through float8 e4m3 as vLLM's online FP8 does (`engine/fp8.py`);
        with `lora_mode` (engine.lora_mode) merged, the adapter is merged into them at each load."""
        self.model = model.eval()  # peft model with the adapter enabled
        if quantization not in QUANTIZATIONS or lora_mode not in LORA_MODES:
            raise ValueError(f"HFEngine: quantization={quantization!r} / lora_mode={lora_mode!r}: expected one of "
                             f"{QUANTIZATIONS} / {LORA_MODES}")
        self._fp8_w0 = None  # merged FP8: W0 of the adapted weights, rounded, the adapter merged into it at each load
        if quantization == "fp8":
            emulate_fp8(self.model)
        if quantization == "fp8" and lora_mode == "merged":
            self._fp8_w0 = merged_fp8_base(self.model)
            merge_fp8(self.model, self._fp8_w0)
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.pad_id = tokenizer.pad_token_id
        self.eos_id = tokenizer.eos_token_id
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.context = getattr(getattr(model, "config", None), "max_position_embeddings", None) or 1 << 30
        self.max_batch_size = max_batch_size
        self.decode_chunk = decode_chunk
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.version = 0
        self._lora = {n: p for n, p in sorted(self.model.named_parameters()) if "lora_" in n}
        self._cache_kw = cache_keyword(model)
        self._queue: list[tuple[int, Request]] = []  # submitted, not yet prefilled
        self._cohorts: list[Cohort] = []             # prefilled, some sequences still to hand back
        self._next_ticket = 0
        self._counters = {"prefill_tokens": 0, "prefill_s": 0.0, "decode_tokens": 0, "decode_s": 0.0,
                          "sequences": 0, "batches": 0, "reprefills": 0}

    # -- weights ---------------------------------------------------------------------------------
    def load_lora(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """In place; cohorts in flight take it from their next token on (prefilled again first)."""
        missing = set(self._lora) - set(tensors)
        if missing:
            raise KeyError(f"adapter update lacks {len(missing)} tensors, e.g. {sorted(missing)[0]}")
        with torch.no_grad():
            for name, param in self._lora.items():
                param.copy_(tensors[name])
        if self._fp8_w0 is not None:
            merge_fp8(self.model, self._fp8_w0)
        self.version = version

    def lora_state(self) -> dict[str, torch.Tensor]:
        return self._lora

    @torch.no_grad()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """One forward of the sequence through the sampling model (the canary, `colocate.canary`)."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        logits = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0, :-1]
        logp = torch.log_softmax(logits.float(), dim=-1)
        return logp.gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1).cpu()

    def stats(self) -> dict[str, float]:
        """Throughput since the last call: prefill and decode tokens/s, mean batch size, cohorts
        prefilled again after an update landed under them."""
        c = self._counters
        out = {"prefill_tokens_per_s": c["prefill_tokens"] / max(c["prefill_s"], 1e-9),
               "decode_tokens_per_s": c["decode_tokens"] / max(c["decode_s"], 1e-9),
               "batch_size": c["sequences"] / max(c["batches"], 1), "reprefills": float(c["reprefills"])}
        self._counters = {k: type(v)(0) for k, v in c.items()}
        return out

    def rng_state(self) -> list[int]:
        """Sampler RNG state as JSON-able ints (checkpoints)."""
        return self.generator.get_state().tolist()

    def set_rng_state(self, state: list[int]) -> None:
        self.generator.set_state(torch.tensor(state, dtype=torch.uint8))

    # -- sampling --------------------------------------------------------------------------------
    def _check_context(self, requests: list[Request]) -> None:
        for r in requests:  # a batch is padded to its longest prompt: one overlong prompt would size them all
            if len(r.prompt_ids) + r.max_new_tokens > self.context:
                raise ValueError(f"a prompt of {len(r.prompt_ids)} tokens plus max_new_tokens={r.max_new_tokens} "
                                 f"exceeds the model's context of {self.context} positions (the env must not ask "
                                 "for it; the dataset env's row checks drop or refuse such rows)")

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Decoded to the end, apart from any streamed cohort (evaluation runs between batches)."""
        self._check_context(requests)
        out: list[Completion] = []
        for start in range(0, len(requests), self.max_batch_size):
            part = requests[start:start + self.max_batch_size]
            co = Cohort(list(range(len(part))), part, self.eos_id, self.pad_id, self.device)
            while not co.done:
                self._step(co)
            out.extend(co.run.completion(i, co.version) for i in range(len(part)))
        return out

    def submit(self, requests: list[Request]) -> list[int]:
        """Queue requests; the next poll prefills them as one cohort."""
        self._check_context(requests)
        tickets = list(range(self._next_ticket, self._next_ticket + len(requests)))
        self._next_ticket += len(requests)
        self._queue.extend(zip(tickets, requests))
        return tickets

    def poll(self, wait_all: bool = False, wake: Callable[[], bool] | None = None) -> list[tuple[int, Completion]]:
        """Start the queued requests, then advance every cohort `decode_chunk` tokens at a time until
        a request finished (every one with `wait_all`), or `wake()` is true after a chunk -> the
        finished ones; the rest stay in flight."""
        for start in range(0, len(self._queue), self.max_batch_size):
            part = self._queue[start:start + self.max_batch_size]
            self._cohorts.append(Cohort([t for t, _ in part], [r for _, r in part], self.eos_id, self.pad_id,
                                        self.device))
        self._queue = []
        out: list[tuple[int, Completion]] = []
        while self._cohorts and (wait_all or not out):
            for co in self._cohorts:
                for _ in range(self.decode_chunk):
                    if co.done:
                        break
                    self._step(co)
            out.extend(self._hand_back())
            if wake is not None and not wait_all and wake():
                break
        return out

    def _hand_back(self) -> list[tuple[int, Completion]]:
        """Completions of the sequences that finished since the last poll; spent cohorts leave."""
        out = []
        for co in self._cohorts:
            for i, ticket in enumerate(co.tickets):
                if not co.handed[i] and (co.done or co.run.is_over(i)):
                    co.handed[i] = True
                    out.append((ticket, co.run.completion(i, co.version)))
        self._cohorts = [co for co in self._cohorts if not all(co.handed)]
        return out

    @torch.no_grad()
    def _prefill(self, co: Cohort) -> None:
        """(Re)build the cohort's cache and next-token logits under the live adapter: the prompts,
        then every id fed so far (after an update, so later tokens see only the new version)."""
        from transformers import DynamicCache
        batch = co.prompt_ids.shape[0]
        ids = torch.cat([co.prompt_ids, *[f.unsqueeze(1) for f in co.fed]], 1)
        co.attn = torch.cat([co.prompt_attn, torch.ones((batch, len(co.fed)), dtype=co.prompt_attn.dtype,
                                                         device=self.device)], 1)
        co.positions = (co.attn.cumsum(1) - 1).clamp(min=0)
        co.cache = DynamicCache()
        t0 = time.perf_counter()
        co.logits = self._forward(ids, co.attn, co.positions, co.cache)  # [B, V] next-token logits
        c = self._counters
        c["prefill_tokens"] += int(co.attn.sum())
        c["prefill_s"] += time.perf_counter() - t0
        if co.version < 0:
            c["sequences"] += batch
            c["batches"] += 1
        else:
            c["reprefills"] += 1
        co.version = self.version

    @torch.no_grad()
    def _step(self, co: Cohort) -> None:
        """Sample one token for every sequence of the cohort, then feed it (unless the cohort is done)."""
        if co.version != self.version:  # first step, or an update landed since the last one
            self._prefill(co)
        t0 = time.perf_counter()
        run = co.run
        mask, allowed_now = self._constraint_mask(run.states, run.finished, co.logits.shape[-1])
        logp = torch.log_softmax(co.logits.float() / co.temps + mask, dim=-1)
        choice = sample_one_no_sync(logp.exp(), self.generator)  # [B]
        choice = torch.where(co.greedy, logp.argmax(dim=-1), choice)
        chosen_logp = logp.gather(1, choice.unsqueeze(1)).squeeze(1)
        before = sum(len(t) for t in run.tokens)
        run.record(co.step, choice.tolist(), chosen_logp.tolist(), allowed_now, self.version)
        co.step += 1
        co.fed.append(choice)
        co.done = all(run.finished) or co.step == co.max_new
        if not co.done:
            co.attn = torch.cat([co.attn, torch.ones((len(co.tickets), 1), dtype=co.attn.dtype, device=self.device)], 1)
            co.positions = co.positions[:, -1:] + 1
            co.logits = self._forward(choice.unsqueeze(1), co.attn, co.positions, co.cache)
        self._counters["decode_tokens"] += sum(len(t) for t in run.tokens) - before
        self._counters["decode_s"] += time.perf_counter() - t0

    def _forward(self, ids, attn, positions, cache) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=positions, **{self._cache_kw: cache},
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
