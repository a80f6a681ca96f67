"""The launcher of `colocate train` (the process `colocate train` runs in): torchrun started beside
the checks, the checked config handed to the ranks, and how the job ended said in one line.

`train` checks everything `check` checks, with the world size it is about to ask for: parsed here
before torch is imported, the rest in a forked child (`launch.start_checks`: it calls the user's
code). torchrun starts at once beside that child, in this process (`python -m torch.distributed.run
--nproc-per-node N -m colocate.train --resolved-config=FILE`): the ranks import their modules while
the checks run, then wait for the config checked here (`handover.py`) instead of checking again. A
bad config is one line and exit code 2, and the waiting ranks exit quietly (nothing built, nothing
written); a failed job exits with the failed rank's code, without torchrun's summary (a rank killed
by a signal or gone without an error is named in one line here, with the last checkpoint). Once
the checks pass and while the job runs, `train` holds its run directory (`run_dir.hold`). Flags
that are not ours or config keys (`--nnodes`, `--node-rank`, `--rdzv-endpoint`, ...) go to torchrun
as given. `torchrun -m colocate.train --config FILE` works as before (it checks on one rank per
node).

`cli.py` calls it (`train`, `interrupted_line`); it imports nothing of the command-line front.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sys
import threading

from colocate import handover
from colocate.config import ConfigError, load_config, parse_overrides

TORCHRUN_VALUE_FLAGS = {"--nnodes", "--node-rank", "--node_rank", "--master-addr", "--master_addr", "--master-port",
                        "--master_port", "--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint", "--rdzv_endpoint",
                        "--rdzv-id", "--rdzv_id", "--rdzv-conf", "--rdzv_conf", "--max-restarts", "--max_restarts",
                        "--monitor-interval", "--log-dir", "--log_dir", "--redirects", "--tee", "--local-addr"}
"""torchrun flags that take a value as the next argument (`--flag=value` works for any flag)."""
TORCHRUN_FLAGS = TORCHRUN_VALUE_FLAGS | {"--standalone", "--no-python", "--no_python", "--run-path", "--run_path",
                                         "--local-ranks-filter", "--local_ranks_filter"}
"""torchrun flags `colocate train` passes through; any other flag is an argument of ours."""


def split_train_args(argv: list[str]) -> tuple[int | None, list[str], list[str]]:
    """-> (--nproc, torchrun flags, colocate.train arguments)."""
    nproc, torchrun, ours, it = None, [], [], iter(argv)
    for arg in it:
        name, sep, value = arg.partition("=")
        if name in ("--nproc", "--nproc-per-node", "--nproc_per_node"):
            value = value if sep else next(it, "")
            if not value.isdigit() or int(value) < 2:
                raise ConfigError(f"{name}={value!r}: expected an integer >= 2 (one rank of each role)")
            nproc = int(value)
        elif name in ("--config", "--resume", "--overwrite") or ("." in name and name.startswith("--")):
            ours.append(arg)
            if name == "--config" and not sep:
                ours.append(next(it, ""))
        elif name in TORCHRUN_FLAGS:
            torchrun.append(arg)
            if name in TORCHRUN_VALUE_FLAGS and not sep:
                torchrun.append(next(it, ""))
        else:  # config overrides and what is neither: `parse_overrides` names the mistake
            ours.append(arg)
    return nproc, torchrun, ours


def torchrun_value(flags: list[str], *names: str) -> str | None:
    for i, arg in enumerate(flags):
        name, sep, value = arg.partition("=")
        if name in names:
            return value if sep else (flags[i + 1] if i + 1 < len(flags) else None)
    return None


@dataclasses.dataclass(frozen=True)
class Job:
    """What `colocate train` knows of the job it launches, to report how it ended."""
    run_dir: str
    roles: tuple[str, ...]
    """Each global rank's role (empty: an elastic world size, which torchrun decides)."""
    checkpoints: bool
    """checkpoint.enabled"""
    single_node: bool


class Checks:
    """The launch's checks, on a thread of the launcher while torchrun runs on its main thread:
    relay the checking child's output, then hold the run directory (one node) and hand the ranks
    the checked config, or a refusal (`handover`). `code` is the checks' exit code (0: passed; a
    refusal printed its one line), `job` the job once the config is handed over."""

    def __init__(self, child, launch: "Launch", hold, shape: tuple[int | None, int, bool]):
        self.child, self.launch, self.hold, self.shape = child, launch, hold, shape
        self.code, self.error, self.cancelled = 0, None, False
        self.thread = threading.Thread(target=self._run, name="colocate-checks", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from colocate.child import finish_child
        from colocate.launch import checks_result
        self.code = 1
        try:
            ended = finish_child(self.child)
            self.code = 0 if self.cancelled else self._take(*checks_result(ended))
        except BaseException as e:  # noqa: BLE001 - raised again on the main thread (`result`)
            self.error = e
        finally:
            if self.launch.job is None:  # the waiting ranks go
                handover.refuse(self.launch.resolved)

    def _take(self, code: int, text: str, phase_ends: dict[str, float]) -> int:
        """The checks' outcome (with their phases' ends, `startup.CHECK_PHASES`) -> the launch's code;
        on 0 the ranks have the config."""
        if code:
            return code
        try:
            if self.hold is not None and self.launch.lock is None:
                self.launch.lock = self.hold()
            job = checked_job(text, *self.shape)
        except ConfigError as e:  # a live run holds the directory
            print(f"colocate: config error: {e}", file=sys.stderr, flush=True)
            return 2
        from colocate.startup import check_phase, check_phase_ends
        check_phase("handover")  # after the child's phases; this process's own first ones are the same
        handover.hand_over(self.launch.resolved, text, {**phase_ends, **check_phase_ends()})
        self.launch.job = job
        return 0

    def cancel(self) -> None:
        """Stop checks still running (torchrun stopped on a signal): no line, no handover."""
        if self.thread.is_alive():
            from colocate.child import kill_child
            self.cancelled = True
            kill_child(self.child)
        self.thread.join()

    def result(self) -> int:
        """Wait for the checks -> their code; a launcher error on the thread is raised here."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.code


def checked_job(text: str, world: int | None, nproc: int, single: bool) -> Job:
    """The job as the checked config describes it."""
    from colocate.launch import config_from_text
    from colocate.topology import place_roles  # torch: only once the config is known good
    cfg = config_from_text(text, "the checked config", world or nproc)
    return Job(cfg.metrics.run_dir, tuple(place_roles(cfg, world, nproc)) if world else (), cfg.checkpoint.enabled,
               single)


@dataclasses.dataclass
class Launch:
    """What `train_command` started: the torchrun command line, the checks running beside it, what
    `close` releases (the handover's private directory, the run directory's lock), and the job
    once the checks passed. `code` is the checks' exit code once known (`finish`)."""
    code: int
    cmd: list = dataclasses.field(default_factory=list)
    job: Job | None = None
    lock: object = None
    resolved: str = ""
    """Where the ranks wait for the checked config (`handover`)."""
    checks: Checks | None = None
    engine_imports: str = ""
    """Which ranks import their engine's modules while they wait (`handover.ENGINE_IMPORTS_ENV`)."""

    def checked_job(self) -> Job | None:
        """The job once the checks end (waits for them); None when they refused."""
        self.finish()
        return self.job

    def finish(self) -> int:
        """Wait for the checks -> their exit code (0: passed)."""
        if self.checks is not None:
            self.code = self.checks.result()
        return self.code

    def close(self) -> None:
        if self.checks is not None:
            self.checks.cancel()
        if self.resolved:  # the ranks have ended
            handover.remove(self.resolved)
        if self.lock is not None:
            self.lock.close()


def launch_shape(argv: list[str]) -> tuple[int, list[str], list[str], int | None, bool]:
    """`colocate train`'s arguments -> (processes per node, torchrun flags, ours, the world size or
    None for an elastic one, one node); the config is parsed (a bad key is refused here, before torch)."""
    from colocate.launch import default_world
    nproc, torchrun, ours = split_train_args(argv)
    path, overrides, _ = parse_overrides([a for a in ours if a != "--overwrite"])
    if path is None:
        raise ConfigError("--config FILE is required")
    nproc = nproc or default_world(load_config(path, overrides))
    nnodes = torchrun_value(torchrun, "--nnodes") or "1"
    world = nproc * int(nnodes) if nnodes.isdigit() else None  # an elastic range: torchrun decides
    single = nnodes == "1" and not torchrun_value(torchrun, "--rdzv-endpoint", "--rdzv_endpoint", "--master-addr",
                                                    "--master_addr")
    return nproc, torchrun, ours, world, single


def engine_imports(cfg, world: int | None, nproc: int) -> str:
    """`handover.ENGINE_IMPORTS_ENV` for the ranks of a launch of `cfg`, parsed and not yet checked: the
    roles as `place_roles` will place them, the GPUs per node as the checks count them (NVML, under
    the CUDA_VISIBLE_DEVICES the ranks inherit); "" for an elastic world or a layout the checks will
    refuse. Only a head start: whatever fails here is "", and the checks name what is wrong."""
    if world is None:
        return ""
    from colocate.engine.table import preimport_ranks
    from colocate.preflight import gpu_count
    from colocate.topology import place_roles
    try:
        return preimport_ranks(cfg.engine.kind, place_roles(cfg, world, nproc), gpu_count(cfg),
                               prestart=cfg.engine.prestart, local_world=nproc)
    except Exception:  # noqa: BLE001 - an unchecked config; the checking child reports it
        return ""


def train_command(argv: list[str]) -> Launch:
    """Parse the config, fork the child that checks it (`launch.start_checks`) and build torchrun's
    command -> the `Launch`; its ranks wait for the checked config (`handover`), which the checks'
    thread hands over once they pass, after holding the run directory (one node: this process, for
    the job's life; several: global rank 0 does). Raises ConfigError (parsing, or with --overwrite
    a live run holding the directory); the caller closes the `Launch`."""
    from colocate import run_dir
    from colocate.launch import parse_request, start_checks
    from colocate.startup import check_phase
    nproc, torchrun, ours, world, single = launch_shape(argv)
    c = parse_request(ours, world, nproc)
    hold = functools.partial(run_dir.hold, c.cfg.metrics.run_dir, by="colocate train") if single else None
    # --overwrite: held before the checks, whose claim deletes the earlier run under the lock (else
    # after them: a refused check leaves the directory as it was, no lock file in it)
    launch = Launch(0, lock=hold() if hold and c.overwrite else None)
    try:
        launch.resolved = handover.place()
        check_phase("parse")
        child = start_checks(c)  # forked before any thread of this process (the checks' own, torchrun's)
        launch.cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                      *(["--standalone"] if single and "--standalone" not in torchrun else []), *torchrun,
                      "-m", "colocate.train", f"--resolved-config={launch.resolved}"]
        launch.checks = Checks(child, launch, hold, (world, nproc, single))
        launch.engine_imports = engine_imports(c.cfg, world, nproc)  # torch: torchrun imports it next anyway
    except BaseException:
        launch.close()
        raise
    return launch


def launch_env(nproc: int) -> dict[str, str]:
    """The ranks' environment: OMP_NUM_THREADS set (torchrun prints a banner when it is not; each
    rank splits its cores again, `topology.split_cpu_threads`), Python warnings as given. Under
    `nohup` (SIGHUP ignored) torchrun does not stop the job on SIGHUP either: it handles the signals
    `TORCHELASTIC_SIGNALS_TO_HANDLE` names, SIGHUP among them by default."""
    import signal
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
        env.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGQUIT")
    return env


def train(argv: list[str]) -> int:
    """`colocate train`: torchrun starts as soon as the config is parsed, its ranks importing while
    the checks run (`train_command`) -> the checks' code when they refused (their line printed, the
    ranks gone quietly), else the job's (`run_torchrun`)."""
    from colocate.startup import LAUNCH_ENV, begin_checks, process_start
    launched_at = repr(process_start())  # the command's start: the ranks' timeline counts from it
    begin_checks()
    launch = train_command(argv)
    try:
        nproc = int(launch.cmd[3].partition("=")[2])  # cmd[3] is --nproc-per-node=N
        sys.stdout.flush()
        os.environ.update(launch_env(nproc))
        # for these ranks only: a later launch from this process has its own
        own = {LAUNCH_ENV: launched_at, handover.LAUNCHER_ENV: str(os.getpid()),
               handover.ENGINE_IMPORTS_ENV: launch.engine_imports}
        os.environ.update(own)
        try:
            code = run_torchrun(launch.cmd[3:], launch)
        finally:
            for name in own:
                del os.environ[name]
        return launch.finish() or code
    finally:
        launch.close()


def run_torchrun(args: list[str], launch: Launch) -> int:
    """torchrun (its arguments after `-m torch.distributed.run`) in this process -> the job's exit
    code: 0, else the failed rank's own (2 bad input, 3 metrics.stop_on_collapse or
    stop_on_mismatch, 1 a rank failed; 128 + N for a rank killed by signal N), where torchrun
    itself would say 1; 128 + N when this process got signal N (the ranks stopped). A rank that
    failed on an error has printed its one line; for one that ended without a word (killed, an
    `os._exit`) and for a stop this process prints it (`ended_line`); ranks that ended on the
    checks' refusal (`launch.checked_job()` is None) leave that to the checks' line. torchrun's log
    lines and its failure summary stay out of the terminal (`LOGLEVEL=INFO` brings its log back)."""
    import logging
    import signal

    from colocate.lifecycle import leave_terminal
    os.environ.setdefault("LOGLEVEL", "CRITICAL")  # torch.distributed.elastic's loggers read it when made
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run
    for name in list(logging.root.manager.loggerDict):  # those made before this call
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(os.environ["LOGLEVEL"])
    try:
        run(parse_args(args))
    except ChildFailedError as e:
        job = launch.checked_job()
        rank, failure, line = failed_rank(e.failures, job) if job else (None, next(iter(e.failures.values())), None)
        if line:
            print(line, file=sys.stderr, flush=True)
        return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
    except SignalException as e:  # SIGTERM / Ctrl-C / a closed terminal: torchrun passed it on to the ranks
        if e.sigval == signal.SIGHUP:
            leave_terminal()
        if launch.checks is not None:
            launch.checks.cancel()
        print(stopped_line(launch.job, int(e.sigval)), file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    return 0


def signal_name(signum: int) -> str:
    import signal
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def stopped_line(job: Job | None, signum: int) -> str:
    """After the ranks stopped on a signal to this process (their own lines say what they wrote;
    no job: the checks had not passed, the ranks were waiting for them)."""
    if job is None:
        return f"colocate: stopped by {signal_name(signum)} before the checks passed; no rank had started its work"
    return f"colocate: stopped by {signal_name(signum)}; {last_checkpoint(job)}"


def interrupted_line(command: str) -> str:
    """Ctrl-C before torchrun took the signals over."""
    return f"colocate: {command} interrupted by SIGINT" + ("; no rank had started" if command == "train" else "")


def last_checkpoint(job: Job) -> str:
    from colocate.checkpoint import checkpoint_root, latest_checkpoint
    path = latest_checkpoint(checkpoint_root(job.run_dir))
    return f"last checkpoint: {path or 'none' + ('' if job.checkpoints else ' (checkpoint.enabled is false)')}"


SAID = (2, 3)
"""Exit codes whose rank printed its own line (bad input; metrics.stop_on_collapse / stop_on_mismatch)."""


def failed_rank(failures: dict, job: Job) -> tuple[int, object, str | None]:
    """torchrun's failed ranks (global rank -> ProcessFailure) -> (the rank that ended the job, its
    failure, the line to print or None when it printed its own). The ranks' error files
    (`lifecycle.tell_launcher`) tell one that failed on an error and said so from one that only saw
    another go; the first of the others to fail (torchrun stopped the rest after it) ended the job."""
    said = {rank: f.error_file_data.get("colocate") for rank, f in failures.items()}
    first = [r for r in failures if said[r] != "peer"]
    if not first:  # every local rank lost a peer: the one that ended went quietly, or on another node
        rank = next(iter(failures))
        return rank, failures[rank], ended_line(job, rank, "lost its connection to another rank, which ended without "
                                                           "an error here (another node's output may name it)")
    rank = min(first, key=lambda r: failures[r].timestamp)  # capture order breaks ties: min keeps the first
    failure = failures[rank]
    if said[rank] or failure.exitcode in SAID:
        return rank, failure, None
    if failure.exitcode < 0:
        name = signal_name(-failure.exitcode)
        how = f"was killed by {name}" + (" (often the out-of-memory killer)" if name == "SIGKILL" else "")
    else:
        how = f"exited with code {failure.exitcode} and no error (an os._exit or a library's exit in its code)"
    return rank, failure, ended_line(job, rank, how)


def ended_line(job: Job, rank: int, how: str) -> str:
    role = f" ({job.roles[rank]})" if rank < len(job.roles) else ""
    return f"colocate: failed: rank {rank}{role} {how}; {last_checkpoint(job)}"
