"""`--profile dataset_rollout`: output tokens/s of the dataset env's rollout through our engine
against plain vLLM with the old GSM8K rollout script's settings, on the same prompts (figures:
profiles/README.md).

Workload (the old script's): 16 questions x 8 samples = 128 sequences (`--questions` sets the
count: 64 fills an engine as the multi-GPU presets' 512 sequences do), 200-400-token prompts
(GSM8K-format word problems behind few-shot examples, through the chat template when the model
has one), unconstrained answers up to 500 tokens, temperature 1.
  vllm   `LLM(max_model_len=2048, CUDA graphs, chunked prefill, max_num_seqs=256 or every sequence,
         gpu_memory_utilization=0.95)`, one `generate` of the questions' prompts with n=8
  ours   `DatasetEnv` + `VLLMEngine` + `RolloutWorker.collect()` (`--questions` groups of 8: prompt ids,
         requests, engine, decoding, rewards), the engine sized as configs/gpu-gsm8k.yaml with the
         same max_model_len / max_num_seqs / memory fraction
  vllm_logprobs  plain vLLM asking what ours asks (the sampled token's log-prob after temperature,
         `logprobs_mode="processed_logprobs"`, no detokenizing): what ours asks costs vLLM alone
  vllm_ours_args  vllm_logprobs with our engine's `LLM` arguments (`llm_arguments`): what our
         engine settings cost without our loop around the engine
  vllm_fp8  plain vLLM as `vllm`, with vLLM's online FP8 (`quantization="fp8"`: the checkpoint's
         bf16 weights rounded to e4m3 at load, dynamic activation scales): the FP8 baseline
  ours+NAME  ours with the config overrides of `--variant NAME:section.key=value,...` (FP8:
         engine.quantization=fp8 with engine.lora_mode=slot or merged and a loss correction, which
         the config check asks for though a rollout trains nothing)
`--ratios A/B,...` adds each named pair's tokens/s ratio beside those against the first side (the
issue's FP8 figures come from one run: ours+fp8 against ours and against vllm_fp8).
Each side runs in its own process on GPU 0 (TP 1), one warm-up round, then `--rounds` timed
rounds. Each round's wall time splits into the engine's span (first request in to last answer
out; its engine steps) and the host work outside it (ours: prompts before, rewards and the batch
after). Ours also records its sampler's log-prob calls by function (`logprob_calls`: our kernel's
and vLLM's own). `--model-path` takes a local model; without it the random qwen2.5-7b shape is
written once under the cache (answers then run to the 500-token limit on both sides).
`--trace-dir DIR` traces each `ours` side's engine core in one more round after the timed ones (not
counted): its first `TRACE_STEPS` engine steps (a few of prefill, then decode) under torch.profiler,
written to DIR/<side>/ (`scripts/trace_summary.py` reads them).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

QUESTIONS, SAMPLES, MAX_TOKENS = 16, 8, 500
TRACE_STEPS = 64
"""Engine steps in the traced round's trace (`--trace-dir`)."""
SIDES = ("vllm", "vllm_fp8", "vllm_logprobs", "vllm_ours_args", "ours")
VLLM_SETTINGS = dict(max_model_len=2048, max_num_seqs=256, gpu_memory_utilization=0.95, enable_chunked_prefill=True)


def add_args(parser) -> None:
    parser.add_argument("--model-path", default="", help="local HF model directory (default: random 7B shape)")
    parser.add_argument("--shape", default="", help="random-weight model shape (default: the preset's, qwen2.5-7b)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--questions", type=int, default=QUESTIONS,
                        help=f"prompts a round, each sampled {SAMPLES} times (default: the old script's {QUESTIONS})")
    parser.add_argument("--sides", default="vllm,ours",
                        help=f"comma-separated, of {SIDES} and ours+NAME; the first is the baseline")
    parser.add_argument("--variant", nargs="*", default=[], help="NAME:section.key=value,... for the side ours+NAME")
    parser.add_argument("--ratios", default="", help="comma-separated A/B pairs of sides: A's tokens/s over B's")
    parser.add_argument("--trace-dir", default="", help="trace each ours side's engine core in one more, untimed "
                        "round, into DIR/<side>/")
    parser.add_argument("--side", default="", help="internal: run one side in this process")
    parser.add_argument("--data", default="")
    parser.add_argument("--result", default="")


def engine_sizing(questions: int) -> dict:
    """Both sides' engine sizing: the old script's, with room for every sequence of a round."""
    return VLLM_SETTINGS | {"max_num_seqs": max(VLLM_SETTINGS["max_num_seqs"], questions * SAMPLES)}


def write_workload(path: str, questions: int) -> None:
    """GSM8K-format rows whose question carries 4 worked examples first (200-400 prompt tokens)."""
    import random
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    from make_task_data import word_problem
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(questions * 4):
            shots = [word_problem(rng) for _ in range(4)]
            row = word_problem(rng)
            context = "\n\n".join(f"Question: {s['question']}\nAnswer: {s['answer']}" for s in shots)
            row["question"] = f"{context}\n\nQuestion: {row['question']}\nAnswer:"
            f.write(json.dumps(row) + "\n")


def deep_update(base: dict, extra: dict) -> dict:
    for k, v in extra.items():
        base[k] = deep_update(base.get(k, {}), v) if isinstance(v, dict) else v
    return base


def side_overrides(side: str, variants: list[str]) -> dict:
    """The config overrides of side `ours+NAME` (none for the others) as a nested dict."""
    from benchmarks.e2e import parse_variants
    from colocate.config import parse_overrides
    name = side.partition("+")[2]
    if not name:
        return {}
    items = parse_variants(variants).get(name)
    if items is None:
        raise SystemExit(f"--sides: {side!r} names a variant that no --variant defines")
    return parse_overrides([f"--{item}" for item in items])[1]


def config(args):
    from colocate.config import load_config
    model = {"path": args.model_path, **({"shape": args.shape} if args.shape else {})}
    sizing = engine_sizing(args.questions)
    return load_config("configs/gpu-gsm8k.yaml", deep_update({
        "model": model, "env": {"data_files": [args.data], "eval_files": []},
        "engine": {"max_new_tokens": MAX_TOKENS, "max_num_seqs": sizing["max_num_seqs"],
                   "max_model_len": sizing["max_model_len"],
                   "gpu_memory_utilization": sizing["gpu_memory_utilization"], "lora_mode": "merged"},
        "rollout": {"groups_per_step": args.questions, "group_size": SAMPLES, "batch_size": args.questions * SAMPLES,
                    "oversample_groups": 0, "stream": True}}, side_overrides(args.side, args.variant)))


def build(args):
    """cfg, tokenizer, model directory and the dataset env (one process, GPU 0)."""
    import torch

    from colocate.engine.model_dir import ensure_model_dir
    from colocate.envs import env_corpus, make_env
    from colocate.models import load_tokenizer
    cfg = config(args)
    key, corpus_fn = env_corpus(cfg)
    tokenizer = load_tokenizer(cfg.model, corpus_fn, key)
    model_dir = ensure_model_dir(cfg, tokenizer, torch.device("cuda:0"), is_writer=True)
    return cfg, tokenizer, model_dir, make_env(cfg, tokenizer, seed=0)


def side_ours(args) -> dict:
    from colocate.engine.vllm import VLLMEngine, lora_spec_for
    from colocate.engine.vllm_settings import engine_settings
    from colocate.envs import env_facts
    from colocate.rollout.worker import RolloutSettings, RolloutWorker
    cfg, tokenizer, model_dir, env = build(args)
    settings = traced(engine_settings(cfg, 1, seed=0, **env_facts(cfg)), args.trace_dir, args.side)
    engine = VLLMEngine(model_dir, lora_spec_for(cfg, tokenizer), tokenizer.eos_token_id, settings)
    worker = RolloutWorker(env, engine, RolloutSettings(groups_per_batch=cfg.rollout.groups_per_step,
                                                        stream=cfg.rollout.stream))
    rounds = []
    for i in range(args.rounds + 1):
        before = dict(engine.counters)
        t0 = time.perf_counter()
        batch, stats, engine_stats = worker.collect()
        wall = time.perf_counter() - t0
        if i:  # the first round warms up
            rounds.append({"wall_s": wall, "out_tokens": engine_stats["out_tokens"],
                           "engine_s": engine.counters["generate_s"] - before["generate_s"],
                           "engine_steps": engine.counters["steps"] - before["steps"],
                           "prompt_tokens_mean": float(batch.prompt_lens.float().mean()),
                           "sequences": batch.num_sequences})
    calls = engine.logprob_calls()
    if args.trace_dir:  # one more round, after the timed ones and not counted
        engine.start_profile()
        worker.collect()
        engine.stop_profile()
    return summarize(rounds) | {"logprob_calls": calls}


def traced(settings, trace_dir: str, side: str):
    """An ours side's engine settings, with its engine core's profiler on when `trace_dir` is given
    (`TRACE_STEPS` steps into trace_dir/side/)."""
    if not trace_dir:
        return settings
    return settings.replace(profile_dir=os.path.join(trace_dir, side), profile_steps=TRACE_STEPS)


def parse_ratios(text: str, names: list[str]) -> list[tuple[str, str]]:
    """'A/B,C/D' -> [(A, B), (C, D)], each a pair of distinct sides of the run."""
    pairs = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        a, sep, b = item.partition("/")
        if not sep or a not in names or b not in names or a == b:
            raise SystemExit(f"--ratios: {item!r} is not A/B with A and B two of --sides {','.join(names)}")
        pairs.append((a, b))
    return pairs


def side_vllm(args, logprobs: bool, ours_args: bool = False, quantization: str = "") -> dict:
    from vllm import LLM, SamplingParams

    from colocate.engine.vllm_settings import engine_settings, llm_arguments
    from colocate.envs import env_facts
    cfg, tokenizer, model_dir, env = build(args)
    if ours_args:
        llm = LLM(**llm_arguments(model_dir, engine_settings(cfg, 1, seed=0, **env_facts(cfg))))
    else:
        extra = {"logprobs_mode": "processed_logprobs"} if logprobs else {}
        if quantization:
            extra["quantization"] = quantization
        llm = LLM(model=model_dir, dtype="bfloat16", seed=0, **engine_sizing(args.questions), **extra)
    asks = {"logprobs": 0, "flat_logprobs": True, "detokenize": False} if logprobs else {}
    params = SamplingParams(n=SAMPLES, temperature=1.0, max_tokens=MAX_TOKENS, **asks)
    steps, engine_step = [0], llm.llm_engine.step

    def counted_step():
        steps[0] += 1
        return engine_step()
    llm.llm_engine.step = counted_step  # LLM.generate steps its engine through this attribute
    rounds = []
    column = env.settings.prompt_column
    for i in range(args.rounds + 1):
        # the env's own rows and prompt ids, in its order: the same prompts as ours
        prompts = [{"prompt_token_ids": env.chat.ids(env.next_row()[column])} for _ in range(args.questions)]
        steps[0] = 0
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        if i:
            rounds.append({"wall_s": wall, "out_tokens": sum(len(o.token_ids) for r in outputs for o in r.outputs),
                           "engine_s": wall, "engine_steps": steps[0],
                           "prompt_tokens_mean": sum(len(p["prompt_token_ids"]) for p in prompts) / len(prompts),
                           "sequences": sum(len(r.outputs) for r in outputs)})
    return summarize(rounds)


def summarize(rounds: list[dict]) -> dict:
    """Out tokens/s over the rounds; the engine's share (ms per engine step, steps per round) and
    the host work outside it per round."""
    tokens, wall = sum(r["out_tokens"] for r in rounds), sum(r["wall_s"] for r in rounds)
    engine_s, steps = sum(r["engine_s"] for r in rounds), sum(r["engine_steps"] for r in rounds)
    return {"out_tokens_per_s": tokens / wall, "engine_ms_per_step": 1e3 * engine_s / max(steps, 1),
            "engine_steps_per_round": steps / len(rounds), "outside_engine_s": (wall - engine_s) / len(rounds),
            "rounds": rounds}


def run_side(args) -> dict:
    if args.side == "ours" or args.side.startswith("ours+"):
        return side_ours(args)
    return side_vllm(args, logprobs=args.side not in ("vllm", "vllm_fp8"), ours_args=args.side == "vllm_ours_args",
                     quantization="fp8" if args.side == "vllm_fp8" else "")


def run(args) -> dict:
    if args.side:
        result = run_side(args)
        with open(args.result, "w") as f:
            json.dump(result, f)
        return {"figures": result}
    names = args.sides.split(",")
    if any(n not in SIDES and not n.startswith("ours+") for n in names) or len(set(names)) != len(names):
        raise SystemExit(f"--sides {args.sides!r}: distinct names of {SIDES} or ours+NAME")
    for n in names:
        side_overrides(n, args.variant)  # refuses an undefined variant before any process starts
    pairs = parse_ratios(args.ratios, names)
    tmp = tempfile.mkdtemp(prefix="dataset-rollout-")
    data = os.path.join(tmp, "workload.jsonl")
    write_workload(data, args.questions)
    sides = {}
    for side in names:
        out = os.path.join(tmp, f"{side}.json")
        cmd = [sys.executable, "scripts/benchmark.py", "--profile", "dataset_rollout", "--side", side,
               "--data", data, "--result", out, "--rounds", str(args.rounds), "--questions", str(args.questions),
               "--out", os.path.join(tmp, "x.json")]
        if args.model_path:
            cmd += ["--model-path", args.model_path]
        if args.shape:
            cmd += ["--shape", args.shape]
        if args.variant:
            cmd += ["--variant", *args.variant]
        if args.trace_dir and side.startswith("ours"):
            cmd += ["--trace-dir", os.path.abspath(args.trace_dir)]
        subprocess.run(cmd, check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
        with open(out) as f:
            sides[side] = json.load(f)
    base = names[0]
    rate = {n: sides[n]["out_tokens_per_s"] for n in names}
    return {"figures": {f"{n}_out_tokens_per_s": rate[n] for n in names if n != base} | {"detail": sides},
            "baseline": {f"{base}_out_tokens_per_s": rate[base]},
            "ratios": {f"{a}_vs_{b}": rate[a] / rate[b] for a, b in [(n, base) for n in names if n != base] + pairs}}
