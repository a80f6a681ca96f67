"""Write tests/data/collapse-step2300.{safetensors,json}: the adapter of a collapsed cpu-tiny run
(issue 39: `configs/cpu-tiny.yaml --learner.num_steps=3000`, checkpoint step 2300) and one batch
sampled from it (16 groups of 8 over the 25 prompts, seeded), for `tests/test_collapse_replay.py`.

    python scripts/dump_collapse_state.py RUN_DIR/checkpoints/step-002300

The batch is drawn here (not recorded in the run): each completion is " <digit>" then EOS under the
answer constraint, sampled from the adapter's own constrained distribution, with its per-token
log-probs as the behaviour log-probs (lag 0) and GRPO advantages from `data.group_advantages`.
"""
from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from colocate.config import load_config  # noqa: E402
from colocate.data import Completion, Sample, group_advantages  # noqa: E402
from colocate.envs import env_corpus  # noqa: E402
from colocate.envs.arithmetic import ArithmeticEnv, prompt_text  # noqa: E402
from colocate.models import load_tokenizer  # noqa: E402
from colocate.models import build_policy  # noqa: E402
from tests.collapse_policy import answer_logprobs, load_adapter  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data")


def main(checkpoint: str) -> None:
    cfg = load_config("configs/cpu-tiny.yaml")
    key, fn = env_corpus(cfg)
    tok = load_tokenizer(cfg.model, fn, key)
    model = build_policy(cfg, tok, torch.device("cpu")).eval()
    adapter = load_file(os.path.join(checkpoint, "adapter_model.safetensors"))
    load_adapter(model, adapter)
    env = ArithmeticEnv.from_config(cfg, tok, 0)
    answers, eos = env.constraint.slots[0], tok.eos_token_id
    g = torch.Generator().manual_seed(0)
    samples, answer_of = [], {}
    for group in range(cfg.rollout.groups_per_step):
        a, b = divmod(int(torch.randint(0, 25, (1,), generator=g)), 5)
        ids = env.chat.ids(prompt_text(a, b))
        steps = answer_logprobs(model, ids, answers)  # [9, 2] per-token log-probs of each answer
        probs = steps.sum(1).exp()
        for _ in range(cfg.rollout.group_size):
            k = int(torch.multinomial(probs, 1, generator=g))
            completion = Completion(token_ids=answers[k] + [eos], logprobs=steps[k].tolist() + [0.0],
                                    allowed_ids=[[answers[0][0]], [s[1] for s in answers], [eos]], version=2300)
            samples.append(Sample(prompt_ids=ids, completion=completion, reward=float(k == a + b), group_key=group))
            answer_of[id(samples[-1])] = a + b
    adv = group_advantages(samples)
    rows = [{"prompt": s.prompt_ids, "completion": s.completion.token_ids, "logprobs": s.completion.logprobs,
             "allowed": s.completion.allowed_ids, "reward": s.reward, "advantage": a, "group": s.group_key,
             "answer": answer_of[id(s)]}
            for s, a in zip(samples, adv)]
    os.makedirs(OUT, exist_ok=True)
    save_file({k: v.contiguous() for k, v in adapter.items()}, os.path.join(OUT, "collapse-step2300.safetensors"))
    with open(os.path.join(OUT, "collapse-step2300.json"), "w") as f:
        json.dump({"source": "cpu-tiny --learner.num_steps=3000, checkpoint step 2300 (issue 39)", "samples": rows}, f)
    print(f"wrote {OUT}/collapse-step2300.*: {len(rows)} samples")


if __name__ == "__main__":
    main(sys.argv[1])
