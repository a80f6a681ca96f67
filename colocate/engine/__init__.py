"""Engines behind the `Engine` protocol (`base.py`): the HF reference (`hf.py`) and vLLM (`vllm.py`)."""
from colocate.engine.base import Engine

__all__ = ["Engine"]
