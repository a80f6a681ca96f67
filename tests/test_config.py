"""Config: parsing, overrides, and every bad config exits with code 2 and one line, fast."""
import os
import re
import subprocess
import sys

import pytest

from colocate.config import ConfigError, field_docs, load_config, parse_overrides, ModelConfig, Config
from tests.conftest import REPO


def test_overrides_parse_and_coerce():
    path, nested, resume = parse_overrides(["--config", "configs/cpu-tiny.yaml", "--learner.lr=0.5",
                                            "--env.use_constraint", "false", "--resume"])
    assert path == "configs/cpu-tiny.yaml" and resume
    cfg = load_config(os.path.join(REPO, path), nested)
    assert cfg.learner.lr == 0.5 and cfg.env.use_constraint is False
    assert cfg.rollout.group_size == 8  # from the YAML file


def test_unknown_key_names_nearest():
    with pytest.raises(ConfigError, match=r"unknown config key 'learner.lrr'.*'learner.lr'"):
        load_config(None, {"learner": {"lrr": 1}})
    with pytest.raises(ConfigError, match=r"'rolout'.*'rollout'"):
        load_config(None, {"rolout": {}})


def test_wrong_type():
    with pytest.raises(ConfigError, match="learner.num_steps: expected int"):
        load_config(None, {"learner": {"num_steps": "many"}})


def test_every_field_documented():
    import dataclasses
    for f in dataclasses.fields(Config):
        section = f.default_factory()
        docs = field_docs(type(section))
        missing = [g.name for g in dataclasses.fields(section) if g.name not in docs]
        assert not missing, f"{f.name}: undocumented fields {missing}"
    assert "path" in field_docs(ModelConfig)


BAD = [
    (["--learner.lrr=1"], "unknown config key 'learner.lrr'"),  # refused while parsing
    (["--topology.num_inference=3"], "do not fit world size"),  # parsed, refused by the world-size check
    (["--model.path=/nonexistent/model"], "not a local directory"),  # refused by the preflight
]


@pytest.mark.parametrize("args,message", BAD, ids=["unknown", "roles", "path"])
def test_bad_config_exits_2_before_anything_is_built(args, message, tmp_path):
    """The process itself (tests/test_bad_input.py runs every other case in-process): exit 2, one
    line, and nothing written under the model cache or the run directory (no tokenizer, no model,
    no run dir: the check comes first)."""
    cache, run = tmp_path / "cache", tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "colocate.train", "--config", "configs/cpu-tiny.yaml", *args,
                           f"--model.cache_dir={cache}", f"--metrics.run_dir={run}"],
                          cwd=REPO, env={**os.environ, "WORLD_SIZE": "2"}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not cache.exists() and not run.exists()


def test_choice_and_range_fields_are_checked():
    with pytest.raises(ConfigError, match=r"engine.cudagraph_mode='full' is not one of"):
        load_config(None, {"engine": {"cudagraph_mode": "full"}})
    with pytest.raises(ConfigError, match=r"topology.placement='by_host' is not one of 'by_node', 'interleaved'"):
        load_config(None, {"topology": {"placement": "by_host"}})
    with pytest.raises(ConfigError, match=r"engine.max_capture_tokens=-1 must be >= 0"):
        load_config(None, {"engine": {"max_capture_tokens": -1}})
    assert load_config(None, {"engine": {"cudagraph_mode": "FULL"}}).engine.cudagraph_mode == "FULL"
    for lag in (0, 1):  # lag 1 would leave the batches no overlap with training
        with pytest.raises(ConfigError, match=r"rollout.oversample_groups=4 needs learner.max_policy_lag >= 2"):
            load_config(None, {"rollout": {"oversample_groups": 4}, "learner": {"max_policy_lag": lag}})


def test_oversampled_batches_start_one_version_fresher():
    from colocate.config import sampling_lag
    assert sampling_lag(load_config(None, {"learner": {"max_policy_lag": 2}})) == 2
    assert sampling_lag(load_config(None, {"learner": {"max_policy_lag": 2}, "rollout": {"oversample_groups": 4}})) == 1
    assert sampling_lag(load_config(None, {"learner": {"max_policy_lag": 3}, "rollout": {"oversample_groups": 1}})) == 2


def test_world_of_one_does_not_fit():
    with pytest.raises(ConfigError, match="do not fit world size 1"):
        load_config(None, {}, world_size=1)


@pytest.mark.parametrize("name,world", [("cpu-tiny", 2), ("cpu-diplomacy-tiny", 2), ("gpu-1", 2), ("gpu-1-7b", 2), ("gpu-2", 2),
                                        ("gpu-4", 4), ("gpu-8", 8), ("gpu-4-gsm8k", 4),
                                        ("gpu-8-gsm8k", 8)])
def test_shipped_configs_validate(name, world):
    cfg = load_config(os.path.join(REPO, "configs", f"{name}.yaml"), world_size=world)
    assert cfg.rollout.batch_size == cfg.rollout.groups_per_step * cfg.rollout.group_size


def test_choice_tuples_match_their_users():
    """config_schema imports nothing of colocate, so the tuples it shares with the loss and the
    models are checked here."""
    from colocate.config_schema import MODEL_SHAPES, NORM_MODES, RATIO_LEVELS
    from colocate.kernels.reference import NORM_MODES as KERNEL_NORM_MODES
    from colocate.kernels.reference import RATIO_LEVELS as KERNEL_RATIO_LEVELS
    from colocate.models import SHAPES
    assert NORM_MODES == KERNEL_NORM_MODES
    assert RATIO_LEVELS == KERNEL_RATIO_LEVELS
    assert MODEL_SHAPES == tuple(SHAPES)


@pytest.mark.parametrize("section,key", [("engine", "jump_forward"), ("sync", "fanout"),
                                         ("learner", "prefetch_blocks")])
def test_levers_not_adopted_are_unknown_keys(section, key):
    with pytest.raises(ConfigError, match=f"unknown config key '{section}.{key}'"):
        load_config(None, {section: {key: 1}})


def write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_base_file_is_merged_under_the_file_and_overrides(tmp_path):
    write(tmp_path / "base.yaml", "learner:\n  lr: 0.5\n  num_steps: 7\nlora:\n  target_modules: [q_proj, v_proj]\n")
    (tmp_path / "presets").mkdir()
    path = write(tmp_path / "presets" / "run.yaml",  # the base path is relative to the file naming it
                 "base: ../base.yaml\nlearner:\n  num_steps: 9\nlora:\n  target_modules: [o_proj]\n")
    cfg = load_config(path, {"learner": {"max_policy_lag": "2"}})
    assert cfg.learner.lr == 0.5                        # from the base
    assert cfg.learner.num_steps == 9                   # the file over its base, key by key
    assert cfg.learner.max_policy_lag == 2              # the overrides over both
    assert cfg.lora.target_modules == ["o_proj"]        # a list is replaced whole
    assert load_config(path, {"learner": {"lr": "0.25"}}).learner.lr == 0.25


def test_base_chain(tmp_path):
    write(tmp_path / "a.yaml", "learner:\n  lr: 0.5\n  num_steps: 3\nrollout:\n  seed: 4\n")
    write(tmp_path / "b.yaml", "base: a.yaml\nlearner:\n  num_steps: 5\n")
    cfg = load_config(write(tmp_path / "c.yaml", "base: b.yaml\nrollout:\n  seed: 6\n"))
    assert (cfg.learner.lr, cfg.learner.num_steps, cfg.rollout.seed) == (0.5, 5, 6)


def test_base_cycle_is_refused(tmp_path):
    write(tmp_path / "a.yaml", "base: b.yaml\n")
    write(tmp_path / "b.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError, match=r"config base cycle: .*a\.yaml -> .*b\.yaml -> .*a\.yaml"):
        load_config(str(tmp_path / "a.yaml"))
    with pytest.raises(ConfigError, match=r"config base cycle: .*self\.yaml -> .*self\.yaml"):
        load_config(write(tmp_path / "self.yaml", "base: self.yaml\n"))


def test_base_errors_name_the_file(tmp_path):
    base = write(tmp_path / "base.yaml", "learner:\n  lrr: 0.5\n")
    path = write(tmp_path / "run.yaml", "base: base.yaml\nlearner:\n  lr: 0.5\n")
    message = rf"^{re.escape(base)}: unknown config key 'learner.lrr'; did you mean 'learner.lr'\?"
    with pytest.raises(ConfigError, match=message):
        load_config(path)
    write(tmp_path / "good.yaml", "learner:\n  lr: 0.5\n")
    child = write(tmp_path / "child.yaml", "base: good.yaml\nrolout:\n  seed: 1\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(child)}: unknown config key 'rolout'; did you mean 'rollout'"):
        load_config(child)
    with pytest.raises(ConfigError, match=r"config file not found: .*missing\.yaml \(the base of .*run2\.yaml\)"):
        load_config(write(tmp_path / "run2.yaml", "base: missing.yaml\n"))
    with pytest.raises(ConfigError, match=r"base: expected a file name"):
        load_config(write(tmp_path / "run3.yaml", "base: [a.yaml]\n"))


@pytest.mark.parametrize("where,expected", [
    ("/dev/zero", "/dev/zero (the base of {file}) is a character device, not a regular file"),
    ("{tmp}", "{tmp} (the base of {file}) is a directory, not a regular file"),
])
def test_a_base_that_is_no_regular_file_says_what_it_is(tmp_path, where, expected):
    file = tmp_path / "run.yaml"
    file.write_text(f"base: {where.format(tmp=tmp_path)}\nlearner:\n  lr: 0.001\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(file))
    assert str(info.value) == expected.format(tmp=tmp_path, file=file) + " (a YAML config file is expected)"


def test_a_config_that_is_a_device_or_empty_says_so(tmp_path):
    with pytest.raises(ConfigError, match=r"^/dev/urandom is a character device, not a regular file"):
        load_config("/dev/urandom")
    empty = tmp_path / "config.yaml"  # an emptied run config.yaml: said, not read as the defaults
    empty.write_text("# nothing\n")
    with pytest.raises(ConfigError, match=r"config.yaml: is empty \(or only comments\)"):
        load_config(str(empty))
    empty.write_text("{}\n")
    assert load_config(str(empty)) == load_config(None)  # all the defaults, said so


def test_an_alias_bomb_is_refused_at_once_wherever_it_is(tmp_path):
    """Nine anchors, each naming the one before nine times: 9^9 values once expanded. Inside
    env.options (a free mapping) as at the top level, on the command line too; a cycle as well."""
    bomb = "".join(f"k{i}: &a{i} [{', '.join([f'*a{i - 1}' if i else 'x'] * 9)}]\n" for i in range(9))
    inside = tmp_path / "inside.yaml"
    inside.write_text("env:\n  options:\n" + "".join("    " + line + "\n" for line in bomb.splitlines()))
    for path in (inside, tmp_path / "top.yaml"):
        if path.name == "top.yaml":
            path.write_text(bomb)
        with pytest.raises(ConfigError, match=r"its YAML aliases expand to more than 100,000 values"):
            load_config(str(path))
    flow = "{" + ", ".join(f"k{i}: &a{i} [{', '.join([f'*a{i - 1}' if i else 'x'] * 9)}]" for i in range(9)) + "}"
    with pytest.raises(ConfigError, match=r"^env.options: its YAML aliases expand"):
        load_config(None, {"env": {"options": flow}})
    (tmp_path / "cycle.yaml").write_text("env:\n  options:\n    a: &a [*a]\n")
    with pytest.raises(ConfigError, match="refers to a node that contains it"):
        load_config(str(tmp_path / "cycle.yaml"))
    (tmp_path / "fine.yaml").write_text("env:\n  options: &o {x: 1}\neval:\n  max_samples: 3\n")
    assert load_config(str(tmp_path / "fine.yaml")).env.options == {"x": 1}  # ordinary anchors still work
