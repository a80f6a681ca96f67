"""The launcher's word to its ranks about their engine (`handover.ENGINE_IMPORTS_ENV`), and the
inference rank's head start that reads it as its first act, before it imports torch.

`colocate train` resolves the engine's kind and counts the GPUs before torchrun starts, and tells
its ranks (`EngineWord`, formatted by `engine.table.preimport_ranks`): which ranks build which
engine (they import its modules while they wait: `engine.table.preimport`, in `main`), and, where
the engine starts a server early (`SERVERS`, `engine.prestart`), the GPU index each of those ranks'
engine gets (`topology.rank_devices`, as the rank's topology computes it later). `head_start`
starts that server from the first lines of `train.py`'s `__main__`, seconds before the rank's own
imports are done: the server's imports (vLLM's) run beside them.

Standard library only, and of colocate only `handover` (with its `jsonfile`; `engine.prestart` when
the server starts): a rank imports this before torch. The word is only a head start: a malformed or missing
one starts nothing early, and the engine's build does it all.
"""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

from colocate.handover import ENGINE_IMPORTS_ENV


@dataclass(frozen=True)
class EngineWord:
    """`KIND:RANK,RANK,...[:prestart=GPU,GPU,...]`, "" for nothing early."""
    kind: str = ""
    ranks: tuple[int, ...] = ()
    """The global ranks that build the engine (the inference ranks)."""
    server_gpus: tuple[int, ...] = ()
    """The CUDA index (of the ranks' CUDA_VISIBLE_DEVICES) of each of `ranks`' engine, in that order,
    where the rank starts the engine's server at its start; () where none does."""

    def __str__(self) -> str:
        if not self.kind:
            return ""
        gpus = ":prestart=" + ",".join(map(str, self.server_gpus)) if self.server_gpus else ""
        return f"{self.kind}:{','.join(map(str, self.ranks))}{gpus}"

    @classmethod
    def parse(cls, text: str) -> EngineWord:
        """The word `str` formats -> its record; a malformed one is the empty word."""
        kind, _, rest = text.partition(":")
        ranks, _, server = rest.partition(":")
        try:
            word = cls(kind, tuple(int(r) for r in ranks.split(",") if r),
                       tuple(int(g) for g in server.removeprefix("prestart=").split(",") if g))
        except ValueError:
            return cls()
        if server and (not server.startswith("prestart=") or len(word.server_gpus) != len(word.ranks)):
            return cls()
        return word

    def server_gpu(self, rank: int) -> int | None:
        """The GPU index of the server `rank` starts at its start, else None."""
        if rank not in self.ranks or not self.server_gpus:
            return None
        return self.server_gpus[self.ranks.index(rank)]


def start_vllm_server(gpu: int) -> None:
    """vLLM's engine core forkserver for CUDA index `gpu` (`prestart.start_engine_server`), where vLLM
    is installed (`find_spec` imports nothing of it)."""
    if importlib.util.find_spec("vllm") is None:
        return
    from colocate.engine.prestart import start_engine_server
    start_engine_server(gpu)


SERVERS: dict[str, Callable[[int], None]] = {"vllm": start_vllm_server}
"""engine.kind -> what its rank starts at its start for a GPU index (the engine table's entry cannot
be imported that early: it imports torch); the launcher's word asks for it with `engine.prestart`."""


def head_start(environ=os.environ) -> None:
    """An inference rank's first act (`train.py`'s `__main__`): the server its engine will use, where
    the launcher's word names one for this rank (`RANK`). On the rank's main thread: the server
    starts in an environment set for a moment. Whatever fails is left to the engine's build, which
    starts the server again or says in one line why vLLM spawns its engine core (`prestart.usable_server`)."""
    try:
        word = EngineWord.parse(environ.get(ENGINE_IMPORTS_ENV, ""))
        gpu = word.server_gpu(int(environ.get("RANK", "-1")))
        if gpu is not None and word.kind in SERVERS:
            SERVERS[word.kind](gpu)
    except Exception:  # noqa: BLE001 - a head start only
        pass
