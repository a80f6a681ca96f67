"""colocate: a single-node torch.distributed GRPO trainer (inference ranks + learner ranks + adapter sync).

Start at `train.py` (the composition root) and DESIGN.md's module map.
"""
__version__ = "0.1.0"
