"""Prompt rendering: raw text, or the tokenizer's chat template (`model.chat_template`).

An instruct model was tuned on its own conversation format; fed raw text it sees something it never
saw in training. With `auto` and a tokenizer that has a template, every env's prompt goes through
it: a text prompt becomes one user message, a list of messages is rendered as given, and the
assistant turn is opened (`add_generation_prompt=True`), so the completion is the assistant's reply.
The embedded tiny tokenizer has no template, so its envs keep raw text.

Token ids are computed here once per prompt on the inference rank; nothing is re-tokenized later.
Envs that build their prompt ids piecewise (Diplomacy memoizes the pieces) wrap them with `wrap`:
the template rendered around a marker, split there, gives the ids before and after the content.
"""
from __future__ import annotations

MARKER = "\x00colocate-prompt\x00"
"""Stands for the content when the template is rendered once to find what surrounds it."""


def is_messages(prompt) -> bool:
    """A list of chat messages: dicts with a string `role` and `content`."""
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt)


class ChatFormat:
    """How one run turns prompts into token ids."""

    def __init__(self, tokenizer, mode: str = "auto"):
        if mode not in ("auto", "none"):
            raise ValueError(f"chat template mode {mode!r}: expected auto or none")
        self.tokenizer = tokenizer
        self.enabled = mode == "auto" and bool(getattr(tokenizer, "chat_template", None))
        self._around: tuple[list[int], list[int]] | None = None

    def text_ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def ids(self, prompt) -> list[int]:
        """Token ids of a text prompt or a list of messages, ready for the assistant's answer."""
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}] if self.enabled else prompt
        elif not is_messages(prompt):
            raise TypeError(f"a prompt is a string or a list of {{role, content}} messages, got {prompt!r:.80}")
        if isinstance(prompt, str):
            return self.text_ids(prompt)
        if not self.enabled:  # no template: the contents, one per line
            return self.text_ids("\n".join(m["content"] for m in prompt))
        return list(self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))

    def render(self, prompt) -> str:
        """The text of `ids(prompt)` (for logs and custom rewards that want the rendered prompt)."""
        return self.tokenizer.decode(self.ids(prompt))

    def wrap(self, content_ids: list[int]) -> list[int]:
        """Ids of one user message whose content is already tokenized (`content_ids`)."""
        if not self.enabled:
            return list(content_ids)
        if self._around is None:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": MARKER}],
                                                      add_generation_prompt=True, tokenize=False)
            before, _, after = text.partition(MARKER)
            self._around = self.text_ids(before), self.text_ids(after)
        before, after = self._around
        return before + list(content_ids) + after
