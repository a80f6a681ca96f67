"""Checkpoints: written atomically, loaded strictly, never pickled.

Layout of `<run_dir>/checkpoints/step-000042/`:
    adapter_model.safetensors   the LoRA adapter in peft format (PeftModel.from_pretrained and
    adapter_config.json         vLLM's LoRARequest both load this directory)
    optimizer.safetensors       optimizer tensors, keys "state.<param index>.<name>"
    optimizer.json              the rest of the optimizer state dict (param groups, scalars)
    rng.safetensors             learner torch RNG state(s)
    trainer_state.json          step, version, metric history, each inference rank's state
    config.yaml                 the resolved config of the run that wrote it
    manifest.json               every other file's size and BLAKE2b hash, written last

A checkpoint is built in `.tmp-step-…` (every file fsynced) and renamed into place: a process
killed mid-write leaves only a temp directory, which `latest_checkpoint` ignores and the next
save removes. Loading verifies the manifest first, so a flipped byte anywhere is caught. Every
load error names the file and raises `CheckpointError`; `train.py` turns it into exit code 2
before any process group does work. `--resume` (auto) takes the newest checkpoint that verifies
and names each newer one it skipped, and why.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor, distribute_tensor

from colocate.jsonfile import read_object
from colocate.lifecycle import NO_FAULTS, Faults

STEP_DIR = re.compile(r"^step-(\d{6,})$")
REQUIRED = ("adapter_model.safetensors", "adapter_config.json", "optimizer.safetensors", "optimizer.json",
            "rng.safetensors", "trainer_state.json")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file."""


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def checkpoints(root: str) -> list[str]:
    """`step-*` directories under root, newest first (temp directories are never listed)."""
    if not os.path.isdir(root):
        return []
    steps = sorted(((int(m.group(1)), name) for name in os.listdir(root) if (m := STEP_DIR.match(name))), reverse=True)
    return [os.path.join(root, name) for _, name in steps]


def latest_checkpoint(root: str) -> str | None:
    """Newest `step-*` directory under root, verified or not."""
    return next(iter(checkpoints(root)), None)


def resolve_resume(resume: str, run_dir: str, trust_unverified: bool = False) -> tuple[str | None, list[str]]:
    """-> (checkpoint to resume from, why each newer one was skipped).

    '' -> nothing; 'auto' -> the newest checkpoint of run_dir that verifies, refused when there is
    none (as `Trainer.train(resume_from_checkpoint=True)` refuses: starting over in the run's
    directory would silently redo and overwrite its work); else that path, which must verify."""
    if not resume:
        return None, []
    if resume != "auto":
        if not os.path.isdir(resume):
            raise CheckpointError(f"{resume}: resume checkpoint directory does not exist")
        return resume, []
    skipped = []
    for path in checkpoints(checkpoint_root(run_dir)):
        try:
            verify_checkpoint(path, trust_unverified)
            return path, skipped
        except CheckpointError as e:
            skipped.append(f"skipped {path}: {e}")
    if skipped:  # checkpoints exist, none verifies: starting over would silently discard the run
        raise CheckpointError(f"no checkpoint under {checkpoint_root(run_dir)} verifies; " + "; ".join(skipped))
    raise CheckpointError(f"--resume: no checkpoint found in {checkpoint_root(run_dir)} (a run writes them with "
                          f"--checkpoint.enabled=true); to start afresh, leave out --resume (and pass --overwrite "
                          f"if {run_dir} holds an earlier run), or name another --metrics.run_dir")


# -- manifest --------------------------------------------------------------------------------------
MANIFEST = "manifest.json"


def file_digest(path: str) -> tuple[int, str]:
    """(bytes, BLAKE2b hex digest) of a file, read in 1 MiB blocks."""
    h, size = hashlib.blake2b(digest_size=32), 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def write_manifest(directory: str, **extra) -> None:
    """Size and hash of every file in `directory`, and `extra` (the base model's identity, the
    adapter's version), as `manifest.json` (written last)."""
    files = {}
    for name in sorted(os.listdir(directory)):
        if name != MANIFEST:
            size, digest = file_digest(os.path.join(directory, name))
            files[name] = {"bytes": size, "blake2b": digest}
    _write_json(os.path.join(directory, MANIFEST), {"format": 1, "files": files, **extra})


def verify_checkpoint(path: str, trust_unverified: bool = False) -> None:
    """Raise `CheckpointError` naming the first file that is missing, resized or changed. A checkpoint
    without a manifest (older than manifests) passes only with `trust_unverified`, with a warning."""
    if not os.path.exists(os.path.join(path, MANIFEST)):
        missing = [name for name in REQUIRED if not os.path.isfile(os.path.join(path, name))]
        if missing:  # no manifest and no checkpoint either (an old checkpoint has its files)
            what = "an empty directory" if not os.listdir(path) else f"no {MANIFEST} either"
            raise CheckpointError(f"{os.path.join(path, missing[0])}: missing from checkpoint ({what}: not a "
                                  "checkpoint, or a save that never finished)")
        if not trust_unverified:
            raise CheckpointError(f"{os.path.join(path, MANIFEST)}: missing (a checkpoint written before manifests "
                                  "existed cannot be verified); to resume from it anyway, add "
                                  "--checkpoint.trust_unverified=true (its files are still read and checked)")
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"colocate: warning: {path} has no {MANIFEST}; resuming unverified "
                  "(checkpoint.trust_unverified=true)", file=sys.stderr, flush=True)
        return
    verify_files(path, REQUIRED)


def verify_files(path: str, required: tuple[str, ...]) -> dict:
    """Every file `path`'s manifest lists (`required` among them) has its size and hash -> the manifest."""
    manifest = _read_json(os.path.join(path, MANIFEST))
    files = manifest.get("files")
    if not isinstance(files, dict) or not set(required) <= set(files):
        raise CheckpointError(f"{os.path.join(path, MANIFEST)}: does not list every file ({', '.join(required)})")
    for name, want in files.items():
        if not isinstance(want, dict):
            raise CheckpointError(f"{os.path.join(path, MANIFEST)}: entry {name!r} is not an object")
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{file}: missing from checkpoint")
        size, digest = file_digest(file)
        if size != want.get("bytes") or digest != want.get("blake2b"):
            raise CheckpointError(f"{file}: content differs from the manifest ({size} bytes, expected "
                                  f"{want.get('bytes')}): the file is damaged")
    return manifest


# -- peft names ------------------------------------------------------------------------------------
def to_peft_name(name: str) -> str:
    """Canonical parameter name -> peft's saved key ("...lora_A.default.weight" -> "...lora_A.weight")."""
    return name.replace(".default.", ".")


def from_peft_name(key: str, adapter: str = "default") -> str:
    return re.sub(r"\.(lora_[AB])\.", rf".\1.{adapter}.", key)


# -- optimizer state <-> (tensors, json) -----------------------------------------------------------
def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().contiguous()  # FSDP2: gathered


def flatten_optimizer(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, meta = {}, {"param_groups": state_dict["param_groups"], "scalars": {}}
    for idx, per_param in state_dict["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{idx}.{key}"] = _full(value)
            else:
                meta["scalars"][f"{idx}.{key}"] = value
    return tensors, meta


def unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict, params: list[torch.Tensor]) -> dict:
    """Rebuild an optimizer state dict for `params` (the optimizer's parameters, in its order): state
    tensors shaped like their parameter take its device, dtype and FSDP2 sharding."""
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = value
    for key, value in meta["scalars"].items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    for idx, per_param in state.items():
        param = params[idx]
        for name, value in per_param.items():
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(param.shape):
                continue  # scalars such as Adam's step stay as saved
            if isinstance(param, DTensor):
                per_param[name] = distribute_tensor(value.to(param.device_mesh.device_type).to(param.dtype),
                                                    param.device_mesh, param.placements)
            else:
                per_param[name] = value.to(device=param.device, dtype=param.dtype)
    return {"state": state, "param_groups": meta["param_groups"]}


# -- write -----------------------------------------------------------------------------------------
def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def _write_tensors(path: str, tensors: dict[str, torch.Tensor]) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


@dataclass
class CheckpointState:
    """What one checkpoint holds (one file each, `save_checkpoint`)."""
    adapter: dict[str, torch.Tensor]                  # canonical name -> full tensor
    peft_config: dict                                 # `peft_config_dict(model)`
    optimizer: tuple[dict[str, torch.Tensor], dict]   # `flatten_optimizer(optimizer.state_dict())`
    rng: dict[str, torch.Tensor]                      # {"torch_cpu": torch.get_rng_state()}
    trainer_state: dict                               # step, version, history, the inference ranks' states
    config_yaml: str                                  # the resolved config
    base: dict | None = None                          # the base model's identity (`models.base_identity`)


def save_checkpoint(root: str, step: int, state: CheckpointState, *, keep: int, faults: Faults = NO_FAULTS,
                    protect_step: int | None = None) -> str:
    """Write `step-<step>` atomically and keep the newest `keep` checkpoints, and also the newest at
    or before `protect_step` when given (metrics.stop_on_collapse: the last good one). Returns its path.
    The base model's identity (`state.base`) goes into the manifest.

    Every learner runs the optimizer gather (`flatten_optimizer`) before rank 0 calls this."""
    os.makedirs(root, exist_ok=True)
    for name in os.listdir(root):  # leftovers of a killed write
        if name.startswith(".tmp-"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    final = os.path.join(root, f"step-{step:06d}")
    tmp = os.path.join(root, f".tmp-step-{step:06d}-{os.getpid()}")
    os.makedirs(tmp)
    _write_tensors(os.path.join(tmp, "adapter_model.safetensors"),
                   {to_peft_name(n): _full(t) for n, t in state.adapter.items()})
    _write_json(os.path.join(tmp, "adapter_config.json"), state.peft_config)
    faults.mid_checkpoint(step)  # nothing, unless a failure test asked for a kill -9 here
    opt_tensors, opt_meta = state.optimizer
    _write_tensors(os.path.join(tmp, "optimizer.safetensors"), opt_tensors)
    _write_json(os.path.join(tmp, "optimizer.json"), opt_meta)
    _write_tensors(os.path.join(tmp, "rng.safetensors"), {k: v.contiguous() for k, v in state.rng.items()})
    _write_json(os.path.join(tmp, "trainer_state.json"), state.trainer_state)
    with open(os.path.join(tmp, "config.yaml"), "w") as f:
        f.write(state.config_yaml)
        f.flush()
        os.fsync(f.fileno())
    write_manifest(tmp, **({"base": state.base} if state.base else {}))
    _fsync_dir(tmp)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    steps = sorted(n for n in os.listdir(root) if STEP_DIR.match(n))
    protected = [n for n in steps if protect_step is not None and int(n.rpartition("-")[2]) <= protect_step][-1:]
    for old in steps[:-keep] if keep > 0 else []:
        if old not in protected:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    return final


def save_adapter(directory: str, adapter: dict[str, torch.Tensor], peft_config: dict, *, base: dict,
                 version: int) -> str:
    """The adapter alone in peft format (`PeftModel.from_pretrained`, vLLM's `LoRARequest`):
    `<run_dir>/adapter` at the end of every run, checkpoints on or off, with a manifest (each file's
    hash, the base model's identity `base`, the adapter's `version`) that `colocate eval` and
    `colocate export` verify. Built in a temp directory (every file fsynced), then renamed over the
    old one."""
    tmp = f"{directory.rstrip(os.sep)}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    _write_tensors(os.path.join(tmp, "adapter_model.safetensors"),
                   {to_peft_name(n): _full(t) for n, t in adapter.items()})
    _write_json(os.path.join(tmp, "adapter_config.json"), peft_config)
    write_manifest(tmp, base=base, version=version)
    _fsync_dir(tmp)
    if os.path.exists(directory):
        shutil.rmtree(directory)
    os.rename(tmp, directory)
    _fsync_dir(os.path.dirname(os.path.abspath(directory)))
    return directory


# -- read ------------------------------------------------------------------------------------------
def _read_json(path: str) -> dict:
    return read_object(path, CheckpointError)


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (OSError, SafetensorError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: unreadable or truncated safetensors file ({e})") from None


def load_checkpoint(path: str, trust_unverified: bool = False) -> dict:
    """Verify, then read and validate every file; -> {adapter, peft_config, optimizer_tensors,
    optimizer_meta, rng, trainer_state}."""
    for name in REQUIRED:
        if not os.path.isfile(os.path.join(path, name)):
            raise CheckpointError(f"{os.path.join(path, name)}: missing from checkpoint")
    verify_checkpoint(path, trust_unverified)
    out = {
        "adapter": {from_peft_name(k): v for k, v in
                    _read_tensors(os.path.join(path, "adapter_model.safetensors")).items()},
        "peft_config": _read_json(os.path.join(path, "adapter_config.json")),
        "optimizer_tensors": _read_tensors(os.path.join(path, "optimizer.safetensors")),
        "optimizer_meta": _read_json(os.path.join(path, "optimizer.json")),
        "rng": _read_tensors(os.path.join(path, "rng.safetensors")),
        "trainer_state": _read_json(os.path.join(path, "trainer_state.json")),
    }
    state = out["trainer_state"]
    for key in ("step", "version", "inference"):
        if key not in state:
            raise CheckpointError(f"{os.path.join(path, 'trainer_state.json')}: missing key {key!r}")
    if not out["adapter"]:
        raise CheckpointError(f"{os.path.join(path, 'adapter_model.safetensors')}: holds no tensors")
    return out


ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
"""What makes a directory an adapter: the run's `adapter/`, an exported one, a checkpoint's step."""


def load_adapter(path: str, trust_unverified: bool = False) -> dict:
    """An adapter to evaluate or export (`ADAPTER_FILES`, in a run's `adapter/`, an export or a
    checkpoint) -> {adapter, peft_config, version, base (None when its manifest has none), path}.
    Every file its manifest lists is verified first; a directory without a manifest is refused
    unless `trust_unverified` (then its files are still read and checked)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such adapter or checkpoint directory")
    for name in ADAPTER_FILES:
        if not os.path.isfile(os.path.join(path, name)):
            raise CheckpointError(f"{os.path.join(path, name)}: missing (an adapter directory holds "
                                  f"{' and '.join(ADAPTER_FILES)})")
    manifest = {}
    if os.path.exists(os.path.join(path, MANIFEST)):
        manifest = verify_files(path, ADAPTER_FILES)
    elif not trust_unverified:
        raise CheckpointError(f"{os.path.join(path, MANIFEST)}: missing (an adapter written before manifests existed "
                              "cannot be verified); to use it anyway, add --checkpoint.trust_unverified=true")
    adapter = {from_peft_name(k): v for k, v in _read_tensors(os.path.join(path, ADAPTER_FILES[0])).items()}
    if not adapter:
        raise CheckpointError(f"{os.path.join(path, ADAPTER_FILES[0])}: holds no tensors")
    peft_config = _read_json(os.path.join(path, ADAPTER_FILES[1]))
    for key in ("r", "lora_alpha", "target_modules"):
        if key not in peft_config:
            raise CheckpointError(f"{os.path.join(path, ADAPTER_FILES[1])}: no {key!r} (not a peft LoRA config)")
    version = manifest.get("version")
    if version is None and os.path.isfile(os.path.join(path, "trainer_state.json")):
        version = _read_json(os.path.join(path, "trainer_state.json")).get("version")
    return {"adapter": adapter, "peft_config": peft_config, "version": int(version or 0),
            "base": manifest.get("base"), "path": path}


def check_base(saved: dict | None, live: dict, path: str) -> None:
    """The base model an adapter was trained on (its manifest's `base`) against this config's
    (`models.base_identity`): the same parameter shapes, then the same weights. A manifest without
    a base (older) is not compared; the adapter's shapes still are (`check_adapter_matches`)."""
    if not saved:
        return
    where = os.path.join(path, MANIFEST)
    if saved.get("shapes") != live["shapes"]:
        embedded = str(saved.get("source", "")).startswith("embedded ") and live["source"].startswith("embedded ")
        fix = ("the embedded model's vocabulary is the tokenizer trained on its env's text: evaluate with the training "
               "run's config and env (--run RUN)" if embedded else
               "set model.path / model.shape to the training run's (--run RUN takes its config)")
        raise CheckpointError(f"{where}: trained on another base model ({saved.get('source')}, "
                              f"{saved.get('parameters', 0):,} parameters) than this config's ({live['source']}, "
                              f"{live['parameters']:,}): {fix}")
    if saved.get("fingerprint") != live["fingerprint"]:
        raise CheckpointError(f"{where}: trained on a base model of this shape with other weights ({saved.get('source')}; "
                              f"this config: {live['source']}): another model.seed, or other files at model.path")


TASK_FIELDS = (("env", "name"), ("env", "unit_labels"), ("env", "list_supports"), ("env", "use_constraint"),
               ("env", "prompt_column"), ("env", "answer_column"), ("env", "answer_choices"), ("env", "reward"),
               ("env", "reward_weights"), ("env", "tools"), ("env", "environment"), ("env", "tool_parser"))
"""Config fields that define what the policy reads and writes, and what it is rewarded for (a
dataset's columns and rewards, an agent's tools and parser); a resumed run must keep them. The data
files may move: the dataset env checks its row count on resume instead."""


def flag_value(value) -> str:
    """A config value as `--section.key=` reads it back: booleans lower-case, lists in YAML's flow
    form ([exact,gsm8k])."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value)


def check_same_task(cfg, path: str) -> None:
    """Refuse to resume with another env, completion format or reward than the checkpoint's run had
    (the presets changed `env.unit_labels` and `env.list_supports`; a silent switch would change the
    policy's task mid-run). Fields the saved config lacks (older checkpoints) count as their
    defaults."""
    import yaml
    file = os.path.join(path, "config.yaml")
    if not os.path.exists(file):
        return
    try:
        with open(file) as f:
            saved = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise CheckpointError(f"{file}: unreadable YAML ({e.__class__.__name__})") from None
    if not isinstance(saved, dict):
        raise CheckpointError(f"{file}: expected a mapping of config sections")
    for section, key in TASK_FIELDS:
        now = getattr(getattr(cfg, section), key)
        then = (saved.get(section) or {}).get(key, getattr(type(getattr(cfg, section))(), key))
        if then != now:
            raise CheckpointError(f"{file}: the checkpoint's run had {section}.{key}={then!r}, this run has {now!r}; "
                                  f"resume with --{section}.{key}={flag_value(then)} or start a new metrics.run_dir")


def check_adapter_matches(adapter: dict[str, torch.Tensor], live: dict[str, torch.Tensor], path: str) -> None:
    """The checkpoint's adapter must have exactly the live model's names and shapes."""
    where = os.path.join(path, "adapter_model.safetensors")
    if set(adapter) != set(live):
        missing = sorted(set(live) - set(adapter))[:1] or sorted(set(adapter) - set(live))[:1]
        raise CheckpointError(f"{where}: adapter names differ from this run's LoRA config (e.g. {missing[0]})")
    for name, t in live.items():
        if tuple(adapter[name].shape) != tuple(t.shape):
            raise CheckpointError(f"{where}: {name} has shape {tuple(adapter[name].shape)}, expected {tuple(t.shape)}")


def peft_config_dict(model) -> dict:
    """The adapter's peft config as JSON-able data (what adapter_config.json holds)."""
    cfg = model.peft_config["default"].to_dict()
    return json.loads(json.dumps(cfg, default=lambda o: sorted(o) if isinstance(o, (set, frozenset)) else str(o)))
