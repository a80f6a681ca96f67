"""`--profile env`: Diplomacy phases per second, our env path against a naive one, same process.

Both paths play the same workload with a uniformly random legal policy: groups of G continuations
forked from one start state (the opening, or a random mid-game state of the committed cache),
`horizon_years` years each; every phase builds every power's prompt and constraint, samples,
decodes and parses the completion, sets the orders and processes the phase. Rates are phases per
wall second and per CPU second of this process (the latter is robust on a machine shared with
other jobs; the 1-minute load average is recorded).

  ours      DiplomacyEnv: `fork_game`, legal orders once per game phase (and once per group at the
            fork phase), memoized piecewise tokenization, `set_orders(expand=False)` on
            engine-format orders.
  baseline  the straightforward version of the same loop: deepcopy + clear_cache per fork,
            `get_all_possible_orders()` per power, the HF tokenizer called per prompt and per unit's
            choices, `set_orders` with expansion.

Forced tokens: over one phase of every power in `--groups` mid-game groups (order lines without
units, as the GPU presets), with the random legal policy, the share of sampled tokens the
constraint alone decides (`constraint.forced_positions`), and per game phase the longest
completion (the answer a streamed game waits for) in all tokens and in choice tokens only: the
decode steps jump-forward decoding would leave on that critical path.

Prefill: the e2e workload's prompts (order lines without units, 4 years, G = 2) through an ideal
prefix cache (vLLM's: 16-token blocks hashed with everything before them, never evicted): prompt
tokens, the share a cache serves, and the tokens left to prefill per request, with the supports
and convoys listed (the default) and without (`env.list_supports=false`). On 4 x H200 the engines'
measured hit rate (57.5 %) matched this model's 56 %, and the rollout is bound by that prefill.

Feeding loop: `RolloutWorker.collect` on the one-GPU workload against an engine that answers at
once (`feed_stats`): the CPU ms per request of the process that feeds the engine, with the env in
that process (baseline) and in `--feed-processes` copies (`env.processes`, ours).

The heap left by the imports is frozen first (`gc.freeze()`): otherwise a full GC pass (~0.3 s)
lands at random in one path. Also times forking one mid-game state into 8 clones (ours, deepcopy +
clear_cache, Game() + set_state) on a game with 27 phases of history and on a cache-loaded state
(no history, where deepcopy is cheap: the forks' share of the baseline is small there).
"""
from __future__ import annotations

import copy
import gc
import os
import random
import statistics
import time

from benchmarks.common import median_time


def add_args(parser) -> None:
    parser.add_argument("--groups", type=int, default=12, help="groups per workload and path")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--horizon-years", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3, help="alternating baseline/ours rounds (median)")
    parser.add_argument("--feed-processes", type=int, default=2, help="env.processes of the feeding-loop part")
    parser.add_argument("--feed-batches", type=int, default=2, help="batches per feeding-loop job (after one warm-up)")


class InstantStreamEngine:
    """A streamed engine that answers at once: each poll hands back up to 8 of the pending requests,
    chosen at random, with random legal answers; `submit` asks each request's Constraint for its
    automaton, as the vLLM engine's does (cached when an env process built it)."""
    version = 0

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.pending: dict = {}
        self.next = 0

    def submit(self, requests):
        for r in requests:
            if r.constraint is not None and r.constraint.slots:
                r.constraint.table()
        tickets = list(range(self.next, self.next + len(requests)))
        self.next += len(requests)
        self.pending.update(zip(tickets, requests))
        return tickets

    def poll(self, wait_all=False, wake=None):
        from colocate.envs.diplomacy import random_legal_completion
        tickets = list(self.pending)
        self.rng.shuffle(tickets)
        return [(t, random_legal_completion(self.pending.pop(t), self.rng))
                for t in (tickets if wait_all else tickets[:8])]

    def stats(self):
        return {}


def feed_stats(tokenizer, processes: int, batches: int, groups: int, seed: int) -> dict:
    """The loop that feeds the engine on the one-GPU Diplomacy workload (gpu.yaml's env: cached
    mid-game forks, order lines without units, supports unlisted, 4 years, G = 2; `groups` per batch
    and a quarter more oversampled, streamed), `RolloutWorker.collect` against `InstantStreamEngine`:
    this process's CPU ms and wall ms per request, with the env in this process (`processes` 0) or
    in that many copies (`env.processes`). One warm-up batch first."""
    from colocate.config import Config
    from colocate.envs import make_env
    from colocate.rollout.worker import RolloutSettings, RolloutWorker
    cfg = Config()
    cfg.env.name, cfg.env.horizon_years, cfg.env.unit_labels, cfg.env.list_supports = "diplomacy", 4, False, False
    cfg.env.state_cache = "colocate/envs/diplomacy/states.jsonl"
    cfg.rollout.group_size = 2
    env = make_env(cfg, tokenizer, seed=seed, processes=processes)
    engine = InstantStreamEngine(seed)
    worker = RolloutWorker(env, engine,
                           RolloutSettings(groups_per_batch=groups, oversample=max(groups // 4, 1), stream=True))
    try:
        worker.collect()
        submitted = engine.next
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(batches):
            worker.collect()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        env.close()
    requests = engine.next - submitted
    return {"requests": requests, "cpu_ms_per_request": 1e3 * cpu / requests, "wall_ms_per_request": 1e3 * wall / requests}


def load_embedded_tokenizer():
    from colocate.config import ModelConfig
    from colocate.envs import diplomacy
    from colocate.models import load_tokenizer
    return load_tokenizer(ModelConfig(), diplomacy.corpus, f"diplomacy-{diplomacy.CORPUS_VERSION}")


def play_random(env, rng):
    """Play every started game to its end with the random legal policy; yields each round's
    [(key, request)] before answering it."""
    from colocate.envs.diplomacy import random_legal_completion
    while keyed := env.requests():
        yield keyed
        env.step({key: random_legal_completion(request, rng) for key, request in keyed})
        env.pop_finished()


def run_ours(tokenizer, starts, group_size, horizon_years, seed) -> tuple[float, float, int, dict]:
    """(wall s, CPU s, phases, env metrics) of playing one group per start state with DiplomacyEnv."""
    from colocate.envs.diplomacy import DiplomacyEnv, DiplomacySettings
    env = DiplomacyEnv(tokenizer, DiplomacySettings(group_size=group_size, horizon_years=horizon_years), seed=seed)
    rng = random.Random(seed)
    t0, c0 = time.perf_counter(), time.process_time()
    for group_id, state in enumerate(starts):
        env.start_states = [state] if state is not None else None
        env.start_group(group_id)
    for _ in play_random(env, rng):
        pass
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    metrics = env.metrics()
    return wall, cpu, int(metrics["phases_processed"]), metrics


def naive_phase(game, tokenizer, rng) -> None:
    """One phase the straightforward way: per power legal orders, prompt, tokenize, sample, parse."""
    from colocate.envs.diplomacy import game as dg
    from colocate.envs.diplomacy.orders import parse_orders
    from colocate.envs.diplomacy.prompt import INSTRUCTION, board_lines, own_lines, power_orders
    eos = tokenizer.eos_token_id
    for power in dg.POWERS:
        per_loc = dg.legal_orders_baseline(game, power)
        orders = power_orders(game, {power: per_loc}).get(power) if per_loc else None
        if orders is None:
            continue
        text = INSTRUCTION + "".join(board_lines(game)) + "".join(own_lines(orders))
        tokenizer(text, add_special_tokens=False)  # the prompt ids the engine would get
        ids = []
        for choices in orders.choices:
            slot = tokenizer([f"{o}\n" for o in choices], add_special_tokens=False)["input_ids"]
            ids.extend(rng.choice(slot))
        ids.append(eos)
        parsed = parse_orders(tokenizer.decode(ids[:-1]), orders)
        game.set_orders(power, parsed.orders)
    game.process()


def run_baseline(tokenizer, starts, group_size, horizon_years, seed) -> tuple[float, float, int]:
    """(wall s, CPU s, phases) of the same workload the naive way."""
    from colocate.envs.diplomacy import game as dg
    rng = random.Random(seed)
    phases = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for state in starts:
        root = dg.game_from_state(state) if state is not None else dg.new_game()
        key = dg.phase_key(root.get_current_phase())
        end_key = (key[0] + horizon_years, key[1], key[2])
        for game in [dg.fork_game_baseline(root) for _ in range(group_size)]:
            owners, last_change = dg.centre_owners(game), key[0]
            while True:
                naive_phase(game, tokenizer, rng)
                phases += 1
                if game.is_game_done:
                    break
                now = dg.phase_key(game.get_current_phase())
                if dg.centre_owners(game) != owners:
                    owners, last_change = dg.centre_owners(game), now[0]
                if now >= end_key or now[0] - last_change >= 2:
                    break
    return time.perf_counter() - t0, time.process_time() - c0, phases


def fork_timings(states, quick: bool) -> tuple[dict, dict]:
    """ms to fork 8 clones: ours vs deepcopy + clear_cache vs Game() + set_state."""
    from colocate.envs.diplomacy import game as dg
    rng = random.Random(0)
    played = dg.new_game()  # a played game carries 27 phases of history at S1910M
    while dg.phase_key(played.get_current_phase()) < (1910, 0, 0):
        for power, per_loc in dg.legal_orders(played).items():
            played.set_orders(power, [rng.choice(v) for v in per_loc.values()])
        played.process()
    loaded = dg.game_from_state(max(states, key=lambda s: dg.phase_key(s["name"])))
    ours, base = {}, {}
    for tag, game in (("played_S1910M", played), ("cache_loaded", loaded)):
        ours[f"fork8_ms_{tag}"] = 1e3 * median_time(lambda: [dg.fork_game(game) for _ in range(8)], iters=50)
        iters = 1 if quick and tag.startswith("played") else 3
        base[f"fork8_ms_deepcopy_{tag}"] = 1e3 * median_time(
            lambda: [dg.fork_game_baseline(game) for _ in range(8)], warmup=1, iters=iters)
        state = game.get_state()
        base[f"fork8_ms_set_state_{tag}"] = 1e3 * median_time(
            lambda: [dg.game_from_state(state) for _ in range(8)], iters=10)
    base["fork8_ms_deepcopy_single_played"] = 1e3 * median_time(lambda: copy.deepcopy(played), warmup=0, iters=1)
    return ours, base


def forced_token_stats(tokenizer, starts, group_size: int, seed: int) -> dict:
    """Forced-token share and the per-phase longest completion (all / choice tokens); see above."""
    from colocate.constraint import forced_positions
    from colocate.envs.diplomacy import DiplomacyEnv, DiplomacySettings, random_legal_completion
    env = DiplomacyEnv(tokenizer, DiplomacySettings(group_size=group_size, horizon_years=1, unit_labels=False),
                       seed=seed)
    for group_id, state in enumerate(starts):
        env.start_states = [state]
        env.start_group(group_id)
    rng = random.Random(seed)
    total = forced = 0
    longest: dict = {}  # (group, continuation) -> [all tokens, choice tokens] of its longest answer
    for key, request in env.requests():
        ids = random_legal_completion(request, rng).token_ids
        marks = forced_positions(request.constraint, ids)
        total, forced = total + len(marks), forced + sum(marks)
        best = longest.setdefault(key[:2], [0, 0])
        best[0], best[1] = max(best[0], len(marks)), max(best[1], len(marks) - sum(marks))
    return {"forced_token_share": forced / max(total, 1),
            "phase_longest_tokens": statistics.mean(b[0] for b in longest.values()),
            "phase_longest_choice_tokens": statistics.mean(b[1] for b in longest.values())}


def prefill_stats(tokenizer, starts, group_size: int, seed: int, list_supports: bool, block: int = 16) -> dict:
    """Prompt tokens per request and what an ideal block prefix cache leaves to prefill (see above)."""
    from colocate.envs.diplomacy import DiplomacyEnv, DiplomacySettings
    settings = DiplomacySettings(group_size=group_size, horizon_years=4, unit_labels=False, list_supports=list_supports)
    env = DiplomacyEnv(tokenizer, settings, seed=seed)
    for group_id, state in enumerate(starts):
        env.start_states = [state]
        env.start_group(group_id)
    cache: set = set()
    requests = prompt_tokens = cached_tokens = 0
    for keyed in play_random(env, random.Random(seed)):
        for _, request in keyed:
            ids, h, hit = request.prompt_ids, 0, True
            for start in range(0, len(ids) - len(ids) % block, block):
                h = hash((h, tuple(ids[start:start + block])))
                hit = hit and h in cache
                cached_tokens += block if hit else 0
                cache.add(h)
            requests, prompt_tokens = requests + 1, prompt_tokens + len(ids)
    return {"requests": requests, "prompt_tokens_mean": prompt_tokens / max(requests, 1),
            "prefix_cache_hit_rate": cached_tokens / max(prompt_tokens, 1),
            "prefill_tokens_per_request": (prompt_tokens - cached_tokens) / max(requests, 1)}


def run(args) -> dict:
    from colocate.envs.diplomacy import game as dg
    tokenizer = load_embedded_tokenizer()
    states = dg.load_state_cache(dg.__file__.replace("game.py", "states.jsonl"))
    # torch + transformers leave ~10^6 objects behind; one full GC pass over them costs ~0.3 s and
    # lands at random inside one path or the other. Freeze them (as a long-running worker should).
    gc.collect()
    gc.freeze()
    groups = 2 if args.quick else args.groups
    rounds = 1 if args.quick else args.rounds
    figures, baseline, ratios = {}, {}, {}
    rng = random.Random(0)
    workloads = {"opening": [None] * groups, "midgame": [rng.choice(states) for _ in range(groups)]}
    run_ours(tokenizer, workloads["midgame"][:1], 2, 1, seed=99)  # warm the token memo and the map
    figures["load_average_1min_start"] = os.getloadavg()[0]
    for name, starts in workloads.items():
        rates = {"ours": [], "ours_cpu": [], "base": [], "base_cpu": []}
        last = {}
        for r in range(rounds):
            wall, cpu, phases = run_baseline(tokenizer, starts, args.group_size, args.horizon_years, seed=r)
            rates["base"].append(phases / wall)
            rates["base_cpu"].append(phases / cpu)
            wall, cpu, phases, last = run_ours(tokenizer, starts, args.group_size, args.horizon_years, seed=r)
            rates["ours"].append(phases / wall)
            rates["ours_cpu"].append(phases / cpu)
        med = {k: statistics.median(v) for k, v in rates.items()}
        figures[f"{name}_phases_per_s"] = med["ours"]
        figures[f"{name}_phases_per_cpu_s"] = med["ours_cpu"]
        baseline[f"{name}_phases_per_s"] = med["base"]
        baseline[f"{name}_phases_per_cpu_s"] = med["base_cpu"]
        ratios[f"{name}_phases_per_s"] = med["ours"] / med["base"]
        ratios[f"{name}_phases_per_cpu_s"] = med["ours_cpu"] / med["base_cpu"]
        for key in ("build_ms_per_phase", "process_ms_per_phase", "parse_ms_per_completion", "fork_ms",
                    "prompt_tokens_mean", "prompt_tokens_max", "orders_tokens_max", "invalid_order_rate"):
            figures[f"{name}_{key}"] = last[key]
        figures[f"{name}_phases_per_round"] = last["phases_processed"]
    figures["load_average_1min_end"] = os.getloadavg()[0]
    figures.update({f"midgame_{k}": v for k, v in
                    forced_token_stats(tokenizer, workloads["midgame"], args.group_size, seed=0).items()})
    prefill_starts = workloads["midgame"][:2 if args.quick else 16]
    for list_supports, tag in ((True, "supports_listed"), (False, "supports_unlisted")):
        figures.update({f"prefill_{tag}_{k}": v for k, v in
                        prefill_stats(tokenizer, prefill_starts, 2, seed=0, list_supports=list_supports).items()})
    ratios["prefill_per_request_unlisted_over_listed"] = (figures["prefill_supports_unlisted_prefill_tokens_per_request"]
                                                          / figures["prefill_supports_listed_prefill_tokens_per_request"])
    feed_groups, feed_batches = (4, 1) if args.quick else (32, args.feed_batches)
    here = feed_stats(tokenizer, 0, feed_batches, feed_groups, seed=0)
    there = feed_stats(tokenizer, args.feed_processes, feed_batches, feed_groups, seed=0)
    for key in ("cpu_ms_per_request", "wall_ms_per_request"):
        baseline[f"feed_{key}_in_process"] = here[key]
        figures[f"feed_{key}_processes{args.feed_processes}"] = there[key]
        ratios[f"feed_{key}_processes{args.feed_processes}_vs_in_process"] = here[key] / there[key]
    figures["feed_requests"] = there["requests"]
    fork_ours, fork_base = fork_timings(states, args.quick)
    figures.update(fork_ours)
    baseline.update(fork_base)
    for tag in ("played_S1910M", "cache_loaded"):
        ratios[f"fork8_{tag}_vs_deepcopy"] = fork_base[f"fork8_ms_deepcopy_{tag}"] / fork_ours[f"fork8_ms_{tag}"]
    figures.update(groups=groups, group_size=args.group_size, horizon_years=args.horizon_years, rounds=rounds)
    return {"figures": figures, "baseline": baseline, "ratios": ratios}
