"""Checkpoints and failure behaviour: atomic writes, strict loads, resume equality, signals, crashes."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from colocate.checkpoint import (CheckpointError, CheckpointState, flatten_optimizer, latest_checkpoint,
                                 load_checkpoint, peft_config_dict, save_checkpoint)
from colocate.models import lora_state
from tests.conftest import REPO


def _save(root, step, model, keep=2):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    opt.step()
    state = CheckpointState(lora_state(model), peft_config_dict(model), flatten_optimizer(opt.state_dict()),
                            {"torch_cpu": torch.get_rng_state()},
                            {"step": step, "version": step, "history": {}, "inference": {}}, "x: 1\n")
    return save_checkpoint(root, step, state, keep=keep)


def test_checkpoint_roundtrip_is_peft_loadable(tmp_path, tiny_cfg, tiny_tokenizer, tiny_policy):
    from peft import PeftModel
    from colocate.models import build_model
    with torch.no_grad():
        for p in lora_state(tiny_policy).values():
            p.normal_(0, 0.1)
    path = _save(str(tmp_path), 3, tiny_policy)
    assert os.path.basename(path) == "step-000003"
    state = load_checkpoint(path)
    for name, t in lora_state(tiny_policy).items():
        assert torch.equal(state["adapter"][name], t.detach())
    # peft loads the directory as an adapter, with the same tensors
    base = build_model(tiny_cfg.model, tiny_tokenizer)
    loaded = PeftModel.from_pretrained(base, path)
    got = lora_state(loaded)
    for name, t in lora_state(tiny_policy).items():
        assert torch.equal(got[name], t.detach()), name
    assert all(k.startswith("state.") for k in state["optimizer_tensors"])


def test_resume_keeps_the_task_format(tmp_path):
    from colocate.checkpoint import check_same_task
    from colocate.config import load_config, save_config
    cfg = load_config(os.path.join(REPO, "configs", "gpu-4.yaml"))  # env.unit_labels, list_supports: false
    save_config(cfg, str(tmp_path / "config.yaml"))
    check_same_task(cfg, str(tmp_path))                                     # same format: fine
    lists = load_config(os.path.join(REPO, "configs", "gpu-4.yaml"), {"env": {"list_supports": True}})
    with pytest.raises(CheckpointError, match="env.list_supports=False.*--env.list_supports=false"):
        check_same_task(lists, str(tmp_path))
    other = load_config(os.path.join(REPO, "configs", "gpu-4.yaml"),  # the defaults' format
                        {"env": {"unit_labels": True, "list_supports": True}})
    with pytest.raises(CheckpointError, match="env.unit_labels=False.*--env.unit_labels=false"):
        check_same_task(other, str(tmp_path))
    (tmp_path / "config.yaml").write_text("env:\n  name: diplomacy\n")     # an older checkpoint: defaults
    check_same_task(other, str(tmp_path))
    with pytest.raises(CheckpointError, match="unit_labels=True"):
        check_same_task(cfg, str(tmp_path))


def test_resume_keeps_the_rewards_and_columns(tmp_path):
    """A dataset run resumed with other rewards or columns is refused, naming the key and the flag
    that restores the checkpoint's value."""
    from colocate.checkpoint import check_same_task
    from colocate.config import load_config, save_config
    path = os.path.join(REPO, "configs", "cpu-dataset-tiny.yaml")
    cfg = load_config(path)
    save_config(cfg, str(tmp_path / "config.yaml"))
    check_same_task(cfg, str(tmp_path))
    with pytest.raises(CheckpointError, match=r"env.reward=\['exact'\].*this run has \['exact', 'gsm8k'\].*--env.reward=\[exact\] "):
        check_same_task(load_config(path, {"env": {"reward": ["exact", "gsm8k"]}}), str(tmp_path))
    with pytest.raises(CheckpointError, match="env.prompt_column='prompt'.*--env.prompt_column=prompt"):
        check_same_task(load_config(path, {"env": {"prompt_column": "text"}}), str(tmp_path))


def test_resume_keeps_the_data_files(tmp_path):
    """A dataset run resumes only on files with the contents it was saved with (its position
    indexes their rows): same row count, other contents is refused in one line naming the key; a
    copy of the same bytes elsewhere resumes; a checkpoint without the digest (older) is taken."""
    from colocate.config import load_config
    from colocate.envs.dataset_files import data_fingerprint
    from colocate.launch import check_same_env
    data = tmp_path / "train.jsonl"
    rows = [json.dumps({"prompt": f"add {i} 1", "answer": str(i + 1)}) for i in range(6)]
    data.write_text("\n".join(rows) + "\n")
    cfg = load_config(os.path.join(REPO, "configs", "cpu-dataset-tiny.yaml"), {"env": {"data_files": [str(data)]}})
    saved = {"inference": {"0": {"env": {"epoch": 0, "position": 3, "rows": 6,
                                         "data": data_fingerprint([str(data)], "train")}}}}
    check_same_env(cfg, saved, "ckpt")
    copy = tmp_path / "elsewhere.jsonl"
    copy.write_bytes(data.read_bytes())
    check_same_env(load_config(os.path.join(REPO, "configs", "cpu-dataset-tiny.yaml"),
                                {"env": {"data_files": [str(copy)]}}), saved, "ckpt")
    data.write_text("\n".join(rows[::-1]) + "\n")  # as many rows, another order
    with pytest.raises(CheckpointError, match="^ckpt: env.data_files hold other contents"):
        check_same_env(cfg, saved, "ckpt")
    check_same_env(cfg, {"inference": {"0": {"env": {"epoch": 0, "position": 3, "rows": 6}}}}, "ckpt")
    with pytest.raises(CheckpointError):  # the split is part of what the position indexes
        check_same_env(load_config(os.path.join(REPO, "configs", "cpu-dataset-tiny.yaml"),
                                    {"env": {"data_files": [str(copy)], "split": "train[:50%]"}}), saved, "ckpt")


def test_keep_last_k_and_temp_dirs_ignored(tmp_path, tiny_policy):
    for step in (1, 2, 3):
        _save(str(tmp_path), step, tiny_policy, keep=2)
    os.makedirs(tmp_path / ".tmp-step-000004-123")
    assert sorted(os.listdir(tmp_path)) == [".tmp-step-000004-123", "step-000002", "step-000003"]
    assert latest_checkpoint(str(tmp_path)).endswith("step-000003")


@pytest.mark.parametrize("victim,damage", [("adapter_model.safetensors", "truncate"),
                                           ("trainer_state.json", "garbage"),
                                           ("optimizer.safetensors", "delete")])
def test_corrupt_checkpoint_is_refused_naming_the_file(tmp_path, tiny_policy, victim, damage):
    path = _save(str(tmp_path), 1, tiny_policy)
    target = os.path.join(path, victim)
    if damage == "truncate":
        size = os.path.getsize(target)
        with open(target, "r+b") as f:
            f.truncate(size // 2)
    elif damage == "garbage":
        with open(target, "w") as f:
            f.write("{not json")
    else:
        os.remove(target)
    with pytest.raises(CheckpointError, match=victim.replace(".", r"\.")):
        load_checkpoint(path)


CHECKPOINT_FILES = ("adapter_model.safetensors", "adapter_config.json", "optimizer.safetensors", "optimizer.json",
                    "rng.safetensors", "trainer_state.json", "config.yaml")


def flip_byte(path: str, at: float = 0.5) -> None:
    data = bytearray(open(path, "rb").read())
    data[int(len(data) * at)] ^= 0x01
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("victim", CHECKPOINT_FILES)
def test_a_flipped_byte_in_any_file_is_detected(tmp_path, tiny_policy, victim):
    from colocate.checkpoint import verify_checkpoint
    path = _save(str(tmp_path), 1, tiny_policy)
    verify_checkpoint(path)
    flip_byte(os.path.join(path, victim), at=0.9)  # inside the tensor data of a safetensors file
    with pytest.raises(CheckpointError, match=victim.replace(".", r"\.") + ".*differs from the manifest"):
        load_checkpoint(path)


@pytest.mark.parametrize("damage", ["flip", "delete", "no-manifest"])
def test_auto_resume_falls_back_to_the_newest_checkpoint_that_verifies(tmp_path, tiny_policy, damage):
    from colocate.checkpoint import resolve_resume
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        _save(str(root), step, tiny_policy, keep=3)
    newest = root / "step-000002"
    if damage == "flip":
        flip_byte(str(newest / "adapter_model.safetensors"), at=0.9)
    elif damage == "delete":
        os.remove(newest / "optimizer.json")
    else:
        os.remove(newest / "manifest.json")
    path, skipped = resolve_resume("auto", str(tmp_path))
    assert path == str(root / "step-000001")
    assert len(skipped) == 1 and str(newest) in skipped[0], skipped
    load_checkpoint(path)
    flip_byte(str(root / "step-000001" / "rng.safetensors"))  # nothing verifies: refused, not a fresh start
    with pytest.raises(CheckpointError, match="no checkpoint .* verifies"):
        resolve_resume("auto", str(tmp_path))
    with pytest.raises(CheckpointError, match="no checkpoint found in"):  # nothing to resume: refused too
        resolve_resume("auto", str(tmp_path / "elsewhere"))


# -- multi-process behaviour (2 ranks, gloo) --------------------------------------------------------
BASE = ["--config", "configs/cpu-tiny.yaml", "--learner.max_policy_lag=0", "--checkpoint.enabled=true"]


def launch(args, tmp_path, env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "colocate.train", *BASE, f"--model.cache_dir={tmp_path / 'cache'}", *args]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)


def finish(proc, timeout=300):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def assert_resume_reproduces_uninterrupted_run(tmp_path, extra: list[str] = ()) -> None:
    """6 steps straight (run_dir a), then run_dir b holding a's step-3 checkpoint (as a run that
    died after it) resumed to 6: the same rewards and losses step for step. test_dataset_env runs it
    on the dataset env; for the arithmetic env test_resume's kill -9 at lag 0 asserts the same."""
    code, out = finish(launch([*extra, "--learner.num_steps=6", "--checkpoint.every=3",
                               f"--metrics.run_dir={tmp_path / 'a'}"], tmp_path))
    assert code == 0, out
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step-000003", tmp_path / "b" / "checkpoints" / "step-000003")
    code, out = finish(launch([*extra, "--learner.num_steps=6", f"--metrics.run_dir={tmp_path / 'b'}", "--resume"],
                              tmp_path))
    assert code == 0 and "resuming from" in out, out
    a = json.loads((tmp_path / "a" / "summary.json").read_text())
    b = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert b["steps"] == 6
    assert b["rewards"] == a["rewards"] and b["losses"] == a["losses"]


@pytest.mark.slow
def test_kill_9_during_checkpoint_keeps_previous_usable(tmp_path):
    run = tmp_path / "run"
    code, out = finish(launch(["--learner.num_steps=6", "--checkpoint.every=2", f"--metrics.run_dir={run}"],
                              tmp_path, env={"COLOCATE_FAULT": "kill_in_checkpoint:step=4"}))
    assert code != 0
    names = sorted(os.listdir(run / "checkpoints"))
    assert "step-000002" in names and "step-000004" not in names
    assert any(n.startswith(".tmp-step-000004") for n in names), names  # the half-written one
    load_checkpoint(str(run / "checkpoints" / "step-000002"))
    code, out = finish(launch(["--learner.num_steps=6", f"--metrics.run_dir={run}", "--resume"], tmp_path))
    assert code == 0 and "step-000002" in out, out
    assert json.loads((run / "summary.json").read_text())["steps"] == 6


@pytest.mark.slow
def test_raising_rank_ends_job_and_is_named(tmp_path):
    # The other rank is stopped by torchrun, or its collectives time out after topology.timeout_s:
    # a job that hangs instead trips communicate's guard (start-up + 30 s + margin).
    code, out = finish(launch(["--learner.num_steps=50", f"--metrics.run_dir={tmp_path / 'run'}",
                               "--topology.timeout_s=30"], tmp_path,
                              env={"COLOCATE_FAULT": "raise:rank=1:step=2"}), timeout=120)
    assert code != 0
    assert "step 3/50" not in out and not (tmp_path / "run" / "summary.json").exists(), out  # nothing trained on
    assert "colocate: failed: rank 1 (learner): RuntimeError: injected fault" in out, out
    # one failure, one message: the other rank's transport reports nothing of its own
    assert out.count("colocate: failed: ") == 1, out
    assert "Connection closed by peer" not in out and "DistBackendError" not in out, out


@pytest.mark.slow
@pytest.mark.parametrize("lag", [[], ["--learner.max_policy_lag=2", "--rollout.oversample_groups=2"]],
                         ids=["sync", "lag2-oversampled"])
def test_sigterm_writes_checkpoint_and_exits_cleanly(tmp_path, lag):
    # the learner drains the batches the inference ranks sampled ahead of it (config.sampling_lag)
    run = tmp_path / "run"
    proc = launch(["--learner.num_steps=5000", f"--metrics.run_dir={run}", *lag], tmp_path)
    lines = []
    for line in proc.stdout:  # wait until training is under way
        lines.append(line)
        if "step 20/5000" in line:
            break
    os.killpg(proc.pid, signal.SIGTERM)  # what Ctrl-C / a scheduler's preemption does
    rest, _ = proc.communicate(timeout=120)
    out = "".join(lines) + rest
    assert "stop requested" in out and "checkpoint written" in out, out[-3000:]
    assert "failed" not in out, out[-3000:]
    ckpt = latest_checkpoint(str(run / "checkpoints"))
    state = load_checkpoint(ckpt)
    assert 20 <= state["trainer_state"]["step"] < 5000
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == state["trainer_state"]["step"]


@pytest.mark.slow
def test_resume_from_corrupt_checkpoint_exits_2(tmp_path, tiny_policy):
    run = tmp_path / "run"
    _save(str(run / "checkpoints"), 2, tiny_policy)  # as a run writes it: only its files are read here
    target = run / "checkpoints" / "step-000002" / "adapter_model.safetensors"
    target.write_bytes(target.read_bytes()[:100])
    proc = subprocess.run([sys.executable, "-m", "colocate.train", *BASE, f"--metrics.run_dir={run}", "--resume"],
                          cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, "WORLD_SIZE": "2"})
    assert proc.returncode == 2
    assert str(target) in proc.stderr and "differs from the manifest" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_kill_9_of_the_launcher_leaves_no_rank_alive(tmp_path):
    import psutil
    proc = launch(["--learner.num_steps=5000", f"--metrics.run_dir={tmp_path / 'run'}"], tmp_path)
    for line in proc.stdout:  # wait until training is under way
        if "step 2/5000" in line:
            break
    ranks = psutil.Process(proc.pid).children(recursive=True)
    assert len(ranks) >= 2, ranks
    os.kill(proc.pid, signal.SIGKILL)  # the launcher only, as a supervisor would
    proc.wait(timeout=10)
    deadline = time.time() + 5
    alive = ranks
    while alive and time.time() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in alive:  # do not leave them behind whatever the assertion says
        p.kill()
    assert not alive, [p.cmdline()[-3:] for p in alive]


def test_an_empty_newest_checkpoint_dir_is_called_empty_not_old(tmp_path, tiny_policy):
    """A `step-*` directory holding nothing (a save that never finished, a stray mkdir) is skipped as
    such, not as a checkpoint "written before manifests existed"."""
    from colocate.checkpoint import REQUIRED, resolve_resume
    root = tmp_path / "checkpoints"
    _save(str(root), 1, tiny_policy, keep=3)
    (root / "step-000002").mkdir()
    path, skipped = resolve_resume("auto", str(tmp_path))
    assert path == str(root / "step-000001") and len(skipped) == 1
    assert f"step-000002/{REQUIRED[0]}: missing from checkpoint (an empty directory: not a checkpoint" in skipped[0]
    assert "manifests existed" not in skipped[0]


def test_an_adapter_of_another_embedded_model_hints_at_the_runs_config_not_model_path():
    """Two tiny-model configs differ in their tokenizer's vocabulary (each trained on its env's text):
    model.path is no fix there; the training run's config is."""
    from colocate.checkpoint import check_base
    saved = {"source": "embedded tiny model, seed 0", "parameters": 100, "shapes": "a", "fingerprint": "f"}
    live = {"source": "embedded tiny model, seed 0", "parameters": 90, "shapes": "b", "fingerprint": "f"}
    with pytest.raises(CheckpointError, match=r"vocabulary is the tokenizer trained on its env's text: evaluate with "
                                              r"the training run's config and env \(--run RUN\)$"):
        check_base(saved, live, "adapter")
    with pytest.raises(CheckpointError, match=r"set model.path / model.shape to the training run's"):
        check_base({**saved, "source": "/models/qwen"}, live, "adapter")
