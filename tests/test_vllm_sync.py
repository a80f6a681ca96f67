"""The adapter's way into a vLLM engine: the worker's LoRA slot plan and in-place apply, the merged
mode (`engine/vllm_worker.py`), and learner rank 0's end of the stateless NCCL group with the
endpoint exchange (`engine/vllm_channel.py`), on CPU with stand-in groups. No vLLM here."""
from types import SimpleNamespace

import pytest
import torch

from colocate.engine.adapter_targets import (AdapterSlot, MergedAdapter, lora_module_name, merge_plan, slot_plan,
                                         slot_views)
from colocate.wire import LoraSpec, RunFlags, checksum, flatten_lora


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
    assert [(p.module, p.slice_index, p.is_a) for p in plan] == [
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
    dst = [slot_views(modules[p.module], p.slice_index, slot, p.is_a, spec.shapes[spec.names.index(p.name)])
           for p in plan]
    adapter = AdapterSlot(spec, dst, [p.is_a for p in plan], scaling=2.5)
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


# ------------------------------------------------------------------------------- merged

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
    assert {p.module for p in plan} == set(weights)                    # every adapted weight is found
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
    assert [(p.module.rsplit(".", 1)[1], p.row_start, p.row_end) for p in plan] == [
        ("qkv_proj", 8, 12), ("o_proj", 0, 8), ("qkv_proj", 0, 8), ("qkv_proj", 12, 16)]
    with pytest.raises(KeyError, match="not adapted"):             # v's rows depend on k's size
        merge_plan([n for n in names if "k_proj" not in n], [s for n, s in zip(names, shapes) if "k_proj" not in n],
                   linear, VLLM_PACKED)
    with pytest.raises(KeyError, match="lora_B"):
        merge_plan(names[:1], shapes[:1], linear, VLLM_PACKED)


# ------------------------------------------------------------------------------- channel

@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_chunked_checksum_equals_reference(chunk):
    flat = torch.randn(1001)
    assert checksum(flat, chunk_bytes=chunk) == checksum(flat)
    assert checksum(flat.to(torch.bfloat16), chunk_bytes=chunk) == checksum(flat.to(torch.bfloat16))


def test_nccl_sender_sends_header_then_the_flat_buffer():
    from colocate.engine.vllm_channel import NcclSender
    sent = []
    group = SimpleNamespace(device=torch.device("cpu"), broadcast=lambda t: sent.append(t.clone()))
    tensors = {"b.lora_A.weight": torch.randn(2, 3), "a.lora_B.weight": torch.randn(4, 2)}
    spec = LoraSpec.of(tensors)
    sender = NcclSender(group, spec, with_checksum=True)
    sender.send(flatten_lora(tensors, spec), 7, RunFlags(2))
    header, flat = sent
    assert header.tolist() == [7, spec.numel, checksum(flat), 2]
    assert torch.equal(flat, flatten_lora(tensors, spec))
    with pytest.raises(ValueError, match="not the spec"):  # a buffer of another layout is refused
        sender.send(torch.zeros(spec.numel + 1), 8)


def _endpoint_worker(rank: int, port: int, result):
    import torch.distributed as dist
    from colocate.engine.vllm_channel import exchange_endpoint
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    topo = SimpleNamespace(device=torch.device("cpu"), sync_src=2, sync_group=None)
    result[rank] = exchange_endpoint(topo, ("10.1.2.3", 41001) if rank == 2 else None)
    dist.destroy_process_group()


def test_exchange_endpoint_reaches_every_inference_rank():
    import torch.multiprocessing as mp
    from tests.conftest import free_port
    result = mp.Manager().dict()
    mp.spawn(_endpoint_worker, args=(free_port(), result), nprocs=3, join=True)
    assert dict(result) == {0: ("10.1.2.3", 41001), 1: ("10.1.2.3", 41001), 2: ("10.1.2.3", 41001)}


def test_adapter_receipt_crosses_the_rpc_as_plain_values_and_becomes_the_update():
    import json
    import time

    from colocate.engine.vllm_channel import VLLMReceiver
    from colocate.engine.vllm_worker import AdapterReceipt
    from colocate.wire import RunFlags
    receipt = AdapterReceipt(version=3, checksum=77, checksum_ok=True, slot_ok=None, flags=int(RunFlags.STOP),
                             apply_ms=1.5)
    wire = json.loads(json.dumps(receipt.to_rpc()))  # plain values only: nothing pickled
    assert AdapterReceipt.from_rpc(wire) == receipt
    update = VLLMReceiver.update(receipt, time.perf_counter())
    assert (update.version, update.flags) == (3, RunFlags.STOP)
    assert update.metrics["apply_ms"] == 1.5 and update.metrics["checksum_ok"] == 1.0


def test_our_kernels_warm_up_at_engine_start_unseen_by_vllms_jit_monitor(monkeypatch):
    """vLLM's JIT monitor hooks Triton once its own warm-up ends and reports each later compile as a
    latency spike during inference. Our kernels' warm-ups (the sampler's log-prob kernel, the
    constraint masks) compile at engine start with that hook held off; it is back after, for the
    compiles of the rollouts, and also when a warm-up raises."""
    knobs = pytest.importorskip("triton").knobs
    from colocate.engine import vllm_logprobs, vllm_trie, vllm_worker
    reported = []

    def monitor(**kwargs):
        reported.append(kwargs["fn"])

    def compile_kernel(*_args):  # what Triton does after it compiles a kernel
        hook = knobs.runtime.jit_post_compile_hook
        if hook is not None:
            hook(fn="kernel")
        return "ours"

    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", monitor)
    monkeypatch.setattr(vllm_logprobs, "install", lambda module: "ours")
    monkeypatch.setattr(vllm_logprobs, "warm_up", compile_kernel)
    monkeypatch.setattr(vllm_trie, "install", compile_kernel)
    config = SimpleNamespace(get_vocab_size=lambda: 8)
    worker = SimpleNamespace(model_runner=SimpleNamespace(model_config=config, device=torch.device("cpu")))
    assert vllm_worker.ColocateWorkerExtension.colocate_use_logprob_kernel(worker) == "ours"
    assert vllm_worker.ColocateWorkerExtension.colocate_use_constraint_masks(worker) == "ours"
    assert reported == [] and knobs.runtime.jit_post_compile_hook is monitor
    compile_kernel()  # a compile after start-up is reported, as vLLM wants
    assert reported == ["kernel"]
    with pytest.raises(RuntimeError), vllm_worker.start_up_compiles():
        raise RuntimeError("a warm-up failed")
    assert knobs.runtime.jit_post_compile_hook is monitor
