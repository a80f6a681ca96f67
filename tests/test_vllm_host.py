"""CPU tests of the vLLM engine's host side: grammar from a Constraint, allowed_ids replay, output
conversion, the LoRA slot plan and in-place apply, checksums, sizing and the spawn environment.
No vLLM here (the GPU tests are tests/test_vllm_gpu.py); llguidance tests skip without it."""
import os
import random
from types import SimpleNamespace

import pytest
import torch

from colocate.constraint import Constraint, ConstraintState
from colocate.data import Request
from colocate.engine.vllm import (REPO_ROOT, completion_from_output, engine_environment, lora_spec_for,
                                  sampled_logprobs, sampling_kwargs, visible_device)
from colocate.engine.vllm_settings import capture_sizes, engine_settings
from colocate.engine.vllm_grammar import (completion_is_forced_eos, constraint_grammar, replay_allowed)
from colocate.engine.vllm_sync import chunked_checksum
from colocate.engine.vllm_worker import (AdapterSlot, MergedAdapter, lora_module_name, merge_plan, slot_plan,
                                         slot_views)
from colocate.sync import LoraSpec, checksum, flatten_lora

EOS = 1


def prefix_constraint() -> Constraint:
    # slot 0: [5] is a prefix of [5, 6]; slot 1 choices share their first token
    return Constraint(slots=[[[5], [5, 6], [7, 8, 9]], [[10, 11], [10, 12]]], eos_id=EOS,
                      texts=[["a", "ab", "cde"], ["xy", "xz"]])


def random_walk(c: Constraint, rng: random.Random) -> list[int]:
    state, out = ConstraintState(c), []
    while not state.done:
        tok = rng.choice(state.allowed())
        out.append(tok)
        state.advance(tok)
    return out


# ------------------------------------------------------------------------------- grammar

def test_token_grammar_lists_each_slot_once_deduped():
    c = Constraint(slots=[[[3, 4], [3, 4], [5]], [[6]]], eos_id=EOS)
    g = constraint_grammar(c)
    assert g.splitlines() == ["start: s0 s1", "s0: <[3]> <[4]> | <[5]>", "s1: <[6]>"]


def test_text_grammar_quotes_strings_and_needs_texts():
    c = prefix_constraint()
    g = constraint_grammar(c, "text")
    assert 's0: "a" | "ab" | "cde"' in g
    with pytest.raises(ValueError):
        constraint_grammar(Constraint(slots=[[[3]]], eos_id=EOS), "text")
    with pytest.raises(ValueError):
        constraint_grammar(Constraint(slots=[], eos_id=EOS))
    with pytest.raises(ValueError):
        constraint_grammar(c, "regex")


# ------------------------------------------------------------------------------- replay

def test_replay_matches_constraint_state_on_random_walks():
    c, rng = prefix_constraint(), random.Random(0)
    for _ in range(50):
        ids = random_walk(c, rng)
        replay = replay_allowed(c, ids)
        assert replay.is_valid and replay.is_done and len(replay.allowed_ids) == len(ids)
        state = ConstraintState(c)
        for tok, allowed in zip(ids, replay.allowed_ids):
            assert allowed == state.allowed() and tok in allowed
            state.advance(tok)


def test_replay_prefix_choice_allows_eos_and_continuation():
    c = Constraint(slots=[[[5], [5, 6]]], eos_id=EOS)
    assert replay_allowed(c, [5, EOS]).allowed_ids == [[5], [EOS, 6]]
    assert replay_allowed(c, [5, 6, EOS]).allowed_ids == [[5], [EOS, 6], [EOS]]


def test_replay_reports_first_disallowed_token_and_tokens_after_eos():
    c = prefix_constraint()
    bad = replay_allowed(c, [7, 9])
    assert not bad.is_valid and not bad.is_done and bad.allowed_ids == [[5, 7]]
    after = replay_allowed(c, [5, 10, 11, EOS, 3])
    assert not after.is_valid and after.is_done and len(after.allowed_ids) == 4


def test_forced_positions_mark_tokens_the_constraint_alone_decides():
    from colocate.constraint import forced_positions
    c = prefix_constraint()  # slot 0: [5] | [5, 6] | [7, 8, 9]; slot 1: [10, 11] | [10, 12]
    # 7 (choice), 8, 9 forced; 10 forced (both slot-1 choices start with it), 11 choice, EOS forced
    assert forced_positions(c, [7, 8, 9, 10, 11, EOS]) == [False, True, True, True, False, True]
    # after [5] both 6 and 10 may follow: not forced
    assert forced_positions(c, [5, 10, 12, EOS]) == [False, False, False, True]
    with pytest.raises(ValueError):
        forced_positions(c, [8])


def test_forced_eos_detection():
    c = prefix_constraint()
    assert completion_is_forced_eos(c, [7, 8, 9, 10, 11])
    assert not completion_is_forced_eos(c, [7, 8, 9])            # slot 1 still open
    assert not completion_is_forced_eos(c, [7, 8, 9, 10, 11, EOS])  # already ended


def test_replay_says_eos_is_forced_as_the_reference_does():
    c, rng = prefix_constraint(), random.Random(1)
    for _ in range(50):
        ids = random_walk(c, rng)
        for cut in range(len(ids) + 1):  # every prefix, as vLLM may report it (without the EOS)
            replay = replay_allowed(c, ids[:cut])
            assert replay.only_eos_next == (not replay.is_done and completion_is_forced_eos(c, ids[:cut]))
    assert replay_allowed(c, [7, 8, 9, 10, 11]).only_eos_next
    assert not replay_allowed(c, [7, 8, 9]).only_eos_next
    assert not replay_allowed(c, [7, 9]).only_eos_next  # an invalid walk


# ------------------------------------------------------------------------------- llguidance

def llg_allowed(matcher, bitmask, vocab: int) -> list[int]:
    import llguidance.torch
    llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
    words = bitmask[0].tolist()
    return [w * 32 + b for w, v in enumerate(words) for b in range(32) if (v >> b) & 1 and w * 32 + b < vocab]


@pytest.mark.parametrize("make", ["prefix", "arithmetic"])
def test_llguidance_token_grammar_allows_exactly_the_constraint(make, tiny_tokenizer):
    llguidance = pytest.importorskip("llguidance")
    import llguidance.hf
    import llguidance.torch
    tok = tiny_tokenizer
    if make == "prefix":
        c = Constraint(slots=[[[5], [5, 6], [7, 8, 9]], [[10, 11], [10, 12]]], eos_id=tok.eos_token_id)
    else:
        answers = [str(v) for v in range(9)]
        c = Constraint(slots=[[tok.encode(" " + a, add_special_tokens=False) for a in answers]],
                       eos_id=tok.eos_token_id)
    vocab = 1024  # model vocab larger than the tokenizer's, as with the random Qwen shapes
    lt = llguidance.hf.from_tokenizer(tok, vocab)
    grammar = llguidance.grammar_from("grammar", constraint_grammar(c))
    assert not llguidance.LLMatcher.validate_grammar(grammar, lt)
    bitmask = llguidance.torch.allocate_token_bitmask(1, lt.vocab_size)
    rng = random.Random(1)
    for _ in range(20):
        matcher = llguidance.LLMatcher(lt, grammar, log_level=0)
        state = ConstraintState(c)
        while not state.done:
            assert llg_allowed(matcher, bitmask, vocab) == state.allowed()
            t = rng.choice(state.allowed())
            state.advance(t)
            if not state.done:
                assert matcher.consume_token(t)


def test_llguidance_text_grammar_admits_other_tokenizations(tiny_tokenizer):
    """Why the engine uses token grammars: a text grammar lets " 7" be spelled in other tokens."""
    llguidance = pytest.importorskip("llguidance")
    import llguidance.hf
    import llguidance.torch
    tok = tiny_tokenizer
    words = [" answer", " and"]  # canonically one token each; also spelt " ", "an", "sw", ...
    c = Constraint(slots=[[tok.encode(w, add_special_tokens=False) for w in words]], eos_id=tok.eos_token_id,
                   texts=[words])
    lt = llguidance.hf.from_tokenizer(tok, len(tok))
    matcher = llguidance.LLMatcher(lt, llguidance.grammar_from("grammar", constraint_grammar(c, "text")), log_level=0)
    bitmask = llguidance.torch.allocate_token_bitmask(1, lt.vocab_size)
    text_first = set(llg_allowed(matcher, bitmask, len(tok)))
    assert set(ConstraintState(c).allowed()) <= text_first
    assert text_first != set(ConstraintState(c).allowed())


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


# ------------------------------------------------------------------------------- LoRA slot

QWEN_PACKED = {"model.layers.0.self_attn.qkv_proj": ["model.layers.0.self_attn.q_proj",
                                                      "model.layers.0.self_attn.k_proj",
                                                      "model.layers.0.self_attn.v_proj"],
               "model.layers.0.mlp.gate_up_proj": ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]}
QWEN_MODULES = {"model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj",
                "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj"}


def test_lora_module_name_and_slot_plan():
    assert lora_module_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") == \
        ("model.layers.0.self_attn.q_proj", True)
    assert lora_module_name("base_model.model.model.layers.0.mlp.down_proj.lora_B.weight") == \
        ("model.layers.0.mlp.down_proj", False)
    names = [f"base_model.model.model.layers.0.{m}.lora_{ab}.default.weight"
             for m in ("self_attn.k_proj", "mlp.up_proj", "self_attn.o_proj") for ab in "AB"]
    plan = slot_plan(names, QWEN_MODULES, QWEN_PACKED)
    assert [(p[1], p[2], p[3]) for p in plan] == [
        ("model.layers.0.self_attn.qkv_proj", 1, True), ("model.layers.0.self_attn.qkv_proj", 1, False),
        ("model.layers.0.mlp.gate_up_proj", 1, True), ("model.layers.0.mlp.gate_up_proj", 1, False),
        ("model.layers.0.self_attn.o_proj", 0, True), ("model.layers.0.self_attn.o_proj", 0, False)]
    with pytest.raises(KeyError):
        slot_plan(["base_model.model.model.layers.0.mlp.fc9.lora_A.default.weight"], QWEN_MODULES, QWEN_PACKED)


def fake_lora_module(n_slices, in_dim, outs, max_loras=2, max_rank=4, dtype=torch.bfloat16):
    return SimpleNamespace(
        lora_a_stacked=tuple(torch.zeros(max_loras, 1, max_rank, in_dim, dtype=dtype) for _ in range(n_slices)),
        lora_b_stacked=tuple(torch.zeros(max_loras, 1, o, max_rank, dtype=dtype) for o in outs))


def test_adapter_slot_applies_cast_and_scaled_copy_without_touching_received_bytes():
    rank, hidden, kv = 4, 8, 4
    tensors = {
        "base_model.model.model.layers.0.self_attn.k_proj.lora_A.default.weight": torch.randn(rank, hidden),
        "base_model.model.model.layers.0.self_attn.k_proj.lora_B.default.weight": torch.randn(kv, rank),
        "base_model.model.model.layers.0.self_attn.o_proj.lora_A.default.weight": torch.randn(rank, hidden),
        "base_model.model.model.layers.0.self_attn.o_proj.lora_B.default.weight": torch.randn(hidden, rank),
    }
    spec = LoraSpec.of(tensors)
    modules = {"model.layers.0.self_attn.qkv_proj": fake_lora_module(3, hidden, (hidden, kv, kv)),
               "model.layers.0.self_attn.o_proj": fake_lora_module(1, hidden, (hidden,))}
    plan = slot_plan(spec.names, set(modules), QWEN_PACKED)
    slot = 1
    dst = [slot_views(modules[m], i, slot, a, spec.shapes[spec.names.index(n)]) for n, m, i, a in plan]
    adapter = AdapterSlot(spec, dst, [p[3] for p in plan], scaling=2.5)
    adapter.flat.copy_(flatten_lora(tensors, spec))
    received = adapter.flat.clone()
    for _ in range(2):  # a second apply of the same bytes must not scale B twice
        adapter.apply()
    assert torch.equal(adapter.flat, received) and adapter.matches()
    qkv = modules["model.layers.0.self_attn.qkv_proj"]
    k_a = tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_A.default.weight"]
    k_b = tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_B.default.weight"]
    assert torch.equal(qkv.lora_a_stacked[1][slot, 0], k_a.to(torch.bfloat16))
    assert torch.equal(qkv.lora_b_stacked[1][slot, 0], k_b.to(torch.bfloat16) * 2.5)  # vLLM's order: cast, scale
    assert not qkv.lora_a_stacked[0].any() and not qkv.lora_a_stacked[1][0].any()  # other slices / slots untouched
    with pytest.raises(ValueError):
        slot_views(modules["model.layers.0.self_attn.o_proj"], 0, slot, True, (rank + 8, hidden))


VLLM_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def fused_base_weights(model) -> dict[str, torch.Tensor]:
    """The base weights of a peft-wrapped HF model laid out as vLLM's Qwen2 holds them (fused q/k/v, gate/up)."""
    out = {}
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    for i, layer in enumerate(inner.model.layers):
        attn, mlp, p = layer.self_attn, layer.mlp, f"model.layers.{i}"
        base = lambda m: getattr(m, "base_layer", m).weight.detach().clone()  # noqa: E731
        out[f"{p}.self_attn.qkv_proj"] = torch.cat([base(attn.q_proj), base(attn.k_proj), base(attn.v_proj)])
        out[f"{p}.self_attn.o_proj"] = base(attn.o_proj)
        out[f"{p}.mlp.gate_up_proj"] = torch.cat([base(mlp.gate_proj), base(mlp.up_proj)])
        out[f"{p}.mlp.down_proj"] = base(mlp.down_proj)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_adapter_equals_peft_merge_in_vllm_layout(tiny_cfg, tiny_policy, dtype):
    """fp32: equal to peft's merge; bf16 (the engine's dtype): within one bf16 rounding of it."""
    from colocate.models import lora_state
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in tiny_policy.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.05)  # B is zero at init: give every update something to merge
    adapter = lora_state(tiny_policy)
    spec = LoraSpec.of(adapter)
    weights = {k: v.to(dtype) for k, v in fused_base_weights(tiny_policy).items()}
    w0 = {k: v.clone() for k, v in weights.items()}
    plan = merge_plan(spec.names, spec.shapes, set(weights), VLLM_PACKED)
    assert {p[0] for p in plan} == set(weights)                    # every adapted weight is found
    merged = MergedAdapter(spec, plan, weights, scaling=tiny_cfg.lora.alpha / tiny_cfg.lora.rank)
    merged.flat.copy_(flatten_lora(adapter, spec))
    for _ in range(2):                                              # merging is from W0: idempotent
        merged.apply()
    assert merged.matches()
    reference = fused_base_weights(tiny_policy.merge_and_unload())  # peft's own merge, per projection
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-3)
    for name, w in weights.items():
        assert w.dtype == dtype
        torch.testing.assert_close(w.float(), reference[name], **tol)
        assert not torch.equal(w, w0[name])
    merged.flat.zero_()                                             # a zero adapter gives back W0 exactly
    merged.apply()
    assert all(torch.equal(weights[k], w0[k]) for k in weights)
    weights["model.layers.0.self_attn.o_proj"][0, 0] += 1.0
    assert not merged.matches()                                     # the check sees a changed weight


def test_merge_plan_rows_and_errors():
    names, shapes = [], []
    for proj, out in (("q_proj", 8), ("k_proj", 4), ("v_proj", 4), ("o_proj", 8)):
        for ab, shape in (("A", (2, 8)), ("B", (out, 2))):
            names.append(f"base_model.model.model.layers.0.self_attn.{proj}.lora_{ab}.default.weight")
            shapes.append(shape)
    linear = {"model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj"}
    plan = merge_plan(names, shapes, linear, VLLM_PACKED)
    assert [(m.rsplit(".", 1)[1], r0, r1) for m, r0, r1, _, _ in plan] == [
        ("qkv_proj", 8, 12), ("o_proj", 0, 8), ("qkv_proj", 0, 8), ("qkv_proj", 12, 16)]
    with pytest.raises(KeyError, match="not adapted"):             # v's rows depend on k's size
        merge_plan([n for n in names if "k_proj" not in n], [s for n, s in zip(names, shapes) if "k_proj" not in n],
                   linear, VLLM_PACKED)
    with pytest.raises(KeyError, match="lora_B"):
        merge_plan(names[:1], shapes[:1], linear, VLLM_PACKED)


@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_chunked_checksum_equals_reference(chunk):
    flat = torch.randn(1001)
    assert chunked_checksum(flat, chunk_bytes=chunk) == checksum(flat)
    assert chunked_checksum(flat.to(torch.bfloat16), chunk_bytes=chunk) == checksum(flat.to(torch.bfloat16))


# ------------------------------------------------------------------------------- sizing, start-up

def test_capture_sizes_cover_the_batch():
    assert capture_sizes(512)[:5] == [1, 2, 4, 8, 16] and capture_sizes(512)[-1] == 512
    assert capture_sizes(100)[-1] == 100 and capture_sizes(3) == [1, 2, 3]
    # mixed steps: every 64 tokens past the decode sizes, up to the step's token budget
    sizes = capture_sizes(224, 1024)
    assert sizes == sorted(set(sizes)) and sizes[:15] == capture_sizes(224)
    assert sizes[15:] == list(range(256, 1025, 64))
    assert capture_sizes(224, 1000)[-2:] == [960, 1000] and capture_sizes(224, 100) == capture_sizes(224)


def test_compilation_settings_capture_mixed_steps_up_to_the_token_budget():
    from colocate.engine.vllm_settings import compilation_settings
    # the streaming preset: 224 sequences, 1,024-token steps -> graphs up to 1,024 tokens
    assert compilation_settings(224, 1024, 2048)["cudagraph_capture_sizes"][-1] == 1024
    # vLLM's default budget (0): up to max_capture_tokens; 0 keeps decode sizes only
    assert compilation_settings(224, 0, 2048)["cudagraph_capture_sizes"][-1] == 2048
    assert compilation_settings(224, 1024, 0)["cudagraph_capture_sizes"] == capture_sizes(224)
    assert "cudagraph_mode" not in compilation_settings(8, 0, 64)  # vLLM's default mode
    assert compilation_settings(8, 0, 64, "FULL")["cudagraph_mode"] == "FULL"
    with pytest.raises(ValueError, match="cudagraph_mode='full'"):
        compilation_settings(8, 0, 64, "full")


def test_engine_settings_from_config(tiny_cfg):
    s = engine_settings(tiny_cfg, num_inference=2, seed=5)
    assert s["max_num_seqs"] == (16 // 2) * 8 and s["max_model_len"] == 128
    assert s["lora_rank"] == tiny_cfg.lora.rank and s["seed"] == 5 and s["lora_mode"] == "slot"
    assert s["validate_grammars"] is True  # vLLM's own check stays on unless the config turns it off
    # 16 groups on 3 ranks: 6, 5, 5; the engine is sized for the largest share
    assert engine_settings(tiny_cfg, num_inference=3, seed=0)["max_num_seqs"] == 6 * 8


def test_engine_passes_the_configs_graph_settings_to_vllm(monkeypatch, tiny_cfg):
    """config -> engine_settings -> VLLMEngine -> the kwargs `vllm.LLM` receives (a stand-in vllm
    module records them): CUDA graphs up to the step's token budget, the configured graph mode."""
    import dataclasses
    import sys
    import types
    from colocate.engine.vllm import VLLMEngine
    seen = {}

    class LLM:
        def __init__(self, **kwargs):
            seen.update(kwargs)

        def collective_rpc(self, method, args=()):
            return [{"method": method}]

    lora_request = types.ModuleType("vllm.lora.request")
    lora_request.LoRARequest = lambda **kw: SimpleNamespace(**kw)
    for name, module in (("vllm", types.ModuleType("vllm")), ("vllm.lora", types.ModuleType("vllm.lora")),
                         ("vllm.lora.request", lora_request)):
        monkeypatch.setitem(sys.modules, name, module)
    sys.modules["vllm"].LLM = LLM
    cfg = dataclasses.replace(tiny_cfg, engine=dataclasses.replace(
        tiny_cfg.engine, max_num_batched_tokens=1024, max_capture_tokens=2048, cudagraph_mode="FULL"))
    settings = engine_settings(cfg, num_inference=2, seed=0)
    spec = LoraSpec.of({"a": torch.zeros(2, 3)})
    engine = VLLMEngine("/nowhere", spec, eos_id=2, **settings)
    compilation = seen["compilation_config"]
    assert compilation["cudagraph_mode"] == "FULL" and seen["max_num_batched_tokens"] == 1024
    assert compilation["cudagraph_capture_sizes"] == capture_sizes(settings["max_num_seqs"], 1024)
    assert compilation["cudagraph_capture_sizes"][-1] == 1024 and engine.slot_info["method"] == "colocate_init_adapter"
    # max_capture_tokens 0: decode sizes only (the pre-session-10 behaviour)
    VLLMEngine("/nowhere", spec, eos_id=2, **{**settings, "max_capture_tokens": 0, "cudagraph_mode": ""})
    assert seen["compilation_config"] == {"cudagraph_capture_sizes": capture_sizes(settings["max_num_seqs"])}


def test_skip_client_grammar_validation_replaces_vllms_check(monkeypatch):
    import sys
    import types
    from colocate.engine.vllm_grammar import skip_client_grammar_validation
    guidance = types.ModuleType("vllm.v1.structured_output.backend_guidance")

    def strict(sampling_params, tokenizer=None):
        raise ValueError("Grammar error: checked")
    guidance.validate_guidance_grammar = strict
    for name in ("vllm", "vllm.v1", "vllm.v1.structured_output"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, guidance.__name__, guidance)
    monkeypatch.setattr(sys.modules["vllm.v1.structured_output"], "backend_guidance", guidance, raising=False)

    def verify(params):  # what SamplingParams._validate_structured_outputs does on every request
        from vllm.v1.structured_output.backend_guidance import validate_guidance_grammar
        return validate_guidance_grammar(params, tokenizer=None)
    with pytest.raises(ValueError, match="checked"):
        verify(object())
    skip_client_grammar_validation()
    assert verify(object()) is None and guidance.validate_guidance_grammar is not strict


def test_engine_environment_cleans_torchrun_and_restores(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert visible_device(1) == "5"
    with engine_environment(2):
        assert "RANK" not in os.environ and "TORCHELASTIC_USE_AGENT_STORE" not in os.environ
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "6"
        assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == REPO_ROOT  # the worker extension imports colocate
    assert os.environ["RANK"] == "3" and os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6"


def test_lora_spec_for_matches_the_learners(tiny_cfg, tiny_tokenizer):
    from colocate.models import lora_state
    from colocate.train import build_policy
    spec = lora_spec_for(tiny_cfg, tiny_tokenizer)
    assert spec == LoraSpec.of(lora_state(build_policy(tiny_cfg, tiny_tokenizer, torch.device("cpu"))))


def test_synthetic_workload_shapes(tiny_tokenizer):
    from benchmarks.vllm_session import synthetic_requests
    reqs = synthetic_requests(16, len(tiny_tokenizer), EOS, seed=0)
    assert all(len(r.prompt_ids) == 440 and r.prompt_ids[:300] == reqs[0].prompt_ids[:300] for r in reqs)
    assert reqs[0].constraint is reqs[7].constraint and reqs[8].constraint is not reqs[0].constraint
    rng = random.Random(0)
    assert {len(random_walk(r.constraint, rng)) for r in reqs} == {32}  # 31 order tokens + EOS


def test_model_dir_holds_the_learners_weights_even_for_a_tied_shape(tmp_path, monkeypatch, tiny_cfg, tiny_tokenizer):
    """What vLLM loads must be the learner's model, for a tied shape too (Qwen2.5-0.5B ties lm_head)."""
    from transformers import AutoModelForCausalLM
    from colocate import models
    from colocate.engine.model_dir import save_model_dir
    monkeypatch.setitem(models.SHAPES, "tiny", {**models.SHAPES["tiny"], "tie_word_embeddings": True})
    model = models.build_model(tiny_cfg.model, tiny_tokenizer, "cpu").eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # materialize keeps the tie
    save_model_dir(str(tmp_path / "m"), model, tiny_tokenizer)
    import json
    assert json.loads((tmp_path / "m" / "config.json").read_text())["tie_word_embeddings"] is True
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), dtype=torch.float32).eval()
    ids = torch.tensor([tiny_tokenizer.encode("add 3 and 4 ; answer :")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    # A head that is not actually tied (e.g. built without materialize) is saved and declared untied.
    untied = models.build_model(tiny_cfg.model, tiny_tokenizer, "cpu").eval()
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone() * 2)
    save_model_dir(str(tmp_path / "u"), untied, tiny_tokenizer)
    assert json.loads((tmp_path / "u" / "config.json").read_text())["tie_word_embeddings"] is False
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "u"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(untied(ids).logits, loaded(ids).logits)


def test_adapter_sender_sends_header_then_the_flat_buffer():
    from colocate.engine.vllm_sync import AdapterSender
    sent = []
    group = SimpleNamespace(device=torch.device("cpu"), broadcast=lambda t: sent.append(t.clone()))
    tensors = {"b.lora_A.weight": torch.randn(2, 3), "a.lora_B.weight": torch.randn(4, 2)}
    spec = LoraSpec.of(tensors)
    sender = AdapterSender(group, spec)
    sender.send(flatten_lora(tensors, spec), 7, with_checksum=True, flags=2)
    header, flat = sent
    assert header.tolist() == [7, spec.numel, checksum(flat), 2]
    assert torch.equal(flat, flatten_lora(tensors, spec))
    with pytest.raises(ValueError, match="not the spec"):  # a buffer of another layout is refused
        sender.send(torch.zeros(spec.numel + 1), 8)


def test_adapter_sender_sends_the_same_version_to_every_engine_group():
    from colocate.engine.vllm_sync import AdapterSender
    sent = {0: [], 1: [], 2: []}
    groups = [SimpleNamespace(device=torch.device("cpu"), broadcast=lambda t, i=i: sent[i].append(t.clone()))
              for i in sent]
    tensors = {"b.lora_A.weight": torch.randn(2, 3), "a.lora_B.weight": torch.randn(4, 2)}
    spec = LoraSpec.of(tensors)
    flat = flatten_lora(tensors, spec)
    AdapterSender(groups, spec).send(flat, 5, flags=1)
    for i in sent:  # each engine's group gets its own header, then the buffer
        header, body = sent[i]
        assert header.tolist() == [5, spec.numel, 0, 1] and torch.equal(body, flat)


def test_group_membership_per_fanout():
    from colocate.engine.vllm_sync import group_membership, num_groups
    # broadcast: one group, learner rank 0 + every engine; per_engine: a pair per engine
    assert [group_membership("broadcast", 3, e) for e in range(3)] == [(0, 4, 1), (0, 4, 2), (0, 4, 3)]
    assert [group_membership("per_engine", 3, e) for e in range(3)] == [(0, 2, 1), (1, 2, 1), (2, 2, 1)]
    assert num_groups("broadcast", 3) == 1 and num_groups("per_engine", 3) == 3
    with pytest.raises(ValueError, match="fanout"):
        num_groups("ring", 2)
    with pytest.raises(ValueError):
        group_membership("per_engine", 2, 2)


def _ports_worker(rank: int, port: int, result):
    import torch.distributed as dist
    from colocate.engine.vllm_sync import exchange_ports
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    topo = SimpleNamespace(num_inference=2, device=torch.device("cpu"), sync_src=2, sync_group=None)
    result[rank] = exchange_ports(topo, [41001, 41002] if rank == 2 else None)
    dist.destroy_process_group()


def test_exchange_ports_reaches_every_inference_rank():
    import torch.multiprocessing as mp
    from tests.conftest import free_port
    result = mp.Manager().dict()
    mp.spawn(_ports_worker, args=(free_port(), result), nprocs=3, join=True)
    assert dict(result) == {0: [41001, 41002], 1: [41001, 41002], 2: [41001, 41002]}


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
        for p in prompts:
            self.running[str(self.counter)] = p["prompt_token_ids"]
            ids.append(f"{self.counter}-{self.rng.getrandbits(32):08x}")
            self.counter += 1
        return ids

    def _step(self):
        names = list(self.running)
        self.rng.shuffle(names)
        out = []
        for name in names[:self.rng.randint(0, 3)]:
            prompt = self.running.pop(name)
            tok = prompt[-1] + 1  # the "sampled" token names the prompt it answers
            result = SimpleNamespace(token_ids=[tok, EOS], logprobs=SimpleNamespace(logprobs=[-0.5, -0.1]),
                                     finish_reason="stop")
            out.append(SimpleNamespace(request_id=name, finished=True, outputs=[result], num_cached_tokens=1))
        return out


def _streaming_engine(monkeypatch, seed=0):
    from colocate.engine.vllm import VLLMEngine
    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM here: the host side only
    engine.llm, engine.version, engine.eos_id, engine.grammar_mode = FakeLLM(seed), 3, EOS, "tokens"
    engine.lora_mode, engine._lora_request = "slot", None
    engine._pending, engine._next_ticket, engine._busy_since = {}, 0, 0.0
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


# ------------------------------------------------------------------------------- jump-forward

def test_jump_forward_settings_name_real_classes():
    import ast
    from colocate.engine import vllm_ff
    from colocate.engine.vllm_settings import jump_forward_settings
    s = jump_forward_settings(6, 224, 1024)
    assert s["speculative_config"]["method"] == "custom_class" and s["speculative_config"]["num_speculative_tokens"] == 6
    assert s["async_scheduling"] is False and s["compilation_config"]["cudagraph_mode"] == "PIECEWISE"
    assert s["compilation_config"]["cudagraph_capture_sizes"][-1] == 1024   # by tokens, capped at the budget
    assert jump_forward_settings(2, 100, 0)["compilation_config"]["cudagraph_capture_sizes"][-1] == 300
    assert jump_forward_settings(6, 512, 0)["compilation_config"]["cudagraph_capture_sizes"][-1] == 2048
    with pytest.raises(ValueError):
        jump_forward_settings(0, 8, 0)
    # the dotted paths vLLM resolves in the engine core name classes this module defines
    defined = {n.name for n in ast.parse(open(vllm_ff.__file__).read()).body if isinstance(n, ast.ClassDef)}
    for path in (s["speculative_config"]["model"], s["scheduler_cls"]):
        module, name = path.rsplit(".", 1)
        assert module == vllm_ff.__name__ and name in defined


def test_engine_args_refused_before_vllm_starts():
    from colocate.engine.vllm_settings import check_engine_args
    check_engine_args("merged", 6, None, 224, 1024)  # merged: drafts may exceed the budget (vLLM trims)
    check_engine_args("slot", 6, None, 100, 1024)
    check_engine_args("slot", 0, None, 100, 1024, "FULL")
    for bad, match in ((("slot", 6, None, 224, 1024), "max_num_batched_tokens"),
                       (("merged", 2, True, 8, 0), "synchronous"),
                       (("merged", -1, None, 8, 0), ">= 0"),
                       (("lora", 0, None, 8, 0), "lora_mode"),
                       (("merged", 4, None, 8, 0, "FULL"), "cudagraph_mode cannot be set with engine.jump_forward")):
        with pytest.raises(ValueError, match=match):
            check_engine_args(*bad)


class _FakeMatcher:
    def __init__(self, forced, stopped=False):
        self.forced, self.stopped = forced, stopped

    def is_stopped(self):
        return self.stopped

    def is_error(self):
        return False

    def compute_ff_tokens(self):
        return list(self.forced)


def _fake_request(forced, *, structured=True, prefill=False, max_tokens=100, out=0, stopped=False):
    grammar = SimpleNamespace(ll_matcher=_FakeMatcher(forced, stopped), validate_tokens=lambda t: [x for x in t if x != 99])
    return SimpleNamespace(is_finished=lambda: False, is_prefill_chunk=prefill, structured=structured,
                           structured_output_request=SimpleNamespace(grammar=grammar),
                           max_tokens=max_tokens, num_output_tokens=out, spec_token_ids=[7])


def test_forced_draft_scheduler_sets_each_requests_forced_chain():
    from colocate.engine.vllm_ff import ForcedDraftScheduler, NoDraft
    requests = {"a": _fake_request([4, 5, 6, 8]),              # capped at num_spec_tokens
                "b": _fake_request([4, 5], max_tokens=10, out=8),  # room for 1 draft + the sampled token
                "c": _fake_request([4], structured=False),      # unconstrained: no draft
                "d": _fake_request([4], prefill=True),          # mid-prefill: no draft
                "e": _fake_request([4], stopped=True),          # grammar done
                "f": _fake_request([3, 99])}                    # the grammar's own check trims
    sched = SimpleNamespace(requests=requests, num_spec_tokens=3,
                            structured_output_manager=SimpleNamespace(should_advance=lambda r: r.structured))
    assert NoDraft(None).propose([[1], [2]]) == [[], []]
    ForcedDraftScheduler.update_draft_token_ids(sched, SimpleNamespace(req_ids=[*requests, "gone"]))
    assert {k: r.spec_token_ids for k, r in requests.items()} == {
        "a": [4, 5, 6], "b": [4], "c": [], "d": [], "e": [], "f": [3]}


def test_llguidance_forced_chain_is_the_constraints_forced_run(tiny_tokenizer):
    """llguidance's compute_ff_tokens on our token grammar = the tokens `forced_positions` marks."""
    llguidance = pytest.importorskip("llguidance")
    import llguidance.hf
    from colocate.constraint import forced_positions
    from colocate.engine.vllm_ff import forced_chain
    c = Constraint(slots=[[[5], [5, 6], [7, 8, 9]], [[10, 11], [10, 12]]], eos_id=tiny_tokenizer.eos_token_id)
    lt = llguidance.hf.from_tokenizer(tiny_tokenizer, len(tiny_tokenizer))
    for ids in ([7, 8, 9, 10, 11], [5, 6, 10, 12], [5, 10, 11]):
        matcher = llguidance.LLMatcher(lt, llguidance.grammar_from("grammar", constraint_grammar(c)), log_level=0)
        grammar = SimpleNamespace(ll_matcher=matcher,
                                  validate_tokens=lambda t, m=matcher: t[:m.validate_tokens(t)])
        marks = forced_positions(c, ids + [c.eos_id])
        for i, tok in enumerate(ids):
            expected = []
            j = i
            while j < len(ids) and marks[j]:  # the run of forced tokens from here (EOS excluded)
                expected.append(ids[j])
                j += 1
            assert forced_chain(grammar, 8) == expected, (ids, i)
            assert matcher.consume_tokens([tok])


class _Grammar:
    """vLLM 0.25's GuidanceGrammar (backend_guidance.py), the parts its draft-mask pass and
    update_from_output use, with the same bookkeeping of `terminated` and `rollback_lag`."""

    def __init__(self, matcher, eos_id):
        self.ll_matcher, self.eos_id, self.terminated, self.rollback_lag = matcher, eos_id, False, 0

    def accept_tokens(self, tokens):
        if self.eos_id in tokens:
            if self.ll_matcher.is_stopped() and not self.terminated:
                self.rollback_lag = 1
            self.terminated = True
        if self.ll_matcher.is_stopped():
            return True
        return self.ll_matcher.consume_tokens(tokens)

    def rollback(self, num_tokens):
        if num_tokens > 0:
            self.ll_matcher.rollback(num_tokens - self.rollback_lag)
            self.terminated, self.rollback_lag = False, 0

    def validate_tokens(self, tokens):
        return tokens[:self.ll_matcher.validate_tokens(tokens)] if tokens else []


def _vllm_draft_masks(grammar, drafts, bitmask, vocab):
    """vLLM's StructuredOutputManager.grammar_bitmask for one request: the mask of each draft
    position, consuming the drafts, then the bonus position's mask; then it rolls the drafts back."""
    rows = []
    for d in drafts:
        rows.append(llg_allowed(grammar.ll_matcher, bitmask, vocab))
        assert grammar.accept_tokens([d])
    rows.append(llg_allowed(grammar.ll_matcher, bitmask, vocab))
    grammar.rollback(len(drafts))
    return rows


def _play_with_drafts(constraint, tok, rng, swap: bool) -> tuple[bool, int, int]:
    """One answer decoded as vLLM does with forced drafts: (every step accepted, tokens, steps)."""
    import llguidance
    import llguidance.hf
    import llguidance.torch
    from colocate.engine.vllm_ff import forced_chain, matchers_swapped_for_copies
    lt = llguidance.hf.from_tokenizer(tok, len(tok))
    grammar = _Grammar(llguidance.LLMatcher(lt, llguidance.grammar_from("grammar", constraint_grammar(constraint)),
                                            log_level=0), tok.eos_token_id)
    bitmask = llguidance.torch.allocate_token_bitmask(1, lt.vocab_size)
    state, tokens, steps = ConstraintState(constraint), 0, 0
    request = SimpleNamespace(structured_output_request=SimpleNamespace(grammar=grammar))
    drafts: list[int] = []
    while not state.done:
        if swap:
            with matchers_swapped_for_copies({"r": request}, {"r": drafts}):
                rows = _vllm_draft_masks(grammar, drafts, bitmask, len(tok))
        else:
            rows = _vllm_draft_masks(grammar, drafts, bitmask, len(tok))
        new = [d for d, row in zip(drafts, rows) if row == [d]]  # forced: the only allowed token
        assert new == drafts  # every draft is a forced token, so always accepted
        new.append(rng.choice(rows[len(drafts)]))                # the token sampled after them
        steps += 1
        for t in new:
            assert t in state.allowed()  # the masks are the Constraint's
            state.advance(t)
        tokens += len(new)
        if not grammar.accept_tokens(new):  # update_from_output
            return False, tokens, steps
        drafts = forced_chain(grammar, 6) if not state.done else []
    return True, tokens, steps


def test_matcher_swap_restores_everything_even_on_error():
    from colocate.engine.vllm_ff import matchers_swapped_for_copies

    class Matcher:
        def deep_copy(self):
            return Matcher()
    grammars = {k: SimpleNamespace(ll_matcher=Matcher(), terminated=False, rollback_lag=0) for k in "ab"}
    requests = {k: SimpleNamespace(structured_output_request=SimpleNamespace(grammar=g)) for k, g in grammars.items()}
    requests["x"] = SimpleNamespace(structured_output_request=SimpleNamespace(grammar=SimpleNamespace()))  # xgrammar
    originals = {k: g.ll_matcher for k, g in grammars.items()}
    with pytest.raises(RuntimeError):
        with matchers_swapped_for_copies(requests, {"a": [5], "b": [], "x": [3], "gone": [4]}):
            assert grammars["a"].ll_matcher is not originals["a"]  # drafts: a copy
            assert grammars["b"].ll_matcher is originals["b"]      # no drafts: untouched
            grammars["a"].terminated, grammars["a"].rollback_lag = True, 1
            raise RuntimeError("vLLM failed mid-pass")
    assert all(g.ll_matcher is originals[k] for k, g in grammars.items())
    assert grammars["a"].terminated is False and grammars["a"].rollback_lag == 0


def test_forced_drafts_survive_vllms_mask_pass_on_diplomacy_grammars():
    """The jump-forward path end to end on llguidance with real order grammars: drafts are the
    forced chain, every one is accepted, the answer needs fewer engine steps than it has tokens,
    and the request's matcher accepts every step, because vLLM's mask pass (consume drafts, mask,
    roll back) runs on a copy. Without the copy llguidance 1.7.6 refuses tokens it had allowed
    (the e2e failure of session 6); that half is pinned only while this llguidance has the bug."""
    pytest.importorskip("llguidance")
    from colocate.envs.diplomacy import DiplomacyEnv, corpus
    from colocate.envs.diplomacy import game as dg
    from colocate.models import train_tokenizer
    tok = train_tokenizer(corpus(num_games=2, last_year=1904))
    env = DiplomacyEnv(tok, group_size=1, horizon_years=1, unit_labels=False, seed=0)
    env.start_states = dg.load_state_cache(dg.__file__.replace("game.py", "states.jsonl"))[:1]
    env.start_group(0)
    rng = random.Random(0)
    requests = [r for _, r in env.requests()]
    assert len(requests) == 7  # every power orders in the first phase
    tokens = steps = 0
    for request in requests:
        ok, n, k = _play_with_drafts(request.constraint, tok, rng, swap=True)
        assert ok
        tokens, steps = tokens + n, steps + k
    assert steps < 0.8 * tokens
    broken = [not _play_with_drafts(r.constraint, tok, rng, swap=False)[0] for r in requests]
    if any(broken):  # the llguidance bug the copy avoids is still there: it must be what breaks
        assert sum(broken) >= len(requests) // 2


def test_profiler_settings_trace_the_engine_core_for_a_bounded_number_of_steps():
    from colocate.engine.vllm_settings import profiler_settings
    s = profiler_settings("profiles/run/inference-engine", 40)
    assert s["profiler"] == "torch" and os.path.isabs(s["torch_profiler_dir"])  # vLLM requires an absolute path
    assert s["torch_profiler_dir"].endswith(os.path.join("profiles", "run", "inference-engine"))
    assert s["max_iterations"] == 40 and s["torch_profiler_use_gzip"] and not s["torch_profiler_with_stack"]
    assert not s["torch_profiler_dump_cuda_time_total"]  # no table built mid-batch when the window ends
    with pytest.raises(ValueError, match=">= 1"):
        profiler_settings("d", 0)  # vLLM would read 0 as "no limit"
