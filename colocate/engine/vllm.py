"""vLLM engine (vllm==0.25.0) for inference ranks: one engine per rank, TP=1, engine core in a child.

What it does beyond `LLM.generate`:
  * constraints (`constraint_masks="ours"`, the default) become automata that our kernel walks and
    applies on the GPU inside vLLM's sampler (`vllm_trie.py`), or (`"vllm"`) vLLM structured outputs
    (llguidance token-id grammars, `vllm_grammar.py`, masked on vLLM's host threads). After
    generation `replay_allowed` walks the same automaton over the sampled ids to rebuild
    `Completion.allowed_ids` (the learner restricts its softmax to them) and checks the walk;
  * log-probs are `logprobs_mode="processed_logprobs"`: after temperature and the grammar mask, i.e.
    what the learner computes over `allowed_ids`; with `logprob_kernel="ours"` the sampler computes
    them with our one-read kernel (`vllm_logprobs.py`) instead of vLLM's own;
  * `lora_mode="slot"`: the adapter sits in one pinned LoRA slot and is overwritten in place, from
    an NCCL broadcast of learner rank 0 (`vllm_channel.py`) or from tensors (`load_lora`); no files
    (`vllm_worker.py`). Requests name the adapter `colocate-v{version}`: vLLM keys prefix-cache
    blocks by that name, so blocks computed with an older adapter are never reused;
  * `lora_mode="merged"`: the engine runs without LoRA and each update is merged into its base
    weights in place (`adapter_targets.MergedAdapter`; FP8 weights are requantized,
    `MergedFp8Adapter`); the prefix cache is reset after each update
    (`update="inflight"`: requests carry a per-version `cache_salt` instead, since vLLM cannot
    reset a cache that running requests hold);
  * `update="inflight"`: an update lands while streamed requests run (vLLM applies the worker RPC
    between two engine steps); tokens after it are sampled with the new weights over the KV the
    older ones computed (PipelineRL-style), and their log-probs are still the sampler's own. A
    completion records the version at submit (`version`: no token is older) and the one when its
    answer was read (`last_version`: none is newer). `generate` (evaluation between batches) then
    runs beside the streamed requests and keeps those that finish meanwhile for the next `poll`;
  * the sync canary (`score`, `colocate.canary`): one request for the probe with
    `prompt_logprobs=0` and one generated token, through the same adapter (slot name or merged
    weights) as the samples; vLLM computes prompt log-probs from the raw logits (log-softmax, no
    temperature) and skips prefix-cache reads for such a request, so the probe is computed anew by
    the weights the engine holds;
  * start-up inside a torchrun rank: the engine core is a child process that sees only this rank's
    GPU and none of torchrun's variables (`prestart.engine_environment`), and is started without
    running the rank's main module again (`spawn_without_main`; `train.py` keeps its entry guarded
    all the same: docs/design.md, Traps); with `engine.prestart` it is forked from a server that
    imported vLLM while the rank started (`prestart.py`), else spawned by vLLM.

Deliberately absent: tensor parallelism, several adapters, sleep mode, speculative decoding.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from colocate.data import Completion, Request
from colocate.engine.base import Engine
from colocate.engine.model_dir import ensure_model_dir
from colocate.engine.prestart import engine_core_start, engine_environment
from colocate.engine.vllm_grammar import constraint_grammar, skip_client_grammar_validation
from colocate.engine.vllm_requests import completion_from_output, prompt_logprobs_of, sampling_kwargs
from colocate.engine.vllm_settings import (VLLMSettings, engine_settings, llm_arguments, merged_copy_bytes,
                                            merged_memory_share)
from colocate.engine.vllm_trie import PAYLOAD_KEY, trie_payload
from colocate.engine.vllm_worker import IN_MEMORY_PATH, SLOT_ID, AdapterReceipt
from colocate.lifecycle import spawn_without_main
from colocate.wire import LoraSpec, flatten_lora, unflatten_lora

COUNTERS = ("requests", "walk_failures", "eos_appended", "engine_errors", "host_s", "generate_s",
            "prompt_tokens", "cached_prompt_tokens", "out_tokens", "steps")


# ---------------------------------------------------------------------------------- start-up

def lora_spec_for(cfg, tokenizer) -> LoraSpec:
    """The learner's adapter layout (names, shapes, dtype), from a model built on the meta device."""
    from colocate.models import add_lora, build_model
    with torch.device("meta"):
        model = add_lora(build_model(cfg.model, tokenizer, "meta"), cfg.lora)
    return LoraSpec.of({n: p for n, p in model.named_parameters() if "lora_" in n})


# ---------------------------------------------------------------------------------- engine

class VLLMEngine(Engine):
    """`Engine` over `vllm.LLM`; see the module docstring."""

    def __init__(self, model_dir: str, spec: LoraSpec, eos_id: int, settings: VLLMSettings, *,
                 gpu: int | None = None):
        s = settings
        self.spec, self.eos_id, self.lora_mode, self.grammar_mode = spec, eos_id, s.lora_mode, s.grammar_mode
        self.quantization = s.quantization  # merged mode writes e4m3 weights with fp8 (`adapter_targets.merged_target`)
        self.inflight = s.update == "inflight"  # adapter updates may land under running requests
        self.max_num_seqs, self.profile_dir, self.version = s.max_num_seqs, s.profile_dir, 0
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._reported = dict(self.counters)
        self._pending: dict[str, tuple[int, Request, int]] = {}  # vLLM request id -> (ticket, request, version)
        self._stash: list[tuple[int, Completion]] = []  # streamed answers read by `generate`, for the next poll
        self._probes: dict[str, object] = {}  # canary request id -> its output, once finished
        self._next_ticket = 0
        self._busy_since = 0.0
        if s.lora_mode == "merged" and torch.cuda.is_available():  # the W0 copy comes out of the engine's share
            total = torch.cuda.get_device_properties(gpu or 0).total_memory
            copy = merged_copy_bytes(spec.names, spec.shapes, s.dtype, s.quantization)
            s = s.replace(gpu_memory_utilization=merged_memory_share(s.gpu_memory_utilization, copy, total))
            fp8 = " (e4m3, and the fp32 buffer they are requantized in)" if s.quantization == "fp8" else ""
            print(f"colocate: lora_mode=merged: vLLM takes {s.gpu_memory_utilization:.3f} of the GPU, "
                  f"{copy / 2**30:.1f} GiB go to the copy of the adapted weights{fp8}", flush=True)
        kwargs = llm_arguments(model_dir, s)  # refuses bad arguments before vLLM starts
        from vllm import LLM
        if not s.validate_grammars:
            skip_client_grammar_validation()
        t0 = time.perf_counter()
        with engine_environment(gpu), spawn_without_main(), engine_core_start(s.prestart):
            self.llm = LLM(**kwargs)
        self.startup_s = time.perf_counter() - t0
        self.logprob_kernel = "vllm"
        if s.logprob_kernel == "ours":  # every worker the same: the first one's answer stands for all
            self.logprob_kernel = self.llm.collective_rpc("colocate_use_logprob_kernel")[0]
            print(f"colocate: engine.logprob_kernel=ours: the sampler's log-probs come from "
                  f"{'our kernel' if self.logprob_kernel == 'ours' else 'vLLM (no V2 model runner to patch)'}",
                  flush=True)
        self.constraint_masks = "vllm"
        if s.constraint_masks == "ours":
            self.constraint_masks = self.llm.collective_rpc("colocate_use_constraint_masks")[0]
            print(f"colocate: engine.constraint_masks=ours: constraints are enforced by "
                  f"{'our automaton kernel' if self.constraint_masks == 'ours' else 'vLLM grammars (no V2 sampler to wrap)'}",
                  flush=True)
        self.slot_info = self._init_adapter(s.lora_rank, s.lora_alpha / s.lora_rank)
        self._lora_request = self._make_lora_request()

    def masked_rows(self) -> int:
        """Logit rows our constraint masks served since start, summed over the engine's workers."""
        if self.constraint_masks != "ours":
            return 0
        return sum(self.llm.collective_rpc("colocate_masked_rows"))

    def logprob_calls(self) -> dict[str, int]:
        """The sampler's log-prob calls since start, summed over the engine's workers: {"ours": served
        by our kernel, "vllm": handed to vLLM's function} (both 0 with `logprob_kernel=vllm`)."""
        if self.logprob_kernel != "ours":
            return {"ours": 0, "vllm": 0}
        counts = self.llm.collective_rpc("colocate_logprob_calls")
        return {k: sum(c[k] for c in counts) for k in ("ours", "vllm")}

    @classmethod
    def from_config(cls, cfg, topo, tokenizer, spec: LoraSpec, *, prompt_bound: int,
                    requests_per_group: int) -> "VLLMEngine":
        """The engine of an inference rank of a torchrun job (its adapter channel is joined after:
        `vllm_channel.join_receiver`) for the learner's adapter layout `spec` (`lora_spec_for`, or the
        rank's own meta model's); the env's facts size it (`colocate.envs.env_facts`)."""
        from colocate.metrics import engine_profile_dir
        model_dir = ensure_model_dir(cfg, tokenizer, topo.device, is_writer=topo.role_rank == 0)
        settings = engine_settings(cfg, topo.num_inference, seed=cfg.rollout.seed * 1000 + topo.rank,
                                   prompt_bound=prompt_bound, requests_per_group=requests_per_group)
        settings = settings.replace(profile_dir=engine_profile_dir(cfg.metrics) if topo.role_rank == 0 else "",
                                    profile_steps=cfg.metrics.profile_engine_steps)
        return cls(model_dir, spec, tokenizer.eos_token_id, settings, gpu=topo.device.index)

    def _init_adapter(self, lora_rank: int, scaling: float) -> dict:
        """The worker's adapter: the pinned LoRA slot, or W0 kept for merging (`vllm_worker.py`)."""
        names, shapes = list(self.spec.names), [list(s) for s in self.spec.shapes]
        dtype_name = str(self.spec.dtype).removeprefix("torch.")
        if self.lora_mode == "slot":
            return self.llm.collective_rpc("colocate_init_adapter", args=(names, shapes, dtype_name, lora_rank,
                                                                          scaling))[0]
        return self.llm.collective_rpc("colocate_init_merged",
                                       args=(names, shapes, dtype_name, scaling, self.quantization))[0]

    @property
    def can_profile(self) -> bool:
        return bool(self.profile_dir)

    def start_profile(self) -> None:
        """Start the engine core's trace (needs `profile_dir` at construction)."""
        if not self.profile_dir:
            raise RuntimeError("VLLMEngine.start_profile: built without profile_dir")
        self.llm.start_profile()

    def stop_profile(self) -> None:
        if self.profile_dir:
            self.llm.stop_profile()  # the worker writes <profile_dir>/*.pt.trace.json.gz

    def _make_lora_request(self):
        if self.lora_mode == "merged":
            return None  # the adapter is in the base weights
        from vllm.lora.request import LoRARequest
        return LoRARequest(lora_name=f"colocate-v{self.version}", lora_int_id=SLOT_ID, lora_path=IN_MEMORY_PATH)

    # -- weights ---------------------------------------------------------------------------------
    def join_sync(self, host: str, port: int, *, world_size: int, rank: int, timeout_s: float = 900.0) -> str:
        """Join one of learner rank 0's stateless NCCL groups from the worker (blocks until all of
        its members joined, at most `timeout_s`)."""
        return self.llm.collective_rpc("colocate_init_sync", args=(host, port, world_size, rank, timeout_s))[0]

    def _require_idle(self, what: str) -> None:
        """With update="drain" weights change only between batches: a streamed request in flight
        would mix versions. A queued canary probe is finished first (`_finish_probes`)."""
        self._finish_probes()
        if self._pending and not self.inflight:
            raise RuntimeError(f"{what} with {len(self._pending)} streamed requests in flight: poll them "
                               "until none is pending first")

    def attach_ipc(self, desc: dict) -> str:
        """Roles on one GPU: the worker maps learner rank 0's shared adapter buffer."""
        return self.llm.collective_rpc("colocate_ipc_attach", args=(desc,))[0]

    def receive_lora(self, verify: bool = False, header: list | None = None) -> AdapterReceipt:
        """Take the next broadcast of learner rank 0 into the slot (or, with the `header` that came
        over gloo, the shared IPC buffer); later samples carry its version."""
        self._require_idle("adapter update")
        method, args = ("colocate_receive_adapter", (verify,)) if header is None else \
            ("colocate_receive_ipc", (header, verify))
        got = AdapterReceipt.from_rpc(self.llm.collective_rpc(method, args=args)[0])
        if got.checksum_ok is False:
            raise RuntimeError(f"adapter version {got.version} arrived corrupted (checksum mismatch)")
        if got.slot_ok is False:
            raise RuntimeError(f"adapter version {got.version}: the LoRA slot differs from what was received")
        self._set_version(got.version)
        return got

    def load_lora(self, version: int, tensors: dict[str, torch.Tensor], verify: bool = False) -> None:
        self._require_idle("adapter update")
        flat = flatten_lora({n: t.detach().cpu() for n, t in tensors.items()}, self.spec)
        (slot_ok,) = self.llm.collective_rpc(
            "colocate_load_adapter_bytes", args=(flat.view(torch.uint8).numpy().tobytes(), verify))[0]
        if slot_ok is False:
            raise RuntimeError(f"adapter version {version}: the LoRA slot differs from what was sent")
        self._set_version(version)

    def lora_state(self) -> dict[str, torch.Tensor]:
        data = self.llm.collective_rpc("colocate_adapter_bytes")[0]
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.spec.dtype)
        return unflatten_lora(flat, self.spec)

    def _set_version(self, version: int) -> None:
        self._require_idle(f"adapter version {version}")
        self.version = version
        self._lora_request = self._make_lora_request()  # slot: a new name is a new prefix-cache key
        if self.lora_mode == "merged" and not self.inflight and not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update (requests running?)")

    # -- sampling --------------------------------------------------------------------------------
    def generate(self, requests: list[Request]) -> list[Completion]:
        self._require_idle("generate()")
        if self._pending:
            return self._generate_beside(requests)
        t0 = time.perf_counter()
        prompts, params = self._params(requests)
        t1 = time.perf_counter()
        outputs = self.llm.generate(prompts, params, lora_request=self._lora_request, use_tqdm=False)
        t2 = time.perf_counter()
        completions = [self._completion(out, r) for out, r in zip(outputs, requests)]
        self.counters["requests"] += len(requests)
        self.counters["host_s"] += (t1 - t0) + (time.perf_counter() - t2)
        self.counters["generate_s"] += t2 - t1
        return completions

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """The canary's probe scored by vLLM's forward with the adapter it samples with now
        (`prompt_logprobs`), at once."""
        return self.start_score(token_ids)()

    def start_score(self, token_ids: list[int]) -> Callable[[], torch.Tensor]:
        """The probe queued as one more request: vLLM's engine core (its own process) starts on it at
        once, while this rank evaluates or waits for old sends, or beside streamed requests already
        running, instead of in a step this rank waits for; reading it steps the engine until it is done."""
        from vllm import SamplingParams
        params = SamplingParams(n=1, temperature=1.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        prompt = {"prompt_token_ids": list(token_ids), **self._cache_salt()}
        (rid,) = self.llm.enqueue([prompt], [params], lora_request=self._lora_request, use_tqdm=False)
        key = rid.split("-", 1)[0]
        self._probes[key] = None

        def read() -> torch.Tensor:
            while self._probes[key] is None:  # streamed answers read meanwhile wait for the next poll
                self._stash.extend(self._step_once())
            return prompt_logprobs_of(self._probes.pop(key), token_ids)
        return read

    def _finish_probes(self) -> None:
        """Step the engine until every queued probe is done: before the weights change (a probe
        belongs to the adapter it was queued under) and before `LLM.generate`, which would take its
        output as one of its own."""
        while any(o is None for o in self._probes.values()):
            self._stash.extend(self._step_once())

    # -- streaming (the rollout worker with rollout.stream) -----------------------------------------
    def _params(self, requests: list[Request]) -> tuple[list[dict], list]:
        """Prompts and SamplingParams for `requests`: each distinct Constraint once as our automaton's
        payload or as a grammar string."""
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams
        ours = self.constraint_masks == "ours"
        encoded: dict[int, dict | str] = {}
        prompts, params = [], []
        for r in requests:
            extra = {}
            c = r.constraint
            if c is not None and c.slots:
                if id(c) not in encoded:
                    encoded[id(c)] = trie_payload(c.table()) if ours else constraint_grammar(c, self.grammar_mode)
                extra = ({"extra_args": {PAYLOAD_KEY: encoded[id(c)]}} if ours
                         else {"structured_outputs": StructuredOutputsParams(grammar=encoded[id(c)])})
            prompts.append({"prompt_token_ids": r.prompt_ids, **self._cache_salt()})
            params.append(SamplingParams(**sampling_kwargs(r, self.eos_id), **extra))
        return prompts, params

    def _cache_salt(self) -> dict:
        """Merged weights with in-flight updates: blocks computed under one version are never
        reused by a request of another (the slot mode's adapter name does it there)."""
        return {"cache_salt": f"colocate-v{self.version}"} if self.lora_mode == "merged" and self.inflight else {}

    def _generate_beside(self, requests: list[Request]) -> list[Completion]:
        """`generate` while streamed requests run (update="inflight"): its own requests through the
        same queue; streamed answers that arrive meanwhile wait in the stash for the next poll."""
        tickets = self.submit(requests)
        wanted, got = set(tickets), {}
        while len(got) < len(tickets):
            for ticket, completion in self._step_once():
                if ticket in wanted:
                    got[ticket] = completion
                else:
                    self._stash.append((ticket, completion))
        return [got[t] for t in tickets]

    def submit(self, requests: list[Request]) -> list[int]:
        """Queue `requests` in the engine (`LLM.enqueue`); the engine core starts on them at once."""
        if not requests:
            return []
        t0 = time.perf_counter()
        prompts, params = self._params(requests)
        ids = self.llm.enqueue(prompts, params, lora_request=self._lora_request, use_tqdm=False)
        tickets = list(range(self._next_ticket, self._next_ticket + len(requests)))
        self._next_ticket += len(requests)
        if not self._pending:
            self._busy_since = t0  # the engine works from the first submit until the last answer
        for rid, ticket, r in zip(ids, tickets, requests):
            # outputs carry the id the LLM numbered the request with; vLLM appends "-<random>" inside
            self._pending[rid.split("-", 1)[0]] = (ticket, r, self.version)
        self.counters["host_s"] += time.perf_counter() - t0
        return tickets

    def poll(self, wait_all: bool = False, wake: Callable[[], bool] | None = None) -> list[tuple[int, Completion]]:
        """Step the engine until a request finishes (all of them with `wait_all`), or `wake()` is
        true after a step."""
        out, self._stash = self._stash, []
        while self._pending and (wait_all or not out):
            out.extend(self._step_once())
            if wake is not None and not wait_all and wake():
                break
        return out

    def _step_once(self) -> list[tuple[int, Completion]]:
        """One `engine.step()` -> the streamed requests it finished, as (ticket, completion)."""
        engine = self.llm.llm_engine
        if not engine.has_unfinished_requests():  # step() would wait for outputs that never come
            raise RuntimeError(f"{len(self._pending)} streamed requests are unknown to vLLM "
                               f"(e.g. {next(iter(self._pending), next(iter(self._probes), None))})")
        streaming = bool(self._pending)  # else the step ran only canary probes: not a rollout step
        finished = [o for o in engine.step() if o.finished]
        self.counters["steps"] += int(streaming)  # streamed engine steps (one per decoded token without drafts)
        t1 = time.perf_counter()
        out = []
        for o in finished:
            if o.request_id in self._probes:  # the canary's request (`score`)
                self._probes[o.request_id] = o
                continue
            ticket, r, version = self._pending.pop(o.request_id)
            out.append((ticket, self._completion(o, r, version)))
        self.counters["host_s"] += time.perf_counter() - t1
        self.counters["requests"] += len(out)
        if out and not self._pending:
            self.counters["generate_s"] += time.perf_counter() - self._busy_since
        return out

    def _completion(self, out, request: Request, version: int | None = None) -> Completion:
        """`version`: the one at submit (streamed); the answer's last token is no newer than now."""
        first = self.version if version is None else version
        completion, counts = completion_from_output(out.outputs[0], request, first, self.eos_id)
        completion.last_version = self.version
        self.counters["prompt_tokens"] += len(request.prompt_ids)
        self.counters["cached_prompt_tokens"] += getattr(out, "num_cached_tokens", None) or 0
        self.counters["out_tokens"] += len(completion.token_ids)
        for k, v in counts.items():
            self.counters[k] += v
        if self.grammar_mode == "tokens" and counts["walk_failures"]:
            raise RuntimeError("vLLM sampled a token the constraint does not allow (token grammar): "
                               "the grammar and the Constraint disagree")
        return completion

    def stats(self) -> dict[str, float]:
        """Since the last call: requests, host time per request around vLLM (grammar, params, replay),
        completions that ended on an appended EOS, replay failures (0 with token grammars), answers
        vLLM ended with an error (cut short), prompt and output tokens/s while the engine had work
        (`LLM.generate`; streamed: first submit to last answer), the prefix-cache hit rate (cached /
        prompt tokens, from vLLM's `num_cached_tokens`), the prompt tokens it computed and the
        streamed engine steps."""
        d = {k: self.counters[k] - self._reported[k] for k in self.counters}
        self._reported = dict(self.counters)
        gen_s = max(d["generate_s"], 1e-9)
        return {"requests": float(d["requests"]), "host_ms_per_request": 1e3 * d["host_s"] / max(d["requests"], 1),
                "eos_appended": float(d["eos_appended"]), "walk_failures": float(d["walk_failures"]),
                "engine_errors": float(d["engine_errors"]),
                # vLLM interleaves prefill and decode in one step: both rates are over the same time
                "prefill_tokens_per_s": d["prompt_tokens"] / gen_s, "decode_tokens_per_s": d["out_tokens"] / gen_s,
                "prefix_cache_hit_rate": d["cached_prompt_tokens"] / max(d["prompt_tokens"], 1),
                # what the engine computed for prompts: the rollout's main cost on the Diplomacy workload
                "prefill_tokens": float(d["prompt_tokens"] - d["cached_prompt_tokens"]),
                # streamed engine steps: out_tokens / steps is the mean number of answers decoding per step
                "steps": float(d["steps"])}

    def shutdown(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            del llm
            import gc
            gc.collect()
