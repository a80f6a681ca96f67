"""`--profile dataset_rollout`: output tokens/s of the dataset env's rollout through our engine
against plain vLLM with the old GSM8K rollout script's settings, on the same prompts (figures:
profiles/README.md).

Workload (the old script's): 16 questions x 8 samples = 128 sequences, 200-400-token prompts
(GSM8K-format word problems behind few-shot examples, through the chat template when the model
has one), unconstrained answers up to 500 tokens, temperature 1.
  vllm   `LLM(max_model_len=2048, CUDA graphs, chunked prefill, max_num_seqs=256,
         gpu_memory_utilization=0.95)`, one `generate` of the 16 prompts with n=8
  ours   `DatasetEnv` + `VLLMEngine` + `RolloutWorker.collect()` (16 groups of 8: prompt ids,
         requests, engine, decoding, rewards), the engine sized as configs/gpu-gsm8k.yaml with the
         same max_model_len / max_num_seqs / memory fraction
Each side runs in its own process on GPU 0 (TP 1), one warm-up round, then `--rounds` timed
rounds. `--model-path` takes a local model; without it the random qwen2.5-7b shape is written once
under the cache (answers then run to the 500-token limit on both sides).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

QUESTIONS, SAMPLES, MAX_TOKENS = 16, 8, 500
VLLM_SETTINGS = dict(max_model_len=2048, max_num_seqs=256, gpu_memory_utilization=0.95, enable_chunked_prefill=True)


def add_args(parser) -> None:
    parser.add_argument("--model-path", default="", help="local HF model directory (default: random 7B shape)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--side", default="", help="internal: run one side (ours / vllm) in this process")
    parser.add_argument("--data", default="")
    parser.add_argument("--result", default="")


def write_workload(path: str) -> None:
    """GSM8K-format rows whose question carries 4 worked examples first (200-400 prompt tokens)."""
    import random
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    from make_task_data import word_problem
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(QUESTIONS * 4):
            shots = [word_problem(rng) for _ in range(4)]
            row = word_problem(rng)
            context = "\n\n".join(f"Question: {s['question']}\nAnswer: {s['answer']}" for s in shots)
            row["question"] = f"{context}\n\nQuestion: {row['question']}\nAnswer:"
            f.write(json.dumps(row) + "\n")


def config(args):
    from colocate.config import load_config
    return load_config("configs/gpu-gsm8k.yaml", {
        "model": {"path": args.model_path}, "env": {"data_files": [args.data], "eval_files": []},
        "engine": {"max_new_tokens": MAX_TOKENS, "max_num_seqs": VLLM_SETTINGS["max_num_seqs"],
                   "max_model_len": VLLM_SETTINGS["max_model_len"],
                   "gpu_memory_utilization": VLLM_SETTINGS["gpu_memory_utilization"], "lora_mode": "merged"},
        "rollout": {"groups_per_step": QUESTIONS, "group_size": SAMPLES, "batch_size": QUESTIONS * SAMPLES,
                    "oversample_groups": 0, "stream": True}})


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
    from colocate.rollout.worker import RolloutWorker
    cfg, tokenizer, model_dir, env = build(args)
    engine = VLLMEngine(model_dir, lora_spec_for(cfg, tokenizer), tokenizer.eos_token_id,
                        engine_settings(cfg, 1, seed=0, **env_facts(cfg)))
    worker = RolloutWorker(env, engine, groups_per_batch=QUESTIONS, stream=cfg.rollout.stream)
    rounds = []
    for i in range(args.rounds + 1):
        t0 = time.perf_counter()
        batch, stats, engine_stats = worker.collect()
        wall = time.perf_counter() - t0
        if i:  # the first round warms up
            rounds.append({"wall_s": wall, "out_tokens": engine_stats["out_tokens"],
                           "prompt_tokens_mean": float(batch.prompt_lens.float().mean()),
                           "sequences": batch.num_sequences})
    return summarize(rounds)


def side_vllm(args) -> dict:
    from vllm import LLM, SamplingParams
    cfg, tokenizer, model_dir, env = build(args)
    llm = LLM(model=model_dir, dtype="bfloat16", seed=0, **VLLM_SETTINGS)
    params = SamplingParams(n=SAMPLES, temperature=1.0, max_tokens=MAX_TOKENS)
    rounds = []
    for i in range(args.rounds + 1):
        # the env's own rows and prompt ids, in its order: the same prompts as ours
        prompts = [{"prompt_token_ids": env.chat.ids(env.next_row()[env.prompt_column])} for _ in range(QUESTIONS)]
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        if i:
            rounds.append({"wall_s": wall, "out_tokens": sum(len(o.token_ids) for r in outputs for o in r.outputs),
                           "prompt_tokens_mean": sum(len(p["prompt_token_ids"]) for p in prompts) / len(prompts),
                           "sequences": sum(len(r.outputs) for r in outputs)})
    return summarize(rounds)


def summarize(rounds: list[dict]) -> dict:
    tokens, wall = sum(r["out_tokens"] for r in rounds), sum(r["wall_s"] for r in rounds)
    return {"out_tokens_per_s": tokens / wall, "rounds": rounds}


def run(args) -> dict:
    if args.side:
        result = side_ours(args) if args.side == "ours" else side_vllm(args)
        with open(args.result, "w") as f:
            json.dump(result, f)
        return {"figures": result}
    tmp = tempfile.mkdtemp(prefix="dataset-rollout-")
    data = os.path.join(tmp, "workload.jsonl")
    write_workload(data)
    sides = {}
    for side in ("vllm", "ours"):
        out = os.path.join(tmp, f"{side}.json")
        cmd = [sys.executable, "scripts/benchmark.py", "--profile", "dataset_rollout", "--side", side,
               "--data", data, "--result", out, "--rounds", str(args.rounds), "--out", os.path.join(tmp, "x.json")]
        if args.model_path:
            cmd += ["--model-path", args.model_path]
        subprocess.run(cmd, check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
        with open(out) as f:
            sides[side] = json.load(f)
    ratio = sides["ours"]["out_tokens_per_s"] / sides["vllm"]["out_tokens_per_s"]
    return {"figures": {"ours_out_tokens_per_s": sides["ours"]["out_tokens_per_s"], "detail": sides},
            "baseline": {"vllm_out_tokens_per_s": sides["vllm"]["out_tokens_per_s"]},
            "ratios": {"ours_vs_vllm": ratio}}
