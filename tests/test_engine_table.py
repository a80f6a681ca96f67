"""The engine table (`colocate/engine/table.py`): `engine.kind` is looked up, never branched on, in
the composition root and the preflight; `auto` takes the first available entry; an unknown kind is
one line naming the kinds; the slot and merged adapter targets share one declared protocol; and a
third engine registered from outside the package (`tests/toy_engine.py`, the DEVELOPERS.md recipe)
trains cpu-tiny end to end."""
import ast
import json
import os
import sys
import types

import pytest
import torch

from colocate.config_checks import ConfigError
from colocate.engine import table
from colocate.engine.table import ENGINES, EngineEntry, check_engine_kind, resolve_kind
from tests.conftest import REPO

CPU = types.SimpleNamespace(device=torch.device("cpu"))
CUDA = types.SimpleNamespace(device=torch.device("cuda", 0))


def kind_branches(source: str) -> list[int]:
    """Lines comparing engine.kind (or an engine_kind call or name) with anything."""
    def names_kind(node) -> bool:
        text = ast.unparse(node)
        return text.endswith("engine.kind") or "engine_kind" in text
    return [n.lineno for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Compare) and any(names_kind(s) for s in [n.left, *n.comparators])]


def test_kind_branches_finds_them():
    assert kind_branches('if cfg.engine.kind == "vllm":\n    pass') == [1]
    assert kind_branches('x = engine_kind(cfg, topo) != "hf"') == [1]
    assert kind_branches('entry = engine_entry(cfg, topo); ok = entry.loads_own_weights') == []


@pytest.mark.parametrize("path", ["colocate/train.py", "colocate/preflight.py"])
def test_composition_root_and_preflight_look_the_engine_up(path):
    assert kind_branches(open(os.path.join(REPO, path)).read()) == []


def test_auto_takes_the_first_available_entry(monkeypatch):
    assert resolve_kind("auto", CPU) == "hf"
    assert resolve_kind("hf", CUDA) == "hf"
    monkeypatch.setattr(table, "vllm_installed", lambda: True)
    monkeypatch.setitem(ENGINES, "vllm", EngineEntry(**{**ENGINES["vllm"].__dict__,
                                                       "available": lambda topo: topo.device.type == "cuda"}))
    assert resolve_kind("auto", CUDA) == "vllm" and resolve_kind("auto", CPU) == "hf"


def test_entries_say_who_loads_weights():
    assert ENGINES["vllm"].loads_own_weights and not ENGINES["hf"].loads_own_weights
    assert ENGINES["hf"].available(CPU) and ENGINES["hf"].installed()


def test_unknown_kind_is_one_line_naming_the_kinds(monkeypatch):
    with pytest.raises(ConfigError, match=r"engine.kind='tgi' is not one of 'auto', 'hf', 'vllm'; did you mean"):
        check_engine_kind("tgi")
    from tests.toy_engine import build_toy
    monkeypatch.setitem(ENGINES, "toy", EngineEntry(build=build_toy, sender=table.broadcast_sender))
    check_engine_kind("toy")  # a registered entry is a kind


def test_adapter_targets_share_a_declared_protocol():
    from colocate.engine.vllm_worker import AdapterSlot, AdapterTarget, MergedAdapter
    for cls in (AdapterSlot, MergedAdapter):
        assert AdapterTarget in cls.__mro__  # declared, not only shaped alike
        assert all(callable(getattr(cls, m)) for m in ("apply", "matches"))


@pytest.mark.slow
def test_a_registered_third_engine_trains_cpu_tiny(tmp_path):
    """One torchrun launch (2 processes, 3 steps of cpu-tiny: ~20 s on 2 cores)."""
    import subprocess
    import sys
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "tests.toy_engine", "--config", "configs/cpu-tiny.yaml", "--engine.kind=toy", "--learner.num_steps=3",
           f"--metrics.run_dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "colocate: toy engine on rank 0" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3, summary


def test_an_fp8_kv_cache_is_refused_where_the_engine_would_not_keep_one(tiny_cfg, monkeypatch):
    """engine.kv_cache_dtype=fp8 is the vLLM entry's (`fp8_kv_cache`): refused for hf, and for auto
    where auto is the HF engine (no GPU here); planning for another machine checks only an explicit kind."""
    import dataclasses

    from colocate.engine.table import check_engine_keys

    def cfg(kind, kv="fp8"):
        return dataclasses.replace(tiny_cfg, engine=dataclasses.replace(tiny_cfg.engine, kind=kind, kv_cache_dtype=kv))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for kind in ("hf", "auto"):
        with pytest.raises(ConfigError, match="engine.kv_cache_dtype=fp8 is not kept by the hf engine"):
            check_engine_keys(cfg(kind))
    check_engine_keys(cfg("vllm"))
    check_engine_keys(cfg("auto"), outside_world=False)
    check_engine_keys(cfg("hf", kv="auto"))


# ------------------------------------------------------------------- imports while the checks run

@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """A stand-in `vllm` package first on sys.path, CUDA reported present -> write(body) sets the
    body of its `vllm.entrypoints.llm`; the vllm modules a test imports are dropped after it."""
    import sys
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    for folder in ("vllm", "vllm/entrypoints"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def write(body: str) -> None:
        (tmp_path / "vllm" / "entrypoints" / "llm.py").write_text(body)
    write("LLM = 'the stand-in'\n")
    yield write
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]


def test_the_launcher_names_the_ranks_that_build_an_engine_with_imports(monkeypatch):
    roles = ["inference", "learner", "inference", "learner"]
    assert table.preimport_ranks("vllm", roles, gpus=1) == "vllm:0,2"
    assert table.preimport_ranks("hf", roles, gpus=1) == "" and table.preimport_ranks("auto", roles, gpus=0) == ""
    monkeypatch.setattr(table, "vllm_installed", lambda: True)
    assert table.preimport_ranks("auto", roles, gpus=1) == "vllm:0,2"  # auto resolved as the checks do
    assert table.preimport_ranks("vllm", roles, gpus=1, prestart=True) == "vllm:0,2:prestart"  # engine.prestart
    assert table.preimport_ranks("hf", roles, gpus=1, prestart=True) == ""


def test_the_launchers_word_starts_the_engines_server_on_its_inference_ranks_first(fake_vllm, monkeypatch):
    """`:prestart` in the word: the entry's `prestart` runs on the rank's own thread before the
    imports' thread starts; without it, or on a learner, it does not."""
    import dataclasses
    import threading
    started = []
    entry = dataclasses.replace(table.ENGINES["vllm"], prestart=lambda rank: started.append(
        (rank, threading.current_thread() is threading.main_thread(), "vllm" in sys.modules)))
    monkeypatch.setitem(table.ENGINES, "vllm", entry)
    assert table.preimport("vllm:0,2:prestart", 1) is None and started == []
    table.preimport("vllm:0,2", 0).join()
    assert started == []
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    table.preimport("vllm:0,2:prestart", 2).join()
    assert started == [(2, True, False)]  # before vLLM's imports


def test_an_inference_rank_imports_vllm_early_and_a_learner_never(fake_vllm):
    import sys
    assert table.preimport("vllm:0", 1) is None and table.preimport("", 0) is None
    assert "vllm" not in sys.modules
    table.preimport("vllm:0", 0).join()
    assert sys.modules["vllm.entrypoints.llm"].LLM == "the stand-in" and "colocate.engine.vllm" in sys.modules


def test_an_early_import_that_fails_is_raised_by_the_builds_own(fake_vllm, monkeypatch):
    import sys
    import threading
    fake_vllm("raise ImportError('libcudart.so.13: cannot open shared object file')\n")
    failures = []
    monkeypatch.setattr(threading, "excepthook", failures.append)
    table.preimport("vllm:1", 1).join()
    assert failures == [] and "vllm.entrypoints.llm" not in sys.modules
    with pytest.raises(ImportError, match="libcudart"):
        import vllm.entrypoints.llm  # noqa: F401


def test_without_cuda_a_rank_imports_nothing_early(fake_vllm, monkeypatch):
    import sys
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    table.preimport("vllm:0", 0).join()
    assert "vllm" not in sys.modules


def test_the_vllm_entry_takes_the_adapter_layout_from_the_ranks_own_model(monkeypatch, tiny_cfg, tiny_tokenizer):
    """The inference rank's meta model gives the engine the learner's adapter layout: the same as a
    model built for it (`lora_spec_for`), without building a second one."""
    from colocate.engine import vllm, vllm_channel
    from colocate.models import build_policy
    seen = {}
    monkeypatch.setattr(vllm.VLLMEngine, "from_config", classmethod(
        lambda cls, cfg, topo, tokenizer, spec, **facts: seen.update(spec=spec, facts=facts) or "engine"))
    monkeypatch.setattr(vllm_channel, "VLLMIpcReceiver", lambda engine, topo, verify: "receiver")
    monkeypatch.setattr(vllm, "lora_spec_for", lambda *a: pytest.fail("a second model was built"))
    parts = table.EngineParts(build_policy(tiny_cfg, tiny_tokenizer, "meta"), tiny_tokenizer,
                              {"prompt_bound": 8, "requests_per_group": 2})
    topo = types.SimpleNamespace(shared_gpu=True)
    assert table.build_vllm(tiny_cfg, topo, parts) == ("engine", "receiver")
    assert seen["facts"] == {"prompt_bound": 8, "requests_per_group": 2}
    monkeypatch.undo()
    assert seen["spec"] == vllm.lora_spec_for(tiny_cfg, tiny_tokenizer)


def test_an_inference_rank_joins_the_world_before_it_waits_for_its_early_imports(monkeypatch, tiny_cfg):
    """The learners' process groups form without waiting for an inference rank's engine imports
    (they run on, beside the groups' forming); the rank waits for them before anything else it does."""
    from colocate import train
    calls = []

    class Imports:  # the early-import thread
        def join(self):
            calls.append("imports joined")

    class Stop(Exception):
        pass

    def first_step_after(cfg):  # the rank's next step after the world is formed
        calls.append("corpus")
        raise Stop
    topo = types.SimpleNamespace(rank=1, role_rank=1)  # no rank-0 lines
    monkeypatch.setattr(train, "build_topology", lambda cfg: calls.append("world formed") or topo)
    monkeypatch.setattr(train, "mark", calls.append)
    monkeypatch.setattr(train, "env_corpus", first_step_after)
    with pytest.raises(Stop):
        train.run_rank(tiny_cfg, None, None, {}, Imports())
    assert calls == ["world formed", "ranks_up", "imports joined", "corpus"]


def test_the_vllm_entrys_head_start_is_the_server_for_the_gpu_its_topology_gives(monkeypatch):
    """`topology.rank_devices`' rule (local rank % GPUs): rank 3 of 4 on a node of 2 GPUs gets GPU 1;
    without CUDA (or vLLM) nothing starts."""
    from colocate.engine import prestart
    started = []
    monkeypatch.setattr(prestart, "start_engine_server", started.append)
    monkeypatch.setattr(table, "vllm_installed", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    table.prestart_vllm(3)
    assert started == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    table.prestart_vllm(3)
    assert started == [1]
