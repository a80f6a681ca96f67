"""Write the small prompt datasets the dataset env ships with (`examples/data/`).

    python scripts/make_task_data.py [--out examples/data]

  * addition-train.jsonl / addition-eval.jsonl: "add 3 and 4 ; answer :" -> "7", every pair of
    operands in 0..max_operand (the task of configs/cpu-dataset-tiny.yaml; a task this small has no
    unseen sums, so the eval file holds the same pairs in another order);
  * gsm8k-mini-train.jsonl / gsm8k-mini-test.jsonl: word problems over small numbers in GSM8K's
    format ({"question", "answer"} with the answer ending in "#### N"), for trying configs/gpu-gsm8k.yaml's
    plumbing without the real files.
Deterministic: the same files every time.
"""
from __future__ import annotations

import argparse
import json
import os
import random

NAMES = ["Ava", "Ben", "Cleo", "Dev", "Emma", "Finn", "Gia", "Hugo"]
ITEMS = ["apples", "stickers", "marbles", "books", "shells", "cards"]


def addition_rows(max_operand: int) -> list[dict]:
    return [{"prompt": f"add {a} and {b} ; answer :", "answer": str(a + b)}
            for a in range(max_operand + 1) for b in range(max_operand + 1)]


def word_problem(rng: random.Random) -> dict:
    """One GSM8K-style problem: two steps over small numbers, the reasoning and '#### N'."""
    name, other, item = rng.choice(NAMES), rng.choice(NAMES), rng.choice(ITEMS)
    has, buys, gives = rng.randint(2, 20), rng.randint(1, 10), rng.randint(1, 5)
    gives = min(gives, has + buys)
    total = has + buys - gives
    question = (f"{name} has {has} {item}. {name} buys {buys} more {item} and then gives {gives} {item} "
                f"to {other}. How many {item} does {name} have now?")
    answer = (f"{name} has {has} + {buys} = <<{has}+{buys}={has + buys}>>{has + buys} {item} after buying.\n"
              f"After giving {gives} away, {name} has {has + buys} - {gives} = "
              f"<<{has + buys}-{gives}={total}>>{total} {item}.\n#### {total}")
    return {"question": question, "answer": answer}


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def write_all(out: str, max_operand: int = 4, word_problems: int = 200) -> dict[str, str]:
    """Every file under `out` -> {name: path}."""
    os.makedirs(out, exist_ok=True)
    rng = random.Random(0)
    train = addition_rows(max_operand)
    held = list(train)
    rng.shuffle(held)
    problems = [word_problem(rng) for _ in range(word_problems)]
    cut = word_problems * 4 // 5
    files = {"addition-train.jsonl": train, "addition-eval.jsonl": held,
             "gsm8k-mini-train.jsonl": problems[:cut], "gsm8k-mini-test.jsonl": problems[cut:]}
    for name, rows in files.items():
        write_jsonl(os.path.join(out, name), rows)
    return {name: os.path.join(out, name) for name in files}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join("examples", "data"))
    parser.add_argument("--max-operand", type=int, default=4)
    parser.add_argument("--word-problems", type=int, default=200)
    args = parser.parse_args()
    for name, path in write_all(args.out, args.max_operand, args.word_problems).items():
        print(path)


if __name__ == "__main__":
    main()
