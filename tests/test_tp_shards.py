"""The adapter split over a tensor-parallel vLLM engine (`tests/tp_shards.py`, kept out of the
package until a key runs it), on CPU.

Each TP rank here is an emulated vLLM worker: its base weights are cut as vLLM's loaders cut them
(`QKVParallelLinear` / `MergedColumnParallelLinear` / `RowParallelLinear`, written out below from
`vllm/model_executor/layers/linear.py`, independently of tp_shards), its LoRA slot has vLLM's
per-rank stacked buffers, and its forward adds the LoRA term slice by slice as punica's
`add_lora_linear` does. The adapter reaches that slot (`AdapterSlot`) or its weights
(`MergedAdapter`) through `TpShard`, and the ranks' outputs must compose into the full layer's
output: column layers by concatenation, row layers by the all-reduce's sum (a real 2-rank gloo
world below). A tiny Qwen2 with GQA (4 q heads, 2 kv heads of 16) and LoRA on all 7 projections.

Tolerance: everything is float64 and the only difference from the reference is the order of
sums of at most 128 terms of size ~1 (|error| < 128 * 2**-52 ~ 3e-14); 1e-10 is loose for that and
a wrong slice is off by ~1.
"""
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from tests.tp_shards import Heads, KvSplit, TpShard, kv_split
from colocate.engine.adapter_targets import (AdapterSlot, MergedAdapter, lora_module_name, merge_plan, slot_plan,
                                             slot_views)
from colocate.wire import LoraSpec, adapter_header, checksum, flatten_lora, parse_adapter_header, unflatten_lora

TOL = dict(rtol=0, atol=1e-10)
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
ROW = ("o_proj", "down_proj")
MAX_RANK, SLOT, RANK, ALPHA = 8, 1, 4, 8.0  # the slot's max_lora_rank above the adapter's r, as vLLM pads


def tiny_model():
    """A tiny Qwen2 (GQA) with a random LoRA adapter on every projection, float64, the same in every process."""
    from transformers import AutoModelForCausalLM

    from colocate.config import load_config
    from colocate.models import add_lora, model_config
    torch.manual_seed(0)
    cfg = load_config(None, {"lora": {"rank": RANK, "alpha": ALPHA, "fused_epilogue": False}})
    model = add_lora(AutoModelForCausalLM.from_config(model_config("tiny", 64, "float32")), cfg.lora).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)  # B is zero at init
    return model


def projections(model) -> dict[str, torch.nn.Module]:
    """vLLM's module path ('model.layers.0.self_attn.q_proj') -> the peft LoRA layer."""
    from peft.tuners.lora import Linear
    return {name.removeprefix("base_model.model."): m for name, m in model.named_modules() if isinstance(m, Linear)}


def adapter_of(model) -> dict[str, torch.Tensor]:
    from colocate.models import lora_state
    return {n: p.detach() for n, p in lora_state(model).items()}


# ---------------------------------------------------------------- vLLM's base-layer split, written out

def base_shard(projection: str, weight: torch.Tensor, heads: Heads, tp: int, t: int) -> torch.Tensor:
    """Rank t's part of one projection's weight (or bias) as vLLM's weight loaders cut it (linear.py):
    QKVParallelLinear: q by `tp_rank`, k/v by `tp_rank // num_kv_head_replicas`, heads / tp each
    (one kv head when tp >= kv heads); MergedColumnParallelLinear: output_size / tp rows at tp_rank;
    RowParallelLinear: input_size_per_partition columns at tp_rank."""
    if projection in ROW:
        size = weight.shape[-1] // tp
        return weight[..., t * size:(t + 1) * size] if weight.dim() == 2 else weight
    if projection == "q_proj":
        size = heads.num_heads // tp * heads.head_dim
        return weight[t * size:(t + 1) * size]
    if projection in ("k_proj", "v_proj"):
        num_kv, replicas = (1, tp // heads.num_kv_heads) if tp >= heads.num_kv_heads else (heads.num_kv_heads // tp, 1)
        size, shard = num_kv * heads.head_dim, t // replicas
        return weight[shard * size:(shard + 1) * size]
    size = weight.shape[0] // tp
    return weight[t * size:(t + 1) * size]


def fused_parts(module: str) -> tuple[str, list[str]]:
    """vLLM module ('...self_attn.qkv_proj') -> (parent path, its projections in packing order)."""
    parent, _, short = module.rpartition(".")
    return parent, PACKED.get(short, [short])


@dataclass
class RankEngine:
    """One emulated TP worker: fused, sharded base weights and biases, and its LoRA slot buffers."""
    weights: dict[str, torch.Tensor]
    biases: dict[str, torch.Tensor | None]
    lora: dict[str, SimpleNamespace]


def base_layers(model) -> dict[str, SimpleNamespace]:
    """Every projection's base weight and bias, as plain tensors by vLLM module path."""
    return {m: SimpleNamespace(weight=layer.base_layer.weight.detach(),
                               bias=None if layer.base_layer.bias is None else layer.base_layer.bias.detach())
            for m, layer in projections(model).items()}


def rank_engine(base: dict[str, SimpleNamespace], heads: Heads, tp: int, t: int) -> RankEngine:
    fused = {f"{p.rpartition('.')[0]}.{f}" for p in base for f, subs in PACKED.items()
             if p.rpartition(".")[2] in subs} | {p for p in base if p.rpartition(".")[2] in ROW}
    weights, biases, lora = {}, {}, {}
    for module in sorted(fused):
        parent, parts = fused_parts(module)
        bases = [base[f"{parent}.{p}"] for p in parts]
        shards = [base_shard(p, b.weight, heads, tp, t) for p, b in zip(parts, bases)]
        weights[module] = torch.cat(shards).clone()
        biases[module] = None if bases[0].bias is None else \
            torch.cat([base_shard(p, b.bias, heads, tp, t) for p, b in zip(parts, bases)])
        # vLLM's create_lora_weights: per slice, A [max_loras, 1, max_rank, in per rank], B [.., out per rank, max_rank]
        lora[module] = SimpleNamespace(
            lora_a_stacked=tuple(torch.zeros(2, 1, MAX_RANK, shards[0].shape[1], dtype=torch.float64) for _ in parts),
            lora_b_stacked=tuple(torch.zeros(2, 1, s.shape[0], MAX_RANK, dtype=torch.float64) for s in shards))
    return RankEngine(weights, biases, lora)


def load_slot(engine: RankEngine, spec: LoraSpec, shard: TpShard, flat: torch.Tensor) -> AdapterSlot:
    packed = {m: [f"{fused_parts(m)[0]}.{p}" for p in fused_parts(m)[1]] for m in engine.lora
              if m.rpartition(".")[2] in PACKED}
    plan = slot_plan(spec.names, set(engine.lora), packed)
    shape_of = dict(zip(shard.spec.names, shard.spec.shapes))
    dst = [slot_views(engine.lora[p.module], p.slice_index, SLOT, p.is_a, shape_of[p.name]) for p in plan]
    slot = AdapterSlot(spec, dst, [p.is_a for p in plan], ALPHA / RANK, shard=shard)
    slot.flat.copy_(flat)
    slot.apply()
    assert slot.matches()
    return slot


def load_merged(engine: RankEngine, spec: LoraSpec, shard: TpShard, flat: torch.Tensor) -> MergedAdapter:
    plan = merge_plan(spec.names, shard.spec.shapes, set(engine.weights), PACKED)  # the rank's row offsets
    merged = MergedAdapter(spec, plan, engine.weights, ALPHA / RANK, shard=shard)
    merged.flat.copy_(flat)
    merged.apply()
    assert merged.matches()
    return merged


def forward(engine: RankEngine, module: str, x: torch.Tensor, use_slot: bool) -> torch.Tensor:
    """The rank's layer output; in slot mode punica's add_lora_linear: slice i's rows += (x A_i^T) B_i^T."""
    out = x @ engine.weights[module].T
    if engine.biases[module] is not None:
        out += engine.biases[module]
    if use_slot:
        offset, lora = 0, engine.lora[module]
        for a, b in zip(lora.lora_a_stacked, lora.lora_b_stacked):
            rows = b.shape[2]
            out[:, offset:offset + rows] += (x @ a[SLOT, 0].T) @ b[SLOT, 0].T
            offset += rows
    return out


# ---------------------------------------------------------------- the composition checks

def column_outputs(model, heads: Heads, tp: int, use_slot: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every column-parallel projection: (ranks' outputs put together, the full layer's output)."""
    adapter = adapter_of(model)
    spec = LoraSpec.of(adapter)
    flat = flatten_lora(adapter, spec)
    x = torch.randn(5, model.config.hidden_size, dtype=torch.float64)
    engines = [rank_engine(base_layers(model), heads, tp, t) for t in range(tp)]
    for t, engine in enumerate(engines):
        (load_slot if use_slot else load_merged)(engine, spec, TpShard.of(spec, heads, tp, t), flat)
    replicas = kv_split(heads, tp).replicas
    out = {}
    for module in (m for m in engines[0].weights if m.rpartition(".")[2] in PACKED):
        parent, parts = fused_parts(module)
        per_rank = [forward(engine, module, x, use_slot).split([b.shape[2] for b in engine.lora[module].lora_b_stacked],
                                                                dim=1) for engine in engines]
        for i, part in enumerate(parts):
            step = replicas if part in ("k_proj", "v_proj") else 1
            owners = range(0, tp, step)
            for t in range(tp):  # a replicated kv head: every replica computes the same rows
                assert torch.equal(per_rank[t][i], per_rank[t - t % step][i])
            with torch.no_grad():
                full = projections(model)[f"{parent}.{part}"](x)
            out[f"{parent}.{part}"] = (torch.cat([per_rank[t][i] for t in owners], dim=1), full)
    return out


@dataclass
class RowCase:
    """What a rank needs for the row layers: their base weights, inputs and the full layers' outputs."""
    base: dict[str, SimpleNamespace]
    x: dict[str, torch.Tensor]
    reference: dict[str, torch.Tensor]
    heads: Heads


def row_case(model) -> RowCase:
    g = torch.Generator().manual_seed(1)
    layers = {m: layer for m, layer in projections(model).items() if m.rpartition(".")[2] in ROW}
    x = {m: torch.randn(5, layer.in_features, generator=g, dtype=torch.float64) for m, layer in layers.items()}
    assert all(layer.base_layer.bias is None for layer in layers.values())  # Qwen2's; vLLM adds one after the all-reduce
    with torch.no_grad():
        reference = {m: layer(x[m]) for m, layer in layers.items()}
    return RowCase(base_layers(model), x, reference, Heads.of(model.config))


def row_partials(case: RowCase, spec: LoraSpec, flat: torch.Tensor, tp: int, t: int,
                 use_slot: bool) -> dict[str, torch.Tensor]:
    """Rank t's partial sums of every row-parallel projection on its input columns (before the all-reduce)."""
    engine = rank_engine(case.base, case.heads, tp, t)
    (load_slot if use_slot else load_merged)(engine, spec, TpShard.of(spec, case.heads, tp, t), flat)
    out = {}
    for module, x in case.x.items():
        cols = x.shape[1] // tp  # the rank's input: its heads' attention output, its share of gate * up
        out[module] = forward(engine, module, x[:, t * cols:(t + 1) * cols], use_slot)
    return out


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def heads(model):
    heads = Heads.of(model.config)
    assert heads == Heads(4, 2, 16)  # GQA, so k = 4 replicates kv heads
    return heads


@pytest.mark.parametrize("use_slot", [True, False], ids=["slot", "merged"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_layers_ranks_outputs_concatenate_to_the_full_layer(model, heads, tp, use_slot):
    outputs = column_outputs(model, heads, tp, use_slot)
    assert {m.rpartition(".")[2] for m in outputs} == {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    assert len(outputs) == 5 * model.config.num_hidden_layers
    for name, (assembled, full) in outputs.items():
        torch.testing.assert_close(assembled, full, **TOL, msg=name)


@pytest.mark.parametrize("use_slot", [True, False], ids=["slot", "merged"])
@pytest.mark.parametrize("tp", [2, 4])
def test_row_layers_ranks_partial_sums_add_up_to_the_full_layer(model, heads, tp, use_slot):
    case = row_case(model)
    adapter = adapter_of(model)
    spec = LoraSpec.of(adapter)
    partials = [row_partials(case, spec, flatten_lora(adapter, spec), tp, t, use_slot) for t in range(tp)]
    assert {m.rpartition(".")[2] for m in case.reference} == set(ROW)
    for module, full in case.reference.items():
        torch.testing.assert_close(sum(p[module] for p in partials), full, **TOL, msg=module)
        assert not torch.allclose(partials[0][module], full, **TOL)  # each rank holds only a part


def test_the_slices_are_vllms_lora_slicing(model, heads):
    """Rank 1 of 2 against the rules of `MergedQKVParallelLinearWithLoRA` / `MergedColumnParallelLinearWithLoRA`
    (B rows of the rank's heads / half) and `RowParallelLinearWithLoRA` (A columns), A / B replicated otherwise."""
    adapter = adapter_of(model)
    spec = LoraSpec.of(adapter)
    views = TpShard.of(spec, heads, 2, 1).views(adapter)
    expected_rows = {"q_proj": (32, 64), "k_proj": (16, 32), "v_proj": (16, 32), "gate_proj": (64, 128),
                     "up_proj": (64, 128)}
    for name, full in adapter.items():
        projection, is_a = lora_module_name(name)[0].rpartition(".")[2], lora_module_name(name)[1]
        if projection in ROW:
            want = full[:, full.shape[1] // 2:] if is_a else full
        else:
            want = full if is_a else full[slice(*expected_rows[projection])]
        assert torch.equal(views[name], want), name


def test_every_byte_lands_on_some_rank_and_the_views_alias_the_checked_buffer(model, heads):
    """The shards cover the adapter (replicated parts on every rank, split parts once or once per kv
    replica), and are views of the received buffer, so its one checksum covers every shard."""
    adapter = adapter_of(model)
    spec = LoraSpec.of(adapter)
    flat = flatten_lora(adapter, spec)
    for tp in (1, 2, 4):
        index = unflatten_lora(torch.arange(spec.numel), spec)
        seen = torch.zeros(spec.numel, dtype=torch.int64)
        for t in range(tp):
            shard = TpShard.of(spec, heads, tp, t)
            for name, view in shard.views(index).items():
                seen[view.reshape(-1)] += 1
            for view in shard.views(unflatten_lora(flat, spec)).values():
                assert view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            assert shard.spec.names == spec.names and shard.spec.dtype == spec.dtype
        assert seen.min() >= 1, f"tp={tp}: {int((seen == 0).sum())} elements on no rank"
        replicas = kv_split(heads, tp).replicas
        for name, idx in index.items():
            projection, is_a = lora_module_name(name)[0].rpartition(".")[2], lora_module_name(name)[1]
            replicated = is_a != (projection in ROW)  # column A and row B
            want = tp if replicated else replicas if projection in ("k_proj", "v_proj") else 1
            assert bool((seen[idx.reshape(-1)] == want).all()), (tp, name)
    assert TpShard.of(spec, heads, 1, 0).spec == spec  # TP = 1: the whole adapter, as today


def test_layouts_vllm_cannot_shard_are_refused_in_one_line(model, heads):
    spec = LoraSpec.of(adapter_of(model))
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        TpShard.of(spec, heads, 3, 0)
    with pytest.raises(ValueError, match="not a multiple of the model's 3 key/value heads"):
        kv_split(Heads(12, 3, 16), 4)
    with pytest.raises(ValueError, match="does not divide the model's 6 key/value heads"):
        kv_split(Heads(12, 6, 16), 4)
    qwen_32b = Heads(40, 8, 128)  # 14B and 32B alike: kv heads split, never replicated, up to TP 8
    assert [kv_split(qwen_32b, tp) for tp in (2, 4, 8)] == [KvSplit(4, 1), KvSplit(2, 1), KvSplit(1, 1)]
    assert kv_split(heads, 4) == KvSplit(1, 2)
    with pytest.raises(ValueError, match="rank 2 is not in"):
        TpShard.of(spec, heads, 2, 2)
    head = LoraSpec(("base_model.model.lm_head.lora_A.default.weight",), ((4, 64),), torch.float64)
    with pytest.raises(ValueError, match="no tensor-parallel rule for 'lm_head'"):
        TpShard.of(head, heads, 2, 0)
    wrong = LoraSpec(("base_model.model.model.layers.0.self_attn.k_proj.lora_B.default.weight",), ((48, 4),),
                     torch.float64)
    with pytest.raises(ValueError, match="48 rows do not match"):
        TpShard.of(wrong, heads, 2, 0)


def test_full_shape_slot_views_do_not_fit_a_tp_rank(model, heads):
    """The trap the shard's shapes remove: at TP 2 a column B / row A of full size is not the slot's."""
    adapter = adapter_of(model)
    spec = LoraSpec.of(adapter)
    engine = rank_engine(base_layers(model), heads, 2, 0)
    q_b = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"
    with pytest.raises(ValueError, match="does not match"):
        slot_views(engine.lora["model.layers.0.self_attn.qkv_proj"], 0, SLOT, False, tuple(adapter[q_b].shape))


# ---------------------------------------------------------------- a real 2-rank world

def _tp_rank_worker(t: int, port: int, case: RowCase, spec: LoraSpec, sent: torch.Tensor, result):
    """One TP rank: receive the adapter from rank 0 (header, then the flat buffer; rank 1 never reads
    `sent`), check its checksum, load its shard (slot and merged), and all-reduce its row layers' partial sums."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=t, world_size=2)
    flat = sent.clone() if t == 0 else torch.zeros(spec.numel, dtype=spec.dtype)
    header = adapter_header(3, spec, flat, 0) if t == 0 else torch.zeros(4, dtype=torch.int64)
    dist.broadcast(header, src=0)
    dist.broadcast(flat, src=0)
    head = parse_adapter_header(header, spec)
    gaps = {}
    for use_slot in (True, False):
        for module, y in row_partials(case, spec, flat, 2, t, use_slot).items():
            dist.all_reduce(y)  # the base layer's all-reduce carries the LoRA partial sums too
            gaps[f"{'slot' if use_slot else 'merged'}:{module}"] = float((y - case.reference[module]).abs().max())
    result[t] = {"checksum_ok": checksum(flat) == head.checksum, "version": head.version, "gaps": gaps}
    dist.destroy_process_group()


def test_row_layers_all_reduce_over_a_two_rank_gloo_world(model):
    """Only rank 0 starts with the adapter (the learner's sender stands in for it); rank 1 has its spec."""
    import torch.multiprocessing as mp

    from tests.conftest import free_port
    adapter = adapter_of(model)
    spec = LoraSpec.of(adapter)
    result = mp.Manager().dict()
    mp.spawn(_tp_rank_worker, args=(free_port(), row_case(model), spec, flatten_lora(adapter, spec), result), nprocs=2,
             join=True)
    assert sorted(result) == [0, 1]
    for t in (0, 1):
        assert result[t]["checksum_ok"] and result[t]["version"] == 3
        gaps = result[t]["gaps"]
        assert len(gaps) == 2 * 2 * 2  # slot and merged, o_proj and down_proj, 2 layers
        assert max(gaps.values()) < TOL["atol"], gaps

