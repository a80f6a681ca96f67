"""The HF engine's FP8 emulation (`engine/fp8.py`, `engine.quantization: fp8` on CPU): e4m3's grid
and scales, which layers it rounds (vLLM's: the decoder blocks' linears, q/k/v and gate/up fused
under one scale; not the embeddings, the LM head or the adapter), the base layer fed a rounded
input beside an adapter fed the exact one, and an FP8 engine's log-probs: its own forward's,
apart from the full-precision learner's by FP8's rounding."""
import pytest
import torch

from colocate.canary import canary_bound
from colocate.engine.fp8 import (E4M3, E4M3_MAX, MIN_INPUT_SCALE, amax_scale, base_linears, emulate_fp8, round_rows,
                                 round_trip, to_e4m3)
from colocate.engine.hf import HFEngine
from colocate.models import lora_state
from tests.test_packing import randomize_adapter

U = 2.0 ** -4  # e4m3's unit roundoff: 3 mantissa bits


def on_grid(x: torch.Tensor, scale) -> bool:
    """x / scale is an e4m3 value (up to the fp32 rounding of multiplying back by the scale)."""
    q = x.float() / scale
    return torch.allclose(q.to(E4M3).float(), q, rtol=2.0 ** -22, atol=0)


def test_round_trip_lands_on_e4m3s_grid_within_its_unit_roundoff():
    torch.manual_seed(0)
    x = torch.randn(64, 96) * 3
    scale = amax_scale(x.abs().amax())
    y = round_trip(x, scale)
    assert scale == x.abs().amax() / 448 and E4M3_MAX == 448 and on_grid(y, scale)
    # the amax maps onto 448, which e4m3 holds exactly
    assert torch.isclose(y.abs().amax(), x.abs().amax(), rtol=2.0 ** -23, atol=0)
    normal = x.abs() / scale >= 2.0 ** -6  # e4m3's smallest normal: below it the error is absolute
    assert ((y - x).abs() <= U * x.abs())[normal].all() and ((y - x)[normal] != 0).any()
    assert round_trip(torch.tensor([1000.0, -1000.0]), torch.tensor(1.0)).tolist() == [448.0, -448.0]  # saturates
    rows = torch.stack([x[0], x[1] * 100, torch.zeros(96)])
    r = round_rows(rows)
    assert torch.equal(r[2], torch.zeros(96))  # an all-zero token: no NaN from a zero scale
    for i in range(2):  # one scale per token: the second row's size does not coarsen the first
        assert on_grid(r[i], rows[i].abs().amax() / 448)
        assert torch.isclose(r[i].abs().amax(), rows[i].abs().amax(), rtol=2.0 ** -23, atol=0)


def test_values_are_scaled_by_the_reciprocal_as_vllm_does():
    """vLLM's per-tensor kernel (weights, at load) and its compiled per-token quantization (inputs,
    `QuantFP8.forward_native`) multiply by the fp32 reciprocal of the scale. Here x / s is 1.1875,
    e4m3's midpoint between 1.125 and 1.25 (a tie: to the even 1.25), and x * (1 / s) one fp32 step
    below it: 1.125, as vLLM rounds it."""
    x, s = torch.tensor(1.9072766304016113), torch.tensor(1.6061277389526367)
    assert x * (1 / s) != x / s and (x / s).to(E4M3).float() == 1.25
    assert to_e4m3(x, s).float() == 1.125 and round_trip(x, s) == torch.tensor(1.125) * s


def test_an_input_rows_scale_has_vllms_floor():
    """A row of zeros (or of values under 448 / 2^9 of fp32's smallest normal) takes vLLM's smallest
    per-token scale, 1 / (448 * 512), and comes back exactly."""
    rows = torch.zeros(2, 8)
    rows[1] = 1e-30
    assert MIN_INPUT_SCALE == 1 / (448 * 512)
    scales = amax_scale(rows.abs().amax(dim=-1, keepdim=True), MIN_INPUT_SCALE)
    assert torch.equal(scales.flatten(), torch.full((2,), MIN_INPUT_SCALE))  # in fp32, as vLLM's
    assert torch.equal(round_rows(rows)[0], rows[0])


def test_emulation_rounds_the_decoder_linears_only_with_vllms_fused_scales(tiny_policy):
    randomize_adapter(tiny_policy)
    before = {n: p.detach().clone() for n, p in tiny_policy.named_parameters()}
    linears = base_linears(tiny_policy)
    layers = tiny_policy.config.num_hidden_layers
    assert emulate_fp8(tiny_policy) == len(linears) == 7 * layers
    weights = {f"{n}.weight" for n, m in tiny_policy.named_modules() if m in linears.values()}
    for name, p in tiny_policy.named_parameters():
        if name in weights:  # changed, within e4m3's rounding of the group's amax
            assert not torch.equal(p, before[name]) and (p - before[name]).abs().max() <= U * before[name].abs().max()
        else:  # embeddings, norms, LM head, the adapter: untouched
            assert torch.equal(p, before[name]), name
    for i in range(layers):
        block = {n.rpartition(".")[2]: m.weight for n, m in linears.items() if f".layers.{i}." in n}
        for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("o_proj",), ("down_proj",)):
            scale = max(block[g].abs().max() for g in group) / 448  # one scale per fused group
            assert all(on_grid(block[g], scale) for g in group), group
        smallest = min(("q_proj", "k_proj", "v_proj"), key=lambda g: block[g].abs().max())
        assert not on_grid(block[smallest], block[smallest].abs().max() / 448)  # not its own scale


def test_the_base_layer_sees_a_rounded_input_and_the_adapter_the_exact_one(tiny_policy):
    """vLLM's slot mode: the FP8 GEMM quantizes its input, punica's LoRA kernels read the bf16 one."""
    randomize_adapter(tiny_policy)
    emulate_fp8(tiny_policy)
    layer = tiny_policy.base_model.model.model.layers[0].self_attn.q_proj  # peft lora.Linear
    x = torch.randn(5, layer.in_features)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    base_in, scaling = round_rows(x), layer.scaling["default"]
    expected = torch.nn.functional.linear(base_in, layer.base_layer.weight, layer.base_layer.bias) \
        + scaling * (x @ a.t() @ b.t())
    # two fp32 evaluations of the same sums in other orders differ by at most K 2^-24 times the sum
    # of the terms' magnitudes on either side (K: the longest sum)
    k = max(layer.in_features, a.shape[0])
    with torch.no_grad():
        magnitude = base_in.abs() @ layer.base_layer.weight.abs().t() + scaling * (x.abs() @ a.abs().t() @ b.abs().t())
        tol = 2 * k * 2.0 ** -24 * float(magnitude.max())
        assert float((layer(x) - expected).abs().max()) <= tol
        adapter_on_rounded = scaling * ((base_in - x) @ a.t() @ b.t())  # what it would add, fed the rounded input
        assert float(adapter_on_rounded.abs().max()) > 2 * tol  # so the adapter's input is the unrounded one


def test_an_fp8_engines_logprobs_are_its_own_and_differ_from_full_precision(tiny_cfg, tiny_tokenizer):
    """The sampler's log-probs (what the loss's ratio and TIS / MIS are taken against) are the FP8
    forward's exactly; the full-precision policy (the learner's) gives others, by more than fp32's
    rounding: the mismatch the correction is for."""
    from colocate.data import build_batch, group_advantages
    from colocate.envs import make_env
    from colocate.kernels import restrict_to_allowed
    from colocate.kernels.reference import per_token_logprobs
    from colocate.learner.packing import completion_logits, packed_micro_batch, set_attention
    from colocate.models import build_policy

    def policy():
        model = build_policy(tiny_cfg, tiny_tokenizer, torch.device("cpu"))
        randomize_adapter(model)
        return model
    engine = HFEngine(policy(), tiny_tokenizer, seed=3, quantization="fp8")
    env = make_env(tiny_cfg, tiny_tokenizer, seed=0)
    for g in range(4):
        env.start_group(g)
    keyed = env.requests()
    env.step({k: c for (k, _), c in zip(keyed, engine.generate([r for _, r in keyed]))})
    samples = env.pop_finished()
    batch = build_batch(samples, group_advantages(samples))
    mb = packed_micro_batch(batch, "cpu", "sdpa")  # the learner's layout: per-token scales do not care

    def logprobs(model):
        set_attention(model, "sdpa")
        with torch.no_grad():
            sub, targets = restrict_to_allowed(completion_logits(model, mb), mb.targets, batch.allowed_ids)
        return per_token_logprobs(sub, targets, tiny_cfg.engine.temperature)
    # two correct fp32 implementations (the sampler's incremental forward, the learner's packed one)
    # differ by at most the canary's fp32 bound, in mean |log-prob| (colocate/canary.py)
    shape = engine.model.config
    with torch.no_grad():
        set_attention(engine.model, "sdpa")
        rms = float(completion_logits(engine.model, mb).float().pow(2).mean().sqrt())
    fp32 = canary_bound(torch.float32, reduction=max(shape.hidden_size, shape.intermediate_size),
                        num_layers=shape.num_hidden_layers, logit_scale=rms)
    assert float((logprobs(engine.model) - batch.behaviour_logprobs).abs().mean()) <= fp32
    full = logprobs(policy())
    forced = batch.behaviour_logprobs > -1e-6  # EOS after a filled slot: log 1 on both sides
    assert float((full - batch.behaviour_logprobs)[~forced].abs().mean()) > fp32  # FP8's rounding, not fp32's
    with pytest.raises(ValueError, match="quantization='int8'"):
        HFEngine(policy(), tiny_tokenizer, quantization="int8")
    assert lora_state(engine.model).keys() == lora_state(policy()).keys()
