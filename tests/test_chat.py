"""Chat templates: prompts rendered by `ChatFormat` equal `apply_chat_template(...,
add_generation_prompt=True)` of a tokenizer built here with a template (nothing downloaded), for
text and message prompts, for the ids Diplomacy wraps, and in the envs' requests; `none` and a
tokenizer without a template keep raw text."""
import copy

import pytest

from colocate.chat import ChatFormat

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture()
def chat_tokenizer(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = TEMPLATE
    return tok


def reference(tok, messages):
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def test_messages_and_text_render_like_apply_chat_template(chat_tokenizer):
    chat = ChatFormat(chat_tokenizer, "auto")
    assert chat.enabled
    messages = [{"role": "system", "content": "you add"}, {"role": "user", "content": "add 1 and 2 ; answer :"}]
    assert chat.ids(messages) == reference(chat_tokenizer, messages)
    text = "add 3 and 4 ; answer :"
    expected = reference(chat_tokenizer, [{"role": "user", "content": text}])
    assert chat.ids(text) == expected
    assert chat.wrap(chat.text_ids(text)) == expected  # Diplomacy's pre-tokenized content
    assert chat_tokenizer.decode(expected).endswith("<|im_start|>assistant\n")


def test_none_and_a_tokenizer_without_template_keep_raw_text(chat_tokenizer, tiny_tokenizer):
    text = "add 3 and 4 ; answer :"
    raw = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert ChatFormat(chat_tokenizer, "none").ids(text) == raw
    assert not ChatFormat(tiny_tokenizer, "auto").enabled and ChatFormat(tiny_tokenizer, "auto").ids(text) == raw
    assert ChatFormat(tiny_tokenizer, "auto").wrap(raw) == raw
    with pytest.raises(TypeError):
        ChatFormat(tiny_tokenizer, "auto").ids(42)


def test_every_env_renders_its_prompts_with_the_template(chat_tokenizer, tiny_cfg, tmp_path):
    from colocate.config import load_config
    from colocate.envs import make_env
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": [{"role": "user", "content": "add 1 and 1 ; answer :"}], "answer": "2"}\n')
    for overrides, content in (({"env": {"name": "arithmetic"}}, None),
                               ({"env": {"name": "dataset", "data_files": [str(data)]}}, "add 1 and 1 ; answer :")):
        cfg = load_config(None, {"model": {"cache_dir": tiny_cfg.model.cache_dir}, **overrides})
        env = make_env(cfg, chat_tokenizer, seed=0)
        env.start_group(0)
        (_, request), *_ = env.requests()
        text = chat_tokenizer.decode(request.prompt_ids)
        assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
        if content is not None:
            assert request.prompt_ids == reference(chat_tokenizer, [{"role": "user", "content": content}])


def test_diplomacy_prompts_are_wrapped(chat_tokenizer):
    pytest.importorskip("diplomacy")
    from colocate.envs.diplomacy import DiplomacyEnv, DiplomacySettings
    plain = DiplomacyEnv(chat_tokenizer, DiplomacySettings(group_size=2), seed=0)
    wrapped = DiplomacyEnv(chat_tokenizer, DiplomacySettings(group_size=2), seed=0,
                           chat=ChatFormat(chat_tokenizer, "auto"))
    for env in (plain, wrapped):
        env.start_group(0)
    (_, raw), *_ = plain.requests()
    (_, chat), *_ = wrapped.requests()
    text = chat_tokenizer.decode(raw.prompt_ids)
    assert chat.prompt_ids == reference(chat_tokenizer, [{"role": "user", "content": text}])
