"""`torchrun --nproc-per-node N -m colocate.train --config CFG [--section.key=value ...]`

The composition root: config (checked before launch: `launch.py`) -> topology -> tokenizer + model ->
engine + env + adapter receiver, or learner + adapter sender -> the role loop of this rank
(`rollout/loop.py`, `learner/loop.py`). The engine and both ends of the adapter channel come from
the engine table's entry for engine.kind (`engine/table.py`).

Step protocol (deterministic, so no rank ever waits on a message that will not come):
  * inference rank, batch k = 0..S-1: receive adapters until its version >= k - sampling lag (below),
    play its share of groups, send one shard of the batch to every learner (a sender thread);
    at the end it receives the remaining versions up to S, so it finishes on the final adapter.
  * learner, step s = 0..S-1: receive one shard from every inference rank, train, and learner
    rank 0 broadcasts version s + 1 on the sync group.
With max_policy_lag = L, batch k is sampled with version max(0, k - L) and trained at step k, so
rollouts of batch k + 1 .. k + L overlap the learner's step k; L = 0 is synchronous. With
oversampled groups (rollout.oversample_groups > 0, L >= 2) batch k is sampled with version
max(0, k - L + 1): a group carried over to batch k + 1 is then trained exactly L steps after its
version (`config.sampling_lag`).

Kept under `if __name__ == "__main__"`: a spawned process runs the main module again unless it is
hidden (`lifecycle.spawn_without_main`, as vLLM's engine core and the env's copies are started;
docs/design.md, "Traps").
"""
from __future__ import annotations

if __name__ == "__main__":  # a rank: a stop signal during the imports below ends it without a traceback
    import gc
    gc.disable()  # for the imports below, whose heap is frozen before `main` (lifecycle.freeze_heap)
    from colocate.lifecycle import guard_terminal, quiet_start
    quiet_start()
    guard_terminal()  # and its terminal closing mid-run does not end it
    import sys
    from colocate.handover import watch
    watch(sys.argv[1:])  # `colocate train`'s checks run meanwhile: a refusal ends this rank mid-import
    from colocate.engine.headstart import head_start
    head_start()  # an inference rank's engine server (vLLM's imports there) starts before any import of its own
    # Every rank builds a tokenizer and a model with an adapter (`run_rank`): their libraries are imported
    # now, while the launcher checks the config. Here, not at the top: what imports this module otherwise
    # (a test, a process spawned with the main module showing: `__mp_main__`) needs none of them.
    import peft  # noqa: F401
    import transformers.modeling_utils  # noqa: F401
    import transformers.tokenization_utils_fast  # noqa: F401

import gc
import os
import socket
import sys
import threading

import torch.distributed as dist

from colocate.canary import probe_ids
from colocate.channel import AdapterReceiver, AdapterSender
from colocate.config import Config, save_config
from colocate.engine.base import Engine
from colocate.engine.table import EngineParts, engine_entry, make_sender as table_sender, preimport
from colocate.envs import env_corpus, env_facts, make_env
from colocate.handover import ENGINE_IMPORTS_ENV
from colocate.rank_config import configure, rank_role
from colocate.learner.learner import Learner
from colocate.learner.loop import run_learner
from colocate.lifecycle import (FAILED_EXIT, StopSignal, die_with_parent, exit_quietly, faults_from_env, freeze_heap,
                                is_peer_failure, leave, quiet_thread_peer_failures, report_failure, tell_launcher)
from colocate.models import build_policy, load_tokenizer
from colocate.rollout.loop import run_inference
from colocate.startup import begin, cache_line, compile_cache_env, mark
from colocate.topology import Topology, build_topology, split_cpu_threads


COLLAPSE_EXIT = 3
"""The exit code of a run that metrics.stop_on_collapse or metrics.stop_on_mismatch ended (the
learner ranks; `colocate train`)."""


def make_engine(cfg: Config, topo: Topology, model, tokenizer) -> tuple[Engine, AdapterReceiver]:
    """The inference rank's engine and the receiving end of the adapter channel that fits it (the
    engine table's entry for engine.kind); the env's facts size the engine, which never sees the env."""
    return engine_entry(cfg, topo).build(cfg, topo, EngineParts(model, tokenizer, env_facts(cfg)))


def make_sender(cfg: Config, topo: Topology, learner: Learner, probe: list[int]) -> AdapterSender:
    """The sending end of the adapter channel (the engine table's `make_sender`). The learner warms up
    (`warm_up_learner`) while the engines start: before the sender waits for them (on a GPU they
    share, unless their start depends on its free memory: then once they have started)."""
    return table_sender(cfg, topo, learner.lora_spec, before_join=lambda: warm_up_learner(cfg, learner, probe))


def warm_up_learner(cfg: Config, learner: Learner, probe: list[int]) -> None:
    """`Learner.warm_up` when `learner.prewarm` is on (every learner: collectives), with the canary's
    probe when the canary is on, then the mark."""
    if cfg.learner.prewarm:
        learner.warm_up(probe if cfg.sync.canary_every > 0 else None)
        mark("learner_warm")


def join_imports(early: threading.Thread | None) -> None:
    """Wait for the engine's early imports (`engine.table.preimport`), if this rank started them."""
    if early is not None:
        early.join()


def run_rank(cfg: Config, resume: dict | None, stop: StopSignal, caches: dict[str, str],
             early: threading.Thread | None = None) -> int | None:
    """Topology, tokenizer, model, then this rank's role loop -> (learners) the step whose collapse
    stopped the run (metrics.stop_on_collapse), or None. An inference rank joins the world while its
    engine's early imports (`early`) still run, so the learners form their groups and go on to their
    model and warm-up without waiting for them; it waits for them right after, before it imports
    anything else (two threads importing modules that import each other can deadlock)."""
    topo = build_topology(cfg)
    mark("ranks_up")
    join_imports(early)
    if topo.role_rank == 0:  # where each role runs, once per role (several nodes: which node)
        print(f"colocate: {topo.role} rank 0 is global rank {topo.rank} on node {os.environ.get('GROUP_RANK', '0')} "
              f"({socket.gethostname()})", flush=True)
    if topo.rank == 0:
        print(cache_line(cfg.model.compile_cache_dir, caches), flush=True)
        save_config(cfg, os.path.join(cfg.metrics.run_dir, "config.yaml"))
        if resume is not None:
            print(f"colocate: resuming from {resume['path']} (step {resume['trainer_state']['step']})", flush=True)
    key, corpus_fn = env_corpus(cfg)
    tokenizer = load_tokenizer(cfg.model, corpus_fn, key)
    # Learners get the policy on the meta device: the Learner shards it, then materializes its shards.
    # An engine that loads its own weights (vLLM: a model directory) leaves its rank the meta one too.
    on_device = topo.role == "inference" and not engine_entry(cfg, topo).loads_own_weights
    model = build_policy(cfg, tokenizer, topo.device if on_device else "meta")
    probe = probe_ids(tokenizer)  # the sync canary's sequence, the same on every rank
    # The long-lived heap (torch, transformers, the model) never becomes garbage: keep full GC
    # passes from walking it (one took ~0.3 s at random points of the rollout loop).
    gc.collect()
    gc.freeze()
    collapse_step = None
    if topo.role == "inference":
        mark("model_ready")
        engine, receiver = make_engine(cfg, topo, model, tokenizer)
        env = make_env(cfg, tokenizer, seed=cfg.rollout.seed * 1000 + topo.rank, processes=cfg.env.processes)
        mark("engine_warm")
        try:
            run_inference(cfg, topo, engine, env, receiver, resume=resume, stop=stop, probe=probe)
        finally:
            env.close()  # its worker processes (env.processes), also when the role failed
    else:
        learner = Learner(cfg, topo, model, tokenizer)
        mark("model_ready")
        sender = make_sender(cfg, topo, learner, probe)
        collapse_step = run_learner(cfg, topo, learner, sender, resume=resume, stop=stop, probe=probe,
                                    faults=faults_from_env())
    dist.destroy_process_group()
    gc.unfreeze()  # let interpreter shutdown release the frozen heap (else nanobind reports leaks)
    return collapse_step if topo.role == "learner" else None


def main(argv: list[str] | None = None) -> int:
    """One rank (or `--check`) -> its exit code: 0, or COLLAPSE_EXIT when a collapse or a canary
    mismatch stopped the run; bad input exits 2 and a failure FAILED_EXIT from inside."""
    timeline = begin()
    # an inference rank of `colocate train` imports its engine's modules while the launcher checks
    early = preimport(os.environ.get(ENGINE_IMPORTS_ENV, ""), int(os.environ.get("RANK", "-1")))
    try:
        cfg, resume, check_only = configure(sys.argv[1:] if argv is None else argv)
    except BaseException:
        join_imports(early)
        raise
    if check_only:  # `--check`: `launch.echo_check` printed the resolved config and its plan
        join_imports(early)
        return 0
    timeline.mark("checks_done")
    caches = compile_cache_env(cfg.model.compile_cache_dir)  # before vLLM, inductor or Triton compile anything
    split_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if "TORCHELASTIC_RUN_ID" in os.environ:  # launched by torchrun: die with it
        die_with_parent()
    stop = StopSignal().install()
    quiet_thread_peer_failures()
    try:
        collapse_step = run_rank(cfg, resume, stop, caches, early)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:
        # One line that names the rank, the cause and where it was raised (the user's function when
        # it was theirs), the traceback in a file; torchrun then stops the other ranks (their
        # collectives time out after topology.timeout_s at the latest). A rank whose transport only
        # reports that another rank died exits quietly: that rank has printed the cause, or
        # `colocate train` names it (killed, gone without a word), told apart by each rank's torchrun
        # error file. No interpreter shutdown: nothing else reaches the terminal (third-party leak reports).
        if is_peer_failure(e):
            tell_launcher("peer")
        else:
            rank = int(os.environ.get("RANK", "0"))
            print(report_failure(e, rank, rank_role(cfg), cfg.metrics.run_dir), file=sys.stderr, flush=True)
            tell_launcher("failed")
        exit_quietly(FAILED_EXIT)
    return COLLAPSE_EXIT if collapse_step is not None else 0


if __name__ == "__main__":
    # The module imports are made: frozen, later collections (the rank's own imports, its model)
    # skip them; enabled without the freeze, the first would walk them all at once instead
    freeze_heap()
    gc.enable()
    leave(main())
