#!/usr/bin/env python3
"""Evaluate a Diplomacy policy against fixed opponents on one process (the HF engine).

    python scripts/eval_diplomacy.py --config configs/cpu-diplomacy-tiny.yaml \
        [--checkpoint RUN_DIR/checkpoints/step-000150] [--out DIR] [--seed S] [--policy-bot KIND] \
        [--eval.opponents=random,greedy --eval.games=8 --eval.temperature=0 ...]

Builds the config's model and engine, loads the checkpoint's adapter (the base model's zero
adapter without one), runs `DiplomacyEnv.evaluate` and prints the metrics as JSON; saved games,
final boards and `results.json` go to --out. `--policy-bot` seats a bot in the policy's place
instead (the bots' own baseline). Any `--section.key=value` override applies to the config.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from colocate.checkpoint import check_adapter_matches, load_checkpoint  # noqa: E402
from colocate.config import load_config, parse_overrides  # noqa: E402
from colocate.engine.hf import HFEngine  # noqa: E402
from colocate.envs import env_corpus, make_env  # noqa: E402
from colocate.envs.diplomacy import evaluate as ev  # noqa: E402
from colocate.models import load_tokenizer  # noqa: E402
from colocate.models import build_policy  # noqa: E402


def parse_args(argv: list[str]):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--checkpoint", default="", help="a checkpoint directory (step-NNNNNN)")
    parser.add_argument("--out", default="", help="where saved games, boards and results.json go")
    parser.add_argument("--seed", type=int, default=0, help="seeds the bots' games and the engine's sampler")
    parser.add_argument("--policy-bot", default="", help="play this bot in the policy's seat instead")
    return parser.parse_known_args(argv)


def build_engine(cfg, checkpoint: str, seed: int):
    key, corpus_fn = env_corpus(cfg)
    tokenizer = load_tokenizer(cfg.model, corpus_fn, key)
    engine = HFEngine(build_policy(cfg, tokenizer, "cpu"), tokenizer, device="cpu", seed=seed)
    if checkpoint:
        state = load_checkpoint(checkpoint)
        check_adapter_matches(state["adapter"], engine.lora_state(), checkpoint)
        engine.load_lora(state["trainer_state"].get("version", 1), state["adapter"])
    return tokenizer, engine


def main(argv: list[str] | None = None) -> None:
    args, rest = parse_args(sys.argv[1:] if argv is None else argv)
    path, overrides, _ = parse_overrides(rest)
    cfg = load_config(path, overrides)
    if args.policy_bot:
        start = time.perf_counter()
        games = ev.new_games(list(cfg.eval.opponents), cfg.eval.games, cfg.eval.horizon_years, args.seed)
        ev.play(games, ev.BotPolicy(args.policy_bot))
        results = [ev.result(g) for g in games]
        metrics = ev.summarize(results, games)
        if args.out:
            ev.write_outputs(games, results, metrics, args.out)
    else:
        tokenizer, engine = build_engine(cfg, args.checkpoint, args.seed)
        env = make_env(cfg, tokenizer, seed=args.seed)
        start = time.perf_counter()
        with torch.no_grad():
            metrics = ev.evaluate(env, engine, cfg.eval, args.out or None, seed=args.seed)
    metrics["eval_s"] = time.perf_counter() - start
    print(json.dumps(metrics, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
