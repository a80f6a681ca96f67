"""colocate: a torch.distributed RL trainer for LLM agents in one torchrun job, on one node or several:
inference ranks + learner ranks + adapter sync; GRPO-family objectives (GRPO, DAPO, Dr.GRPO, GSPO), with a
fused loss kernel on GPU.

Start at `train.py` (the composition root) and `docs/design.md`.

The loss kernels live in the repository's top-level `kernels/` folder and are installed as
`colocate.kernels` (setuptools `package_dir`; a top-level `kernels` package would collide with the
Hugging Face hub-kernels package that transformers probes for). Run from a source checkout without
an install, `colocate.kernels` is found beside this package by the finder below.
"""
import importlib.abc
import importlib.util
import os
import sys

__version__ = "0.1.0"

_CHECKOUT_KERNELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")


class _CheckoutKernelsFinder(importlib.abc.MetaPathFinder):
    """`colocate.kernels` -> `<checkout>/kernels` (only when this package runs from a checkout)."""

    def find_spec(self, name, path=None, target=None):
        if name != "colocate.kernels":
            return None
        return importlib.util.spec_from_file_location(name, os.path.join(_CHECKOUT_KERNELS, "__init__.py"),
                                                      submodule_search_locations=[_CHECKOUT_KERNELS])


# An installed copy has `colocate/kernels/__init__.py` in place; a checkout has `kernels/` beside
# `colocate/` (an empty `colocate/kernels/` left by an old checkout must not hide it).
if not os.path.isfile(os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels", "__init__.py")) \
        and os.path.isfile(os.path.join(_CHECKOUT_KERNELS, "grpo_rows_sm90.cu")):
    sys.meta_path.insert(0, _CheckoutKernelsFinder())
