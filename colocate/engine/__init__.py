"""Engines behind the `Engine` protocol (`base.py`): the HF reference (`hf.py`) and vLLM (`vllm.py`); which
one a run builds, and how adapters reach it, is the engine table (`table.py`)."""
from colocate.engine.base import Engine

__all__ = ["Engine"]
