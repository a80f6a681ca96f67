"""Rewrite docs/errors.md: every bad input of `tests/test_bad_input.py` with the one line it gets.

    python scripts/bad_inputs.py            # from the repository root

Each case runs through `colocate.rank_config.configure` (what every rank and `--check` run before any
process group or model exists) in a temporary directory whose path is shown as `<tmp>`.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import socket
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from colocate.rank_config import configure  # noqa: E402
from tests.test_bad_input import CONFIG_CASES, USER_CASES, materialize  # noqa: E402
from tests.test_launcher import LAUNCH_CASES, run_launch_case  # noqa: E402


def message(text, overrides: list[str]) -> tuple[int, str]:
    """(exit code, stderr) of one case, in a fresh temporary directory."""
    with tempfile.TemporaryDirectory() as tmp:
        path, overrides = materialize(text, overrides, Path(tmp))
        sys.path.insert(0, tmp)  # the cases' user modules
        argv = ["--config", path, f"--metrics.run_dir={tmp}/run", f"--model.cache_dir={tmp}/cache", *overrides]
        err = io.StringIO()
        code = 0
        with contextlib.redirect_stderr(err):
            try:
                configure(argv)
            except SystemExit as e:
                code = e.code
        sys.path.remove(tmp)
        return code, err.getvalue().strip().replace(tmp, "<tmp>").replace(str(REPO) + "/", "")


def table(cases) -> list[str]:
    """The markdown rows of the cases: id, input, exit code, the line printed."""
    rows = []
    for case_id, text, overrides, _ in cases:
        code, line = message(text, overrides)
        shown = " ".join(overrides) or ("(the config file)" if text is not None else "")
        rows.append(f"| {case_id} | `{shown}` | {code} | {line.replace('|', '/')} |")
    return rows


USER_SECTION = """
## User data and user code

Rows of `env.data_files` are checked when the files are opened (streamed, `colocate/envs/rows.py`):
a prompt missing, null, neither text nor chat messages, empty or whitespace, or longer than the
model's context less `engine.max_new_tokens`, and a null answer where the rewards need one. Under
`env.bad_rows: error` (default) the first such row is the error, named by file, the file's own
line number and column; under `skip` they are dropped and counted (`data/dropped/<reason>` in
TensorBoard, one line on stderr at start-up). A directory in `env.data_files` stands for the data
files under it. Reward modules and env classes are imported and checked before launch, in a child
of the launching process (an env class against the `Env` protocol by signature, `env.options`
against its constructor; a reward function called on the first row as the env will call it:
signature, raise, result shape).
At run time, a reward function or env method returning the wrong shape is logged once with what it
returned and what was expected, counted (`rollout/reward_errors`, `rollout/env_errors`; reward
errors also on the step line and in the summary), and `env.max_reward_errors` of them in a row
stop the run. A reward function runs in a box: one that
raises (`SystemExit` too), outlasts `env.reward_timeout_s` or returns NaN, inf or a value beyond
`env.reward_max_abs` is counted the same way, by kind (`rollout/reward_errors/<kind>`, docs/envs.md),
and stops the run naming it (`RewardError: reward my_pkg.rewards:score gave no usable value for N
samples in a row ...`). Model-written tool calls and users' tools never stop a run: each fault is a
tool message and a count (`rollout/tool_errors/<kind>`, docs/agents.md). When a rank fails, it
alone prints `colocate: failed: rank R (role): ...; at FUNCTION (FILE:LINE); traceback in
RUN_DIR/failure-rankR.txt`, and `colocate train` exits with 1; the other ranks exit without a
transport traceback.

| case | input | exit | message |
| --- | --- | --- | --- |
"""


LATER_SECTION = """
## Refusals the catalogue cannot replay

Their words depend on the machine, they belong to `colocate check` alone, or they come after the
config (a resume, an evaluation):

- `colocate check --gpu-memory 80` (a size without its unit: GB and GiB differ by 7 %), exit 2:
  `colocate: config error: --gpu-memory='80': expected a size with its unit, 80GiB (2^30 bytes) or
  80GB (10^9 bytes), 81559MiB, or a card: h100, h200, a100-80, a100-40, l40s, b200`.

- ranks on CPUs whose weights alone exceed the host's memory (`gpu_budget.check_host_memory`; e.g.
  `configs/gpu-4.yaml --engine.kind=hf` on a 24 GiB machine), exit 2: `colocate: config error: 4 CPU
  processes would hold at least 50.1 GiB of weights (2 engines x 14.2 GiB, 2 learners x 10.9 GiB of
  model.shape=qwen2.5-7b), more than this host's 23.5 GiB: the out-of-memory killer would end them; run on
  GPUs or with a smaller model`. Refused, not warned: the figure is a lower bound (no activations),
  and the out-of-memory killer would end a rank without a word.
- `--resume` past a newest `checkpoints/step-*` that holds nothing: `colocate: resume: skipped
  RUN/checkpoints/step-N: RUN/checkpoints/step-N/adapter_model.safetensors: missing from checkpoint (an
  empty directory: not a checkpoint, or a save that never finished)`, printed once.
- `colocate eval` of a tiny-model adapter against another tiny-model config: `colocate: checkpoint
  error: DIR/manifest.json: trained on another base model (...): the embedded model's vocabulary is
  the tokenizer trained on its env's text: evaluate with the training run's config and env (--run RUN)`.
- a reward function that keeps failing at run time: `RewardError: reward NAME gave no usable value for
  N samples in a row (env.max_reward_errors=M); the last raised ValueError: ... (rollout/reward_errors/raised)`.
- `engine.quantization=fp8` with `engine.lora_mode=merged` (the 7B Diplomacy presets) on a GPU
  without FP8 tensor cores (NVML's compute capability below 8.9: before Ada vLLM repacks FP8 weights
  for weight-only kernels), refused at the checks, exit 2: `colocate: config error:
  engine.quantization=fp8 with engine.lora_mode=merged needs FP8 tensor cores (compute capability 8.9
  or more: Ada, Hopper); GPU 0 is NVIDIA A100-SXM4-80GB (8.0): set engine.quantization=none`. Where
  the checks could not read the GPU, or vLLM keeps another layout (per-channel scales), or merged mode
  meets a checkpoint quantized already, the engine's start stops with `engine.lora_mode=merged with
  engine.quantization=fp8 writes e4m3 weights (vLLM's online FP8), but vLLM holds MODULE as DTYPE
  (SHAPE) (N of the M adapted modules: another kernel's layout, or a quantized checkpoint): use
  engine.lora_mode=slot` (or `... an FP8 linear holds ... not vLLM's per-tensor e4m3 layout this merge
  writes: use engine.lora_mode=slot`).
- engines sharing a GPU that size their memory at start (vLLM without `engine.kv_cache_gib`; e.g.
  `colocate check --config configs/gpu-1-gsm8k.yaml --world-size 3 --gpus-per-node 1 --gpu-memory
  80GiB --engine.kv_cache_gib=0`), exit 2: `colocate: config error: ranks 0, 1 are 2 engines on GPU 0:
  they start together, and vLLM's start-up memory profile would count the others' memory as its own;
  set engine.kv_cache_gib (a fixed KV cache per engine, no profile)`.
"""


LAUNCH_SECTION = """
## The launcher and the ranks it starts

`colocate train` and `colocate check` parse the config in their own process, before torch is
imported, and run every other check in a forked child: the checks import and call the user's code
(reward modules, env classes, tools), which must not end, break or move the launcher. A check that
ends without its result, or raises something that is not bad input, is one `colocate: failed:` line
and exit code 1 (128 + N for a signal N). `colocate train` starts torchrun beside the checks, with
`--resolved-config=FILE`: its ranks wait until the config it checked (every path absolute, the
checkpoint to resume pinned) is there, its SHA-256 beside it, or exit quietly with code 2 when the
checks refused (their line is the launch's only one). A rank loads that file instead of checking
again, and refuses it when its SHA-256 differs; `--config-sha256=HEX` gives the hash as an argument.

| case | input | exit | message |
| --- | --- | --- | --- |
"""


def launch_table() -> list[str]:
    rows = []
    for case_id, shown, where, what, _ in LAUNCH_CASES:
        with tempfile.TemporaryDirectory() as tmp:
            code, err = run_launch_case(where, what, tmp)
        line = err.strip().replace(tmp, "<tmp>").replace(str(REPO) + "/", "")
        line = re.sub(r"colocate-launch-\w+/", "colocate-launch-XXXX/", line)
        line = re.sub(r"colocate-config-\w+\.yaml", "colocate-config-XXXX.yaml", re.sub(r"[0-9a-f]{64}|[0-9a-f]{16}\.\.\.", "...", line))
        rows.append(f"| {case_id} | {shown} | {code} | {line.replace('|', '/')} |")
    return rows


END_SECTION = """
## How a run ends

`colocate train` prints a line itself for what no rank could say: a live run holding the run
directory (a `flock` on `RUN_DIR/.colocate-lock`, held by `colocate train`, or by global rank 0 of a
job on several nodes; the kernel drops it when the run ends however it ends), a rank killed by a
signal or gone on its own without an error (the job exits with 128 + N or that rank's code), and a
stop on a signal (SIGINT, SIGTERM, SIGHUP: the ranks stop after the same step; the learner's line
says what was kept). A rank that fails on an error prints its own line (above); the ranks that
only lost it print nothing. A signal during a rank's start-up ends it quietly (one line, below).

| case | exit | message |
| --- | --- | --- |
"""


def end_rows() -> list[str]:
    """The lines of `END_SECTION`, from the functions that print them."""
    import signal

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from colocate import launcher, run_dir
    from colocate.config import ConfigError, load_config
    from colocate.learner.loop import stop_line
    from colocate.lifecycle import tell_launcher
    with tempfile.TemporaryDirectory() as tmp:
        job = launcher.Job(f"{tmp}/run", ("inference", "learner"), checkpoints=True, single_node=True)
        os.makedirs(f"{tmp}/run/checkpoints/step-000040")

        def failure(exitcode: int, said: str | None) -> ProcessFailure:
            path = f"{tmp}/error-{exitcode}-{said}.json"
            if said:
                os.environ["TORCHELASTIC_ERROR_FILE"] = path
                tell_launcher(said)
                del os.environ["TORCHELASTIC_ERROR_FILE"]
            return ProcessFailure(local_rank=0, pid=0, exitcode=exitcode, error_file=path)
        lock = run_dir.hold(f"{tmp}/run", by="colocate train")
        try:
            run_dir.refuse_if_held(f"{tmp}/run")
            raise SystemExit("a held run directory was not refused")
        except ConfigError as e:
            held = re.sub(r"started \S+ \S+:", "started DATE TIME:", f"colocate: config error: {e}")
        lock.close()
        held = held.replace(f"pid {os.getpid()} ", "pid PID ")
        cfg = load_config(str(REPO / "configs" / "cpu-tiny.yaml"), {"metrics": {"run_dir": f"{tmp}/run"}})
        rows = [("a live run holds `metrics.run_dir` (`colocate train`, `--overwrite`, `--resume`, `colocate check`)",
                 "2", held),
                ("a rank killed by a signal (kill -9, the out-of-memory killer, a crash)", "128 + N",
                 launcher.failed_rank({0: failure(-9, None), 1: failure(1, "peer")}, job)[2]),
                ("a rank leaving without an error (`os._exit(C)` in user code or a library)", "C",
                 launcher.failed_rank({1: failure(7, None), 0: failure(1, "peer")}, job)[2]),
                ("every rank of this node only lost a peer (the one that ended is on another node, or left with 0)",
                 "1", launcher.failed_rank({0: failure(1, "peer"), 1: failure(1, "peer")}, job)[2]),
                ("SIGINT / SIGTERM / SIGHUP to `colocate train` once the ranks run", "128 + N",
                 launcher.stopped_line(job, signal.SIGINT)),
                ("the learner's line at that stop, with checkpoints off", "",
                 stop_line(cfg, [], signal.SIGINT, 12, checkpointed=False)),
                ("SIGINT / SIGTERM / SIGHUP to `colocate train` while it checks (its ranks wait for the checks)",
                 "128 + N", launcher.stopped_line(None, signal.SIGINT)),
                ("Ctrl-C while `colocate train` parses the config, before torchrun starts", "130",
                 launcher.interrupted_line("train"))]
    return [f"| {case} | {code} | {line.replace(tmp, '<tmp>').replace(socket.gethostname(), 'HOST')} |"
            for case, code, line in rows]


def main() -> None:
    os.environ.update(WORLD_SIZE="2", RANK="0")
    rows, user_rows, launch_rows = table(CONFIG_CASES), table(USER_CASES), launch_table()
    out = REPO / "docs" / "errors.md"
    out.write_text(
        "# Bad input and its message\n\n"
        "Every case of `tests/test_bad_input.py` (the test asserts each: one line, exit code 2, before any\n"
        "process group or model), with the line it prints, as `python scripts/bad_inputs.py` last wrote\n"
        "them. Overrides apply to `configs/cpu-tiny.yaml` unless the case writes its own config file.\n"
        "Under torchrun every rank exits with 2 and rank 0 prints the line once; torchrun itself then\n"
        "exits with 1 (`python -m colocate.train --config FILE --check` returns the 2 before launch).\n\n"
        "| case | input | exit | message |\n| --- | --- | --- | --- |\n" + "\n".join(rows) + "\n"
        + USER_SECTION + "\n".join(user_rows) + "\n" + LAUNCH_SECTION + "\n".join(launch_rows) + "\n"
        + END_SECTION + "\n".join(end_rows()) + "\n" + LATER_SECTION)
    print(f"wrote {out} ({len(rows) + len(user_rows) + len(launch_rows)} cases)")


if __name__ == "__main__":
    main()
