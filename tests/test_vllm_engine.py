"""`VLLMEngine`'s host side without vLLM: output conversion (log-probs, replayed `allowed_ids`, the
appended EOS, answers vLLM cut short), SamplingParams fields, what reaches `vllm.LLM` (a stand-in
vllm module records it), the spawn environment, the adapter layout, and streaming over a fake
`LLM`. The GPU tests are tests/test_vllm_gpu.py."""
import os
import random
from types import SimpleNamespace

import pytest
import torch

from colocate.constraint import Constraint
from colocate.data import Request
from colocate.lifecycle import spawn_without_main
from colocate.engine.prestart import REPO_ROOT, engine_environment, visible_device
from colocate.engine.vllm import lora_spec_for
from colocate.engine.vllm_requests import (completion_from_output, prompt_logprobs_of, sampled_logprobs,
                                           sampling_kwargs)
from colocate.engine.vllm_settings import capture_sizes, engine_settings
from colocate.wire import LoraSpec
from tests.test_vllm_grammar import EOS, prefix_constraint


# ------------------------------------------------------------------------------- outputs

def fake_output(ids, lps, reason="stop", flat=True):
    if flat:
        logprobs = SimpleNamespace(logprobs=list(lps))
    else:
        logprobs = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(ids, lps)]
    return SimpleNamespace(token_ids=list(ids), logprobs=logprobs, finish_reason=reason)


def test_sampled_logprobs_flat_and_per_position():
    assert sampled_logprobs(fake_output([5, 6], [-0.5, -1.0])) == [-0.5, -1.0]
    assert sampled_logprobs(fake_output([5, 6], [-0.5, -1.0], flat=False)) == [-0.5, -1.0]


def test_completion_keeps_sampled_eos_and_replays_allowed():
    c = prefix_constraint()
    req = Request(prompt_ids=[2, 3], max_new_tokens=8, constraint=c)
    comp, counts = completion_from_output(fake_output([7, 8, 9, 10, 12, EOS], [-1.1, 0, 0, 0, -0.7, 0]), req, 4, EOS)
    assert comp.token_ids[-1] == EOS and comp.version == 4 and comp.finish_reason == "stop"
    assert comp.allowed_ids == [[5, 7], [8], [9], [10], [11, 12], [EOS]]
    assert counts == {"walk_failures": 0, "eos_appended": 0, "engine_errors": 0}


def test_completion_appends_forced_eos_when_vllm_omits_it():
    c = prefix_constraint()
    req = Request(prompt_ids=[2], max_new_tokens=8, constraint=c)
    comp, counts = completion_from_output(fake_output([5, 10, 11], [-0.3, -0.2, -0.6]), req, 0, EOS)
    assert comp.token_ids == [5, 10, 11, EOS] and comp.logprobs[-1] == 0.0 and comp.allowed_ids[-1] == [EOS]
    assert counts["eos_appended"] == 1


def test_completion_length_and_walk_failure_and_unconstrained():
    c = prefix_constraint()
    req = Request(prompt_ids=[2], max_new_tokens=2, constraint=c)
    comp, counts = completion_from_output(fake_output([7, 8], [-1, 0], reason="length"), req, 0, EOS)
    assert comp.finish_reason == "length" and len(comp.allowed_ids) == 2 and counts["walk_failures"] == 0
    comp, counts = completion_from_output(fake_output([7, 3, 9], [-1, -2, -3]), req, 0, EOS)
    assert counts["walk_failures"] == 1 and comp.allowed_ids == [[5, 7], [3], [9]]
    # vLLM cut the answer short (e.g. its grammar refused a token, which it appended): counted, kept
    # up to the last allowed token, reported as truncated
    comp, counts = completion_from_output(fake_output([7, 8, 3], [-1, 0, -2], reason="error"), req, 0, EOS)
    assert counts == {"walk_failures": 0, "eos_appended": 0, "engine_errors": 1}
    assert comp.token_ids == [7, 8] and comp.logprobs == [-1, 0] and comp.allowed_ids == [[5, 7], [8]]
    assert comp.finish_reason == "length"
    free = Request(prompt_ids=[2], max_new_tokens=3)
    comp, _ = completion_from_output(fake_output([4, 4, EOS], [-1, -1, -1]), free, 2, EOS)
    assert comp.allowed_ids is None and comp.token_ids == [4, 4, EOS]


def test_sampling_kwargs():
    kw = sampling_kwargs(Request(prompt_ids=[1], max_new_tokens=9, temperature=0.7), EOS)
    assert kw == dict(n=1, temperature=0.7, max_tokens=9, logprobs=0, flat_logprobs=True, detokenize=False)
    only_eos = sampling_kwargs(Request(prompt_ids=[1], max_new_tokens=9, constraint=Constraint([], EOS)), EOS)
    assert only_eos["max_tokens"] == 1 and only_eos["allowed_token_ids"] == [EOS]


# ------------------------------------------------------------------------------- start-up

def test_engine_passes_the_configs_graph_settings_to_vllm(monkeypatch, tiny_cfg):
    """config -> engine_settings -> VLLMEngine -> the kwargs `vllm.LLM` receives (a stand-in vllm
    module records them): CUDA graphs up to the step's token budget, the configured graph mode; the
    worker is asked to use our log-prob kernel unless `engine.logprob_kernel=vllm`."""
    import dataclasses
    import sys
    import types
    from colocate.engine.vllm import VLLMEngine
    seen, calls = {}, []

    class LLM:
        def __init__(self, **kwargs):
            seen.update(kwargs)

        def collective_rpc(self, method, args=()):
            calls.append(method)
            if method == "colocate_logprob_calls":  # two workers' counts
                return [{"ours": 5, "vllm": 0}, {"ours": 4, "vllm": 1}]
            return ["ours"] if method == "colocate_use_logprob_kernel" else [{"method": method}]

    lora_request = types.ModuleType("vllm.lora.request")
    lora_request.LoRARequest = lambda **kw: SimpleNamespace(**kw)
    for name, module in (("vllm", types.ModuleType("vllm")), ("vllm.lora", types.ModuleType("vllm.lora")),
                         ("vllm.lora.request", lora_request)):
        monkeypatch.setitem(sys.modules, name, module)
    sys.modules["vllm"].LLM = LLM
    cfg = dataclasses.replace(tiny_cfg, engine=dataclasses.replace(
        tiny_cfg.engine, max_num_batched_tokens=1024, max_capture_tokens=2048, cudagraph_mode="FULL"))
    settings = engine_settings(cfg, num_inference=2, seed=0, prompt_bound=64, requests_per_group=8)
    spec = LoraSpec.of({"a": torch.zeros(2, 3)})
    engine = VLLMEngine("/nowhere", spec, 2, settings)
    compilation = seen["compilation_config"]
    assert compilation["cudagraph_mode"] == "FULL" and seen["max_num_batched_tokens"] == 1024
    assert compilation["cudagraph_capture_sizes"] == capture_sizes(settings.max_num_seqs, 1024)
    assert compilation["cudagraph_capture_sizes"][-1] == 1024 and engine.slot_info["method"] == "colocate_init_adapter"
    assert engine.logprob_kernel == "ours" and calls.count("colocate_use_logprob_kernel") == 1
    assert engine.logprob_calls() == {"ours": 9, "vllm": 1}  # summed over the workers
    # max_capture_tokens 0: decode sizes only; vLLM's own log-probs
    calls.clear()
    engine = VLLMEngine("/nowhere", spec, 2, settings.replace(max_capture_tokens=0, cudagraph_mode="",
                                                              logprob_kernel="vllm"))
    assert seen["compilation_config"] == {"cudagraph_capture_sizes": capture_sizes(settings.max_num_seqs)}
    assert engine.logprob_kernel == "vllm" and "colocate_use_logprob_kernel" not in calls
    assert engine.logprob_calls() == {"ours": 0, "vllm": 0} and "colocate_logprob_calls" not in calls


def test_engine_environment_cleans_torchrun_and_restores(monkeypatch):
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert visible_device(1) == "5"
    with engine_environment(2):
        assert "RANK" not in os.environ and "TORCHELASTIC_USE_AGENT_STORE" not in os.environ
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "6"
        assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == REPO_ROOT  # the worker extension imports colocate
        assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"  # vLLM's choice, so it does not warn
    assert os.environ["RANK"] == "3" and os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6"
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ


def spawn_and_join(target, *args) -> int:
    import multiprocessing
    child = multiprocessing.get_context("spawn").Process(target=target, args=args)
    child.start()
    child.join(timeout=120)
    return child.exitcode


def test_spawn_without_main_skips_the_main_module_and_restores_it(monkeypatch, tmp_path):
    """A main module with a spec (a rank's `colocate.train`) runs again in a spawned child, except
    inside `spawn_without_main`; the child still runs its target, and `__main__` is restored (also
    after an exception)."""
    import importlib
    import sys
    marker = tmp_path / "imported"
    (tmp_path / "colocate_fake_main.py").write_text(f"open({str(marker)!r}, 'a').write('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    main = importlib.import_module("colocate_fake_main")
    monkeypatch.setitem(sys.modules, "__main__", main)
    marker.unlink()
    assert spawn_and_join(os.makedirs, str(tmp_path / "ran-plain")) == 0
    assert marker.read_text() == "imported"  # the test sees a re-import: spawn ran the main module again
    marker.unlink()
    spec, file = main.__spec__, main.__file__
    with pytest.raises(RuntimeError, match="engine failed"):
        with spawn_without_main():
            assert spawn_and_join(os.makedirs, str(tmp_path / "ran-hidden")) == 0
            raise RuntimeError("engine failed")
    assert not marker.exists() and (tmp_path / "ran-hidden").is_dir()
    assert main.__spec__ is spec and main.__file__ == file and sys.modules["__main__"] is main


def test_lora_spec_for_matches_the_learners(tiny_cfg, tiny_tokenizer):
    from colocate.models import lora_state
    from colocate.models import build_policy
    spec = lora_spec_for(tiny_cfg, tiny_tokenizer)
    assert spec == LoraSpec.of(lora_state(build_policy(tiny_cfg, tiny_tokenizer, torch.device("cpu"))))


# ------------------------------------------------------------------------------- streaming

class FakeLLM:
    """`LLM.enqueue` + `llm_engine.step()` as vLLM 0.25 behaves: enqueue returns internal ids
    "<n>-<random>", outputs carry "<n>"; each step finishes a random subset (FINAL_ONLY outputs)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.counter = 100
        self.running: dict[str, list[int]] = {}
        self.llm_engine = SimpleNamespace(step=self._step, has_unfinished_requests=lambda: bool(self.running))

    def enqueue(self, prompts, params, lora_request=None, use_tqdm=True):
        ids = []
        for p, sp in zip(prompts, params):
            self.running[str(self.counter)] = (p["prompt_token_ids"], sp)
            ids.append(f"{self.counter}-{self.rng.getrandbits(32):08x}")
            self.counter += 1
        return ids

    def generate(self, prompts, params, lora_request=None, use_tqdm=True):
        """Runs only its own requests (the engine calls it with nothing streamed in flight)."""
        assert not self.running
        self.enqueue(prompts, params)
        out = []
        while self.running:
            out += self._step()
        return sorted(out, key=lambda o: int(o.request_id))

    def _step(self):
        names = list(self.running)
        self.rng.shuffle(names)
        out = []
        for name in names[:self.rng.randint(0, 3)]:
            prompt, params = self.running.pop(name)
            tok = prompt[-1] + 1  # the "sampled" token names the prompt it answers
            result = SimpleNamespace(token_ids=[tok, EOS], logprobs=SimpleNamespace(logprobs=[-0.5, -0.1]),
                                     finish_reason="stop")
            scored = getattr(params, "prompt_logprobs", None) is not None  # log p(t) = -t / 100 here
            prompt_lps = [None] + [{t: SimpleNamespace(logprob=-t / 100)} for t in prompt[1:]] if scored else None
            out.append(SimpleNamespace(request_id=name, finished=True, outputs=[result], num_cached_tokens=1,
                                       prompt_logprobs=prompt_lps))
        return out


def _streaming_engine(monkeypatch, seed=0):
    from colocate.engine.vllm import VLLMEngine
    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM here: the host side only
    engine.llm, engine.version, engine.eos_id, engine.grammar_mode = FakeLLM(seed), 3, EOS, "tokens"
    engine.lora_mode, engine._lora_request = "slot", None
    engine._pending, engine._next_ticket, engine._busy_since, engine._stash, engine._probes = {}, 0, 0.0, [], {}
    engine.inflight = False
    engine.counters = dict.fromkeys(("requests", "walk_failures", "eos_appended", "engine_errors", "host_s", "generate_s",
                                     "prompt_tokens", "cached_prompt_tokens", "out_tokens", "steps"), 0)
    monkeypatch.setattr(engine, "_params", lambda requests: ([{"prompt_token_ids": r.prompt_ids} for r in requests],
                                                             [None] * len(requests)))
    return engine


def test_vllm_submit_poll_maps_outputs_to_tickets(monkeypatch):
    engine = _streaming_engine(monkeypatch)
    requests = [Request(prompt_ids=[7, 10 * i], max_new_tokens=2) for i in range(12)]
    tickets = engine.submit(requests[:5]) + engine.submit(requests[5:])
    assert tickets == list(range(12))
    got = {}
    while len(got) < 12:
        done = engine.poll()
        assert done  # a poll returns at least one completion while any is pending
        got.update(done)
    assert engine.poll() == [] and not engine._pending
    for t, r in zip(tickets, requests):
        assert got[t].token_ids == [r.prompt_ids[-1] + 1, EOS] and got[t].version == 3
    assert engine.counters["requests"] == 12 and engine.counters["out_tokens"] == 24
    assert engine.counters["steps"] >= 4  # at most 3 finish per fake step


def test_vllm_streamed_poll_returns_after_one_step_once_woken(monkeypatch):
    """wake() true: the poll ends after the engine step it made, finished or not; every request
    is still answered once by later polls."""
    engine = _streaming_engine(monkeypatch, seed=2)
    engine.submit([Request(prompt_ids=[1, i], max_new_tokens=2) for i in range(20)])
    got, polls = {}, 0
    while engine._pending:
        steps = engine.counters["steps"]
        got.update(engine.poll(wake=lambda: True))
        assert engine.counters["steps"] == steps + 1  # one step per woken poll
        polls += 1
    assert len(got) == 20 and polls > 20 // 3  # at most 3 finish per fake step


def test_vllm_poll_wait_all_and_no_update_while_streaming(monkeypatch):
    engine = _streaming_engine(monkeypatch, seed=1)
    engine.submit([Request(prompt_ids=[1, i], max_new_tokens=2) for i in range(8)])
    for update in (lambda: engine._set_version(4), lambda: engine.receive_lora(),
                   lambda: engine.generate([Request(prompt_ids=[1], max_new_tokens=1)])):
        with pytest.raises(RuntimeError, match="in flight"):
            update()  # weights must not change under running requests (checked before any RPC)
    assert len(engine.poll(wait_all=True)) == 8 and not engine._pending
    assert engine.counters["generate_s"] > 0  # first submit -> last answer


def test_vllm_poll_refuses_requests_vllm_does_not_know(monkeypatch):
    engine = _streaming_engine(monkeypatch, seed=2)
    engine.submit([Request(prompt_ids=[1, 2], max_new_tokens=2)])
    engine.llm.running.clear()  # lost inside vLLM: step() would block forever
    with pytest.raises(RuntimeError, match="unknown to vLLM"):
        engine.poll()


def test_vllm_inflight_updates_land_under_running_requests(monkeypatch):
    """update="inflight": a version lands while streamed requests run; each answer records the
    version at its submit (no token older) and the one when it was read (none newer); evaluation's
    `generate` runs beside them and keeps the streamed answers it reads for the next poll."""
    engine = _streaming_engine(monkeypatch, seed=3)
    engine.inflight = True
    monkeypatch.setattr(engine, "_make_lora_request", lambda: None)
    early = engine.submit([Request(prompt_ids=[1, 10 + i], max_new_tokens=2) for i in range(6)])
    got = dict(engine.poll())
    engine._set_version(4)  # no refusal: the update lands between two engine steps
    late = engine.submit([Request(prompt_ids=[2, 20 + i], max_new_tokens=2) for i in range(6)])
    evaluated = engine.generate([Request(prompt_ids=[3, 30 + i], max_new_tokens=2) for i in range(4)])
    assert [c.token_ids[0] for c in evaluated] == [31, 32, 33, 34]
    while engine._pending or engine._stash:
        got.update(engine.poll())
    assert set(got) == set(early) | set(late)  # nothing lost to the evaluation, nothing twice
    for t in early:
        assert got[t].version == 3 and got[t].last_version in (3, 4)
    for t in late:
        assert got[t].version == 4 and got[t].last_version == 4


# ------------------------------------------------------------------------------- the canary

def test_prompt_logprobs_of_reads_the_probes_own_tokens():
    out = SimpleNamespace(prompt_logprobs=[None, {7: SimpleNamespace(logprob=-0.5), 3: SimpleNamespace(logprob=-2.0)},
                                           {9: SimpleNamespace(logprob=-1.25)}])
    assert prompt_logprobs_of(out, [4, 7, 9]).tolist() == [-0.5, -1.25]
    with pytest.raises(RuntimeError, match="prompt_logprobs=0"):
        prompt_logprobs_of(SimpleNamespace(prompt_logprobs=None), [4, 7, 9])


def test_vllm_canary_scores_the_probe_idle_and_beside_streamed_requests(monkeypatch):
    """`score` asks vLLM for the probe's prompt log-probs with one generated token, through the
    engine's queue: alone when nothing streams, else beside the running requests, where the
    streamed answers it reads wait for the next poll and the probe is never taken for one of them."""
    import sys
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kw: SimpleNamespace(**kw)))
    engine = _streaming_engine(monkeypatch, seed=4)
    probe = [5, 11, 12, 30]
    want = [-0.11, -0.12, -0.30]
    assert engine.score(probe).tolist() == pytest.approx(want)
    engine.inflight = True
    tickets = engine.submit([Request(prompt_ids=[1, 40 + i], max_new_tokens=2) for i in range(9)])
    for _ in range(3):
        assert engine.score(probe).tolist() == pytest.approx(want)
    got = {}
    while engine._pending or engine._stash:
        got.update(engine.poll())
    assert sorted(got) == tickets and not engine._probes
    assert [got[t].token_ids[0] for t in tickets] == [41 + i for i in range(9)]
    assert engine.counters["requests"] == 9  # the probes are not samples


def test_vllm_canary_probe_started_before_a_batch_runs_beside_it(monkeypatch):
    """`start_score` queues the probe; the batch submitted after it runs beside it, its answers are
    only the batch's, and reading the probe afterwards gives its log-probs. A probe still queued
    when `generate` or a weight update comes is finished first: `LLM.generate` would take its output
    (the fake refuses to start with anything running), and it belongs to the adapter it was queued under."""
    import sys
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kw: SimpleNamespace(**kw)))
    engine = _streaming_engine(monkeypatch, seed=5)
    probe, want = [5, 11, 12, 30], [-0.11, -0.12, -0.30]
    read = engine.start_score(probe)
    tickets = engine.submit([Request(prompt_ids=[1, 40 + i], max_new_tokens=2) for i in range(9)])
    got = {}
    while engine._pending or engine._stash:
        got.update(engine.poll())
    assert sorted(got) == tickets and engine.counters["requests"] == 9
    assert read().tolist() == pytest.approx(want) and not engine._probes
    steps = engine.counters["steps"]
    engine.score(probe)  # alone: the steps it takes are not rollout steps
    assert engine.counters["steps"] == steps
    read = engine.start_score(probe)  # queued, then a drain-mode evaluation's generate
    outs = engine.generate([Request(prompt_ids=[1, 60], max_new_tokens=2)])
    assert [o.token_ids[0] for o in outs] == [61] and engine._probes  # done, kept for its reader
    assert read().tolist() == pytest.approx(want)
    engine.start_score(probe)
    engine._require_idle("adapter update")  # what every weight update asks first
    assert all(o is not None for o in engine._probes.values()) and not engine.llm.running
