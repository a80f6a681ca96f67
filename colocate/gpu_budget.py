"""The memory plan of every rank's GPU, made before any weights load.

Each GPU holds an inference rank (vLLM), a learner rank, or both (one GPU, CUDA IPC). A vLLM engine
takes `engine.gpu_memory_utilization` of its card for its weights (twice over in merged mode: the
adapted copy beside W0; with FP8 weights W0 in e4m3 and an fp32 buffer), CUDA graphs and KV
cache; the rank's own process needs a CUDA context beside it. A learner's peak is its shard of the
base weights (FSDP2 over `num_learners`), the weights FSDP2 holds gathered (the root's embeddings
and head between forward and backward, the block in flight and the one prefetched, the last
block), the adapter with its AdamW state, the activations one micro-batch keeps for backward and
the logits at its completion positions.

The learner figure is a formula from the model's shape, checked against measured peaks
(`profiles/README.md`, "Memory plan"): per token and decoder layer, backward keeps the
bf16 tensors 16h + 4kv + 8i bytes (h hidden, kv the key/value width, i the MLP width: the norms' fp32
inputs and bf16 outputs, q/k/v and the attention output, gate, up, SiLU and their product) without
recomputation; compiled blocks keep `COMPILED_ACTIVATIONS` of that (inductor saves fewer
intermediates); with activation checkpointing each block keeps only its input (2h), and the peak
holds the logits or one block's recomputed activations. Logits are bf16 [tokens, vocab] at most.

`learner.micro_batch_tokens: auto` takes the largest budget, in steps of `AUTO_STEP` tokens, whose
estimate leaves `AUTO_MARGIN` of the card free (fragmentation, NCCL buffers, what the formula
misses); a card this process cannot see (no GPU, no `--gpu-memory`) gets `AUTO_WITHOUT_GPU`. An
explicit budget, or a GPU split, that cannot fit the card is refused in one line naming the key and
the estimate (`colocate check --world-size N --gpu-memory 80GiB` plans a card you do not have).
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from fractions import Fraction

import torch

from colocate.config import Config, ConfigError
from colocate.engine.fp8_merge import fp8_copy_bytes

GIB = 1 << 30
MIB = 1 << 20
CONTEXT_BYTES = 1 * GIB
"""Per process: the CUDA context, cuBLAS workspaces, NCCL's buffers (outside PyTorch's allocator)."""
COMPILED_ACTIVATIONS = 0.8
"""Activations compiled blocks keep against eager ones (measured 0.76-0.79 at 7B, 2 and 4 learners)."""
AUTO_MARGIN = 0.10
"""Fraction of the card `micro_batch_tokens: auto` leaves free beyond the estimate."""
AUTO_STEP = 1024
AUTO_MAX = 65536
AUTO_WITHOUT_GPU = 4096
"""`auto` where no card is known (CPU runs, `colocate check` without `--gpu-memory`): the schema's old default."""
CARDS = {"h100": 81559 * MIB, "h200": 143771 * MIB, "a100-80": 81920 * MIB, "a100-40": 40960 * MIB,
         "l40s": 46068 * MIB, "b200": 183359 * MIB}
"""Named cards for `--gpu-memory`: what NVML reports as the card's total (H100 80GB HBM3: 81,559 MiB)."""


UNITS = {"gib": (GIB, "GiB being 2^30 bytes"), "mib": (MIB, "MiB being 2^20 bytes"), "tib": (1 << 40, "TiB being 2^40 bytes"),
         "gb": (10**9, "GB being 10^9 bytes"), "mb": (10**6, "MB being 10^6 bytes"), "tb": (10**12, "TB being 10^12 bytes")}
"""`--gpu-memory` units: binary (GiB, what NVML and PyTorch report) or decimal (GB, what a card's
name says: an "80GB" H100 holds 79.6 GiB)."""


def gpu_memory_unit(text: str) -> tuple[int, str]:
    """`--gpu-memory TEXT` -> (bytes, how it was read: `80GB = 74.5 GiB, GB being 10^9 bytes`), exactly;
    ConfigError naming the flag otherwise (a number without its unit is refused: GB and GiB differ by 7 %)."""
    key = text.strip().lower()
    if key in CARDS:
        return CARDS[key], f"{text} = {CARDS[key] / GIB:.1f} GiB, {CARDS[key] // MIB:,} MiB"
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]*)", key)
    if not match or match.group(2) not in UNITS:
        raise ConfigError(f"--gpu-memory={text!r}: expected a size with its unit, 80GiB (2^30 bytes) or 80GB (10^9 "
                          f"bytes), 81559MiB, or a card: {', '.join(CARDS)}")
    unit, words = UNITS[match.group(2)]
    total = int(Fraction(match.group(1)) * unit)
    return total, f"{text} = {total / GIB:.1f} GiB, {words}"


def parse_gpu_memory(text: str) -> int:
    """`80GiB`, `80GB`, `81559MiB`, `h100` -> bytes (`gpu_memory_unit`)."""
    return gpu_memory_unit(text)[0]


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of the base model, read once from the (meta-device) model."""
    num_params: int
    root_params: int  # embeddings, final norm, lm_head: outside the decoder blocks
    block_params: int  # one decoder block
    num_layers: int
    hidden: int
    kv: int
    intermediate: int
    vocab: int
    lora_params: int
    dtype_bytes: int

    @staticmethod
    def of(cfg: Config, model) -> "ModelShape":
        c = model.config
        blocks = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n)
        total = sum(p.numel() for p in model.parameters())
        lora = sum(cfg.lora.rank * (m.in_features + m.out_features) for name, m in model.named_modules()
                   if name.rpartition(".")[2] in cfg.lora.target_modules and isinstance(m, torch.nn.Linear))
        kv = c.num_key_value_heads * (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
        dtype_bytes = torch.finfo(getattr(torch, cfg.model.dtype)).bits // 8
        return ModelShape(total, total - blocks, blocks // c.num_hidden_layers, c.num_hidden_layers, c.hidden_size,
                          kv, c.intermediate_size, c.vocab_size, lora, dtype_bytes)


def per_token_bytes(cfg: Config, shape: ModelShape) -> dict[str, float]:
    """Bytes one micro-batch token adds to a learner's peak: activations kept for backward over all
    decoder blocks, and its logits row. With activation checkpointing the blocks keep only their
    inputs, and the peak holds either the logits or one block's recomputed activations."""
    per_layer = 16 * shape.hidden + 4 * shape.kv + 8 * shape.intermediate
    logits = 2 * shape.vocab
    lc = cfg.learner
    if lc.activation_checkpointing:
        return {"activations": 2 * shape.hidden * shape.num_layers, "logits": max(logits, per_layer)}
    return {"activations": per_layer * shape.num_layers * (COMPILED_ACTIVATIONS if lc.compile else 1.0),
            "logits": logits}


def learner_parts(cfg: Config, shape: ModelShape, num_learners: int, tokens: int) -> dict[str, int]:
    """A learner rank's peak by part (bytes) at a micro-batch budget of `tokens`."""
    weight = shape.dtype_bytes
    gathered_blocks = shape.num_layers if not cfg.learner.reshard_after_forward else 3  # in flight, prefetched, last
    shards = num_learners if cfg.learner.fsdp else 1
    per_token = per_token_bytes(cfg, shape)
    return {
        "weights": shape.num_params * weight // shards,
        "gathered": (shape.root_params + gathered_blocks * shape.block_params) * weight if cfg.learner.fsdp else 0,
        "adapter+AdamW": shape.lora_params * 16 // shards + shape.lora_params * 4,
        "activations": int(tokens * per_token["activations"]),
        "logits": int(tokens * per_token["logits"]),
        "context": CONTEXT_BYTES,
    }


def vllm_weight_bytes(cfg: Config, shape: ModelShape) -> int:
    """The weights vLLM loads (one copy): with engine.quantization fp8 the decoder blocks in one byte
    a parameter (their norms too: a few KiB counted short), embeddings and LM head in the model's
    dtype."""
    blocks = shape.block_params * shape.num_layers
    block_bytes = 1 if cfg.engine.quantization == "fp8" else shape.dtype_bytes
    return (shape.num_params - blocks) * shape.dtype_bytes + blocks * block_bytes


def merged_copy_bytes(cfg: Config, shape: ModelShape) -> int:
    """What lora_mode merged keeps beside vLLM's weights (0 in slot mode), planned from the shape
    before launch (the engine's build counts it again from the adapter's own shapes,
    `engine.vllm_settings.merged_copy_bytes`): W0 of the decoder blocks, the most any target list
    adapts (embeddings and LM head are never copied), in the model's dtype; with fp8 in e4m3, one
    byte a parameter, and the fp32 scratch the largest fused weight is requantized in: gate_up
    (2 x intermediate x hidden) or qkv (q taken as wide as the hidden size), `engine/fp8_merge.py`."""
    if cfg.engine.lora_mode != "merged":
        return 0
    blocks = shape.block_params * shape.num_layers
    if cfg.engine.quantization != "fp8":
        return blocks * shape.dtype_bytes
    return fp8_copy_bytes(blocks, shape.hidden * max(2 * shape.intermediate, shape.hidden + 2 * shape.kv))


def engine_parts(cfg: Config, shape: ModelShape, total: int) -> dict[str, int]:
    """An inference rank's use of its card: vLLM's pool, of which its weights (`vllm_weight_bytes`
    and merged mode's copy, `merged_copy_bytes`), and the rank's own process."""
    own = vllm_weight_bytes(cfg, shape)
    copy = merged_copy_bytes(cfg, shape)
    parts = {"vLLM": int(cfg.engine.gpu_memory_utilization * total), "of which weights": own + copy,
             "context": CONTEXT_BYTES}
    if copy:
        parts["of which the merged copy"] = copy
    return parts


@dataclass(frozen=True)
class GpuPlan:
    """One GPU of one node: the ranks on it and each one's estimate."""
    gpu: tuple[int, int]  # (node, index)
    ranks: tuple[int, ...]
    roles: tuple[str, ...]
    parts: tuple[dict, ...]
    micro_batch_tokens: int
    """The learners' packing budget the plan is for (`auto` resolved)."""

    def used(self) -> int:
        return sum(rank_estimate(p) for p in self.parts)


def rank_estimate(parts: dict) -> int:
    return sum(v for k, v in parts.items() if not k.startswith("of which"))


def ranks_by_gpu(devices: list[tuple[int, int]]) -> dict[tuple[int, int], list[int]]:
    """{(node, index): the ranks on that GPU}, in GPU order."""
    by_gpu: dict[tuple[int, int], list[int]] = {}
    for rank, gpu in enumerate(devices):
        by_gpu.setdefault(gpu, []).append(rank)
    return dict(sorted(by_gpu.items()))


def fit_tokens(cfg: Config, shape: ModelShape, num_learners: int, room: int) -> int:
    """The largest budget (a multiple of AUTO_STEP, at most AUTO_MAX) whose learner estimate fits `room`; 0: none."""
    fixed = rank_estimate(learner_parts(cfg, shape, num_learners, 0))
    per_token = sum(per_token_bytes(cfg, shape).values())
    tokens = int((room - fixed) // per_token) // AUTO_STEP * AUTO_STEP
    return max(0, min(AUTO_MAX, tokens))


def learner_rooms(cfg: Config, shape: ModelShape, roles: list[str], devices: list[tuple[int, int]],
                  total: int) -> list[int]:
    """What each learner may use, per GPU that holds learners: the card less `AUTO_MARGIN`, less the
    engines' parts on it, shared by the learners on it."""
    rooms = []
    for ranks in ranks_by_gpu(devices).values():
        on_gpu = [roles[r] for r in ranks]
        if "learner" in on_gpu:
            engines = on_gpu.count("inference") * rank_estimate(engine_parts(cfg, shape, total))
            rooms.append(int((total * (1 - AUTO_MARGIN) - engines) // on_gpu.count("learner")))
    return rooms


def resolve_micro_batch_tokens(cfg: Config, shape: ModelShape | None, roles: list[str],
                               devices: list[tuple[int, int]] | None, total: int | None) -> tuple[int, str | None]:
    """`learner.micro_batch_tokens` as an integer (`auto`: the largest budget every learner's GPU
    holds) and the line saying what `auto` chose (None when it was set); `cfg` is left as it is."""
    if cfg.learner.micro_batch_tokens != "auto":
        return cfg.learner.micro_batch_tokens, None
    if total is None or shape is None or devices is None:
        return AUTO_WITHOUT_GPU, f"learner.micro_batch_tokens auto -> {AUTO_WITHOUT_GPU} (no GPU to plan for)"
    num_learners = roles.count("learner")
    tokens = min(fit_tokens(cfg, shape, num_learners, room) for room in learner_rooms(cfg, shape, roles, devices, total))
    if tokens < AUTO_STEP:
        fixed = rank_estimate(learner_parts(cfg, shape, num_learners, 0))
        raise ConfigError(f"learner.micro_batch_tokens=auto: no budget fits: a learner needs ~{fixed / GIB:.1f} GiB "
                          f"before activations, beside what shares its {total / GIB:.1f} GiB card ({AUTO_MARGIN:.0%} "
                          "kept free); add learners (topology.num_learners), set learner.activation_checkpointing=true "
                          "or lower engine.gpu_memory_utilization")
    est = rank_estimate(learner_parts(cfg, shape, num_learners, tokens))
    return tokens, (f"learner.micro_batch_tokens auto -> {tokens} (learner ~{est / GIB:.1f} GiB of "
                    f"{total / GIB:.1f} GiB, {AUTO_MARGIN:.0%} of the card kept free)")


def plan_gpus(cfg: Config, shape: ModelShape, roles: list[str], devices: list[tuple[int, int]],
              total: int, tokens: int) -> list[GpuPlan]:
    """Every GPU's ranks and their estimates, the learners at `tokens` (micro_batch_tokens resolved)."""
    num_learners = roles.count("learner")
    plans = []
    for gpu, ranks in ranks_by_gpu(devices).items():
        parts = tuple(engine_parts(cfg, shape, total) if roles[r] == "inference" else
                      learner_parts(cfg, shape, num_learners, tokens) for r in ranks)
        plans.append(GpuPlan(gpu, tuple(ranks), tuple(roles[r] for r in ranks), parts, tokens))
    return plans


def check_plan(cfg: Config, plans: list[GpuPlan], total: int) -> None:
    """ConfigError (one line: the key, the estimate, the card) where a GPU cannot hold its ranks."""
    check_shared_engines(cfg, plans)
    for plan in plans:
        for role, parts in zip(plan.roles, plan.parts):
            if role == "inference" and parts["vLLM"] < parts["of which weights"] + CONTEXT_BYTES:
                raise ConfigError(
                    f"engine.gpu_memory_utilization={cfg.engine.gpu_memory_utilization} gives vLLM "
                    f"{parts['vLLM'] / GIB:.1f} GiB of a {total / GIB:.1f} GiB card, less than its weights "
                    f"({parts['of which weights'] / GIB:.1f} GiB, engine.lora_mode={cfg.engine.lora_mode}"
                    f"{', engine.quantization=fp8' if cfg.engine.quantization == 'fp8' else ''}) plus room "
                    f"for a KV cache; {engine_remedy(cfg, parts, total)}")
        if plan.used() > total:
            raise ConfigError(f"GPU {plan.gpu[1]} (ranks {', '.join(map(str, plan.ranks))}) cannot hold "
                              f"{describe(cfg, plan)}: ~{plan.used() / GIB:.1f} GiB of {total / GIB:.1f} GiB; "
                              f"{remedy(cfg, plan)}")


def check_shared_engines(cfg: Config, plans: list[GpuPlan]) -> None:
    """ConfigError where engines that share a GPU would each size their memory from what the GPU has
    free while they start (`EngineEntry.sizes_from_free_memory`: vLLM's start-up profile without
    `engine.kv_cache_gib`): they start together, and each would count the others' memory as its own."""
    from colocate.engine.table import ENGINES, on_device, resolve_kind
    if not ENGINES[resolve_kind(cfg.engine.kind, on_device("cuda"))].sizes_from_free_memory(cfg):
        return
    for plan in plans:
        engines = [r for r, role in zip(plan.ranks, plan.roles) if role == "inference"]
        if len(engines) > 1:
            raise ConfigError(f"ranks {', '.join(map(str, engines))} are {len(engines)} engines on GPU {plan.gpu[1]}: "
                              "they start together, and vLLM's start-up memory profile would count the others' memory "
                              "as its own; set engine.kv_cache_gib (a fixed KV cache per engine, no profile)")


def engine_remedy(cfg: Config, parts: dict, total: int) -> str:
    """What frees an engine whose weights (`engine_parts`) its share of the card cannot hold."""
    weights, copy = parts["of which weights"], parts.get("of which the merged copy", 0)
    if weights + CONTEXT_BYTES < total:
        return "raise it" + (", or use engine.lora_mode=slot" if copy else "")
    if copy and weights - copy + CONTEXT_BYTES < total:
        return "no share of one card holds them: use engine.lora_mode=slot (one copy of the weights)"
    return "no share of one card holds them: the model needs a tensor-parallel engine, not built yet"


def remedy(cfg: Config, plan: GpuPlan) -> str:
    if "learner" not in plan.roles:
        return "lower engine.gpu_memory_utilization"
    fixes = [f"lower learner.micro_batch_tokens ({plan.micro_batch_tokens}) or set it to auto"]
    if not cfg.learner.activation_checkpointing:
        fixes.append("set learner.activation_checkpointing=true")
    if "inference" in plan.roles:
        fixes.append("lower engine.gpu_memory_utilization")
    return ", ".join(fixes[:-1]) + (" or " if len(fixes) > 1 else "") + fixes[-1]


def merged_words(cfg: Config, parts: dict) -> str:
    """How an engine's weights split in merged mode ("" otherwise), after their figure."""
    weights, copy = parts["of which weights"], parts.get("of which the merged copy", 0)
    if not copy:
        return ""
    what = ("W0 in e4m3 with the fp32 buffer the merge is requantized in (engine.lora_mode=merged, "
            "engine.quantization=fp8)" if cfg.engine.quantization == "fp8"
            else "the decoder blocks' W0 (engine.lora_mode=merged)")
    return f" = {(weights - copy) / GIB:.1f} + {copy / GIB:.1f}, vLLM's and {what}"


def describe(cfg: Config, plan: GpuPlan) -> str:
    words = []
    for role, parts in zip(plan.roles, plan.parts):
        body = ", ".join(f"{k} {v / GIB:.1f}" + (merged_words(cfg, parts) if k == "of which weights" else "")
                         for k, v in parts.items() if k != "of which the merged copy")
        if role == "learner":
            words.append(f"a learner at {plan.micro_batch_tokens} tokens ({body})")
        else:
            words.append(f"an engine at engine.gpu_memory_utilization={cfg.engine.gpu_memory_utilization} ({body})")
    return " and ".join(words)


def plan_lines(cfg: Config, plans: list[GpuPlan], total: int, card: str) -> list[str]:
    """The plan as printed at start: one line per distinct GPU layout (roles and estimates)."""
    seen: dict[str, list[int]] = {}
    for plan in plans:
        text = describe(cfg, plan) + f": ~{plan.used() / GIB:.1f} GiB, {(total - plan.used()) / GIB:.1f} to spare"
        seen.setdefault(text, []).extend(plan.ranks)
    return [f"colocate: memory plan ({card}): ranks {', '.join(map(str, ranks))}: {text}" for text, ranks in seen.items()]


def gpu_total_bytes(index: int = 0) -> int | None:
    """The card's memory from NVML; None when NVML is unavailable (the plan is skipped, not the run)."""
    from colocate.nvml import memory
    figures = memory(index)
    return figures[0] if figures else None


@dataclass(frozen=True)
class Card:
    """The GPUs a plan is for: each one's bytes, how many a node has, and what to call them."""
    total: int
    per_node: int
    name: str


@dataclass(frozen=True)
class MemoryPlan:
    """What the plan says: the lines printed at start, and each rank's estimate in GiB (by global
    rank as a string; empty without a card), which the run keeps beside the measured peaks, and the
    learners' packing budget (`learner.micro_batch_tokens`, `auto` resolved: the run takes it from here)."""
    lines: list[str]
    estimates_gib: dict[str, float]
    micro_batch_tokens: int


def plan_memory(cfg: Config, model, roles: list[str], devices: list[tuple[int, int]] | None,
                card: Card | None) -> MemoryPlan:
    """Resolve `micro_batch_tokens: auto` (into the plan, not `cfg`), then plan and check every GPU.
    `devices` None or `card` None: CPU ranks (only `auto` is resolved)."""
    if card is None or devices is None:
        tokens, line = resolve_micro_batch_tokens(cfg, None, roles, None, None)
        return MemoryPlan([f"colocate: {line}"] if line else [], {}, tokens)
    shape = ModelShape.of(cfg, model)
    tokens, line = resolve_micro_batch_tokens(cfg, shape, roles, devices, card.total)
    plans = plan_gpus(cfg, shape, roles, devices, card.total, tokens)
    check_plan(cfg, plans, card.total)
    estimates = {str(r): round(rank_estimate(p) / GIB, 2) for plan in plans for r, p in zip(plan.ranks, plan.parts)}
    lines = ([f"colocate: {line}"] if line else []) + plan_lines(cfg, plans, card.total, card.name)
    return MemoryPlan(lines + kv_cache_lines(cfg, shape, plans), estimates, tokens)


def kv_cache_lines(cfg: Config, shape: ModelShape, plans: list[GpuPlan]) -> list[str]:
    """What vLLM's pool leaves for its KV cache once the weights are in (its activations and CUDA
    graphs come out of the same room), in tokens and in sequences of the engine's real max_model_len."""
    from colocate.engine.vllm_settings import engine_max_model_len
    from colocate.envs import env_facts
    engines = [parts for plan in plans for role, parts in zip(plan.roles, plan.parts) if role == "inference"]
    if not engines:
        return []
    per_token = 2 * shape.num_layers * shape.kv * shape.dtype_bytes  # a key and a value per layer
    length = engine_max_model_len(cfg, env_facts(cfg)["prompt_bound"])
    if cfg.engine.kv_cache_gib > 0:  # fixed: vLLM does not size it from its share
        room = int(cfg.engine.kv_cache_gib * GIB)
        size = f"is {room / GIB:.1f} GiB (engine.kv_cache_gib)"
    else:
        room = engines[0]["vLLM"] - engines[0]["of which weights"]
        size = (f"gets at most {room / GIB:.1f} GiB (vLLM's share less its weights; its activations and CUDA graphs "
                "come out of it too)")
    tokens = room // per_token
    return [f"colocate: memory plan: each engine's KV cache {size}: ~{tokens:,} tokens at "
            f"{per_token // 1024} KiB a token, {tokens // length:,} sequences of max_model_len={length}"]


def host_memory_bytes() -> int | None:
    """This host's physical memory (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def model_name(cfg: Config) -> str:
    """The key that names the run's model, as a message shows it."""
    return f"model.path={cfg.model.path!r}" if cfg.model.path else f"model.shape={cfg.model.shape}"


def check_host_memory(cfg: Config, model, roles: list[str], local_world: int, total: int) -> None:
    """Ranks on CPUs hold their weights in the host's memory: an engine (engine.kind=hf) the whole
    model, a learner its FSDP2 shard, the weights it gathers and the adapter with AdamW. Their sum
    over the busiest node, before any activation, beyond the host's `total` bytes is refused: the
    out-of-memory killer would end a rank mid-start (a lower bound, so never a false refusal)."""
    shape = ModelShape.of(cfg, model)
    engine = shape.num_params * shape.dtype_bytes
    learner = rank_estimate(learner_parts(cfg, shape, roles.count("learner"), 0)) - CONTEXT_BYTES
    nodes = [roles[i:i + local_world] for i in range(0, len(roles), local_world)]
    need, node = max((r.count("inference") * engine + r.count("learner") * learner, r) for r in nodes)
    if need > total:
        raise ConfigError(f"{len(node)} CPU processes would hold at least {need / GIB:.1f} GiB of weights "
                          f"({node.count('inference')} engines x {engine / GIB:.1f} GiB, {node.count('learner')} "
                          f"learners x {learner / GIB:.1f} GiB of {model_name(cfg)}), more than this host's {total / GIB:.1f} GiB: the out-of-memory killer "
                          "would end them; run on GPUs or with a smaller model")


def print_plan(lines: list[str]) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        for line in lines:
            print(line, file=sys.stderr, flush=True)
