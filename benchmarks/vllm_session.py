"""One GPU session for the vLLM profiles (`sync`, `rollout`) and the vLLM GPU tests.

Two GPUs, one process, the same code paths as a torchrun job: the learner side (peft policy,
`AdapterSender`) on cuda:0 in this process; `VLLMEngine` with its engine core in a child process on
GPU 1, joined to the learner by the stateless NCCL group. An engine start costs ~1 minute, so one
session serves every measurement of a shape (each in its own module):

  measure_sync     (sync.py) learner step end -> first token sampled with the new version (ours) against
                   save adapter + LoRARequest(path) + first token (disk), same engine, same prompt;
                   plus a checksum / slot read-back check of one update.
  measure_parity   (parity.py) vLLM's sampled-token log-probs against the learner's (same adapter, same
                   `allowed_ids` mask, same temperature): synthetic, Diplomacy, unconstrained.
  measure_rollout  (rollout.py) the same requests through vLLM alone (pre-built prompts and grammars), our
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
import tempfile
import threading
import time
from dataclasses import dataclass, field

import torch

from colocate.constraint import Constraint
from colocate.data import Request
from colocate.metrics import write_json_atomic

SHAPES = {"0.5b": "qwen2.5-0.5b", "7b": "qwen2.5-7b", "tiny": "tiny"}
LEARNER = "cuda:0"
"""The learner's device; "cpu" only for a dry run against a stand-in engine."""
TRACE_STEPS = 64  # most engine steps in one engine-core trace (`--trace-dir`; a traced update takes 1-3)


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
                 jump_forward: int = 0, trace_dir: str = "", compile_kw: dict | None = None) -> Session:
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
                        lora_mode=lora_mode, async_scheduling=async_scheduling, jump_forward=jump_forward,
                        profile_dir=trace_dir, profile_steps=TRACE_STEPS, **(compile_kw or {}))
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


# ---------------------------------------------------------------------------------- entry

def run_session(shape: str, parts: list[str], *, budget_s: float = 480.0, num_seqs: int = 512,
                sync_iters: int = 10, lora_mode: str = "slot", async_scheduling: bool | None = None,
                jump_forward: int = 0, trace_dir: str = "", compile_kw: dict | None = None) -> dict:
    """Open one engine for `shape`, run `parts` (sync, parity, rollout) in that order of priority."""
    deadline = time.time() + budget_s
    partial = os.environ.get("COLOCATE_PARTIAL_JSON", "")  # figures so far, rewritten after each part
    # merged keeps a copy of the adapted base weights on the engine's GPU: leave room for it
    s = open_session(shape, max_num_seqs=max(num_seqs, 64), lora_mode=lora_mode,
                     gpu_memory_utilization=0.85 if lora_mode == "slot" else 0.75, async_scheduling=async_scheduling,
                     jump_forward=jump_forward, trace_dir=trace_dir, compile_kw=compile_kw)
    figures = dict(s.figures)
    figures["engine/compilation"] = dict(compile_kw or {})
    figures["engine/jump_forward"] = jump_forward
    figures["engine/lora_mode"] = lora_mode
    figures["engine/async_scheduling"] = "vllm default" if async_scheduling is None else async_scheduling
    for part in parts:
        if partial:
            write_json_atomic(partial, {"shape": shape, "figures": figures})
        if time.time() > deadline:
            figures[f"{part}/skipped"] = "budget"
            continue
        try:  # each part lives in its own module, which imports this one
            if part == "sync":
                from benchmarks.sync import measure_sync
                figures.update(measure_sync(s, iters=sync_iters))
            elif part == "parity":
                from benchmarks.parity import measure_parity
                figures.update(measure_parity(s))
            elif part == "rollout":
                from benchmarks.rollout import measure_rollout
                figures.update(measure_rollout(s, num_seqs=num_seqs, deadline=deadline - 30))
            log(f"{shape}: {part} done")
        except Exception as exc:
            import traceback
            traceback.print_exc()
            figures[f"{part}/error"] = f"{type(exc).__name__}: {exc}"[:500]
    if trace_dir:  # after every part: vLLM's engine stays slower after its profiler window
        try:
            from benchmarks.sync import trace_first_tokens
            figures.update(trace_first_tokens(s))
        except Exception as exc:  # noqa: BLE001 - keep the parts' figures
            figures["sync/trace_error"] = f"{type(exc).__name__}: {exc}"[:500]
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
    from colocate.engine.vllm_settings import CUDAGRAPH_MODES
    parser.add_argument("--cudagraph-mode", default="", choices=CUDAGRAPH_MODES,
                        help="engine.cudagraph_mode (default: vLLM's FULL_AND_PIECEWISE)")
    parser.add_argument("--max-capture-tokens", type=int, default=2048,
                        help="engine.max_capture_tokens: largest step replayed from a CUDA graph (0: decode sizes only)")
    parser.add_argument("--trace-dir", default="",
                        help="after the parts, trace vLLM's engine core over 5 updates, each with its first token, "
                             "into this folder; the record gets each trace's summary (scripts/trace_summary.py)")


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
                          jump_forward=args.jump_forward, trace_dir=args.trace_dir,
                          compile_kw={"cudagraph_mode": args.cudagraph_mode,
                                      "max_capture_tokens": args.max_capture_tokens})
    return split(figures)


def split(figures: dict) -> dict:
    """figures / baseline / ratios for the benchmark record (baselines: disk, vLLM alone, HF)."""
    ratios = {k: v for k, v in figures.items() if "speedup" in k or "_vs_" in k}
    baseline = {k: v for k, v in figures.items() if k not in ratios
                and any(t in k for t in ("disk_", "vllm_alone", "hf_generate", "vllm_unconstrained"))}
    rest = {k: v for k, v in figures.items() if k not in baseline and k not in ratios}
    return {"figures": rest, "baseline": baseline, "ratios": ratios}
