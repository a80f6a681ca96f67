"""A third engine, registered in the engine table from outside the package: DEVELOPERS.md's engine
recipe followed once (`tests/test_engine_table.py` runs it on cpu-tiny under torchrun).

`ToyEngine` wraps the HF engine and answers through the `Engine` defaults (no streaming of its own:
one `generate` per poll), counting its calls; its entry takes the HF engine's adapter channel.

    python -m torch.distributed.run --nproc-per-node 2 -m tests.toy_engine --config configs/cpu-tiny.yaml \\
        --engine.kind=toy
"""
from __future__ import annotations

from colocate.channel import BroadcastReceiver
from colocate.engine.base import Engine
from colocate.engine.hf import HFEngine
from colocate.engine.table import ENGINES, EngineEntry, EngineParts, broadcast_sender
from colocate.startup import mark
from colocate.wire import LoraSpec


class ToyEngine(Engine):
    def __init__(self, inner: HFEngine):
        self.inner, self.calls = inner, 0

    @property
    def version(self) -> int:
        return self.inner.version

    @version.setter
    def version(self, value: int) -> None:
        self.inner.version = value

    def generate(self, requests):
        self.calls += 1
        return self.inner.generate(requests)

    def load_lora(self, version, tensors):
        self.inner.load_lora(version, tensors)

    def lora_state(self):
        return self.inner.lora_state()

    def score(self, token_ids):
        return self.inner.score(token_ids)

    def stats(self) -> dict[str, float]:
        return {"toy_generate_calls": float(self.calls)}


def build_toy(cfg, topo, parts: EngineParts):
    """The engine and its receiver: adapters arrive by broadcast on the sync group."""
    engine = ToyEngine(HFEngine(parts.model, parts.tokenizer, device=topo.device, seed=cfg.rollout.seed))
    print(f"colocate: toy engine on rank {topo.rank}", flush=True)
    mark("engine_constructed")  # the start-up timeline's mark, before the receiver
    spec = LoraSpec.of(engine.lora_state())
    return engine, BroadcastReceiver(engine, spec, src=topo.sync_src, group=topo.sync_group, device=topo.device)


def register() -> None:
    ENGINES["toy"] = EngineEntry(build=build_toy, sender=broadcast_sender)


if __name__ == "__main__":
    from colocate import train
    from colocate.lifecycle import leave
    register()
    leave(train.main())
