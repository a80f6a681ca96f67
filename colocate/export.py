"""`colocate export --run DIR [--merge] --out DIR`: a run's final adapter for use elsewhere.

Without `--merge`: the adapter as the run saved it (`<run>/adapter`, peft format:
`adapter_model.safetensors` + `adapter_config.json`, and its `manifest.json`), plus the tokenizer,
for `PeftModel.from_pretrained(base, out)` or vLLM's `LoRARequest("name", 1, out)` over the base
model; `colocate eval --checkpoint out` scores it. With `--merge`: W0 + (alpha / r) B A folded into
the base weights (peft's `merge_and_unload`) and saved as a Hugging Face model directory with its
tokenizer, which `AutoModelForCausalLM.from_pretrained(out)` and `vllm.LLM(model=out)` load with no
adapter at all.

The base model is the run's own (`<run>/config.yaml`: model.path, or the embedded tiny model rebuilt
from its seed). Before anything is written or built, `--out` is checked (a new or empty directory
that can be written) and the adapter verified against its manifest (every file's hash, the base
model's shape and weight fingerprint, the LoRA shapes): bad input is one line and exit code 2.
An adapter without a manifest (older runs) needs `--checkpoint.trust_unverified=true`.
"""
from __future__ import annotations

import os
import shutil
import sys

from colocate.config import ConfigError, load_config

TRUST_FLAG = "--checkpoint.trust_unverified"


def parse_args(argv: list[str]) -> tuple[str, bool, str, bool]:
    """-> (run dir, merge, out dir, trust an adapter without a manifest)."""
    values, merge, trust, it = {"--run": "", "--out": ""}, False, False, iter(argv)
    for arg in it:
        name, sep, value = arg.partition("=")
        if name == "--merge":
            merge = True
        elif name == TRUST_FLAG:
            trust = not sep or value.lower() == "true"
        elif name in values:
            values[name] = value if sep else next(it, "")
        else:
            raise ConfigError(f"cannot parse argument {arg!r}; usage: colocate export --run DIR [--merge] --out DIR")
    if not values["--run"] or not values["--out"]:
        raise ConfigError("colocate export needs --run DIR and --out DIR")
    return values["--run"], merge, values["--out"], trust


def run_parts(run: str) -> tuple[str, str]:
    """(the run's config.yaml, its adapter directory), both checked to exist."""
    config, adapter = os.path.join(run, "config.yaml"), os.path.join(run, "adapter")
    if not os.path.isfile(config):
        raise ConfigError(f"--run {run}: no config.yaml (not a run directory: metrics.run_dir of a run)")
    if not os.path.isfile(os.path.join(adapter, "adapter_model.safetensors")):
        raise ConfigError(f"--run {run}: no adapter/adapter_model.safetensors (the run did not finish; its "
                          "checkpoints/step-* directories hold the adapter in the same format)")
    return config, adapter


def check_out(out: str) -> None:
    """--out: a new or empty directory that can be written (nothing is created here)."""
    from colocate.preflight import check_writable_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out {out} exists and is a file (a directory to write is expected)")
    if os.path.isdir(out) and os.listdir(out):
        raise ConfigError(f"--out {out} exists and is not empty")
    check_writable_dir(f"--out {out}", out)


def export(run: str, merge: bool, out: str, trust_unverified: bool = False) -> str:
    """Write the adapter (or the merged model) and the tokenizer to `out`; -> `out`."""
    from peft import PeftModel

    from colocate.checkpoint import load_adapter
    from colocate.envs import env_corpus
    from colocate.eval import check_adapter
    from colocate.models import build_model, load_tokenizer, quiet_peft_probe
    check_out(out)
    config, adapter_dir = run_parts(run)
    cfg = load_config(config, saved_run=True)
    adapter = load_adapter(adapter_dir, trust_unverified)
    key, corpus_fn = env_corpus(cfg)
    tokenizer = load_tokenizer(cfg.model, corpus_fn, key)
    check_adapter(cfg, adapter, tokenizer)
    if merge:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()  # one file's "Writing model shards" bar: the last line says it all
        with quiet_peft_probe():
            model = PeftModel.from_pretrained(build_model(cfg.model, tokenizer, "cpu"), adapter_dir)
        model.merge_and_unload().save_pretrained(out, safe_serialization=True)
    else:
        shutil.copytree(adapter_dir, out, dirs_exist_ok=True)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str]) -> int:
    from colocate.checkpoint import CheckpointError
    run, merge, out, trust = parse_args(argv)
    try:
        export(run, merge, out, trust)
    except CheckpointError as e:
        print(f"colocate: checkpoint error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"colocate: wrote {'a merged model' if merge else 'the adapter'} to {out}")
    return 0
