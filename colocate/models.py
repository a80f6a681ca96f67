"""Tokenizer and base model construction, shared by the engine and the learner.

Nothing is downloaded. With `model.path` set, the tokenizer and weights come from that local HF
directory. Otherwise the embedded default is built once and cached under `model.cache_dir`:
  * a byte-level BPE tokenizer trained with `tokenizers` on the environment's own text;
  * a Qwen2-architecture model at a named shape with random weights from `model.seed`
    (`tiny` for CPU runs; `qwen2.5-0.5b` / `qwen2.5-7b` shapes for GPU benchmarks; `qwen2.5-14b` /
    `qwen2.5-32b` for the memory plan of bigger models).
Every rank builds the identical model from the seed, so no weights cross the wire at start-up.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import warnings

import torch

SPECIAL_TOKENS = ["<pad>", "<eos>"]
TOKENIZER_VERSION = "2"  # bump when the training recipe changes (invalidates cached tokenizers)
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# Named shapes (Qwen2.5 configs) for random-init benchmarks; vocab is the tokenizer's unless real.
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048,
                 initializer_range=0.1),  # wider than Qwen's 0.02 so a frozen lm_head can express confident answers
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, max_position_embeddings=32768, vocab_size=151936,
                         tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, max_position_embeddings=32768, vocab_size=152064,
                       tie_word_embeddings=False),
    # For the memory plan, ahead of tensor-parallel engines (docs/design.md): a 32B engine does not fit
    # one 80 GB card in merged mode, and in slot mode its 61 GiB of weights alone take
    # engine.gpu_memory_utilization 0.78 of it.
    "qwen2.5-14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                        num_key_value_heads=8, max_position_embeddings=32768, vocab_size=152064,
                        tie_word_embeddings=False),
    "qwen2.5-32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                        num_key_value_heads=8, max_position_embeddings=32768, vocab_size=152064,
                        tie_word_embeddings=False),
}


def atomic_dir_write(path: str, write) -> None:
    """Build into a temp dir and rename, so concurrent ranks never see a half-written cache."""
    if os.path.exists(path):
        return
    tmp = f"{path}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    write(tmp)
    try:
        os.rename(tmp, path)
    except OSError:  # another rank won the race; its copy is identical
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)


def train_tokenizer(texts: list[str], vocab_size: int = 512):
    """Byte-level BPE trained on `texts`, wrapped as a transformers fast tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Qwen2's own normalizer and pre-tokenizer: AutoTokenizer (and vLLM) rebuild a saved tiny model's
    # tokenizer as Qwen2Tokenizer from config.json, and must then split text exactly as we did.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def load_tokenizer(model_cfg, corpus_fn, corpus_key: str):
    """The run's tokenizer: from `model.path`, or the embedded one trained on `corpus_fn()` (cached)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    if model_cfg.path:
        tok = AutoTokenizer.from_pretrained(model_cfg.path)
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        return tok
    digest = hashlib.sha1(f"{TOKENIZER_VERSION}:{corpus_key}".encode()).hexdigest()[:10]
    path = os.path.join(model_cfg.cache_dir, f"tokenizer-{digest}")
    atomic_dir_write(path, lambda d: train_tokenizer(corpus_fn()).save_pretrained(d))
    return PreTrainedTokenizerFast.from_pretrained(path)


def model_context(cfg) -> int:
    """Positions the run's model (and its engine) can hold: the model's `max_position_embeddings`,
    or `engine.max_model_len` when that is set and smaller. Reads only config.json (no weights)."""
    if cfg.model.path:
        from transformers import AutoConfig
        context = getattr(AutoConfig.from_pretrained(cfg.model.path), "max_position_embeddings", None) or 1 << 30
    else:
        context = SHAPES[cfg.model.shape]["max_position_embeddings"]
    return min(context, cfg.engine.max_model_len) if cfg.engine.max_model_len > 0 else context


def model_config(shape: str, vocab_size: int, dtype: str):
    from transformers import Qwen2Config
    kw = dict(SHAPES[shape])
    kw.setdefault("vocab_size", vocab_size)
    kw.setdefault("tie_word_embeddings", False)
    return Qwen2Config(**kw, rms_norm_eps=1e-6, rope_theta=10000.0, torch_dtype=dtype,
                       pad_token_id=0, eos_token_id=1, bos_token_id=None, attn_implementation="sdpa")


def build_model(model_cfg, tokenizer, device: str | torch.device = "cpu"):
    """The frozen base model: local weights, or random at `model.shape` (identical on every rank).

    Built on the meta device, then `materialize`d on `device`; device "meta" returns it unmaterialized
    (the learner shards it with FSDP2 first, so each rank only keeps its shard)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    dtype = getattr(torch, model_cfg.dtype)
    is_meta = torch.device(device).type == "meta"
    if model_cfg.path and not is_meta:
        model = AutoModelForCausalLM.from_pretrained(model_cfg.path, dtype=dtype, attn_implementation="sdpa")
        return model.to(device)
    if model_cfg.path:
        cfg = AutoConfig.from_pretrained(model_cfg.path, attn_implementation="sdpa")
    else:
        cfg = model_config(model_cfg.shape, len(tokenizer), model_cfg.dtype)
        if cfg.vocab_size < len(tokenizer):
            raise ValueError(f"shape {model_cfg.shape} vocab {cfg.vocab_size} < tokenizer {len(tokenizer)}")
        cfg.pad_token_id, cfg.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    if not is_meta:
        materialize(model, model_cfg, device)
    return model


@contextlib.contextmanager
def quiet_peft_probe():
    """peft's wrapping without its one warning: peft reads transformers' deprecated
    `is_gradient_checkpointing` (a FutureWarning on every rank of every run) to decide what it need
    not do here. Only that warning is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def add_lora(model, lora_cfg):
    """Wrap with a peft LoRA adapter; only adapter parameters require grad."""
    from peft import LoraConfig, get_peft_model
    pcfg = LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                      target_modules=list(lora_cfg.target_modules), bias="none", task_type="CAUSAL_LM")
    with quiet_peft_probe():
        model = get_peft_model(model, pcfg)
    set_fused_lora(model, lora_cfg.fused_epilogue)
    return model


def _fused_lora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """peft `lora.Linear.forward` for one plain adapter, with the LoRA term added by the GEMM:

        peft:  y = base(x) + B(A(x)) * s      mm [T, r] x [r, out], then * s and + : two passes over [T, out]
        here:  y = addmm(base(x), A(x), B^T, alpha=s)   the same sum in the GEMM's epilogue (beta = 1)

    Backward is addmm's: d(base(x)) is the incoming gradient itself and s folds into the two small
    GEMMs, so the [T, out] multiply of peft's backward goes too. Anything else (adapters disabled
    for the reference pass, merged, several or variant adapters, a lora_B bias, extra arguments,
    an adapter in another dtype than the activations, as fp32 adapters without FSDP's mixed
    precision) takes peft's own path."""
    names = self.active_adapters
    name = names[0] if len(names) == 1 else None
    if args or kwargs or self.disable_adapters or self.merged or name not in self.lora_A \
            or name in self.lora_variant or self.lora_B[name].bias is not None \
            or self.lora_A[name].weight.dtype != x.dtype:  # e.g. fp32 adapter on bf16 activations: peft's upcast
        return type(self).forward(self, x, *args, **kwargs)
    lora_a, lora_b = self.lora_A[name], self.lora_B[name]
    result = self.base_layer(x)                                                      # [..., out]
    h = lora_a(self.lora_dropout[name](x))                                           # [..., r]
    out = torch.addmm(result.reshape(-1, result.shape[-1]), h.reshape(-1, h.shape[-1]), lora_b.weight.t(),
                      alpha=self.scaling[name])
    return out.view(result.shape)


def set_fused_lora(model, fused: bool) -> int:
    """Route every peft `lora.Linear` of `model` through `_fused_lora_forward` (or back to peft's
    own forward); returns how many modules. The trainer benchmark's baseline switches it off."""
    import types
    from peft.tuners.lora import Linear as LoraLinear
    count = 0
    for module in model.modules():
        if type(module) is LoraLinear:  # subclasses (quantized, DoRA hosts) keep peft's forward
            if fused:
                module.forward = types.MethodType(_fused_lora_forward, module)
            else:
                vars(module).pop("forward", None)
            count += 1
    return count


def lora_state(model) -> dict[str, torch.Tensor]:
    """Adapter tensors by canonical name (sorted), the unit of sync and checkpoints."""
    return {n: p for n, p in sorted(model.named_parameters()) if "lora_" in n}


# Prefixes that wrappers insert into parameter names (activation checkpointing, FSDP1, torch.compile).
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def canonical_name(name: str) -> str:
    """A parameter name as on the plain (unwrapped) module: what `lora_state` and the sync use."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def hf_key(name: str) -> str:
    """Checkpoint key of a base parameter: the canonical name without peft's wrapping."""
    name = canonical_name(name)
    if name.startswith("base_model.model."):
        name = name[len("base_model.model."):]
    return name.replace(".base_layer.", ".")


def _local_rows(param: torch.Tensor) -> tuple[int, int] | None:
    """(start, end) rows of the global tensor this rank holds; None when the tensor is not sharded.

    FSDP2 shards dim 0 with torch.chunk semantics (the last ranks may hold fewer rows, or none)."""
    from torch.distributed.tensor import DTensor, Shard
    if not isinstance(param, DTensor):
        return None
    if len(param.placements) != 1 or param.placements[0] != Shard(0):
        raise ValueError(f"materialize handles FSDP's Shard(0) on a 1-D mesh, got {param.placements}")
    rows, world = param.shape[0], param.device_mesh.size()
    chunk = -(-rows // world)
    start = min(rows, chunk * param.device_mesh.get_local_rank())
    return start, min(rows, start + chunk)


def _initial_value(module: torch.nn.Module, pname: str, name: str, shape: torch.Size, std: float, seed: int,
                   device: torch.device) -> torch.Tensor:
    """The full float32 initial value of one parameter, from a generator seeded by (seed, name) alone,
    so it does not depend on the order of construction, the sharding or the number of ranks."""
    import zlib
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63))
    kind = type(module).__name__
    if pname == "bias" or ".lora_B." in f".{name}":
        return torch.zeros(shape, device=device)
    if ".lora_A." in f".{name}":  # peft's default: kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(fan_in), +)
        bound = 1.0 / shape[1] ** 0.5
        return (torch.rand(shape, generator=gen, device=device) * 2 - 1) * bound
    if kind.endswith("RMSNorm") or kind.endswith("LayerNorm"):
        return torch.ones(shape, device=device)
    if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
        value = torch.randn(shape, generator=gen, device=device) * std
        if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None:
            value[module.padding_idx] = 0
        return value
    raise ValueError(f"no initialization rule for {name} ({kind})")


def materialize(model: torch.nn.Module, model_cfg, device: str | torch.device) -> torch.nn.Module:
    """Give a meta-device model (plain or FSDP2-sharded, peft-wrapped or not) real storage on `device`.

    Base weights come from `model.path` (safetensors, only this rank's rows are read) or from a seeded
    initialization per parameter: every rank, sharded or not, arrives at the same values; each full
    value exists transiently, one parameter at a time. Adapter weights always get peft's default
    initialization, seeded the same way. Non-persistent buffers (rotary frequencies) are recomputed.
    """
    device = torch.device(device)
    # `to_empty` gives each module its own new parameter, which silently unties a tied lm_head
    # (Qwen2.5-0.5B ties it to the embeddings): record the ties and restore them afterwards.
    ties = _shared_parameters(model)
    model.to_empty(device=device)
    for (owner, pname), (src_owner, src_pname) in ties:
        setattr(owner, pname, getattr(src_owner, src_pname))
    std = getattr(getattr(model, "config", None), "initializer_range", 0.02)
    loaded = _checkpoint_reader(model_cfg.path) if model_cfg.path else None
    seen: set[int] = set()
    with torch.no_grad():
        for mod_name, module in model.named_modules():
            for pname, param in module.named_parameters(recurse=False):
                if id(param) in seen:  # tied weights: initialize once
                    continue
                seen.add(id(param))
                name = canonical_name(f"{mod_name}.{pname}" if mod_name else pname)
                rows = _local_rows(param)
                local = param.to_local() if rows is not None else param
                key = hf_key(name)
                if loaded is not None and "lora_" not in name:
                    value = loaded(key, rows)
                else:
                    seed_name = name if "lora_" in name else key
                    value = _initial_value(module, pname, seed_name, param.shape, std, model_cfg.seed, device)
                    value = value[rows[0]:rows[1]] if rows is not None else value
                local.copy_(value.to(local.dtype))
            if type(module).__name__.endswith("RotaryEmbedding"):
                fresh = type(module)(config=module.config)
                for bname, buf in fresh.named_buffers(recurse=False):
                    getattr(module, bname).copy_(buf)
    return model


def _shared_parameters(model: torch.nn.Module) -> list[tuple[tuple, tuple]]:
    """((module, name), (first module, name)) for every parameter that is the same object as one
    registered earlier, e.g. a tied lm_head."""
    first: dict[int, tuple] = {}
    ties = []
    for module in model.modules():
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in first:
                ties.append(((module, pname), first[id(param)]))
            else:
                first[id(param)] = (module, pname)
    return ties


def _checkpoint_reader(path: str):
    """key, rows -> float tensor of an HF safetensors checkpoint (single file or index + shards)."""
    from safetensors import safe_open
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    else:
        single = os.path.join(path, "model.safetensors")
        with safe_open(single, framework="pt") as f:
            files = {k: single for k in f.keys()}

    def read(key: str, rows: tuple[int, int] | None) -> torch.Tensor:
        if key not in files:
            raise KeyError(f"{path}: checkpoint has no tensor {key!r}")
        with safe_open(files[key], framework="pt") as f:
            sl = f.get_slice(key)
            return sl[rows[0]:rows[1]] if rows is not None else sl[:]
    return read


def save_tiny_model(dir_path: str, model, tokenizer) -> None:
    """Write an HF model directory (used by tests of the `model.path` loading path)."""
    model.save_pretrained(dir_path, is_main_process=True)
    tokenizer.save_pretrained(dir_path)
    with open(os.path.join(dir_path, "colocate.json"), "w") as f:
        json.dump({"built_by": "colocate.models.save_tiny_model"}, f)


def build_policy(cfg, tokenizer, device):
    """Base model + LoRA, identical on every rank (per-parameter seeds), adapter version 0.

    Built on the meta device and materialized on `device`; device "meta" leaves that to the learner,
    which shards it with FSDP2 first (`colocate.learner.learner.Learner`)."""
    model = build_model(cfg.model, tokenizer, "meta")
    for p in model.parameters():
        p.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):  # peft draws its (overwritten) init from the global RNG
        model = add_lora(model, cfg.lora)
    if torch.device(device).type != "meta":
        materialize(model, cfg.model, device)
    return model


FINGERPRINT_TENSORS = 3
"""How many base weight matrices the fingerprint samples (the smallest, so a random-weight base
computes them in milliseconds), FINGERPRINT_ROWS rows of each."""
FINGERPRINT_ROWS = 2


def base_identity(model_cfg, vocab_size: int) -> dict:
    """The base model's identity, from what its weights are made of and without building it: its
    parameters' names and shapes (a digest and a count) and a fingerprint of its weights (a BLAKE2b
    of the first rows of a few fixed matrices, read from `model.path`'s safetensors or computed from
    `model.seed` exactly as `materialize` does). Written into an adapter's manifest; `colocate eval`
    and `colocate export` compare it before building anything (`checkpoint.check_base`).
    `vocab_size`: the tokenizer's length (what a random-weight shape's vocabulary follows)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(model_cfg.path) if model_cfg.path else \
        model_config(model_cfg.shape, vocab_size, model_cfg.dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = hashlib.blake2b(digest_size=16)
    params, matrices = 0, []
    for mod_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            key = hf_key(f"{mod_name}.{pname}" if mod_name else pname)
            shapes.update(f"{key}:{tuple(param.shape)};".encode())
            params += param.numel()
            if param.dim() == 2:
                matrices.append((param.numel(), key, module, pname, param.shape))
    read = _checkpoint_reader(model_cfg.path) if model_cfg.path else None
    std = getattr(config, "initializer_range", 0.02)
    weights = hashlib.blake2b(digest_size=16)
    for _, key, module, pname, shape in sorted(matrices, key=lambda m: m[:2])[:FINGERPRINT_TENSORS]:
        rows = (0, min(FINGERPRINT_ROWS, shape[0]))
        value = read(key, rows) if read else _initial_value(module, pname, key, shape, std, model_cfg.seed,
                                                            torch.device("cpu"))[rows[0]:rows[1]]
        weights.update(key.encode() + value.float().contiguous().numpy().tobytes())
    source = model_cfg.path or f"embedded {model_cfg.shape} model, seed {model_cfg.seed}"
    return {"source": source, "parameters": params, "shapes": shapes.hexdigest(), "fingerprint": weights.hexdigest()}
