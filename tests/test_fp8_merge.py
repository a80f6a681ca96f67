"""FP8 weights with the adapter merged in (`engine.quantization: fp8`, `engine.lora_mode: merged`):
the worker's requantizing merge (`engine/fp8_merge.py`, `adapter_targets.MergedFp8Adapter`) against a
float64 reference on stand-ins of vLLM's FP8 linears, written in place into the live tensors; the
HF engine's emulation of it (`engine/fp8.py`); the config accepting it. No vLLM here."""
import os
from types import SimpleNamespace

import pytest
import torch

from colocate.engine.fp8 import E4M3, amax_scale, to_e4m3
from colocate.engine.fp8_merge import Fp8Weight, live_fp8, merged_fp8_bytes
from colocate.engine.adapter_targets import MergedAdapter, MergedFp8Adapter, merge_plan, merged_target
from colocate.wire import LoraSpec, flatten_lora
from tests.conftest import REPO
from tests.test_vllm_sync import VLLM_PACKED

PREFIX = "base_model.model.model.layers.0"
RANK, HIDDEN = 4, 24  # 24: not a multiple of 16, so vLLM pads the live weight (cutlass)
OUTS = {"self_attn.q_proj": 8, "self_attn.k_proj": 4, "self_attn.v_proj": 4, "self_attn.o_proj": 12}
FUSED = {"model.layers.0.self_attn.qkv_proj": 16, "model.layers.0.self_attn.o_proj": 12}


def fp8_layer(q: torch.Tensor, scale: float):
    """A stand-in of a vLLM linear after online FP8 loading: `weight` the [in, out] transpose of an
    [out, in] e4m3 tensor zero-padded to multiples of 16, `weight_scale` one fp32 scale."""
    out, inp = q.shape
    storage = torch.zeros(-(-out // 16) * 16, -(-inp // 16) * 16, dtype=E4M3)
    storage[:out, :inp] = q
    return SimpleNamespace(weight=storage.t(), weight_scale=torch.tensor([scale]), output_size_per_partition=out,
                           input_size_per_partition=inp, storage=storage)


def exact_values(*shape, generator) -> torch.Tensor:
    """Multiples of 1/16 in [-1/2, 1/2]: every product and sum below is exact in fp32 and float64."""
    return torch.randint(-8, 9, shape, generator=generator).float() / 16


def random_e4m3(out: int, inp: int, generator) -> torch.Tensor:
    """e4m3 values spread over its range, one of them 448 (what vLLM's load gives the amax)."""
    q = to_e4m3(torch.randn(out, inp, generator=generator) * 120, torch.tensor(1.0))
    q[0, 0] = 448.0
    return q


def adapter(generator) -> dict[str, torch.Tensor]:
    return {f"{PREFIX}.{m}.lora_{ab}.default.weight": exact_values(*((RANK, HIDDEN) if ab == "A" else (out, RANK)),
                                                                   generator=generator)
            for m, out in OUTS.items() for ab in "AB"}


def reference(q: torch.Tensor, s0: float, tensors: dict, parts: list[str], scaling: float):
    """Dequantize W0, add scaling * B @ A to each part's rows in float64, quantize by vLLM's dynamic
    per-tensor rule (`scaled_fp8_quant(x, scale=None)`: scale = amax / 448 in fp32, x times the fp32
    reciprocal of it, saturated at +-448, cast to e4m3) -> (e4m3 weight, scale)."""
    w = q.double() * s0
    row = 0
    for part in parts:
        b, a = (tensors[f"{PREFIX}.{part}.lora_{ab}.default.weight"].double() for ab in "BA")
        w[row:row + b.shape[0]] += scaling * (b @ a)
        row += b.shape[0]
    x = w.float()
    scale = torch.tensor(float(x.abs().max()), dtype=torch.float32) / 448
    return (x * (1 / scale)).clamp(-448, 448).to(E4M3), scale


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_requantized_merge_is_the_float64_reference_bit_for_bit_in_place(dtype):
    """A fused q/k/v weight and a plain one, both padded: each update requantizes W0 + scaling * B @ A
    with a new scale into the very tensors the engine holds (same storage, same scale tensor),
    the padding left zero; `matches` holds, and sees a changed weight or scale. fp32: the received
    buffer is the staged one; bf16: cast to fp32 first (the adapter's values are exact in both)."""
    g = torch.Generator().manual_seed(0)
    s0 = 2.0 ** -8  # a power of two: W0 dequantized exactly
    w0 = {m: random_e4m3(out, HIDDEN, g) for m, out in FUSED.items()}
    layers = {m: fp8_layer(q, s0) for m, q in w0.items()}
    pointers = {m: (layer.storage.data_ptr(), layer.weight_scale.data_ptr()) for m, layer in layers.items()}
    tensors = {k: v.to(dtype) for k, v in adapter(g).items()}
    spec = LoraSpec.of(tensors)
    plan = merge_plan(spec.names, spec.shapes, set(layers), VLLM_PACKED)
    need, build = merged_target(spec, plan, layers, scaling=2.0, quantization="fp8")
    merged = build()
    assert isinstance(merged, MergedFp8Adapter) and (merged.staged is merged.flat) == (dtype == torch.float32)
    assert need == merged_fp8_bytes([16 * HIDDEN, 12 * HIDDEN]) == 28 * HIDDEN + 4 * 16 * HIDDEN
    for step in range(2):  # merging is from W0: the second update starts from it again
        merged.flat.copy_(flatten_lora({k: v * (step + 1) for k, v in tensors.items()}, spec))
        merged.apply()
        assert merged.matches()
        for m, layer in layers.items():
            parts = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"] if "qkv" in m else ["self_attn.o_proj"]
            want, scale = reference(w0[m], s0, {k: v * (step + 1) for k, v in tensors.items()}, parts, 2.0)
            out = FUSED[m]
            assert torch.equal(bits(layer.storage[:out, :HIDDEN]), bits(want)), (m, step)
            assert torch.equal(layer.weight_scale, scale.reshape(1)) and layer.weight_scale != s0
            assert not bits(layer.storage[out:]).any() and not bits(layer.storage[:, HIDDEN:]).any()
            assert (layer.storage.data_ptr(), layer.weight_scale.data_ptr()) == pointers[m]
    live = layers["model.layers.0.self_attn.qkv_proj"]
    live.storage[9, 3] = (live.storage[9, 3].float() * 2).to(E4M3)  # k's first row
    assert not merged.matches()
    merged.apply()
    assert merged.matches()
    live.weight_scale.mul_(1 + 2 ** -20)
    assert not merged.matches()


def test_a_zero_adapter_gives_w0_back_and_an_update_shows_only_across_the_grid():
    """From a bf16-like weight rounded as vLLM loads it: a zero adapter requantizes to W0's e4m3 values
    exactly (the scale to within fp32's rounding of amax / 448); a small update moves only the
    weights it pushes past a midpoint of e4m3's grid, and every weight is its merge rounded to e4m3
    at the new scale (half a step: 2^-4 relative, or half the smallest subnormal step absolute)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, HIDDEN, generator=g) * 0.02
    s0 = amax_scale(w.abs().amax())
    q0 = to_e4m3(w, s0)
    layer = fp8_layer(q0, float(s0))
    names = [f"{PREFIX}.self_attn.o_proj.lora_{ab}.default.weight" for ab in "AB"]
    spec = LoraSpec(tuple(names), ((RANK, HIDDEN), (16, RANK)), torch.float32)
    plan = merge_plan(spec.names, spec.shapes, {"model.layers.0.self_attn.o_proj"}, VLLM_PACKED)
    merged = MergedFp8Adapter(spec, plan, {"model.layers.0.self_attn.o_proj": live_fp8(layer)}, scaling=1.0)
    merged.apply()  # flat is zero
    assert torch.equal(bits(layer.storage[:16, :HIDDEN]), bits(q0))
    assert torch.isclose(layer.weight_scale, s0, rtol=2 ** -22, atol=0)
    a, b = torch.randn(RANK, HIDDEN, generator=g), torch.randn(16, RANK, generator=g) * 1e-4
    merged.flat.copy_(flatten_lora({names[0]: a, names[1]: b}, spec))
    merged.apply()
    new = layer.storage[:16, :HIDDEN]
    moved = (bits(new) != bits(q0)).float().mean()
    assert 0 < moved < 0.25, moved  # the update is ~1/100 of the weights: most stay put
    x = q0.float() * s0 + b @ a
    scale = layer.weight_scale
    err = (new.float() * scale - x).abs()
    assert (err <= torch.maximum(2 ** -4 * x.abs(), 2 ** -10 * scale) * (1 + 2 ** -20)).all()


def test_merged_target_follows_the_config_and_refuses_weights_its_merge_cannot_write():
    """Without FP8, bf16 weights keep `MergedAdapter` (W0 in bf16, 2 bytes a parameter); with
    engine.quantization fp8, e4m3 ones the FP8 merge. Each refuses, in one line naming a module and
    engine.lora_mode=slot, the weights the other writes, a mix, and integers (Marlin's repacked FP8
    before Ada, a quantized checkpoint): no merge into a layout it does not know. A layer not in
    vLLM's per-tensor FP8 layout is refused by name."""
    g = torch.Generator().manual_seed(2)
    tensors = adapter(g)
    spec = LoraSpec.of(tensors)
    bf16 = {m: SimpleNamespace(weight=torch.zeros(out, HIDDEN, dtype=torch.bfloat16)) for m, out in FUSED.items()}
    plan = merge_plan(spec.names, spec.shapes, set(bf16), VLLM_PACKED)
    need, build = merged_target(spec, plan, bf16, scaling=2.0)
    assert need == 2 * 28 * HIDDEN and isinstance(build(), MergedAdapter)
    e4m3 = {m: fp8_layer(random_e4m3(out, HIDDEN, g), 1.0) for m, out in FUSED.items()}
    assert isinstance(merged_target(spec, plan, e4m3, scaling=2.0, quantization="fp8")[1](), MergedFp8Adapter)
    o_proj = "model.layers.0.self_attn.o_proj"
    marlin = {**e4m3, o_proj: SimpleNamespace(weight=torch.zeros(12, HIDDEN // 4, dtype=torch.int32))}
    cases = [(bf16, "fp8", "bfloat16"), (e4m3, "none", "float8_e4m3fn"), (marlin, "fp8", "int32"),
             ({**bf16, o_proj: e4m3[o_proj]}, "none", "float8_e4m3fn"),
             ({m: SimpleNamespace(weight=torch.zeros(4, 4, dtype=torch.int8)) for m in bf16}, "none", "int8"),
             ({m: SimpleNamespace(weight=torch.zeros(4, 4, dtype=torch.float8_e5m2)) for m in bf16}, "none",
              "float8_e5m2")]
    for layers, quantization, held in cases:
        with pytest.raises(RuntimeError, match=rf"engine.quantization={quantization} writes .* as torch.{held} "
                                               r".*use engine.lora_mode=slot"):
            merged_target(spec, plan, layers, scaling=2.0, quantization=quantization)
    per_channel = fp8_layer(random_e4m3(12, HIDDEN, g), 1.0)
    per_channel.weight_scale = torch.ones(12)
    with pytest.raises(RuntimeError, match="use engine.lora_mode=slot"):
        live_fp8(per_channel)
    live = live_fp8(fp8_layer(random_e4m3(12, HIDDEN, g), 1.0))
    assert isinstance(live, Fp8Weight) and live.weight.shape == (12, HIDDEN) and live.weight.stride() == (32, 1)


def test_the_hf_engine_merges_the_adapter_into_its_fp8_weights_in_merged_mode(tiny_cfg, tiny_tokenizer):
    """engine.kind=hf with fp8 and lora_mode merged mirrors vLLM's merged FP8: peft's adapter layers are
    off and each load writes W0 + scaling * B @ A, rounded through e4m3 at one new scale per fused
    group, into the base weights; a zero adapter gives the slot engine's rounded W0 back (its e4m3
    values exactly; the scale, amax / 448 of W0's amax, to within fp32's rounding)."""
    from colocate.engine.fp8 import round_trip
    from colocate.engine.hf import HFEngine
    from colocate.models import build_policy, lora_state
    from tests.test_packing import randomize_adapter
    slot = HFEngine(build_policy(tiny_cfg, tiny_tokenizer, torch.device("cpu")), tiny_tokenizer, quantization="fp8")
    w0 = {n: p.detach().clone() for n, p in slot.model.named_parameters() if "base_layer" in n}
    engine = HFEngine(build_policy(tiny_cfg, tiny_tokenizer, torch.device("cpu")), tiny_tokenizer,
                      quantization="fp8", lora_mode="merged")
    weights = {n: p for n, p in engine.model.named_parameters() if "base_layer" in n}
    same = dict(rtol=2 ** -21, atol=0)
    assert all(torch.allclose(weights[n], w0[n], **same) for n in w0)  # peft initializes B to zero
    source = build_policy(tiny_cfg, tiny_tokenizer, torch.device("cpu"))
    randomize_adapter(source)
    engine.load_lora(1, {n: t.detach() for n, t in lora_state(source).items()})
    attn = engine.model.base_model.model.model.layers[0].self_attn
    merged = {p: w0[f"base_model.model.model.layers.0.self_attn.{p}.base_layer.weight"]
              + getattr(attn, p).scaling["default"] * getattr(attn, p).lora_B["default"].weight
              @ getattr(attn, p).lora_A["default"].weight for p in ("q_proj", "k_proj", "v_proj")}
    scale = amax_scale(max(m.abs().max() for m in merged.values()))
    for p, value in merged.items():  # fp32 sums in another order: within a step of e4m3 (2^-3) of the merge
        got = getattr(attn, p).base_layer.weight
        assert torch.allclose(got, round_trip(value, scale), rtol=2 ** -3, atol=2 ** -9 * float(scale)), p
        assert not torch.equal(got, w0[f"base_model.model.model.layers.0.self_attn.{p}.base_layer.weight"])
    x = torch.randn(3, attn.q_proj.in_features)
    with torch.no_grad():
        assert torch.equal(attn.q_proj(x), attn.q_proj.base_layer(x))  # the adapter lives in the weights only
    engine.load_lora(2, {n: torch.zeros_like(t) for n, t in lora_state(source).items()})
    assert all(torch.allclose(weights[n], w0[n], **same) for n in w0)


def test_fp8_goes_with_either_lora_mode_and_still_needs_the_loss_correction():
    from colocate.config import ConfigError, load_config
    from colocate.engine.vllm_settings import check_engine_args
    for mode in ("slot", "merged"):
        cfg = load_config(None, {"engine": {"quantization": "fp8", "lora_mode": mode}, "loss": {"tis_cap": 2.0}})
        assert (cfg.engine.quantization, cfg.engine.lora_mode) == ("fp8", mode)
        check_engine_args(mode, "fp8")
        with pytest.raises(ConfigError, match="engine.quantization=fp8 samples from a rounded copy.*loss.tis_cap"):
            load_config(None, {"engine": {"quantization": "fp8", "lora_mode": mode}})


@pytest.mark.parametrize("facts, refused", [(("NVIDIA A100-SXM4-80GB", 8, 0), True), (("NVIDIA L40S", 8, 9), False),
                                            (("NVIDIA H100 80GB HBM3", 9, 0), False), (None, False)])
def test_fp8_merged_is_refused_before_fp8_tensor_cores(monkeypatch, facts, refused):
    """The FP8 presets merge into per-tensor e4m3 weights, which vLLM keeps only on Ada and later:
    before them the run is refused at its checks (one line naming the GPU and the key), not at the
    engine's build; slot mode, the HF engine's emulation, no GPU and no NVML are left alone."""
    from colocate import nvml
    from colocate.config import ConfigError, load_config
    from colocate.engine.table import check_engine_devices
    monkeypatch.setattr(nvml, "capability", lambda index: facts)
    cfg = load_config(os.path.join(REPO, "configs", "gpu-4.yaml"))  # vLLM, FP8, merged
    if refused:
        with pytest.raises(ConfigError, match=r"needs FP8 tensor cores .*GPU 0 is NVIDIA A100-SXM4-80GB \(8\.0\): "
                                              r"set engine\.quantization=none"):
            check_engine_devices(cfg, 4)
    else:
        check_engine_devices(cfg, 4)
    for engine in ({"lora_mode": "slot"}, {"kind": "hf"}):
        check_engine_devices(load_config(os.path.join(REPO, "configs", "gpu-4.yaml"), {"engine": engine}), 4)
    check_engine_devices(cfg, 0)
