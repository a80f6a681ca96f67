"""The base-model directory a vLLM engine loads: a local `model.path`, or the random base model at a
named shape, written once by inference rank 0 under `model.cache_dir` (keyed by shape, dtype, seed
and tokenizer) with exactly the weights the learner builds. Other ranks wait for it to appear."""
from __future__ import annotations

import os
import time

import torch


MODEL_DIR_VERSION = "2"  # bump when what `save_model_dir` writes changes (2: heads saved as the learner has them)


def model_dir_key(cfg, tokenizer) -> str:
    import hashlib
    vocab = sorted(tokenizer.get_vocab().items())
    digest = hashlib.sha1(repr(vocab).encode()).hexdigest()[:10]
    return f"model-v{MODEL_DIR_VERSION}-{cfg.model.shape}-{cfg.model.dtype}-seed{cfg.model.seed}-tok{digest}"


def save_model_dir(path: str, model, tokenizer) -> None:
    """Write an HF directory vLLM can load. `is_main_process=True` because under torch.distributed
    `save_pretrained` otherwise writes the weights only on global rank 0, and the writer here is
    inference rank 0 (vLLM then refused a folder holding only the tokenizer).

    It must hold the weights the learner holds. A model whose config says "tied" but whose lm_head
    is its own tensor would lose lm_head on save, and vLLM would tie it back to the embeddings,
    sampling from another model than the learner trains (seen: 0.7 nats apart, before
    `models.materialize` learned to restore ties). So a head that is not actually tied is saved,
    and declared, untied."""
    config = model.config
    if getattr(config, "tie_word_embeddings", False) and \
            model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        config.tie_word_embeddings = False
    from colocate.models import atomic_dir_write

    def write(tmp: str) -> None:
        model.save_pretrained(tmp, is_main_process=True)
        tokenizer.save_pretrained(tmp)
    atomic_dir_write(path, write)


def ensure_model_dir(cfg, tokenizer, device, *, is_writer: bool, timeout_s: float = 1800.0) -> str:
    """`model.path`, or the random base model written once under `model.cache_dir`.

    The writer builds the weights exactly as the learner does (`build_model`: same seed, same
    device type, so the same numbers) and frees them; other ranks wait for the directory.
    """
    if cfg.model.path:
        return cfg.model.path
    path = os.path.abspath(os.path.join(cfg.model.cache_dir, model_dir_key(cfg, tokenizer)))
    if not os.path.exists(path) and is_writer:
        from colocate.models import build_model
        model = build_model(cfg.model, tokenizer, device)
        save_model_dir(path, model, tokenizer)
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    deadline = time.time() + timeout_s
    while not os.path.exists(path):
        if time.time() > deadline:
            raise TimeoutError(f"model directory {path} did not appear (written by inference rank 0)")
        time.sleep(1.0)
    return path
