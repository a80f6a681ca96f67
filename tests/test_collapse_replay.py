"""Issue 39's collapse, replayed from its dump (`tests/data/collapse-step2300.*`, written by
`scripts/dump_collapse_state.py` from checkpoint step 2300 of `cpu-tiny --learner.num_steps=3000`,
reward down from ~0.97 to ~0.5): the mechanism of docs/design.md ("Why a converged run collapses").

  * the adapter is confidently wrong on several prompts (p >= 0.9 on one wrong answer);
  * every group of such a prompt is uniform (all 0), so its advantages are exactly 0 and it adds
    exactly nothing to the gradient: GRPO has no signal to bring it back;
  * the advantages of the other groups are bounded by sqrt(G - 1) (one sample of G unlike the rest:
    (1 - 1/G) / sqrt((G - 1) / G^2)), so no group with a standard deviation near 0 blows up;
  * one AdamW step on the whole batch at the preset's rate leaves those prompts wrong.
"""
import json
import math
import os

import torch
from safetensors.torch import load_file

from colocate.kernels import LossBatch, LossSpec, grpo_loss
from tests.collapse_policy import answer_logprobs, load_adapter
from tests.conftest import REPO

DATA = os.path.join(REPO, "tests", "data")


def _load(tiny_policy):
    with open(os.path.join(DATA, "collapse-step2300.json")) as f:
        samples = json.load(f)["samples"]
    load_adapter(tiny_policy, load_file(os.path.join(DATA, "collapse-step2300.safetensors")))
    return samples


def _answers(samples):
    return sorted({tuple(s["completion"][:2]) for s in samples} | {(samples[0]["completion"][0], d) for d in
                  samples[0]["allowed"][1]})


def _policy(model, prompt, answers):
    return answer_logprobs(model, prompt, [list(a) for a in answers]).sum(1).exp()


def _batch_loss(model, samples):
    """The learner's loss (dapo, behaviour = the dump's log-probs) over the completion tokens of
    `samples`, through the model: one forward per (prompt, completion) length, every sequence's
    completion rows in one loss call (dapo's per-token mean over all of them is linear in the rows)."""
    by_len: dict[tuple[int, int], list[dict]] = {}
    for s in samples:
        by_len.setdefault((len(s["prompt"]), len(s["completion"])), []).append(s)
    logits, ordered = [], []
    for (p, c), group in by_len.items():
        out = model(torch.tensor([s["prompt"] + s["completion"] for s in group])).logits[:, p - 1:p + c - 1]
        logits.append(out.reshape(-1, out.shape[-1]))
        ordered += group
    rows = [(s, j) for s in ordered for j in range(len(s["completion"]))]
    allowed = torch.full((len(rows), 9), -1, dtype=torch.int32)
    for i, (s, j) in enumerate(rows):
        allowed[i, :len(s["allowed"][j])] = torch.tensor(s["allowed"][j])
    batch = LossBatch(torch.tensor([s["completion"][j] for s, j in rows]), torch.ones(len(rows), dtype=torch.bool),
                      torch.tensor([s["logprobs"][j] for s, j in rows]),
                      torch.tensor([float(s["advantage"]) for s, _ in rows]), num_tokens=len(rows), allowed_ids=allowed)
    loss, _ = grpo_loss(torch.cat(logits), batch, LossSpec(norm="dapo", impl="torch"))
    return loss


def test_collapsed_prompts_get_no_signal_and_stay_wrong(tiny_policy):
    model = tiny_policy.train()
    samples = _load(model)
    answers = _answers(samples)
    prompts = {tuple(s["prompt"]): s for s in samples}  # answers are 0..8 in order: index == value
    # the dump's behaviour log-probs are this model's: the replay is the run's policy
    for s in samples[::8]:
        lp = answer_logprobs(model, s["prompt"], [list(a) for a in answers])[answers.index(tuple(s["completion"][:2]))]
        assert torch.allclose(lp, torch.tensor(s["logprobs"][:2]), atol=1e-5)
    groups: dict[int, list[dict]] = {}
    for s in samples:
        groups.setdefault(s["group"], []).append(s)
    # confidently wrong prompts: p(wrong argmax) >= 0.9; a group of one is all wrong, advantage 0
    stuck = {}
    for prompt, s in prompts.items():
        probs = _policy(model, list(prompt), answers)
        top = int(probs.argmax())
        if top != s["answer"] and probs[top] >= 0.9:
            stuck[prompt] = top
    assert len(stuck) >= 3, "the dump holds confidently wrong prompts"
    all_wrong = [g for g in groups.values() if all(s["reward"] == 0.0 for s in g)]
    assert len(all_wrong) >= 3 and all(s["advantage"] == 0.0 for g in all_wrong for s in g)
    assert all(tuple(g[0]["prompt"]) in stuck for g in all_wrong)
    G = len(next(iter(groups.values())))
    bound = math.sqrt(G - 1)
    assert max(abs(s["advantage"]) for s in samples) <= bound * (1 + 1e-6)
    # the stuck groups' gradient is exactly zero
    model.zero_grad()
    _batch_loss(model, [s for g in all_wrong for s in g]).backward()
    assert all(p.grad is None or float(p.grad.abs().max()) == 0.0 for p in model.parameters() if p.requires_grad)
    # one AdamW step on the whole batch at the preset's rate: they stay wrong
    params = [p for p in model.parameters() if p.requires_grad]
    before = {pr: float(_policy(model, list(pr), answers)[stuck[pr]]) for pr in stuck}
    opt = torch.optim.AdamW(params, lr=0.003, weight_decay=0.0)
    model.zero_grad()
    _batch_loss(model, samples).backward()
    opt.step()
    after = {pr: float(_policy(model, list(pr), answers)[stuck[pr]]) for pr in stuck}
    assert all(after[pr] >= 0.5 for pr in stuck), (before, after)
