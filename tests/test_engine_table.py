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
    from colocate.engine.adapter_targets import AdapterSlot, AdapterTarget, MergedAdapter, MergedFp8Adapter
    for cls in (AdapterSlot, MergedAdapter, MergedFp8Adapter):
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
    assert table.preimport_ranks("vllm", roles, gpus=1, prestart=True) == "vllm:0,2:prestart=0,0"  # engine.prestart
    assert table.preimport_ranks("vllm", roles, gpus=0, prestart=True) == "vllm:0,2"  # no GPU: no server
    assert table.preimport_ranks("hf", roles, gpus=1, prestart=True) == ""


@pytest.mark.parametrize("roles, gpus, local_world, servers", [
    (["inference", "learner"], 1, None, {0: 0}),  # one GPU shared: the engine's is GPU 0
    (["inference", "inference", "learner", "learner"], 4, None, {0: 0, 1: 1}),
    (["inference", "learner", "inference", "learner"], 2, 4, {0: 0, 2: 0}),  # 4 processes on 2 GPUs: round-robin
    (["inference", "learner", "inference", "learner"], 2, 2, {0: 0, 2: 0}),  # 2 nodes: global rank 2 is node 1's 0
    (["learner", "inference", "learner", "inference", "learner", "inference"], 2, 3, {1: 1, 3: 0, 5: 0}),
])
def test_the_launchers_word_gives_each_inference_rank_the_gpu_its_topology_will(roles, gpus, local_world, servers):
    """The word round-trips (`preimport_ranks` formats it, `headstart.EngineWord` parses it): each
    inference rank reads, without torch, the GPU index `topology.rank_devices` gives it at build time."""
    from colocate.engine.headstart import EngineWord
    from colocate.topology import rank_devices
    text = table.preimport_ranks("vllm", roles, gpus=gpus, prestart=True, local_world=local_world)
    word = EngineWord.parse(text)
    assert str(word) == text and word.kind == "vllm" and word.ranks == tuple(servers)
    devices = rank_devices(len(roles), local_world or len(roles), gpus)
    assert {r: word.server_gpu(r) for r in range(len(roles)) if word.server_gpu(r) is not None} == servers
    assert all(devices[r][1] == gpu for r, gpu in servers.items())


def test_a_malformed_word_starts_nothing_early():
    from colocate.engine.headstart import EngineWord
    for text in ("", "vllm:0,x", "vllm:0,2:prestart", "vllm:0,2:prestart=0", "vllm:0:other=1"):
        assert EngineWord.parse(text) == EngineWord() and table.preimport(text, 0) is None, text


def test_the_head_start_starts_the_server_for_its_rank_only(monkeypatch):
    """`head_start` (the rank's first act) starts the word's server on the inference ranks it names,
    for their GPU; a learner, a word without `prestart=`, or a server that fails start nothing more
    (the build starts it again)."""
    from colocate import handover
    from colocate.engine import headstart
    started = []
    monkeypatch.setitem(headstart.SERVERS, "vllm", started.append)
    env = {handover.ENGINE_IMPORTS_ENV: "vllm:0,2:prestart=0,1"}
    for rank in ("1", "2", "0"):
        headstart.head_start({**env, "RANK": rank})
    headstart.head_start({handover.ENGINE_IMPORTS_ENV: "vllm:0,2", "RANK": "0"})
    headstart.head_start({"RANK": "0"})  # plain torchrun: no word
    assert started == [1, 0]
    monkeypatch.setitem(headstart.SERVERS, "vllm", lambda gpu: 1 / 0)
    headstart.head_start({**env, "RANK": "0"})  # a head start only: nothing raised


def test_the_vllm_server_starts_only_where_vllm_is_installed(monkeypatch):
    from colocate.engine import headstart, prestart
    started = []
    monkeypatch.setattr(prestart, "start_engine_server", started.append)
    monkeypatch.setattr(headstart.importlib.util, "find_spec", lambda name: None)
    headstart.start_vllm_server(1)
    assert started == []
    monkeypatch.setattr(headstart.importlib.util, "find_spec", lambda name: object())
    headstart.start_vllm_server(1)
    assert started == [1]


def test_the_rank_starts_its_server_before_it_imports_torch(tmp_path):
    """`train.py`'s `__main__` head, run up to its head start in a fresh interpreter (with a stand-in
    server that imports the real one's module, `prestart`, as `start_vllm_server` does), has imported
    no torch (nor transformers, vLLM) when the server starts: its imports run beside the rank's own."""
    import subprocess
    from colocate import handover
    source = open(os.path.join(REPO, "colocate", "train.py")).read()
    head = next(n for n in ast.parse(source).body if isinstance(n, ast.If))  # `if __name__ == "__main__":`
    upto = next(i for i, n in enumerate(head.body) if "head_start()" in ast.unparse(n))
    script = ("import sys\nfrom colocate.engine import headstart\n"
              "headstart.SERVERS['vllm'] = lambda gpu: __import__('colocate.engine.prestart') and "
              "print(gpu, sorted(m for m in ('torch', 'transformers', "
              "'vllm', 'peft') if m in sys.modules))\n" + "\n".join(ast.unparse(n) for n in head.body[:upto + 1]))
    env = {**os.environ, "PYTHONPATH": REPO, handover.ENGINE_IMPORTS_ENV: "vllm:0,1:prestart=0,1", "RANK": "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout) == (0, "1 []\n"), out.stderr
    assert "import peft" in "\n".join(ast.unparse(n) for n in head.body[upto:])  # the heavy imports come after


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
