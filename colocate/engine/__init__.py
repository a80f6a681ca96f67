"""Engines behind the `Engine` protocol (`base.py`): the HF reference (`hf.py`) and vLLM (`vllm.py`); which
one a run builds, and how adapters reach it, is the engine table (`table.py`).

The package itself imports nothing: an inference rank starts vLLM's engine core server through
`headstart.py` and `prestart.py` before it imports torch."""
