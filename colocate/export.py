"""`colocate export --run DIR [--merge] --out DIR`: a run's final adapter for use elsewhere.

Without `--merge`: the adapter as the run saved it (`<run>/adapter`, peft format:
`adapter_model.safetensors` + `adapter_config.json`), plus the tokenizer, for
`PeftModel.from_pretrained(base, out)` or vLLM's `LoRARequest("name", 1, out)` over the base model.
With `--merge`: W0 + (alpha / r) B A folded into the base weights (peft's `merge_and_unload`) and
saved as a Hugging Face model directory with its tokenizer, which `AutoModelForCausalLM
.from_pretrained(out)` and `vllm.LLM(model=out)` load with no adapter at all.

The base model is the run's own (`<run>/config.yaml`: model.path, or the embedded tiny model rebuilt
from its seed). Bad input is one line and exit code 2 (`cli.main`).
"""
from __future__ import annotations

import os
import shutil

from colocate.config import ConfigError, load_config


def parse_args(argv: list[str]) -> tuple[str, bool, str]:
    """-> (run dir, merge, out dir)."""
    values, merge, it = {"--run": "", "--out": ""}, False, iter(argv)
    for arg in it:
        name, sep, value = arg.partition("=")
        if name == "--merge":
            merge = True
        elif name in values:
            values[name] = value if sep else next(it, "")
        else:
            raise ConfigError(f"cannot parse argument {arg!r}; usage: colocate export --run DIR [--merge] --out DIR")
    if not values["--run"] or not values["--out"]:
        raise ConfigError("colocate export needs --run DIR and --out DIR")
    return values["--run"], merge, values["--out"]


def run_parts(run: str) -> tuple[str, str]:
    """(the run's config.yaml, its adapter directory), both checked to exist."""
    config, adapter = os.path.join(run, "config.yaml"), os.path.join(run, "adapter")
    if not os.path.isfile(config):
        raise ConfigError(f"--run {run}: no config.yaml (not a run directory: metrics.run_dir of a run)")
    if not os.path.isfile(os.path.join(adapter, "adapter_model.safetensors")):
        raise ConfigError(f"--run {run}: no adapter/adapter_model.safetensors (the run did not finish; its "
                          "checkpoints/step-* directories hold the adapter in the same format)")
    return config, adapter


def export(run: str, merge: bool, out: str) -> str:
    """Write the adapter (or the merged model) and the tokenizer to `out`; -> `out`."""
    from peft import PeftModel

    from colocate.envs import env_corpus
    from colocate.models import build_model, load_tokenizer
    config, adapter = run_parts(run)
    if os.path.exists(out) and os.listdir(out):
        raise ConfigError(f"--out {out} exists and is not empty")
    cfg = load_config(config)
    key, corpus_fn = env_corpus(cfg)
    tokenizer = load_tokenizer(cfg.model, corpus_fn, key)
    if merge:
        model = PeftModel.from_pretrained(build_model(cfg.model, tokenizer, "cpu"), adapter)
        model.merge_and_unload().save_pretrained(out, safe_serialization=True)
    else:
        shutil.copytree(adapter, out, dirs_exist_ok=True)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str]) -> int:
    run, merge, out = parse_args(argv)
    export(run, merge, out)
    print(f"colocate: wrote {'a merged model' if merge else 'the adapter'} to {out}")
    return 0
