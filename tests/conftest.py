"""Shared fixtures: a tiny tokenizer + model built once per session in a temp cache."""
import os
import socket

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_cfg(tmp_path_factory):
    from colocate.config import load_config
    cache = tmp_path_factory.mktemp("cache")
    return load_config(os.path.join(REPO, "configs", "cpu-tiny.yaml"), {"model": {"cache_dir": str(cache)}})


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_cfg):
    from colocate.envs import env_corpus
    from colocate.models import load_tokenizer
    key, fn = env_corpus(tiny_cfg)
    return load_tokenizer(tiny_cfg.model, fn, key)


@pytest.fixture()
def tiny_policy(tiny_cfg, tiny_tokenizer):
    from colocate.train import build_policy
    return build_policy(tiny_cfg, tiny_tokenizer, torch.device("cpu"))
