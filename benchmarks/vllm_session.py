"""One GPU session for the vLLM profiles (`sync`, `rollout`) and the vLLM GPU tests: the shared
base of the vLLM benchmark modules (it imports none of them; they import it).

Two GPUs, one process, the same code paths as a torchrun job: the learner side (peft policy,
`NcclSender`) on cuda:0 in this process; `VLLMEngine` with its engine core in a child process on
GPU 1, joined to the learner by the stateless NCCL group. `--one-gpu`: the engine shares cuda:0
and the adapter goes by CUDA IPC (`LocalIpcSender`, the one-GPU channel of a torchrun job less its
gloo header message, which is handed over in-process here). An engine start costs ~1 minute, so one
session serves every measurement of a shape. Each measurement is a *part* (`Part`), defined in its
own module and handed in by the profile that runs it:

  sync     (sync.py) learner step end -> first token sampled with the new version (ours) against
           save adapter + LoRARequest(path) + first token (disk), same engine, same prompt;
           plus a checksum / slot read-back check of one update.
  parity   (parity.py) vLLM's sampled-token log-probs against the learner's (same adapter, same
           `allowed_ids` mask, same temperature): synthetic, Diplomacy, unconstrained.
  rollout  (rollout.py) the same requests through vLLM alone (pre-built prompts and grammars), our
           inference-rank path (requests -> grammar -> engine -> replay -> parse), and HF
           `generate` (peft, 64 sequences, unconstrained, as the baseline); optional Diplomacy
           phase and text-grammar mismatch count.

Synthetic workload: prompts of 440 tokens sharing their first 300, random ids of the embedded
tokenizer; a constraint of 4 slots x 16 choices of 8/8/8/7 tokens (2-token shared prefix per slot,
as orders share "A PAR"), so every completion is 31 tokens + EOS = 32. The prefix cache is reset
before every timed run, so no run reuses another's prompts.

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
from typing import Callable

import torch

from colocate.config_schema import EngineConfig
from colocate.constraint import Constraint
from colocate.data import Request
from colocate.jsonfile import write_atomic

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
    sender: object            # engine/vllm_channel.NcclSender: learner rank 0's end of the group
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

    def push(self, *, with_checksum: bool = False, verify: bool = False):
        """Learner -> engine as train.py does (NCCL: the send is enqueued, the worker completes it;
        IPC: a copy into the shared buffer, then the worker copies it out)."""
        self.sender.with_checksum = with_checksum
        try:
            self.sender.send(self.gather(), self.version)
        finally:
            self.sender.with_checksum = False
        got = self.receive(verify=verify)
        sync_learner()
        return got

    def receive(self, verify: bool = False):
        """The engine takes the update just sent (with the IPC header when the channel is IPC) ->
        its `AdapterReceipt`."""
        header = self.sender.header if isinstance(self.sender, LocalIpcSender) else None  # NCCL: broadcast
        return self.engine.receive_lora(verify=verify, header=header)


class LocalIpcSender:
    """The one-GPU channel (`channel.IpcSender`) with both ends in this process: the buffer is
    shared with the engine's worker once, each send is a device copy into it, and the [4] header
    goes to `receive_lora` directly instead of over a gloo group."""

    def __init__(self, engine, spec, device):
        from colocate.wire import share_cuda_buffer
        self.spec, self.with_checksum, self.header = spec, False, None
        self.ring = torch.zeros(1, spec.numel, dtype=spec.dtype, device=device)  # one update at a time here
        engine.attach_ipc(share_cuda_buffer(self.ring))

    def send(self, flat, version: int, flags: int = 0, *, wait: bool = False) -> float:
        from colocate.wire import adapter_header, flatten_lora
        t0 = time.perf_counter()
        self.ring[0].copy_(flatten_lora(flat, self.spec))
        sync_learner()  # the bytes are in the buffer before the worker reads them
        self.header = adapter_header(version, self.spec, self.ring[0] if self.with_checksum else None, flags).tolist()
        return time.perf_counter() - t0


Part = Callable[[Session, float], dict]
"""One measurement in an open session: (session, deadline as a `time.time()`) -> figures."""


def learner_policy(cfg, tokenizer, lora_b_std: float):
    """The learner's peft policy on LEARNER, with a non-trivial adapter (peft starts B at 0, which
    would hide a wrong A)."""
    from colocate.models import build_policy
    policy = build_policy(cfg, tokenizer, LEARNER).eval()
    with torch.no_grad():
        g = torch.Generator(device=LEARNER).manual_seed(1)
        for n, p in policy.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g, device=LEARNER) * lora_b_std)
    return policy


def connect_sender(engine, spec):
    """The stateless NCCL group of the learner (rank 0) and the engine's worker (rank 1). Both ends
    live in this process: the learner's end joins from a thread while the worker joins."""
    from colocate.engine.vllm_channel import LOCAL_HOST, NcclSender, listen_socket
    from colocate.engine.vllm_worker import StatelessGroup
    sock, port = listen_socket(LOCAL_HOST)
    box = {}
    thread = threading.Thread(target=lambda: box.update(
        group=StatelessGroup(LOCAL_HOST, port, 0, 2, torch.device(LEARNER), listen=sock)))
    thread.start()
    engine.join_sync(LOCAL_HOST, port, world_size=2, rank=1)
    thread.join()
    return NcclSender(box["group"], spec)


def open_session(shape: str, *, max_num_seqs: int = 512, max_model_len: int = 1024,
                 gpu_memory_utilization: float = 0.85, max_loras: int = 2, lora_b_std: float = 0.02,
                 cache_dir: str = "", lora_mode: str = "slot", async_scheduling: bool | None = None,
                 trace_dir: str = "", compile_kw: dict | None = None, one_gpu: bool = False) -> Session:
    from colocate.config import load_config
    from colocate.engine.model_dir import ensure_model_dir
    from colocate.engine.vllm import VLLMEngine, lora_spec_for
    from colocate.engine.vllm_settings import VLLMSettings
    from colocate.learner.fsdp import LoraGather
    if torch.device(LEARNER).type == "cuda" and torch.cuda.device_count() < 2 and not one_gpu:
        raise SystemExit("the vLLM session needs 2 GPUs (learner on cuda:0, engine on GPU 1; --one-gpu: both "
                         "on cuda:0) and vllm")
    cache_dir = cache_dir or os.path.join(tempfile.gettempdir(), "colocate-models")
    cfg = load_config(None, {"model": {"shape": SHAPES[shape], "dtype": "bfloat16", "cache_dir": cache_dir},
                             "lora": {"rank": 16, "alpha": 32.0}, "env": {"name": "diplomacy"}})
    figures = {}
    t0 = time.perf_counter()
    tokenizer = embedded_tokenizer(cfg)
    policy = learner_policy(cfg, tokenizer, lora_b_std)
    spec = lora_spec_for(cfg, tokenizer)
    model_dir = ensure_model_dir(cfg, tokenizer, LEARNER, is_writer=True)
    figures["setup/policy_and_model_dir_s"] = time.perf_counter() - t0
    log(f"{shape}: policy on {LEARNER}, model dir {model_dir} ({figures['setup/policy_and_model_dir_s']:.0f}s)")
    settings = VLLMSettings(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                            gpu_memory_utilization=gpu_memory_utilization, lora_rank=cfg.lora.rank,
                            lora_alpha=cfg.lora.alpha, max_loras=max_loras, lora_mode=lora_mode,
                            async_scheduling=async_scheduling, profile_dir=trace_dir, profile_steps=TRACE_STEPS,
                            **(compile_kw or {}))
    engine = VLLMEngine(model_dir, spec, tokenizer.eos_token_id, settings, gpu=0 if one_gpu else 1)
    figures["engine/startup_s"] = engine.startup_s
    log(f"{shape}: engine up in {engine.startup_s:.0f}s, slot {engine.slot_info}")
    sender = LocalIpcSender(engine, spec, LEARNER) if one_gpu else connect_sender(engine, spec)
    session = Session(shape, cfg, tokenizer, policy, spec, engine, sender, model_dir, figures,
                      gather=LoraGather(policy))
    if session.gather.spec != spec:
        raise RuntimeError("the policy's adapter layout differs from the engine's LoraSpec")
    session.push()  # version 0 = the learner's initial adapter (non-zero B)
    return session


# ---------------------------------------------------------------------------------- entry

def run_parts(s: Session, parts: dict[str, Part], figures: dict, deadline: float) -> None:
    """Each part in order into `figures`; a part past the deadline is skipped, a failing one
    leaves its error and the next runs."""
    partial = os.environ.get("COLOCATE_PARTIAL_JSON", "")  # figures so far, rewritten after each part
    for name, part in parts.items():
        if partial:
            write_atomic(partial, {"shape": s.shape, "figures": figures})
        if time.time() > deadline:
            figures[f"{name}/skipped"] = "budget"
            continue
        try:
            figures.update(part(s, deadline))
            log(f"{s.shape}: {name} done")
        except Exception as exc:
            import traceback
            traceback.print_exc()
            figures[f"{name}/error"] = f"{type(exc).__name__}: {exc}"[:500]


def run_session(shape: str, parts: dict[str, Part], *, budget_s: float = 480.0, num_seqs: int = 512,
                lora_mode: str = "slot", async_scheduling: bool | None = None, trace: Part | None = None,
                trace_dir: str = "", compile_kw: dict | None = None, one_gpu: bool = False) -> dict:
    """Open one engine for `shape`, run `parts` in their order (of priority), then `trace` when
    `trace_dir` is set (last: vLLM's engine stays slower after its profiler window)."""
    deadline = time.time() + budget_s
    # merged keeps a copy of the adapted base weights; one GPU also holds the learner's policy
    share = (0.85 if lora_mode == "slot" else 0.75) - (0.4 if one_gpu else 0.0)
    s = open_session(shape, max_num_seqs=max(num_seqs, 64), lora_mode=lora_mode, gpu_memory_utilization=share,
                     async_scheduling=async_scheduling, trace_dir=trace_dir, compile_kw=compile_kw, one_gpu=one_gpu)
    figures = dict(s.figures)
    figures["engine/compilation"] = dict(compile_kw or {})
    figures["engine/lora_mode"] = lora_mode
    # the precision the parity part's gap is the engine's at
    figures["engine/quantization"] = (compile_kw or {}).get("quantization", EngineConfig.quantization)
    figures["engine/async_scheduling"] = "vllm default" if async_scheduling is None else async_scheduling
    run_parts(s, parts, figures, deadline)
    if trace_dir and trace is not None:
        try:
            figures.update(trace(s, deadline))
        except Exception as exc:  # noqa: BLE001 - keep the parts' figures
            figures["sync/trace_error"] = f"{type(exc).__name__}: {exc}"[:500]
    figures["engine/stats"] = dict(s.engine.counters)
    if os.environ.get("COLOCATE_PARTIAL_JSON"):
        write_atomic(os.environ["COLOCATE_PARTIAL_JSON"], {"shape": shape, "figures": figures})
    s.engine.shutdown()
    return figures


# -- the `sync` and `rollout` profiles share one session and one argument list --------------------
def add_session_args(parser, *, others: str) -> None:
    from colocate.config_schema import CONSTRAINT_MASKS, CUDAGRAPH_MODES, QUANTIZATIONS
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
    parser.add_argument("--cudagraph-mode", default="", choices=CUDAGRAPH_MODES,
                        help="engine.cudagraph_mode (default: vLLM's FULL_AND_PIECEWISE)")
    parser.add_argument("--max-capture-tokens", type=int, default=2048,
                        help="engine.max_capture_tokens: largest step replayed from a CUDA graph (0: decode sizes only)")
    parser.add_argument("--constraint-masks", default=EngineConfig.constraint_masks, choices=CONSTRAINT_MASKS,
                        help="engine.constraint_masks: our automata on the GPU or vLLM's grammars")
    parser.add_argument("--quantization", default=EngineConfig.quantization, choices=QUANTIZATIONS,
                        help="engine.quantization: fp8 samples from vLLM's online FP8 of the base weights (merged: "
                             "requantized at each update)")
    parser.add_argument("--one-gpu", action="store_true",
                        help="the engine shares cuda:0 with the learner; the adapter goes by CUDA IPC")
    parser.add_argument("--trace-dir", default="",
                        help="sync profile: after the parts, trace vLLM's engine core over 5 updates, each with its "
                             "first token, into this folder; the record gets each trace's summary")


def run_profile(args, part: str, parts: dict[str, Part], *, first: bool, trace: Part | None = None) -> dict:
    """Run `part` plus the `--also` parts (of `parts`) in one engine session (`part` first or last)."""
    global LEARNER
    LEARNER = args.learner_device
    shape = "0.5b" if args.quick else args.shape
    also = [p for p in args.also.split(",") if p and p != part]
    unknown = sorted(set(also) - set(parts))
    if unknown:  # the sync profile runs every part
        raise SystemExit(f"--also {','.join(unknown)}: --profile {part} runs only {', '.join(parts)}")
    if args.trace_dir and trace is None:
        raise SystemExit(f"--trace-dir: --profile {part} does not trace (the sync profile does)")
    order = [part] + also if first else also + [part]
    figures = run_session(shape, {name: parts[name] for name in order}, budget_s=args.budget_s,
                          num_seqs=args.num_seqs, lora_mode=args.lora_mode,
                          async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
                          trace=trace, trace_dir=args.trace_dir,
                          compile_kw={"cudagraph_mode": args.cudagraph_mode,
                                      "max_capture_tokens": args.max_capture_tokens,
                                      "constraint_masks": args.constraint_masks, "quantization": args.quantization},
                          one_gpu=args.one_gpu)
    return split(figures)


def split(figures: dict) -> dict:
    """figures / baseline / ratios for the benchmark record (baselines: disk, vLLM alone, HF)."""
    ratios = {k: v for k, v in figures.items() if "speedup" in k or "_vs_" in k}
    baseline = {k: v for k, v in figures.items() if k not in ratios
                and any(t in k for t in ("disk_", "vllm_alone", "hf_generate", "vllm_unconstrained"))}
    rest = {k: v for k, v in figures.items() if k not in baseline and k not in ratios}
    return {"figures": rest, "baseline": baseline, "ratios": ratios}
