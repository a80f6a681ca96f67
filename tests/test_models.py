"""Model construction: meta-device build + materialize keeps tied weights tied and is deterministic."""
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from colocate.config import ModelConfig
from colocate.models import materialize


def _meta_model(tie: bool):
    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=50, tie_word_embeddings=tie)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def test_materialize_keeps_tied_lm_head_tied():
    model = materialize(_meta_model(tie=True), ModelConfig(seed=3), "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    untied = materialize(_meta_model(tie=False), ModelConfig(seed=3), "cpu")
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


def test_materialize_is_deterministic_per_seed():
    a = materialize(_meta_model(tie=False), ModelConfig(seed=1), "cpu")
    b = materialize(_meta_model(tie=False), ModelConfig(seed=1), "cpu")
    c = materialize(_meta_model(tie=False), ModelConfig(seed=2), "cpu")
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def _lora_pair(dtype):
    """The same small peft model twice: peft's own LoRA forward, and the fused epilogue."""
    from colocate.config import LoraConfig
    from colocate.models import add_lora
    models = []
    for fused in (False, True):
        base = materialize(_meta_model(tie=False), ModelConfig(seed=5), "cpu").to(dtype)
        # all in `dtype`, as under FSDP2's mixed precision (peft alone would keep the adapter in fp32)
        model = add_lora(base, LoraConfig(rank=4, alpha=8.0, fused_epilogue=fused)).to(dtype)
        with torch.no_grad():  # same A in both (peft draws it), B != 0 or the LoRA term would vanish
            g = torch.Generator().manual_seed(0)
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        models.append(model)
    return models


def _logits_and_grads(model, ids):
    from colocate.models import lora_state
    logits = model(input_ids=ids).logits.float()
    logits.square().mean().backward()
    return logits.detach(), {n: p.grad.double() for n, p in lora_state(model).items()}


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_fused_lora_epilogue_matches_peft_values_and_gradients():
    ids = torch.randint(0, 50, (3, 11), generator=torch.Generator().manual_seed(1))
    plain, fused = _lora_pair(torch.float32)
    (lp, gp), (lf, gf) = _logits_and_grads(plain, ids), _logits_and_grads(fused, ids)
    assert _rel(lf, lp) <= 1e-5
    assert gp.keys() == gf.keys() and len(gp) == 2 * 7
    for n in gp:
        assert gp[n].norm() > 0 and _rel(gf[n], gp[n]) <= 1e-5, n
    # the reference pass (adapter disabled) is peft's own path in both
    with plain.disable_adapter(), fused.disable_adapter(), torch.no_grad():
        base = fused(input_ids=ids).logits
        assert torch.equal(plain(input_ids=ids).logits, base)
    assert _rel(lf, base) > 1e-3  # the adapter does change the output
    # bf16: another rounding order, so judged against the fp32 result: no further from it than peft
    bf_plain, bf_fused = _lora_pair(torch.bfloat16)
    (bp, bgp), (bfl, bgf) = _logits_and_grads(bf_plain, ids), _logits_and_grads(bf_fused, ids)
    assert _rel(bfl, lp) <= 1.5 * _rel(bp, lp) + 1e-3
    for n in gp:
        assert _rel(bgf[n], gp[n]) <= 1.5 * _rel(bgp[n], gp[n]) + 1e-3, n


def test_fused_lora_epilogue_switches_every_adapter_forward():
    from peft.tuners.lora import Linear as LoraLinear
    from colocate.models import set_fused_lora
    plain, fused = _lora_pair(torch.float32)
    layers = [m for m in fused.modules() if isinstance(m, LoraLinear)]
    assert len(layers) == 7 and all("forward" in vars(m) for m in layers)
    assert not any("forward" in vars(m) for m in plain.modules() if isinstance(m, LoraLinear))
    assert set_fused_lora(fused, False) == 7 and not any("forward" in vars(m) for m in layers)


def test_fused_lora_epilogue_leaves_fp32_adapters_on_bf16_to_peft():
    """peft computes an fp32 adapter's term in fp32 on bf16 activations; the fused path would round
    it to bf16, so it steps aside (exactly peft's result)."""
    from colocate.config import LoraConfig
    from colocate.models import add_lora
    outs = []
    for fused in (False, True):
        base = materialize(_meta_model(tie=False), ModelConfig(seed=5), "cpu").to(torch.bfloat16)
        model = add_lora(base, LoraConfig(rank=4, alpha=8.0, fused_epilogue=fused))
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            for n, p in model.named_parameters():
                if "lora_" in n:
                    assert p.dtype == torch.float32  # peft's autocast of adapters
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            outs.append(model(input_ids=torch.arange(10)[None]).logits)
    assert torch.equal(outs[0], outs[1])


def test_building_sampling_and_gathering_raise_no_future_warning(tiny_cfg, tiny_tokenizer, monkeypatch):
    """Every run used to print four FutureWarnings (peft's probe of transformers' deprecated
    `is_gradient_checkpointing`, `past_key_values`, `all_gather_into_tensor`); each is avoided or
    silenced at its source."""
    import warnings

    import torch.distributed as dist

    from colocate.data import Request
    from colocate.engine.hf import HFEngine
    from colocate.learner.fsdp import all_gather_single
    from colocate.models import build_policy
    from tests.conftest import free_port
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        policy = build_policy(tiny_cfg, tiny_tokenizer, "cpu")
        HFEngine(policy, tiny_tokenizer).generate([Request(prompt_ids=[5, 6], max_new_tokens=3, temperature=1.0)])
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
        try:
            out = torch.zeros(3)
            all_gather_single(out, torch.arange(3.0))
        finally:
            dist.destroy_process_group()
    assert out.tolist() == [0.0, 1.0, 2.0]
    assert not [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
