"""What users bring: their data files, reward functions and env classes.

Start-up failures are in `tests/test_bad_input.py`'s catalogue (one line, exit 2, through
`rank_config.configure`, which `--check` runs too); here: the row policy at scale (skip counts equal the
bad rows), results of the wrong shape at run time (counted, named, fatal past the limit), a fuzz
of every built-in env's parsing, the engine's context guard, old checkpoints, and `--check` as a
process.
"""
import importlib.util
import json
import os
import random
import subprocess
import sys

import pytest

from colocate.config import load_config
from tests.conftest import REPO

DATASET = os.path.join(REPO, "configs", "cpu-dataset-tiny.yaml")


def dataset_cfg(tmp_path, files, **env):
    return load_config(DATASET, {"env": {"data_files": files, "eval_files": [], **env},
                                 "model": {"cache_dir": str(tmp_path / "cache")},
                                 "metrics": {"run_dir": str(tmp_path / "run")}})


BAD_KINDS = {  # one per reason a row is dropped; a JSON line each
    "missing_prompt": '{"answer": "3"}', "empty_prompt": '{"prompt": "  ", "answer": "3"}',
    "missing_answer": '{"prompt": "add 1 and 2 ; answer :", "answer": null}',
    "too_long": '{"prompt": "' + " ".join(map(str, range(1200))) + '", "answer": "3"}',
}


def write_rows(path, num_rows: int, bad_every: int) -> dict[str, list[int]]:
    """A JSONL file with a bad row (cycling through BAD_KINDS) every `bad_every` rows -> reason ->
    the file lines of those rows."""
    kinds, lines = list(BAD_KINDS), {k: [] for k in BAD_KINDS}
    with open(path, "w") as f:
        for i in range(num_rows):
            if i % bad_every == bad_every - 1:
                kind = kinds[(i // bad_every) % len(kinds)]
                f.write(BAD_KINDS[kind] + "\n")
                lines[kind].append(i + 1)
            else:
                f.write(json.dumps({"prompt": f"add {i % 5} and 1 ; answer :", "answer": str(i % 5 + 1)}) + "\n")
    return lines


def digit_ids(prompt) -> list[int]:
    """A stand-in tokenizer: one id per character (the tiny tokenizer splits digits likewise)."""
    return list(range(len(prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt))))


def test_20000_rows_with_1_percent_bad_skip_counts_them_and_error_names_the_first(tmp_path):
    from colocate.envs.dataset_files import BadRowError, open_rows
    file = tmp_path / "big.jsonl"
    lines = write_rows(file, 20_000, bad_every=100)
    rows, scan = open_rows(dataset_cfg(tmp_path, [str(file)], bad_rows="skip"), "data_files", digit_ids)
    assert scan.counts == {k: len(v) for k, v in lines.items()} and sum(scan.counts.values()) == 200
    assert len(rows) == 19_800 and all(p and p.strip() for p in rows["prompt"])
    with pytest.raises(BadRowError, match=rf"big.jsonl line {lines['missing_prompt'][0]}, column 'prompt'"):
        open_rows(dataset_cfg(tmp_path, [str(file)]), "data_files", digit_ids)


def test_the_env_drops_bad_rows_under_skip_and_reports_them(tmp_path, tiny_tokenizer):
    from colocate.envs.dataset import DatasetEnv
    file = tmp_path / "small.jsonl"
    lines = write_rows(file, 400, bad_every=10)
    env = DatasetEnv.from_config(dataset_cfg(tmp_path, [str(file)], bad_rows="skip"), tiny_tokenizer, seed=0)
    assert env.data_stats() == {f"dropped/{k}": float(len(v)) for k, v in lines.items()}
    assert len(env.rows) == 360


def test_the_env_hashes_its_data_files_once_when_a_checkpoint_first_asks(tmp_path, tiny_tokenizer, monkeypatch):
    from colocate.envs import dataset
    file = tmp_path / "small.jsonl"
    write_rows(file, 40, bad_every=1000)  # no bad row
    calls = []
    real = dataset.data_fingerprint
    monkeypatch.setattr(dataset, "data_fingerprint", lambda *a: calls.append(a) or real(*a))
    cfg = dataset_cfg(tmp_path, [str(file)])
    env = dataset.DatasetEnv.from_config(cfg, tiny_tokenizer, seed=0)
    assert calls == []  # not at start-up
    assert env.state_dict()["data"] == env.state_dict()["data"] == real([str(file)], cfg.env.split)
    assert calls == [([str(file)], cfg.env.split)]


def test_a_directory_of_data_files_is_read_as_its_files(tmp_path):
    from colocate.envs.dataset import load_rows
    from colocate.envs.dataset_files import check_data_files
    folder = tmp_path / "data"
    (folder / "part").mkdir(parents=True)
    write_rows(folder / "a.jsonl", 30, bad_every=1000)
    write_rows(folder / "part" / "b.jsonl", 20, bad_every=1000)
    (folder / "README.txt").write_text("not data")
    check_data_files("data_files", [str(folder)])
    assert len(load_rows([str(folder)], "train", str(tmp_path / "cache"))) == 50


# -- reward functions and env methods returning the wrong shape -----------------------------------
def returns_generator(prompts, completions, **columns):
    return (1.0 for _ in completions)


def returns_scalar(prompts, completions, **columns):
    return 1.0


def returns_strings(prompts, completions, **columns):
    return ["1"] * len(completions)


def returns_too_few(prompts, completions, **columns):
    return [1.0]


@pytest.mark.parametrize("name,said", [("returns_generator", "returned generator"), ("returns_scalar", "float 1.0"),
                                       ("returns_strings", "returned str '1' at position 0"),
                                       ("returns_too_few", "returned 1 values for 3 completions")])
def test_reward_results_of_the_wrong_shape_are_named_counted_and_fatal_in_a_row(name, said, capsys):
    from colocate.rewards import RewardError, RewardLimits, RewardSet
    rewards = RewardSet([f"tests.test_user_inputs:{name}"], [], limits=RewardLimits(max_errors=5))
    total, bad = rewards.score(["p"] * 3, ["a", "b", "c"], {"answer": ["a"] * 3})
    assert total == [0.0] * 3 and bad == [True] * 3 and rewards.take_errors() == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"reward function tests.test_user_inputs:{name} " in err[0] and said in err[0], err
    with pytest.raises(RewardError, match=name):
        rewards.score(["p"] * 3, ["a", "b", "c"], {"answer": ["a"] * 3})


class ScriptedEnv:
    """Stands in for a user's env: returns what the test tells it to."""
    def __init__(self, requests, finished):
        self._requests, self._finished = requests, finished

    def requests(self):
        return self._requests

    def pop_finished(self):
        return self._finished


def test_env_results_of_the_wrong_shape_are_named_counted_and_fatal_in_a_row(capsys):
    from colocate.data import Request
    from colocate.envs.protocol import EnvResultError, ResultCheck
    good = ((0, 0), Request(prompt_ids=[1, 2], max_new_tokens=2, temperature=1.0))
    env = ScriptedEnv([good, ("only a key",), ([0], good[1])], {"not": "a list"})
    check = ResultCheck(env, max_errors=3)
    assert check.requests(env.requests()) == [good]
    assert check.samples(env.pop_finished()) == []
    assert check.take_errors() == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "ScriptedEnv.requests() returned an item tuple ('only a key',)" in err[0], err
    assert "ScriptedEnv.pop_finished() returned dict" in err[1] and "expected a list of Samples" in err[1], err
    with pytest.raises(EnvResultError, match=r"ScriptedEnv.requests\(\)"):
        for _ in range(4):
            check.requests([("x",)])


def test_requests_in_flight_are_skipped_and_the_rest_still_checked():
    """The rollout worker passes the keys in flight: those pairs are not checked again or returned;
    new pairs are, and bad items (an unhashable key among them) are still counted."""
    from colocate.data import Request
    from colocate.envs.protocol import ResultCheck
    request = Request(prompt_ids=[1, 2], max_new_tokens=2, temperature=1.0)
    flying, new = ((0, 0), request), ((0, 1), request)
    returned = [flying, new, ([0], request), "junk"]
    env = ScriptedEnv(returned, [])
    check = ResultCheck(env, max_errors=3)
    assert check.requests(returned, known={(0, 0)}) == [new]
    assert check.requests(returned) == [flying, new]
    assert check.take_errors() == 4
    for _ in range(5):  # in flight is usable: an env that also returns one bad item each time never trips the limit
        assert check.requests([flying, "junk"], known={(0, 0)}) == []


def test_the_guessing_game_follows_the_protocol_and_a_broken_env_is_named():
    from colocate.envs.base import Env
    from colocate.envs.protocol import EnvProtocolError, check_env_class
    from examples.guessing_game import GuessingGameEnv
    check_env_class(GuessingGameEnv, {"max_number": 4})

    class NoPop(GuessingGameEnv):
        pop_finished = Env.pop_finished
    with pytest.raises(EnvProtocolError, match=r"NoPop does not implement pop_finished\(\)"):
        check_env_class(NoPop, {})


def test_a_user_module_that_fails_at_import_is_one_line_naming_file_and_line(tmp_path, monkeypatch):
    from colocate.objects import ObjectPathError, load_object
    (tmp_path / "broken_at_line_3.py").write_text("import os\n\nvalue = {}['missing']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ObjectPathError) as info:
        load_object("broken_at_line_3:score")
    message = str(info.value)
    assert "\n" not in message and "KeyError: 'missing'" in message and "broken_at_line_3.py, line 3" in message


# -- model output: every built-in env parses anything ---------------------------------------------
def fuzz_texts(seed: int, count: int):
    """Random text of any length and bytes, plus the known killers (huge integers, lone surrogates)."""
    rng = random.Random(seed)
    yield "9" * 5000
    yield "-" + "1" * 4301
    yield "\\boxed{" * 300 + "1" * 5000
    yield "#### " + "7" * 4400
    yield "\ud800 12"
    for _ in range(count):
        n = rng.choice([0, 1, 3, 20, 200, 5000])
        raw = bytes(rng.randrange(256) for _ in range(n))
        yield rng.choice([raw.decode("utf-8", "replace"), raw.decode("latin-1"),
                          "".join(rng.choice("0123456789 ,.-#{}\\boxed\n") for _ in range(n))])


def test_fuzz_arithmetic_and_reward_parsing_never_raise():
    from colocate.envs.arithmetic import parse_answer
    from colocate.rewards import boxed, exact, gsm8k
    for text in fuzz_texts(seed=0, count=600):
        value = parse_answer(text)
        assert value is None or isinstance(value, int)
        for fn in (gsm8k, boxed, exact):
            assert fn([""], [text], answer=[text[:50]])[0] in (0.0, 1.0)
            assert fn([""], [[{"role": "assistant", "content": text}]], answer=["#### 7"])[0] in (0.0, 1.0)
    assert parse_answer(" 12 ") == 12 and parse_answer("9" * 5000) is None


def test_fuzz_diplomacy_order_parsing_never_raises():
    from colocate.envs.diplomacy import game as dg
    from colocate.envs.diplomacy.orders import parse_orders
    from colocate.envs.diplomacy.prompt import power_orders
    game = dg.new_game()
    orders = power_orders(game, dg.legal_orders(game))["FRANCE"]
    for text in fuzz_texts(seed=1, count=300):
        for labels in (True, False):
            parsed = parse_orders(text, orders, unit_labels=labels)
            assert parsed.num_invalid + len(parsed.orders) == orders.num_slots


# -- the engine's context, old checkpoints, --check as a process ----------------------------------
def test_the_hf_engine_refuses_a_prompt_longer_than_its_context(tiny_policy, tiny_tokenizer):
    from colocate.data import Request
    from colocate.engine.hf import HFEngine
    engine = HFEngine(tiny_policy, tiny_tokenizer)
    too_long = Request(prompt_ids=[5] * (engine.context - 1), max_new_tokens=4, temperature=1.0)
    with pytest.raises(ValueError, match=f"exceeds the model's context of {engine.context}"):
        engine.generate([Request(prompt_ids=[5, 6], max_new_tokens=2, temperature=1.0), too_long])


def test_a_checkpoint_without_manifest_resumes_only_when_trusted_with_one_warning(tmp_path, tiny_policy, capsys):
    from colocate.checkpoint import CheckpointError, load_checkpoint
    from tests.test_checkpoint import _save
    path = _save(str(tmp_path / "checkpoints"), 3, tiny_policy)
    os.remove(os.path.join(path, "manifest.json"))
    with pytest.raises(CheckpointError, match="--checkpoint.trust_unverified=true"):
        load_checkpoint(path)
    state = load_checkpoint(path, trust_unverified=True)
    assert state["trainer_state"]["step"] == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "resuming unverified" in err[0], err


CHECK_CASES = [(["--checkpoint.resume=/nonexistent/step-000001"], "does not exist")]
if importlib.util.find_spec("vllm") is None:
    CHECK_CASES.append((["--engine.kind=vllm"], "vllm is not installed"))


@pytest.mark.parametrize("args,expected", CHECK_CASES, ids=[c[0][0] for c in CHECK_CASES])
def test_check_refuses_what_the_launch_refuses(tmp_path, args, expected):
    out = subprocess.run([sys.executable, "-m", "colocate.train", "--config", "configs/cpu-tiny.yaml", "--check",
                          f"--metrics.run_dir={tmp_path / 'run'}", *args], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env={k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")})
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and expected in lines[0], out.stderr


def test_start_up_failures_come_before_any_weights(tmp_path, monkeypatch, capsys):
    """The catalogue's user-input cases fail in `configure` with building or loading weights made
    impossible."""
    import colocate.models
    from tests.test_bad_input import CASES, materialize, run_case

    def no_weights(*args, **kwargs):
        raise AssertionError("model weights were built during start-up checks")
    monkeypatch.setattr(colocate.models, "build_model", no_weights)
    monkeypatch.setattr(colocate.models, "materialize", no_weights)
    picked = ("dataset row prompt too long", "reward module syntax error", "custom env unknown option",
              "resume without manifest")
    for case_id, text, overrides, expected in [c for c in CASES if c[0] in picked]:
        path, filled = materialize(text, overrides, tmp_path)
        code, err = run_case(path, filled, tmp_path, monkeypatch, capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1 and expected in err, (case_id, err)


@pytest.mark.slow
def test_a_run_whose_reward_always_hangs_stops_in_one_line_naming_it(tmp_path):
    """Issue 52: a reward that never answers once stalled a run for good behind a generic stall
    alert; now each call ends at env.reward_timeout_s and max_reward_errors of them in a row end the
    run, non-zero, with one failure line naming the function."""
    import time
    cmd = [sys.executable, "-m", "colocate.cli", "train", "--config", "configs/cpu-dataset-tiny.yaml",
           "--env.reward=[tests.agent_fixtures:reward_hangs]", "--env.reward_timeout_s=1", "--env.max_reward_errors=20",
           "--learner.num_steps=5", f"--metrics.run_dir={tmp_path / 'run'}", f"--model.cache_dir={tmp_path / 'cache'}"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and time.monotonic() - t0 < 300
    failures = [line for line in proc.stderr.splitlines() if "colocate: failed: " in line]
    assert len(failures) == 1 and failures[0].startswith(
        "colocate: failed: rank 0 (inference): RewardError: reward tests.agent_fixtures:reward_hangs gave no usable "
        "value for 21 samples in a row (env.max_reward_errors=20); the last gave no answer within "
        "env.reward_timeout_s=1s"), proc.stderr[-3000:]


# -- a file that does not parse, paths -----------------------------------------------------------
def test_a_malformed_line_deep_in_a_large_file_is_named_by_its_file_line(tmp_path):
    """`datasets` reports the row of its own parser chunk ("row 96"); the line is the file's."""
    from colocate.config import ConfigError
    from colocate.envs.dataset_files import check_dataset
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        for i in range(20_000):
            f.write('{"prompt": "x", bad\n' if i == 19_000 else json.dumps({"prompt": f"q {i}", "answer": "1"}) + "\n")
    with pytest.raises(ConfigError, match=rf"env.data_files: {path} line 19001 column 17: not valid JSON \("):
        check_dataset(dataset_cfg(tmp_path, [str(path)]))
    path.write_text('{"prompt": "q", "answer": "1"}\n\n[1, 2]\n')  # blank lines count, a list is no row
    with pytest.raises(ConfigError, match=r"big.jsonl line 3: a JSON list, not an object of columns"):
        check_dataset(dataset_cfg(tmp_path, [str(path)]))


def test_data_files_are_relative_to_the_working_directory_and_base_to_the_config(tmp_path, monkeypatch):
    """README, Configure: `base:` is relative to the config file, every other path to the directory
    the command runs in; a data file missing under a relative path says so."""
    from colocate.config import ConfigError
    from colocate.envs.dataset_files import check_dataset
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "data.jsonl").write_text('{"prompt": "add 1 and 2 ; answer :", "answer": "3"}\n')
    (tmp_path / "conf" / "run.yaml").write_text(f"base: {os.path.relpath(DATASET, tmp_path / 'conf')}\n"
                                                "env:\n  data_files: [data.jsonl]\n  eval_files: []\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config("conf/run.yaml", {"model": {"cache_dir": str(tmp_path / "cache")}})  # base found from conf/
    with pytest.raises(ConfigError, match=rf"'data.jsonl' does not exist .*relative path is from the working "
                                          rf"directory {tmp_path}"):
        check_dataset(cfg)
    monkeypatch.chdir(tmp_path / "conf")
    check_dataset(cfg)
