"""`colocate eval` and `colocate export` on what a run leaves: the run's `adapter/` (with its
manifest: file hashes, the base model's identity, the version) is scored as a checkpoint is, eval
writes outside the run-dir policy and says where, and every damaged adapter, mismatched base or bad
output path is one line and exit code 2 before anything is written or built (issue 56: 1, 5, 12, 13)."""
import json
import os

import pytest
import torch

from colocate import cli
from colocate.config import save_config
from tests.conftest import REPO

TINY = os.path.join(REPO, "configs", "cpu-tiny.yaml")


@pytest.fixture()
def run(tmp_path, tiny_cfg, tiny_tokenizer):
    """A finished run's directory as training leaves it: config.yaml and adapter/ (B != 0: trained-looking)."""
    from colocate.checkpoint import peft_config_dict, save_adapter
    from colocate.models import base_identity, canonical_name
    from colocate.models import build_policy
    run = tmp_path / "run"
    save_config(tiny_cfg, str(run / "config.yaml"))
    policy = build_policy(tiny_cfg, tiny_tokenizer, "cpu")
    g = torch.Generator().manual_seed(0)
    adapter = {}
    for name, p in policy.named_parameters():
        if "lora_" in name:
            adapter[canonical_name(name)] = torch.randn(p.shape, generator=g) * 0.5 if "lora_B" in name else p.detach()
    save_adapter(str(run / "adapter"), adapter, peft_config_dict(policy),
                 base=base_identity(tiny_cfg.model, len(tiny_tokenizer)), version=7)
    return run


def eval_args(tmp_path, tiny_cfg, *extra):
    return ["eval", "--config", TINY, f"--model.cache_dir={tiny_cfg.model.cache_dir}",
            f"--metrics.run_dir={tmp_path / 'run'}", *extra]


def refused(capsys, call) -> str:
    """`call()` ends with exit code 2 and one line on stderr -> that line."""
    try:
        code = call()
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, (code, err)
    return err[0]


@pytest.fixture()
def no_weights(monkeypatch):
    """Building or loading a model's weights fails the test: refusals come before them."""
    import colocate.models

    def fail(*args, **kwargs):
        raise AssertionError("model weights were built before the input was checked")
    monkeypatch.setattr(colocate.models, "materialize", fail)  # what gives a model (built on meta) its weights


def test_the_adapter_manifest_lists_files_base_and_version(run, tiny_cfg, tiny_tokenizer):
    from colocate.checkpoint import file_digest
    from colocate.models import base_identity
    manifest = json.loads((run / "adapter" / "manifest.json").read_text())
    assert set(manifest["files"]) == {"adapter_model.safetensors", "adapter_config.json"}
    for name, entry in manifest["files"].items():
        assert [entry["bytes"], entry["blake2b"]] == list(file_digest(str(run / "adapter" / name)))
    assert manifest["version"] == 7 and manifest["base"] == base_identity(tiny_cfg.model, len(tiny_tokenizer))
    other_seed = base_identity(type(tiny_cfg.model)(**{**vars(tiny_cfg.model), "seed": 1}), len(tiny_tokenizer))
    assert other_seed["shapes"] == manifest["base"]["shapes"]
    assert other_seed["fingerprint"] != manifest["base"]["fingerprint"]
    assert not [p for p in os.listdir(run) if ".tmp" in p]  # built aside, renamed into place


def test_eval_scores_the_runs_adapter_and_writes_outside_the_run(run, tmp_path, tiny_cfg, capsys):
    assert cli.main(eval_args(tmp_path, tiny_cfg, "--checkpoint", str(run / "adapter"))) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert result["version"] == 7 and 0 <= result["metrics"]["accuracy"] <= 1 and result["metrics"]["samples"] == 25
    written = run / "evals" / "adapter" / "metrics.json"
    assert f"colocate: eval wrote {written}" in err
    assert json.loads(written.read_text())["metrics"] == result["metrics"]
    assert (run / "evals" / "adapter" / "arithmetic-eval-v7.jsonl").exists()
    # --run: the run's adapter with the run's own config, the same figures; a config.yaml saved before
    # some keys left the code still holds them, and is read all the same (a config of one's own is not)
    import yaml
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["engine"]["kv_cache_dtype"], saved["topology"]["mps"] = "auto", "off"
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    assert cli.main(["eval", "--run", str(run)]) == 0
    assert json.loads(capsys.readouterr().out)["metrics"] == result["metrics"]


def test_eval_does_not_block_the_next_train_and_overwrite_keeps_it(monkeypatch, tmp_path, tiny_cfg, capsys):
    from colocate.launch import check_config
    for key in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    assert cli.main(eval_args(tmp_path, tiny_cfg)) == 0  # the base model, before training
    assert json.loads(capsys.readouterr().out)["version"] == 0
    base = tmp_path / "run" / "evals" / "base" / "metrics.json"
    train_args = ["--config", TINY, f"--metrics.run_dir={tmp_path / 'run'}",
                  f"--model.cache_dir={tiny_cfg.model.cache_dir}"]
    check_config(train_args, world=2)  # not refused: the directory holds no run
    (tmp_path / "run" / "config.yaml").write_text("x")
    check_config([*train_args, "--overwrite"], world=2)
    assert base.exists() and not (tmp_path / "run" / "config.yaml").exists()


def flip_bit(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("merge", [[], ["--merge"]])
def test_a_flipped_bit_is_refused_by_export_and_eval(run, tmp_path, tiny_cfg, capsys, no_weights, merge):
    flip_bit(run / "adapter" / "adapter_model.safetensors")
    line = refused(capsys, lambda: cli.main(["export", "--run", str(run), *merge, "--out", str(tmp_path / "x")]))
    assert "adapter_model.safetensors: content differs from the manifest" in line and line.startswith("colocate:")
    assert not (tmp_path / "x").exists()
    line = refused(capsys, lambda: cli.main(eval_args(tmp_path, tiny_cfg, "--checkpoint", str(run / "adapter"))))
    assert "content differs from the manifest" in line and not (run / "evals").exists()


def damage_truncate(run):
    path = run / "adapter" / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def damage_config(run):
    (run / "adapter" / "adapter_config.json").write_text("{not json")


def other_shape(run):
    text = (run / "config.yaml").read_text().replace("shape: tiny", "shape: qwen2.5-0.5b")
    (run / "config.yaml").write_text(text)


def other_seed(run):
    text = (run / "config.yaml").read_text().replace("seed: 0\n", "seed: 5\n", 1)
    (run / "config.yaml").write_text(text)


@pytest.mark.parametrize("damage,expected", [
    (damage_truncate, "adapter_model.safetensors: content differs from the manifest"),
    (damage_config, "adapter_config.json: content differs from the manifest"),
    (other_shape, "trained on another base model (embedded tiny model, seed 0"),
    (other_seed, "trained on a base model of this shape with other weights"),
], ids=["truncated", "garbage config", "other shape", "other seed"])
def test_export_merge_refuses_a_damaged_adapter_or_another_base(run, tmp_path, capsys, no_weights, damage, expected):
    damage(run)
    line = refused(capsys, lambda: cli.main(["export", "--run", str(run), "--merge", "--out", str(tmp_path / "m")]))
    assert expected in line, line
    assert not (tmp_path / "m").exists()


def test_without_a_manifest_only_when_trusted_and_still_checked(run, tmp_path, capsys, no_weights):
    os.remove(run / "adapter" / "manifest.json")
    line = refused(capsys, lambda: cli.main(["export", "--run", str(run), "--out", str(tmp_path / "a")]))
    assert "manifest.json: missing" in line and "--checkpoint.trust_unverified=true" in line
    damage_config(run)
    line = refused(capsys, lambda: cli.main(["export", "--run", str(run), "--out", str(tmp_path / "a"),
                                             "--checkpoint.trust_unverified=true"]))
    assert "adapter_config.json: unreadable or corrupt JSON" in line


def test_export_out_an_existing_file_or_unwritable(run, tmp_path, capsys, no_weights):
    (tmp_path / "file").write_text("mine")
    line = refused(capsys, lambda: cli.main(["export", "--run", str(run), "--out", str(tmp_path / "file")]))
    assert "exists and is a file" in line and (tmp_path / "file").read_text() == "mine"
    line = refused(capsys, lambda: cli.main(["export", "--run", str(run), "--out", "/proc/colocate-export"]))
    assert "/proc is not writable" in line


def other_shape_model(tmp_path, tiny_cfg, tiny_tokenizer) -> str:
    """A model directory of another shape than the tiny preset's (hidden size 32)."""
    from transformers import AutoModelForCausalLM

    from colocate.models import model_config, save_tiny_model
    config = model_config("tiny", len(tiny_tokenizer), "float32")
    config.hidden_size, config.intermediate_size = 32, 64
    path = tmp_path / "other-model"
    save_tiny_model(str(path), AutoModelForCausalLM.from_config(config), tiny_tokenizer)
    return str(path)


def test_eval_refuses_another_rank_shape_seed_or_an_unwritable_out(run, tmp_path, tiny_cfg, tiny_tokenizer, capsys,
                                                                   monkeypatch):
    model_dir = other_shape_model(tmp_path, tiny_cfg, tiny_tokenizer)
    capsys.readouterr()
    import colocate.models
    monkeypatch.setattr(colocate.models, "materialize", lambda *a, **k: pytest.fail("weights built"))
    adapter = ["--checkpoint", str(run / "adapter")]
    cases = [(["--lora.rank=8"], "the adapter has r=16, lora_alpha=32; this config has lora.rank=8"),
             ([f"--model.path={model_dir}"], "trained on another base model"),
             (["--model.seed=3"], "trained on a base model of this shape with other weights"),
             (["--out=/proc/colocate-eval/metrics.json"], "/proc is not writable"),
             ([f"--out={tmp_path}"], "is a directory")]
    for extra, expected in cases:
        line = refused(capsys, lambda: cli.main(eval_args(tmp_path, tiny_cfg, *adapter, *extra)))
        assert expected in line, (extra, line)
    assert not (run / "evals").exists()
