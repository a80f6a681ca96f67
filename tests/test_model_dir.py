"""The base-model directory a vLLM engine loads (`engine/model_dir.py`) holds the learner's weights."""
import torch


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
