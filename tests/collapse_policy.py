"""The arithmetic policy's constrained answer distribution from a saved adapter (issue 39's replay
and its dump script, `scripts/dump_collapse_state.py`)."""
import torch

from colocate.checkpoint import from_peft_name
from colocate.models import canonical_name


def load_adapter(model, adapter: dict[str, torch.Tensor]) -> None:
    """Copy a saved (peft-named) adapter into a peft model's LoRA parameters."""
    live = {canonical_name(n): p for n, p in model.named_parameters() if "lora_" in n}
    with torch.no_grad():
        for key, value in adapter.items():
            live[from_peft_name(key)].copy_(value)


def answer_logprobs(model, prompt_ids: list[int], answers: list[list[int]]) -> torch.Tensor:
    """[num answers, answer length] log-prob of each answer token under the constraint (the allowed
    ids at each position: the answers' tokens that continue the same prefix), temperature 1. The
    answers have one length, so one forward takes them all (no padding)."""
    if len({len(a) for a in answers}) != 1:
        raise ValueError("answer_logprobs: the answers must have one length")
    out = torch.zeros(len(answers), len(answers[0]))
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + seq for seq in answers])).logits
        for i, seq in enumerate(answers):
            for j, t in enumerate(seq):
                allowed = sorted({a[j] for a in answers if a[:j] == seq[:j]})
                row = torch.log_softmax(logits[i, len(prompt_ids) - 1 + j, allowed].float(), -1)
                out[i, j] = row[allowed.index(t)]
    return out
