"""Tokenizer and base model construction, shared by the engine and the learner.

Nothing is downloaded. With `model.path` set, the tokenizer and weights come from that local HF
directory. Otherwise the embedded default is built once and cached under `model.cache_dir`:
  * a byte-level BPE tokenizer trained with `tokenizers` on the environment's own text;
  * a Qwen2-architecture model at a named shape with random weights from `model.seed`
    (`tiny` for CPU runs; `qwen2.5-0.5b` / `qwen2.5-7b` shapes for GPU benchmarks).
Every rank builds the identical model from the seed, so no weights cross the wire at start-up.
"""
from __future__ import annotations

import hashlib
import json
import os

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
}


def _atomic_dir_write(path: str, write) -> None:
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
    _atomic_dir_write(path, lambda d: train_tokenizer(corpus_fn()).save_pretrained(d))
    return PreTrainedTokenizerFast.from_pretrained(path)


def model_config(shape: str, vocab_size: int, dtype: str):
    from transformers import Qwen2Config
    kw = dict(SHAPES[shape])
    kw.setdefault("vocab_size", vocab_size)
    kw.setdefault("tie_word_embeddings", False)
    return Qwen2Config(**kw, rms_norm_eps=1e-6, rope_theta=10000.0, torch_dtype=dtype,
                       pad_token_id=0, eos_token_id=1, bos_token_id=None, attn_implementation="sdpa")


def build_model(model_cfg, tokenizer, device: str | torch.device = "cpu"):
    """The frozen base model: local weights, or random at `model.shape` (identical on every rank)."""
    from transformers import AutoModelForCausalLM
    dtype = getattr(torch, model_cfg.dtype)
    if model_cfg.path:
        model = AutoModelForCausalLM.from_pretrained(model_cfg.path, dtype=dtype, attn_implementation="sdpa")
        return model.to(device)
    cfg = model_config(model_cfg.shape, len(tokenizer), model_cfg.dtype)
    if cfg.vocab_size < len(tokenizer):
        raise ValueError(f"shape {model_cfg.shape} vocab {cfg.vocab_size} < tokenizer {len(tokenizer)}")
    cfg.pad_token_id, cfg.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(model_cfg.seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model


def add_lora(model, lora_cfg):
    """Wrap with a peft LoRA adapter; only adapter parameters require grad."""
    from peft import LoraConfig, get_peft_model
    pcfg = LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                      target_modules=list(lora_cfg.target_modules), bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, pcfg)


def lora_state(model) -> dict[str, torch.Tensor]:
    """Adapter tensors by canonical name (sorted), the unit of sync and checkpoints."""
    return {n: p for n, p in sorted(model.named_parameters()) if "lora_" in n}


def save_tiny_model(dir_path: str, model, tokenizer) -> None:
    """Write an HF model directory (used by tests of the `model.path` loading path)."""
    model.save_pretrained(dir_path, is_main_process=True)
    tokenizer.save_pretrained(dir_path)
    with open(os.path.join(dir_path, "colocate.json"), "w") as f:
        json.dump({"built_by": "colocate.models.save_tiny_model"}, f)
