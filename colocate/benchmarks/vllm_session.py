"""One GPU session for the vLLM profiles (`sync`, `rollout`) and the vLLM GPU tests.

Two GPUs, one process, the same code paths as a torchrun job: the learner side (peft policy,
`AdapterSender`) on cuda:0 in this process; `VLLMEngine` with its engine core in a child process on
GPU 1, joined to the learner by the stateless NCCL group. An engine start costs ~1 minute, so one
session serves every measurement of a shape:

  measure_sync     learner step end -> first token sampled with the new version (ours) against
                   save adapter + LoRARequest(path) + first token (disk), same engine, same prompt;
                   plus a checksum / slot read-back check of one update.
  measure_parity   vLLM's sampled-token log-probs against the learner's (same adapter, same
                   `allowed_ids` mask, same temperature): synthetic, Diplomacy, unconstrained.
  measure_rollout  the same requests through vLLM alone (pre-built prompts and grammars), our
                   inference-rank path (requests -> grammar -> engine -> replay -> parse), and HF
                   `generate` (peft, 64 sequences, unconstrained, as the anchor); optional
                   Diplomacy phase and text-grammar mismatch count.

Synthetic workload (anchors/vllm_probe.py): prompts of 440 tokens sharing their first 300, random
ids of the embedded tokenizer; a constraint of 4 slots x 16 choices of 8/8/8/7 tokens (2-token
shared prefix per slot, as orders share "A PAR"), so every completion is 31 tokens + EOS = 32.
The prefix cache is reset before every timed run, so no run reuses another's prompts.

`--learner-device cpu` with a stand-in `vllm` package runs all of it on a CPU (a dry run of the
code paths; the figures mean nothing there).
"""
from __future__ import annotations

import os
import random
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field

import torch

from colocate.benchmarks.common import median_time
from colocate.constraint import Constraint
from colocate.data import Request
from colocate.metrics import write_json_atomic

SHAPES = {"0.5b": "qwen2.5-0.5b", "7b": "qwen2.5-7b", "tiny": "tiny"}
LEARNER = "cuda:0"
"""The learner's device; "cpu" only for a dry run against a stand-in engine."""


def sync_learner() -> None:
    if torch.device(LEARNER).type == "cuda":
        torch.cuda.synchronize(LEARNER)


def log(msg: str) -> None:
    print(f"[vllm-session {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------- workload

def synthetic_constraint(rng: random.Random, vocab: int, eos_id: int, tokenizer=None,
                         lengths=(8, 8, 8, 7), num_choices: int = 16) -> Constraint:
    slots = []
    for length in lengths:
        prefix = [rng.randrange(2, vocab) for _ in range(2)]
        seen: dict[tuple, None] = {}
        while len(seen) < num_choices:
            seen[tuple(prefix + [rng.randrange(2, vocab) for _ in range(length - 2)])] = None
        slots.append([list(c) for c in seen])
    texts = [[tokenizer.decode(c) for c in slot] for slot in slots] if tokenizer is not None else None
    return Constraint(slots=slots, eos_id=eos_id, texts=texts)


def synthetic_requests(n: int, vocab: int, eos_id: int, *, seed: int, prompt_len: int = 440, shared: int = 300,
                       group_size: int = 8, max_new_tokens: int = 32, constrained: bool = True,
                       tokenizer=None) -> list[Request]:
    rng = random.Random(seed)
    prefix = [rng.randrange(2, vocab) for _ in range(shared)]
    constraints = [synthetic_constraint(rng, vocab, eos_id, tokenizer) for _ in range(-(-n // group_size))]
    return [Request(prompt_ids=prefix + [rng.randrange(2, vocab) for _ in range(prompt_len - shared)],
                    max_new_tokens=max_new_tokens, temperature=1.0,
                    constraint=constraints[i // group_size] if constrained else None) for i in range(n)]


# ---------------------------------------------------------------------------------- session

def embedded_tokenizer(cfg):
    """The embedded tokenizer trained on Diplomacy text (cached under .cache/colocate)."""
    from colocate.config import ModelConfig
    from colocate.envs import env_corpus
    from colocate.models import load_tokenizer
    key, corpus_fn = env_corpus(cfg)
    return load_tokenizer(ModelConfig(), corpus_fn, key)


@dataclass
class Session:
    shape: str
    cfg: object
    tokenizer: object
    policy: object            # peft model on cuda:0 (the learner's weights)
    spec: object
    engine: object
    sender: object
    model_dir: str
    figures: dict = field(default_factory=dict)
    version: int = 0
    gather: object = None     # the learner's LoraGather over `policy` (what train.py's learner sends)

    def lora(self) -> dict[str, torch.Tensor]:
        from colocate.models import lora_state
        return lora_state(self.policy)

    @torch.no_grad()
    def step_adapter(self, std: float = 0.002) -> None:
        """Stand-in for an optimizer step: every lora_B moves a little; version += 1."""
        for name, p in self.lora().items():
            if ".lora_B." in name:
                p.add_(torch.randn_like(p) * std)
        self.version += 1

    def push(self, *, with_checksum: bool = False, verify: bool = False) -> dict:
        """Learner -> engine over NCCL, as train.py does (the send is enqueued, the worker completes it)."""
        self.sender.send(self.gather(), self.version, with_checksum=with_checksum, wait=False)
        got = self.engine.receive_lora(verify=verify)
        sync_learner()
        return got


def open_session(shape: str, *, max_num_seqs: int = 512, max_model_len: int = 1024,
                 gpu_memory_utilization: float = 0.85, max_loras: int = 2, lora_b_std: float = 0.02,
                 cache_dir: str = "", lora_mode: str = "slot", async_scheduling: bool | None = None,
                 jump_forward: int = 0) -> Session:
    from colocate.config import load_config
    from colocate.engine.model_dir import ensure_model_dir
    from colocate.engine.vllm import VLLMEngine, lora_spec_for
    from colocate.engine.vllm_sync import HOST, AdapterSender, StatelessGroup, listen_socket
    from colocate.train import build_policy
    if torch.device(LEARNER).type == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit("the vLLM session needs 2 GPUs (learner on cuda:0, engine on GPU 1) and vllm")
    cache_dir = cache_dir or os.path.join(tempfile.gettempdir(), "colocate-models")
    cfg = load_config(None, {"model": {"shape": SHAPES[shape], "dtype": "bfloat16", "cache_dir": cache_dir},
                             "lora": {"rank": 16, "alpha": 32.0}, "env": {"name": "diplomacy"}})
    figures = {}
    t0 = time.perf_counter()
    tokenizer = embedded_tokenizer(cfg)
    policy = build_policy(cfg, tokenizer, LEARNER).eval()
    with torch.no_grad():  # a non-trivial adapter (peft starts B at 0, which would hide a wrong A)
        g = torch.Generator(device=LEARNER).manual_seed(1)
        for n, p in policy.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g, device=LEARNER) * lora_b_std)
    spec = lora_spec_for(cfg, tokenizer)
    model_dir = ensure_model_dir(cfg, tokenizer, LEARNER, is_writer=True)
    figures["setup/policy_and_model_dir_s"] = time.perf_counter() - t0
    log(f"{shape}: policy on {LEARNER}, model dir {model_dir} ({figures['setup/policy_and_model_dir_s']:.0f}s)")
    engine = VLLMEngine(model_dir, spec, tokenizer.eos_token_id, max_num_seqs=max_num_seqs,
                        max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                        lora_rank=cfg.lora.rank, lora_alpha=cfg.lora.alpha, max_loras=max_loras, local_rank=1,
                        lora_mode=lora_mode, async_scheduling=async_scheduling, jump_forward=jump_forward)
    figures["engine/startup_s"] = engine.startup_s
    log(f"{shape}: engine up in {engine.startup_s:.0f}s, slot {engine.slot_info}")
    # Both ends of the stateless group live in this process: the learner's end joins from a thread.
    sock, port = listen_socket()
    box = {}
    thread = threading.Thread(target=lambda: box.update(group=StatelessGroup(HOST, port, 0, 2, LEARNER, listen=sock)))
    thread.start()
    engine.join_sync(HOST, port, world_size=2, rank=1)
    thread.join()
    from colocate.learner.fsdp import LoraGather
    session = Session(shape, cfg, tokenizer, policy, spec, engine, AdapterSender(box["group"], spec), model_dir,
                      figures, gather=LoraGather(policy))
    if session.gather.spec != spec:
        raise RuntimeError("the policy's adapter layout differs from the engine's LoraSpec")
    session.push()  # version 0 = the learner's initial adapter (non-zero B)
    return session


# ---------------------------------------------------------------------------------- sync

def measure_sync(s: Session, iters: int = 10, warmup: int = 3) -> dict:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    vocab = len(s.tokenizer)
    probe = synthetic_requests(1, vocab, s.tokenizer.eos_token_id, seed=7, prompt_len=64, shared=0,
                               max_new_tokens=1, constrained=False)
    out = {}
    # Correctness first: one update with checksum and slot read-back.
    s.step_adapter()
    got = s.push(with_checksum=True, verify=True)
    from colocate.engine.vllm_sync import chunked_checksum
    from colocate.sync import flatten_lora
    engine_bytes = flatten_lora(s.engine.lora_state(), s.spec)
    learner_bytes = flatten_lora({k: v.detach().cpu() for k, v in s.lora().items()}, s.spec)
    out["sync/checksum_ok"] = bool(got["checksum_ok"])
    out["sync/slot_matches_received"] = bool(got["slot_ok"])
    out["sync/engine_bytes_equal_learner"] = bool(torch.equal(engine_bytes.view(torch.uint8),
                                                              learner_bytes.view(torch.uint8)))
    out["sync/checksum"] = chunked_checksum(learner_bytes)
    out["sync/adapter_mb"] = s.spec.numel * s.spec.dtype.itemsize / 1e6
    # Ours: step end -> enqueue send -> worker receive+apply -> first token with the new version.
    parts = {"send_enqueue_ms": [], "receive_apply_ms": [], "first_token_ms": [], "total_ms": [], "apply_ms": []}
    for i in range(warmup + iters):
        s.step_adapter()
        sync_learner()
        t0 = time.perf_counter()                                   # learner step end
        s.sender.send(s.gather(), s.version, wait=False)           # gather (one multi-tensor copy) + send
        t1 = time.perf_counter()
        got = s.engine.receive_lora()
        t2 = time.perf_counter()
        (c,) = s.engine.generate(probe)
        t3 = time.perf_counter()
        assert c.version == s.version == got["version"]
        sync_learner()
        if i >= warmup:
            for k, v in (("send_enqueue_ms", t1 - t0), ("receive_apply_ms", t2 - t1), ("first_token_ms", t3 - t2),
                         ("total_ms", t3 - t0)):
                parts[k].append(v * 1e3)
            parts["apply_ms"].append(got["apply_ms"])
    for k, v in parts.items():
        out[f"sync/ours_{k}"] = statistics.median(v)
    # The same first token without any update (what sampling costs anyway).
    out["sync/first_token_no_update_ms"] = 1e3 * median_time(lambda: s.engine.generate(probe), warmup=0, iters=iters)
    out.update(first_token_breakdown(s, probe, iters))
    if s.engine.lora_mode == "merged":  # built without LoRA: vLLM's loader, the disk path, is not there
        out["sync/disk_skipped"] = "lora_mode=merged"
        return out
    # Disk: save the adapter (peft), a new LoRARequest from the path, first token with it.
    prompt = [{"prompt_token_ids": probe[0].prompt_ids}]
    params = SamplingParams(max_tokens=1, detokenize=False)
    disk = {"save_ms": [], "load_first_token_ms": [], "total_ms": []}
    with tempfile.TemporaryDirectory(dir=os.environ.get("COLOCATE_DISK_DIR") or None) as root:
        for i in range(max(3, iters // 2) + 1):
            s.step_adapter()
            sync_learner()
            t0 = time.perf_counter()
            path = os.path.join(root, f"v{s.version}")
            s.policy.save_pretrained(path, is_main_process=True)
            t1 = time.perf_counter()
            s.engine.llm.generate(prompt, params, lora_request=LoRARequest(f"disk-v{s.version}", 100 + i, path),
                                  use_tqdm=False)
            t2 = time.perf_counter()
            if i >= 1:  # the first disk load also warms the loader
                disk["save_ms"].append((t1 - t0) * 1e3)
                disk["load_first_token_ms"].append((t2 - t1) * 1e3)
                disk["total_ms"].append((t2 - t0) * 1e3)
    s.push()  # the engine's slot holds the learner's latest again
    for k, v in disk.items():
        out[f"sync/disk_{k}"] = statistics.median(v)
    out["sync/speedup_vs_disk"] = out["sync/disk_total_ms"] / out["sync/ours_total_ms"]
    return out


def first_token_breakdown(s: Session, probe: list[Request], iters: int) -> dict:
    """Where the one-token generate after an update goes, each part timed on its own (medians):
      rpc_roundtrip_ms       one `collective_rpc` that does nothing (client -> engine core -> worker -> back)
      first_token_stream_ms  the probe through `submit` + `poll` (`LLM.enqueue` + `llm_engine.step()`,
                             what streamed rollouts use) instead of `LLM.generate`
      first_token_16_ms      a 16-token prompt instead of 64 (how much is prefill)
      two_tokens_ms          max_tokens=2: minus first_token_no_update_ms, one decode step
      first_token_base_ms    no LoRA request at all (slot mode: the LoRA kernels' share)"""
    from vllm import SamplingParams

    def median_ms(fn) -> float:
        return 1e3 * median_time(fn, warmup=1, iters=iters)

    vocab, eos = len(s.tokenizer), s.tokenizer.eos_token_id
    short = synthetic_requests(1, vocab, eos, seed=8, prompt_len=16, shared=0, max_new_tokens=1, constrained=False)
    two = synthetic_requests(1, vocab, eos, seed=7, prompt_len=64, shared=0, max_new_tokens=2, constrained=False)
    prompt = [{"prompt_token_ids": probe[0].prompt_ids}]
    out = {
        "sync/rpc_roundtrip_ms": median_ms(lambda: s.engine.llm.collective_rpc("colocate_ping")),
        "sync/first_token_stream_ms": median_ms(lambda: (s.engine.submit(probe), s.engine.poll(wait_all=True))),
        "sync/first_token_16_ms": median_ms(lambda: s.engine.generate(short)),
        "sync/two_tokens_ms": median_ms(lambda: s.engine.generate(two)),
    }
    if s.engine.lora_mode == "slot":
        params = SamplingParams(max_tokens=1, detokenize=False)
        out["sync/first_token_base_ms"] = median_ms(
            lambda: s.engine.llm.generate(prompt, params, use_tqdm=False))
    return out


# ---------------------------------------------------------------------------------- parity

@torch.no_grad()
def learner_logprobs(policy, requests, completions, temperature: float, batch: int = 16,
                     use_adapter: bool = True) -> list[float]:
    """The learner's log-probs of the sampled tokens: softmax over `allowed_ids` when the completion
    has them (the learner's `restrict_to_allowed`), over the vocabulary otherwise."""
    import contextlib
    from colocate.kernels import restrict_to_allowed
    from colocate.kernels.reference import per_token_logprobs
    out: list[float] = []
    device = next(policy.parameters()).device
    with policy.disable_adapter() if not use_adapter else contextlib.nullcontext():
        for start in range(0, len(requests), batch):
            reqs, comps = requests[start:start + batch], completions[start:start + batch]
            seqs = [r.prompt_ids + c.token_ids for r, c in zip(reqs, comps)]
            width = max(len(x) for x in seqs)
            ids = torch.zeros((len(seqs), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            rows, cols, targets, allowed = [], [], [], []
            for i, (r, c, x) in enumerate(zip(reqs, comps, seqs)):
                ids[i, :len(x)] = torch.tensor(x)
                mask[i, :len(x)] = 1
                p = len(r.prompt_ids)
                rows += [i] * len(c.token_ids)
                cols += list(range(p - 1, p - 1 + len(c.token_ids)))
                targets += c.token_ids
                allowed += c.allowed_ids if c.allowed_ids is not None else []
            logits = policy(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[rows, cols]
            tgt = torch.tensor(targets, device=device)
            if allowed:
                k = max(len(a) for a in allowed)
                allowed_t = torch.full((len(allowed), k), -1, dtype=torch.long)
                for j, a in enumerate(allowed):
                    allowed_t[j, :len(a)] = torch.tensor(a)
                logits, tgt = restrict_to_allowed(logits, tgt, allowed_t.to(device))
            out += per_token_logprobs(logits, tgt, temperature).tolist()
    return out


def parity_stats(prefix: str, s: Session, reqs, comps) -> dict:
    engine_lp = [x for c in comps for x in c.logprobs]
    mine = learner_logprobs(s.policy, reqs, comps, 1.0)
    base = learner_logprobs(s.policy, reqs, comps, 1.0, use_adapter=False)
    diffs = [abs(a - b) for a, b in zip(engine_lp, mine)]
    out = {f"{prefix}/tokens": len(diffs), f"{prefix}/mean_abs_diff": statistics.mean(diffs),
           f"{prefix}/max_abs_diff": max(diffs), f"{prefix}/p99_abs_diff": sorted(diffs)[int(0.99 * (len(diffs) - 1))],
           f"{prefix}/adapter_effect_mean_abs": statistics.mean(abs(a - b) for a, b in zip(mine, base)),
           f"{prefix}/mean_logprob": statistics.mean(engine_lp)}
    if all(c.allowed_ids is not None for c in comps):
        sizes = [len(a) for c in comps for a in c.allowed_ids]
        free = [d for d, k in zip(diffs, sizes) if k > 1]  # tokens with a choice (forced ones are log 1 = 0)
        forced = [abs(x) for x, k in zip(engine_lp, sizes) if k == 1]
        out.update({f"{prefix}/free_tokens": len(free),
                    f"{prefix}/free_mean_abs_diff": statistics.mean(free) if free else 0.0,
                    f"{prefix}/free_max_abs_diff": max(free) if free else 0.0,
                    f"{prefix}/forced_max_abs_logprob": max(forced) if forced else 0.0})
    return out


def measure_parity(s: Session, n: int = 64) -> dict:
    """vLLM's sampled-token log-probs vs the learner's on the same completions, same adapter, same mask.

    Three workloads: synthetic constrained (most tokens forced), Diplomacy orders (real branching),
    and unconstrained (softmax over the whole vocabulary: the hardest, no mask to hide behind)."""
    vocab, eos = len(s.tokenizer), s.tokenizer.eos_token_id
    reqs = synthetic_requests(n, vocab, eos, seed=11)
    comps = s.engine.generate(reqs)
    assert all(c.version == s.version for c in comps)
    out = parity_stats("parity", s, reqs, comps)
    try:
        from colocate.envs.diplomacy import DiplomacyEnv
        env = DiplomacyEnv(s.tokenizer, group_size=4, horizon_years=1, seed=3)
        for g in range(3):
            env.start_group(g)
        dreqs = [r for _, r in env.requests()][:n]
        out.update(parity_stats("parity_diplomacy", s, dreqs, s.engine.generate(dreqs)))
        # Engine steps for one answer alone: one per token in plain decoding; with jump-forward the
        # grammar-forced tokens ride along as drafts, so fewer steps than tokens.
        longest = max(dreqs, key=lambda r: sum(max(len(c) for c in slot) for slot in r.constraint.slots))
        steps = s.engine.counters["steps"]
        s.engine.submit([longest])
        ((_, answer),) = s.engine.poll(wait_all=True)
        out["parity_diplomacy/one_answer_tokens"] = len(answer.token_ids)
        out["parity_diplomacy/one_answer_engine_steps"] = s.engine.counters["steps"] - steps
    except Exception as exc:
        out["parity_diplomacy/error"] = f"{type(exc).__name__}: {exc}"[:300]
    ureqs = synthetic_requests(n // 2, vocab, eos, seed=12, max_new_tokens=16, constrained=False)
    out.update(parity_stats("parity_unconstrained", s, ureqs, s.engine.generate(ureqs)))
    out.update({"parity/walk_failures": s.engine.counters["walk_failures"],
                "parity/eos_appended": s.engine.counters["eos_appended"],
                "parity/engine_errors": s.engine.counters["engine_errors"]})
    return out


# ---------------------------------------------------------------------------------- rollout

def _vllm_inputs(engine, requests, constrained: bool = True):
    """Prompts + SamplingParams exactly as VLLMEngine builds them, built before the clock starts."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams
    from colocate.engine.vllm import sampling_kwargs
    from colocate.engine.vllm_grammar import constraint_grammar
    grammars = {}
    params = []
    for r in requests:
        so = None
        if constrained and r.constraint is not None:
            g = grammars.setdefault(id(r.constraint), constraint_grammar(r.constraint, engine.grammar_mode))
            so = StructuredOutputsParams(grammar=g)
        kw = sampling_kwargs(r, engine.eos_id)
        if not constrained:
            kw.update(min_tokens=r.max_new_tokens, ignore_eos=True)
        params.append(SamplingParams(**kw, structured_outputs=so))
    return [{"prompt_token_ids": r.prompt_ids} for r in requests], params


def _timed_vllm_alone(engine, prompts, params) -> tuple[float, int]:
    engine.llm.reset_prefix_cache()
    t = time.perf_counter()
    outs = engine.llm.generate(prompts, params, lora_request=engine._lora_request, use_tqdm=False)
    return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)


def _timed_ours(engine, tokenizer, requests) -> tuple[float, int]:
    engine.llm.reset_prefix_cache()
    t = time.perf_counter()
    comps = engine.generate(requests)
    for c in comps:  # what an env does with a completion: decode it to text for its parser
        tokenizer.decode(c.token_ids[:-1] if c.token_ids and c.token_ids[-1] == engine.eos_id else c.token_ids)
    return time.perf_counter() - t, sum(len(c.token_ids) for c in comps)


@torch.no_grad()
def hf_generate_tok_s(policy, requests, new_tokens: int = 32) -> float:
    ids = torch.tensor([r.prompt_ids for r in requests], device=LEARNER)
    policy.generate(input_ids=ids[:4], attention_mask=torch.ones_like(ids[:4]), max_new_tokens=4, do_sample=True)
    sync_learner()
    t = time.perf_counter()
    policy.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens, do_sample=True, temperature=1.0)
    sync_learner()
    return len(requests) * new_tokens / (time.perf_counter() - t)


def measure_rollout(s: Session, num_seqs: int = 512, rounds: int = 2, hf_seqs: int = 64,
                    deadline: float = float("inf")) -> dict:
    e, tok = s.engine, s.tokenizer
    vocab, eos = len(tok), tok.eos_token_id
    out = {}
    warm = synthetic_requests(32, vocab, eos, seed=99)
    e.generate(warm)
    alone, ours = [], []
    for r in range(rounds):  # fresh prompts each run (same shapes); the order alternates per round
        def run_alone():
            prompts, params = _vllm_inputs(e, synthetic_requests(num_seqs, vocab, eos, seed=1000 + r))
            dt, n = _timed_vllm_alone(e, prompts, params)
            alone.append(n / dt)

        def run_ours():
            dt, n = _timed_ours(e, tok, synthetic_requests(num_seqs, vocab, eos, seed=2000 + r))
            ours.append(n / dt)
        for run in ((run_alone, run_ours) if r % 2 == 0 else (run_ours, run_alone)):
            run()
    out["rollout/num_seqs"] = num_seqs
    out["rollout/vllm_alone_out_tok_s"] = statistics.mean(alone)
    out["rollout/ours_out_tok_s"] = statistics.mean(ours)
    out["rollout/ours_vs_vllm_alone"] = out["rollout/ours_out_tok_s"] / out["rollout/vllm_alone_out_tok_s"]
    out["rollout/ours_host_s_per_seq_ms"] = 1e3 * e.counters["host_s"] / max(e.counters["requests"], 1)
    log(f"{s.shape}: rollout alone {out['rollout/vllm_alone_out_tok_s']:.0f} ours {out['rollout/ours_out_tok_s']:.0f} tok/s")
    reqs = synthetic_requests(num_seqs, vocab, eos, seed=3000, constrained=False)
    prompts, params = _vllm_inputs(e, reqs, constrained=False)
    dt, n = _timed_vllm_alone(e, prompts, params)
    out["rollout/vllm_unconstrained_out_tok_s"] = n / dt
    out["rollout/hf_generate_seqs"] = hf_seqs
    out["rollout/hf_generate_out_tok_s"] = hf_generate_tok_s(s.policy, synthetic_requests(hf_seqs, vocab, eos, seed=4000))
    out["rollout/ours_vs_hf"] = out["rollout/ours_out_tok_s"] / out["rollout/hf_generate_out_tok_s"]
    log(f"{s.shape}: hf generate {out['rollout/hf_generate_out_tok_s']:.0f} tok/s")
    if time.time() < deadline:
        out.update(measure_diplomacy(s))
    if time.time() < deadline:
        out.update(measure_text_grammar(s))
    return out


def measure_diplomacy(s: Session, groups: int = 9, group_size: int = 8) -> dict:
    """One fork phase of Diplomacy (every power of every continuation): vLLM alone vs our path with
    the env's own prompt building and order parsing (`requests` + `generate` + `step`)."""
    from colocate.envs.diplomacy import DiplomacyEnv
    out = {}
    try:
        def fresh():
            env = DiplomacyEnv(s.tokenizer, group_size=group_size, horizon_years=1, seed=5)
            for g in range(groups):
                env.start_group(g)
            return env
        env_a = fresh()
        reqs = [r for _, r in env_a.requests()]
        prompts, params = _vllm_inputs(s.engine, reqs)
        dt_a, n_a = _timed_vllm_alone(s.engine, prompts, params)
        env_b = fresh()
        s.engine.llm.reset_prefix_cache()
        t = time.perf_counter()
        keyed = env_b.requests()
        comps = s.engine.generate([r for _, r in keyed])
        env_b.step({k: c for (k, _), c in zip(keyed, comps)})
        dt_b = time.perf_counter() - t
        n_b = sum(len(c.token_ids) for c in comps)
        metrics = env_b.metrics()
        out.update({"diplomacy/requests": len(reqs), "diplomacy/mean_prompt_tokens": statistics.mean(len(r.prompt_ids) for r in reqs),
                    "diplomacy/mean_out_tokens": n_b / len(comps),
                    "diplomacy/vllm_alone_out_tok_s": n_a / dt_a, "diplomacy/ours_out_tok_s": n_b / dt_b,
                    "diplomacy/ours_vs_vllm_alone": (n_b / dt_b) / (n_a / dt_a),
                    **{f"diplomacy/env_{k}": float(v) for k, v in metrics.items() if isinstance(v, (int, float))}})
    except Exception as exc:  # the env is someone else's and optional here
        out["diplomacy/error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def measure_text_grammar(s: Session, n: int = 128) -> dict:
    """How often a text grammar (choices as strings) samples ids outside the Constraint's trie."""
    from colocate.envs.diplomacy import DiplomacyEnv
    e = s.engine
    before = dict(e.counters)
    e.grammar_mode = "text"
    try:
        env = DiplomacyEnv(s.tokenizer, group_size=8, horizon_years=1, seed=6)
        for g in range(3):
            env.start_group(g)
        reqs = [r for _, r in env.requests()][:n]
        comps = e.generate(reqs)
    except Exception as exc:
        return {"text_grammar/error": f"{type(exc).__name__}: {exc}"[:300]}
    finally:
        e.grammar_mode = "tokens"
    failures = e.counters["walk_failures"] - before["walk_failures"]
    e.counters["walk_failures"] = before["walk_failures"]
    return {"text_grammar/completions": len(comps), "text_grammar/walk_failures": failures,
            "text_grammar/failure_rate": failures / max(len(comps), 1)}


# ---------------------------------------------------------------------------------- entry

def run_session(shape: str, parts: list[str], *, budget_s: float = 480.0, num_seqs: int = 512,
                sync_iters: int = 10, lora_mode: str = "slot", async_scheduling: bool | None = None,
                jump_forward: int = 0) -> dict:
    """Open one engine for `shape`, run `parts` (sync, parity, rollout) in that order of priority."""
    deadline = time.time() + budget_s
    partial = os.environ.get("COLOCATE_PARTIAL_JSON", "")  # figures so far, rewritten after each part
    # merged keeps a copy of the adapted base weights on the engine's GPU: leave room for it
    s = open_session(shape, max_num_seqs=max(num_seqs, 64), lora_mode=lora_mode,
                     gpu_memory_utilization=0.85 if lora_mode == "slot" else 0.75, async_scheduling=async_scheduling,
                     jump_forward=jump_forward)
    figures = dict(s.figures)
    figures["engine/jump_forward"] = jump_forward
    figures["engine/lora_mode"] = lora_mode
    figures["engine/async_scheduling"] = "vllm default" if async_scheduling is None else async_scheduling
    for part in parts:
        if partial:
            write_json_atomic(partial, {"shape": shape, "figures": figures})
        if time.time() > deadline:
            figures[f"{part}/skipped"] = "budget"
            continue
        try:
            if part == "sync":
                figures.update(measure_sync(s, iters=sync_iters))
            elif part == "parity":
                figures.update(measure_parity(s))
            elif part == "rollout":
                figures.update(measure_rollout(s, num_seqs=num_seqs, deadline=deadline - 30))
            log(f"{shape}: {part} done")
        except Exception as exc:
            import traceback
            traceback.print_exc()
            figures[f"{part}/error"] = f"{type(exc).__name__}: {exc}"[:500]
    figures["engine/stats"] = dict(s.engine.counters)
    if partial:
        write_json_atomic(partial, {"shape": shape, "figures": figures})
    s.engine.shutdown()
    return figures


# -- the `sync` and `rollout` profiles share one session and one argument list --------------------
def add_session_args(parser, *, others: str) -> None:
    parser.add_argument("--shape", default="7b", choices=("0.5b", "7b", "tiny"))
    parser.add_argument("--learner-device", default="cuda:0", help="cpu: dry run against a stand-in vllm")
    parser.add_argument("--iters", type=int, default=10, help="sync iterations")
    parser.add_argument("--also", default="", help=f"comma list of more parts: {others}")
    parser.add_argument("--num-seqs", type=int, default=512, help="rollout batch")
    parser.add_argument("--budget-s", type=float, default=480.0, help="skip later parts past this")
    parser.add_argument("--lora-mode", default="slot", choices=("slot", "merged"),
                        help="engine.lora_mode (merged: the sync part skips its disk baseline)")
    parser.add_argument("--async-scheduling", default="auto", choices=("auto", "on", "off"),
                        help="vLLM's async scheduling (auto: vLLM's default, on in 0.25)")
    parser.add_argument("--jump-forward", type=int, default=0,
                        help="engine.jump_forward: grammar-forced tokens per step as exact speculative drafts "
                             "(0 = off; needs synchronous scheduling, which it selects)")


def run_profile(args, part: str, *, first: bool) -> dict:
    """Run `part` plus `--also` parts in one engine session (`part` first or last)."""
    global LEARNER
    LEARNER = args.learner_device
    shape = "0.5b" if args.quick else args.shape
    also = [p for p in args.also.split(",") if p and p != part]
    parts = [part] + also if first else also + [part]
    figures = run_session(shape, parts, budget_s=args.budget_s, num_seqs=args.num_seqs, sync_iters=args.iters,
                          lora_mode=args.lora_mode,
                          async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
                          jump_forward=args.jump_forward)
    return split(figures)


def split(figures: dict) -> dict:
    """figures / baseline / ratios for the benchmark record (baselines: disk, vLLM alone, HF)."""
    ratios = {k: v for k, v in figures.items() if "speedup" in k or "_vs_" in k}
    baseline = {k: v for k, v in figures.items() if k not in ratios
                and any(t in k for t in ("disk_", "vllm_alone", "hf_generate", "vllm_unconstrained"))}
    rest = {k: v for k, v in figures.items() if k not in baseline and k not in ratios}
    return {"figures": rest, "baseline": baseline, "ratios": ratios}
