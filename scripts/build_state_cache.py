#!/usr/bin/env python3
"""Build a warm-start library of mid-game Diplomacy states: `env.state_cache` points at the output.

Plays seeded games with a simple greedy-random policy (each unit moves into a supply centre its
power does not own when it can, with probability --greed; otherwise a uniformly random legal order)
and keeps a few movement-phase states per game between --first-year and --last-year. Each output
line is one `Game.get_state()` dict (the package's own state format, JSON; never pickle); the file
is checked by loading it back exactly as the env does.

    python scripts/build_state_cache.py --out colocate/envs/diplomacy/states.jsonl --num-games 40
"""
import argparse
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from colocate.envs.diplomacy import game as dg  # noqa: E402


def greedy_orders(game, rng: random.Random, greed: float) -> dict[str, list[str]]:
    centres = set(game.map.scs)
    out = {}
    for power, per_loc in dg.legal_orders(game).items():
        owned = set(game.powers[power].centers)
        chosen = []
        for orders in per_loc.values():
            grabs = [o for o in orders if " - " in o and " S " not in o and " C " not in o
                     and o.split(" - ")[-1].split()[0][:3] in centres - owned]
            builds = [o for o in orders if o.endswith(" B")]
            if grabs and rng.random() < greed:
                chosen.append(rng.choice(grabs))
            elif builds:
                chosen.append(rng.choice(builds))
            else:
                chosen.append(rng.choice(orders))
        out[power] = chosen
    return out


def play_game(rng: random.Random, args) -> list[dict]:
    game = dg.new_game()
    candidates = []
    while not game.is_game_done:
        phase = game.get_current_phase()
        year = dg.phase_key(phase)[0]
        if year > args.last_year:
            break
        if year >= args.first_year and phase.endswith("M"):
            state = game.get_state()
            state.pop("timestamp", None)  # wall-clock: keeps the file reproducible from the seed
            candidates.append(state)
        for power, orders in greedy_orders(game, rng, args.greed).items():
            game.set_orders(power, orders)
        game.process()
    return rng.sample(candidates, min(args.states_per_game, len(candidates)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="colocate/envs/diplomacy/states.jsonl")
    parser.add_argument("--num-games", type=int, default=40)
    parser.add_argument("--states-per-game", type=int, default=4)
    parser.add_argument("--first-year", type=int, default=1902)
    parser.add_argument("--last-year", type=int, default=1910)
    parser.add_argument("--greed", type=float, default=0.6, help="probability of grabbing a centre when possible")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    states = []
    for _ in range(args.num_games):
        states.extend(play_game(rng, args))
    dg.save_state_cache(args.out, states)
    loaded = dg.load_state_cache(args.out)  # the same check the env runs
    years = sorted(dg.phase_key(s["name"])[0] for s in loaded)
    print(f"wrote {len(loaded)} states ({os.path.getsize(args.out) / 1024:.0f} KiB) to {args.out}; "
          f"years {years[0]}-{years[-1]}, median {years[len(years) // 2]}")


if __name__ == "__main__":
    main()
