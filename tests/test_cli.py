"""The `colocate` command and what a user types: floats in any notation, a derived batch size,
`--help`, `colocate train` checking before torchrun (and starting none on bad input), the run
directory policy, `colocate export`."""
import os

import pytest
import torch

from colocate import cli, launcher
from colocate.config import ConfigError, load_config, parse_overrides
from tests.conftest import REPO

TINY = os.path.join(REPO, "configs", "cpu-tiny.yaml")


def no_torchrun_env(monkeypatch):
    for key in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)


def handed_over(args: list[str]) -> tuple[str, bytes | None]:
    """What a rank of `colocate train` gets (torchrun's arguments `args`): it waits as a rank does
    (`handover.wait`) -> (the config's path, its bytes; None: the checks refused)."""
    from colocate import handover
    path = args[-1].partition("=")[2]
    if handover.wait(path, os.getppid(), wait_s=600) != handover.READY:
        return path, None
    with open(path, "rb") as f:
        return path, f.read()


@pytest.mark.parametrize("text,value", [("3e-3", 3e-3), ("1e-6", 1e-6), (".5", 0.5), ("1E-4", 1e-4), ("2", 2.0)])
def test_floats_in_any_notation_on_the_command_line_and_in_yaml(tmp_path, text, value):
    _, overrides, _ = parse_overrides([f"--learner.lr={text}"])
    assert load_config(TINY, overrides).learner.lr == value
    path = tmp_path / "c.yaml"
    path.write_text(f"base: {TINY}\nlearner:\n  lr: {text}\nloss:\n  eps_low: {text if value < 1 else '.2'}\n")
    cfg = load_config(str(path))
    assert cfg.learner.lr == value and isinstance(cfg.learner.lr, float)
    with pytest.raises(ConfigError, match="learner.lr: expected float, got str 'fast'"):
        load_config(TINY, {"learner": {"lr": "fast"}})


def test_batch_size_is_derived_and_checked_only_when_given():
    cfg = load_config(TINY, {"rollout": {"group_size": "16"}})
    assert cfg.rollout.batch_size == cfg.rollout.groups_per_step * 16
    assert load_config(TINY, {"rollout": {"group_size": "4", "batch_size": "64"}}).rollout.batch_size == 64
    with pytest.raises(ConfigError, match=r"rollout.batch_size=100 must equal .* = 16 \* 8 = 128"):
        load_config(TINY, {"rollout": {"batch_size": "100"}})


def test_help_of_the_command_and_of_a_config_section(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(c in out for c in ("train", "eval", "check", "export"))
    assert cli.main(["train", "--help"]) == 0
    assert "--nproc" in capsys.readouterr().out
    assert cli.main(["check", "--help", "learner"]) == 0
    out = capsys.readouterr().out
    assert "--learner.lr=0.001" in out and "updates_per_batch" in out and "AdamW steps per rollout batch" in out
    assert cli.main(["check", "--help", "lerner"]) == 2
    assert "no config section 'lerner'" in capsys.readouterr().err


def test_no_command_or_an_unknown_one_is_exit_2_with_usage(capsys):
    assert cli.main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("colocate: a command is required\nusage: colocate <command>")
    assert cli.main(["trian", "--config", TINY]) == 2
    err = capsys.readouterr().err
    assert err.startswith("colocate: unknown command 'trian'; did you mean 'train'?\nusage:")
    assert cli.main(["zzz"]) == 2
    assert "unknown command 'zzz' (commands: train, check, eval, export)" in capsys.readouterr().err


def test_colocate_check_refuses_a_run_dir_train_would_refuse(tmp_path, capsys, monkeypatch):
    no_torchrun_env(monkeypatch)
    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    args = ["--config", TINY, f"--metrics.run_dir={run}", f"--model.cache_dir={tmp_path / 'cache'}"]
    assert cli.main(["check", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds an earlier run (adapter)" in err[0]
    assert cli.main(["check", *args, "--overwrite"]) == 0 and (run / "adapter").exists()


def test_train_checks_then_runs_torchrun_with_the_world_it_checked(monkeypatch, tmp_path):
    """The ranks get the config the launcher checked (a file, its SHA-256 beside it), not its arguments
    to check again; the file is gone once torchrun returns."""
    import hashlib

    import yaml

    from colocate import handover
    no_torchrun_env(monkeypatch)
    calls = []

    def fake_torchrun(args, launch):
        calls.append((args, *handed_over(args), handover.read_record(args[-1].partition("=")[2])))
        return 0
    monkeypatch.setattr(launcher, "run_torchrun", fake_torchrun)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    args = ["--config", TINY, f"--metrics.run_dir={tmp_path / 'run'}", "--learner.lr=3e-3"]
    assert cli.main(["train", *args]) == 0
    (cmd, resolved, data, record), = calls
    assert cmd[:3] == ["--nproc-per-node=2", "--standalone", "-m"] and os.environ["OMP_NUM_THREADS"].isdigit()
    assert cmd[3:] == ["colocate.train", f"--resolved-config={resolved}"]
    assert record["sha256"] == hashlib.sha256(data).hexdigest()
    # the checks' phases, launch -> handover: each of them in order, none negative, none past the handover
    from colocate.startup import CHECK_PHASES, check_seconds, process_start
    assert list(record["phase_ends"]) == list(CHECK_PHASES)
    launched = process_start()  # the launch: this process's start, as `launcher.train` counts it
    seconds = check_seconds(record["phase_ends"], launched)
    assert min(seconds.values()) >= 0 and record["phase_ends"]["handover"] <= record["checked_unix"]
    assert sum(seconds.values()) <= record["checked_unix"] - launched + 0.0005 * len(seconds)  # each rounded
    cfg = yaml.safe_load(data)
    assert cfg["learner"]["lr"] == 3e-3 and cfg["metrics"]["run_dir"] == str(tmp_path / "run")
    assert not os.path.exists(resolved)
    # several nodes: torchrun's flags pass through, the check covers nproc x nnodes ranks
    calls.clear()
    assert cli.main(["train", "--nproc", "3", "--nnodes=2", "--node-rank", "1", "--rdzv-endpoint=h:29400", *args]) == 0
    cmd = calls[0][0]
    assert "--standalone" not in cmd and cmd[:5] == ["--nproc-per-node=3", "--nnodes=2", "--node-rank", "1",
                                                     "--rdzv-endpoint=h:29400"]


def test_every_bad_input_through_colocate_train_is_one_line_and_no_torchrun(monkeypatch, tmp_path, capsys):
    import datasets  # noqa: F401 - imported here, the checks forked for each case start warm
    import colocate.envs.agent  # noqa: F401
    import colocate.envs.dataset  # noqa: F401
    from tests.test_bad_input import CASES, materialize
    no_torchrun_env(monkeypatch)
    ranks = []  # torchrun starts beside the checks; its ranks must get no config

    def fake_torchrun(args, launch):
        ranks.append(handed_over(args)[1])
        return 2
    monkeypatch.setattr(launcher, "run_torchrun", fake_torchrun)
    for case_id, text, overrides, expected in CASES:
        case_dir = tmp_path / case_id.replace(" ", "_")
        case_dir.mkdir()
        path, overrides = materialize(text, overrides, case_dir)
        monkeypatch.syspath_prepend(str(case_dir))  # the case's user modules, as tests/test_bad_input.py does
        code = cli.main(["train", "--config", path, f"--metrics.run_dir={case_dir / 'run'}",
                         f"--model.cache_dir={tmp_path / 'cache'}", *overrides])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and expected in err[0], (case_id, err)
        assert set(ranks) <= {None}, case_id


def test_python_m_train_without_torchrun_says_how_to_launch(monkeypatch, capsys):
    from colocate.rank_config import configure
    no_torchrun_env(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        configure(["--config", TINY])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "colocate train --config" in err[0]


def test_a_run_dir_holding_a_run_is_refused_unless_resumed_or_overwritten(monkeypatch, tmp_path):
    from colocate.launch import check_config
    no_torchrun_env(monkeypatch)
    run = tmp_path / "run"
    args = ["--config", TINY, f"--metrics.run_dir={run}", f"--model.cache_dir={tmp_path / 'cache'}"]
    check_config(args, world=2)  # a fresh directory
    (run / "tb" / "learner").mkdir(parents=True)
    (run / "config.yaml").write_text("x")
    (run / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"holds an earlier run \(config.yaml, tb\): it wrote no checkpoint to "
                                          r"--resume from: pass --overwrite"):
        check_config(args, world=2)
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"\(config.yaml, tb, checkpoints\): pass --resume to continue it"):
        check_config(args, world=2)
    check_config([*args, "--resume"], world=2)
    with pytest.raises(ConfigError, match=r"holds an earlier run"):  # a check refuses what the run would
        check_config([*args, "--check"], world=2)
    check_config([*args, "--check", "--overwrite"], world=2)  # and deletes nothing
    assert (run / "tb").exists()
    for name in ("startup.json", "inference-rank0.json", "failure-rank1.txt"):  # a run that failed, per rank
        (run / name).write_text("{}")
    check_config([*args, "--overwrite"], world=2)
    assert sorted(os.listdir(run)) == ["notes.txt"]  # the earlier run's entries only, its per-rank files too
    (run / "failure-rank1.txt").write_text("x")  # alone, it still marks an earlier run
    with pytest.raises(ConfigError, match=r"holds an earlier run \(failure-rank1.txt\)"):
        check_config(args, world=2)


def greedy_answers(model, tokenizer, prompts):
    out = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def test_export_merged_model_answers_as_the_adapter_through_peft(tmp_path, tiny_cfg, tiny_tokenizer):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from colocate.checkpoint import peft_config_dict, save_adapter
    from colocate.config import save_config
    from colocate.models import build_model
    from colocate.models import build_policy
    run = tmp_path / "run"
    save_config(tiny_cfg, str(run / "config.yaml"))
    policy = build_policy(tiny_cfg, tiny_tokenizer, "cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a trained-looking adapter: B != 0, large enough to change greedy answers
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    adapter = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_" in n}
    from colocate.models import canonical_name
    from colocate.models import base_identity
    save_adapter(str(run / "adapter"), {canonical_name(n): t for n, t in adapter.items()}, peft_config_dict(policy),
                 base=base_identity(tiny_cfg.model, len(tiny_tokenizer)), version=1)
    assert cli.main(["export", "--run", str(run), "--merge", "--out", str(tmp_path / "merged")]) == 0
    assert cli.main(["export", "--run", str(run), "--out", str(tmp_path / "adapter")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    through_peft = PeftModel.from_pretrained(build_model(tiny_cfg.model, tiny_tokenizer, "cpu"),
                                             str(tmp_path / "adapter")).eval()
    base = build_model(tiny_cfg.model, tiny_tokenizer, "cpu").eval()
    prompts = ["add 1 and 2 ; answer :", "add 3 and 4 ; answer :", "add 0 and 0 ; answer :",
               "add 2 and 2 ; answer :", "add 4 and 1 ; answer :"]
    want = greedy_answers(through_peft, tiny_tokenizer, prompts)
    assert greedy_answers(merged, tiny_tokenizer, prompts) == want
    assert greedy_answers(base, tiny_tokenizer, prompts) != want  # the adapter matters


def test_readme_commands_script_runs_the_readmes_commands_in_order():
    """scripts/readme_commands.sh (issue 56) holds every command of the README's Install, Run and
    test blocks, in the README's order, so the two cannot drift apart."""
    readme = open(os.path.join(REPO, "README.md")).read()
    blocks = [block.split("```", 1)[0] for block in readme.split("```bash\n")[1:4]]
    assert "pip install torch" in blocks[0] and "colocate train" in blocks[1] and "pytest" in blocks[2]
    commands = [part.split("#")[0].strip() for block in blocks for line in block.splitlines()
                for part in line.split(";") if part.split("#")[0].strip()]
    script = open(os.path.join(REPO, "scripts", "readme_commands.sh")).read()
    missing = [c for c in commands if c not in script]
    assert not missing, missing
    positions = [script.index(c) for c in commands]
    assert positions == sorted(positions)


def test_check_without_world_size_derives_the_world_as_train_does(monkeypatch, tmp_path):
    """gpu-4.yaml fixes 2 + 2 ranks: `colocate train` starts 4 processes, so `colocate check` plans 4,
    not a default of 2 that the topology cannot fit."""
    from colocate.launch import check_config, default_world, split_check_flags
    no_torchrun_env(monkeypatch)
    gpu4 = os.path.join(REPO, "configs", "gpu-4.yaml")
    assert split_check_flags(["--check", "--config", gpu4]).world is None
    assert default_world(load_config(gpu4)) == 4  # what `colocate train` starts without --nproc
    cfg, _, _ = check_config(["--check", "--config", gpu4, "--gpu-memory", "h100", f"--metrics.run_dir={tmp_path}"])
    assert (cfg.topology.num_inference, cfg.topology.num_learners) == (2, 2)


def test_resume_and_overwrite_together_are_refused_in_one_line(monkeypatch, tmp_path):
    from colocate.launch import check_config
    no_torchrun_env(monkeypatch)
    args = ["--config", TINY, f"--metrics.run_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError, match=r"^--overwrite and --resume contradict: --overwrite starts .* afresh"):
        check_config([*args, "--resume", "--overwrite"], world=2)
    with pytest.raises(ConfigError, match=r"^--overwrite and checkpoint.resume='auto' contradict"):
        check_config([*args, "--checkpoint.resume=auto", "--overwrite", "--check"], world=2)


def test_skipped_checkpoints_are_named_once_per_launch(monkeypatch, tmp_path, capsys):
    """One process checks a launch and names the checkpoints it skipped; the ranks load the one it
    pinned (`load_resumed`) and say nothing more."""
    from colocate import launch, rank_config
    no_torchrun_env(monkeypatch)
    monkeypatch.setattr("colocate.checkpoint.resolve_resume", lambda *a: (None, ["skipped step-000009: damaged"]))
    cfg = launch.load_config(TINY)
    assert launch.load_resume(cfg, True) is None  # the launcher's check
    assert capsys.readouterr().err.count("colocate: resume: skipped step-000009") == 1
    assert rank_config.load_resumed(cfg) is None  # a rank: nothing pinned, nothing to load or say
    assert capsys.readouterr().err == ""


def test_check_prints_the_plan_after_the_config(monkeypatch, tmp_path):
    """The plan is the last thing a check prints: a long config echo does not scroll it away."""
    import io
    import sys
    no_torchrun_env(monkeypatch)
    monkeypatch.chdir(REPO)
    terminal = io.StringIO()  # stdout and stderr, as one terminal shows them
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli.main(["check", "--config", "configs/gpu-4.yaml", "--gpu-memory", "h100",
                     f"--metrics.run_dir={tmp_path / 'run'}"]) == 0
    lines = terminal.getvalue().strip().splitlines()
    first_plan_line = next(i for i, line in enumerate(lines) if line.startswith("colocate: memory plan"))
    assert lines.index("learner:") < first_plan_line
    assert all(line.startswith("colocate: memory plan") for line in lines[first_plan_line:])
def test_a_run_that_takes_the_directory_during_the_checks_refuses_the_launch(monkeypatch, tmp_path, capsys):
    """The launcher holds the run directory once the checks passed, while its ranks wait: a live run
    that took it meanwhile is the launch's one line and exit 2, and the ranks get a refusal."""
    from colocate import run_dir
    no_torchrun_env(monkeypatch)

    def taken(path, by):
        raise ConfigError(f"metrics.run_dir={path!r} is in use by another run")
    monkeypatch.setattr(run_dir, "hold", taken)
    ranks = []
    monkeypatch.setattr(launcher, "run_torchrun", lambda args, launch: ranks.append(handed_over(args)[1]) or 2)
    assert cli.main(["train", "--config", TINY, f"--metrics.run_dir={tmp_path / 'run'}",
                     f"--model.cache_dir={tmp_path / 'cache'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("colocate: config error: metrics.run_dir=") and ranks == [None], err


HOLDER = """
import sys, time
sys.path.insert(0, {repo!r})
from colocate import run_dir
lock = run_dir.hold({path!r}, by="colocate train")
print("held", flush=True)
time.sleep(300)
"""


def test_a_live_run_holds_its_directory_and_a_killed_one_leaves_it_free(monkeypatch, tmp_path):
    """While a run holds its directory, another run, `--overwrite` and `colocate check` are refused
    in one line naming it (pid, host, start), and nothing is deleted; its rank 0 goes ahead (its
    launcher is the holder), another job's rank 0 does not. Killed with -9, it leaves the directory
    free: the kernel dropped its lock."""
    import signal
    import socket
    import subprocess
    import sys

    from colocate import run_dir
    from colocate.launch import check_config
    from tests.conftest import REPO
    no_torchrun_env(monkeypatch)
    run = tmp_path / "run"
    (run / "tb").mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER.format(repo=REPO, path=str(run))], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        args = ["--config", TINY, f"--metrics.run_dir={run}", f"--model.cache_dir={tmp_path / 'cache'}"]
        in_use = (rf"metrics.run_dir='{run}' is in use by pid {holder.pid} \(colocate train\) on "
                  rf"{socket.gethostname()}, started \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d: wait for it to end or stop it, "
                  r"or --metrics.run_dir=NEW")
        for extra in ([], ["--overwrite"], ["--resume"], ["--check"]):
            with pytest.raises(ConfigError, match=in_use):
                check_config([*args, *extra], world=2)
        assert (run / "tb").is_dir()
        cfg = load_config(TINY, {"metrics": {"run_dir": str(run)}})
        monkeypatch.setattr(run_dir, "_held", [])
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
        monkeypatch.setenv("RANK", "0")
        with pytest.raises(ConfigError, match=in_use):  # rank 0 of another job
            run_dir.claim(cfg, resume=False, overwrite=True, remove=True)
        monkeypatch.setattr(os, "getppid", lambda: holder.pid)  # rank 0 of the holder's own job
        run_dir.claim(cfg, resume=False, overwrite=True, remove=True)
        assert run_dir._held == [] and not (run / "tb").exists()  # its --overwrite deleted the entries
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    monkeypatch.undo()
    no_torchrun_env(monkeypatch)
    check_config(args, world=2)  # free again
    lock = run_dir.hold(str(run), by="colocate train")
    assert lock is not None
    lock.close()


def failure(tmp_path, monkeypatch, name: str, exitcode: int, said: str | None):
    """A torchrun ProcessFailure for a rank that left `said` in its error file (None: no file)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from colocate.lifecycle import tell_launcher
    import uuid
    path = tmp_path / f"{name}-{uuid.uuid4().hex}.json"  # a new file for every call
    if said is not None:
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        tell_launcher(said)
    return ProcessFailure(local_rank=0, pid=1, exitcode=exitcode, error_file=str(path))


def test_the_rank_that_ended_the_job_is_named_when_it_said_nothing(tmp_path, monkeypatch):
    """`launcher.failed_rank`: the first failed rank that did not only lose a peer ended the job; a line
    for it unless it printed its own (an error, exit 2 or 3); ranks that followed never count."""
    from colocate.launcher import Job, failed_rank
    job = Job("/r", ("inference", "learner"), checkpoints=False, single_node=True)

    def case(**ranks):
        return failed_rank({int(k[1:]): failure(tmp_path, monkeypatch, k, *v) for k, v in ranks.items()}, job)

    tail = "; last checkpoint: none (checkpoint.enabled is false)"
    rank, f, line = case(r1=(1, "peer"), r0=(-9, None))
    assert (rank, f.exitcode) == (0, -9)
    assert line == "colocate: failed: rank 0 (inference) was killed by SIGKILL (often the out-of-memory killer)" + tail
    rank, f, line = case(r0=(1, "peer"), r1=(-11, None))
    assert (rank, line) == (1, "colocate: failed: rank 1 (learner) was killed by SIGSEGV" + tail)
    rank, f, line = case(r1=(7, None), r0=(1, "peer"))
    assert (rank, line) == (1, "colocate: failed: rank 1 (learner) exited with code 7 and no error (an os._exit or "
                               "a library's exit in its code)" + tail)
    assert case(r0=(1, "failed"), r1=(1, "peer"))[::2] == (0, None)  # it printed its line
    assert case(r0=(2, None), r1=(-9, None))[::2] == (0, None)  # a refusal; torchrun killed the other after it
    rank, f, line = case(r0=(1, "peer"), r1=(1, "peer"))
    assert rank == 0 and "rank 0 (inference) lost its connection to another rank" in line


def test_the_launchers_checking_child_works_under_its_lock_and_others_are_refused(tmp_path):
    """`colocate train` holds the run directory before its checks, so an --overwrite's deletes run
    under the lock: its forked checking child passes (even with `json` broken by user code), any
    other process is refused naming the holder."""
    from colocate import run_dir
    lock = run_dir.hold(str(tmp_path / "run"), by="colocate train")
    try:
        pid = os.fork()
        if pid == 0:  # the checking child
            import json
            json.loads = lambda *a, **k: "garbage"
            try:
                run_dir.refuse_if_held(str(tmp_path / "run"))
                os._exit(0)
            except ConfigError:
                os._exit(2)
        assert os.waitpid(pid, 0)[1] == 0
        with pytest.raises(ConfigError, match=r"is in use by pid \d+ \(colocate train\)"):
            run_dir.refuse_if_held(str(tmp_path / "run"))  # this process is not its own launcher's child
    finally:
        lock.close()
