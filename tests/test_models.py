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
