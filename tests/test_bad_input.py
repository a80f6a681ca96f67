"""Every bad input is one clear line and exit code 2 before any process group or model exists.

`CASES` is the catalogue (`CONFIG_CASES`, then `USER_CASES`: users' files and code): (id,
config file text or None for the shipped cpu-tiny.yaml, overrides,
text the message must contain). Each runs through `rank_config.configure`, what every rank and
`--check` run first; `docs/errors.md` lists the same cases with their messages
(`python scripts/bad_inputs.py` rewrites it).
"""
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

TINY = os.path.join(REPO, "configs", "cpu-tiny.yaml")

CONFIG_CASES = [
    # the file itself
    ("missing file", "<missing>", [], "config file not found"),
    ("config is a directory", "<dir>", [], "is a directory, not a regular file"),
    ("base is a device", "base: /dev/zero\nlearner:\n  lr: 0.001\n", [], "is a character device, not a regular file"),
    ("empty config", "", [], "is empty (or only comments)"),
    ("alias bomb in env.options", "env:\n  options:\n" + "".join(
        f"    k{i}: &a{i} [{', '.join([f'*a{i - 1}' if i else 'x'] * 9)}]\n" for i in range(9)), [], "expand to more than"),
    ("corrupt YAML", "model: [unclosed\n", [], "YAML"),
    ("binary file", b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", [], "not a UTF-8 text file"),
    ("YAML list at the top", "- a\n- b\n", [], "mapping"),
    ("unknown section", "modle:\n  shape: tiny\n", [], "did you mean 'model'"),
    ("unknown key", "model:\n  shap: tiny\n", [], "did you mean 'model.shape'"),
    ("section not a mapping", "model: 3\n", [], "model"),
    ("unknown override key", None, ["--learner.lrr=1"], "did you mean 'learner.lr'"),
    ("retired key", "engine:\n  kv_cache_dtype: fp8\n", [], "'engine.kv_cache_dtype' left colocate"),
    ("override without section", None, ["--lr=1"], "--section.key=value"),
    ("override without value", None, ["--learner.lr"], "no value"),
    ("bare argument", None, ["learner.lr=1"], "--section.key=value"),
    ("wrong type int", None, ["--learner.num_steps=ten"], "learner.num_steps"),
    ("wrong type bool", None, ["--checkpoint.enabled=maybe"], "checkpoint.enabled"),
    # model
    ("model dir missing", None, ["--model.path=/nonexistent/model"], "model.path"),
    ("model dir without config.json", None, ["--model.path=<emptydir>"], "config.json"),
    ("model config.json invalid", None, ["--model.path=<badmodel>"], "config.json: unreadable or corrupt JSON"),
    ("unknown shape", None, ["--model.shape=llama-70b"], "model.shape"),
    ("unknown dtype", None, ["--model.dtype=float8"], "model.dtype"),
    # lora
    ("lora rank 0", None, ["--lora.rank=0"], "lora.rank"),
    ("lora rank negative", None, ["--lora.rank=-4"], "lora.rank"),
    ("lora alpha 0", None, ["--lora.alpha=0"], "lora.alpha"),
    ("lora alpha nan", None, ["--lora.alpha=nan"], "lora.alpha"),
    ("lora dropout 1.5", None, ["--lora.dropout=1.5"], "lora.dropout"),
    ("lora dropout negative", None, ["--lora.dropout=-0.1"], "lora.dropout"),
    ("lora unknown target", None, ["--lora.target_modules=no_such_proj"], "did you mean"),
    ("lora no targets", None, ["--lora.target_modules=[]"], "lora.target_modules"),
    # engine
    ("engine kind", None, ["--engine.kind=tgi"], "engine.kind"),
    ("temperature nan", None, ["--engine.temperature=.nan"], "engine.temperature"),
    ("temperature inf", None, ["--engine.temperature=inf"], "engine.temperature"),
    ("temperature 0", None, ["--engine.temperature=0"], "engine.temperature"),
    ("temperature negative", None, ["--engine.temperature=-1"], "engine.temperature"),
    ("max_new_tokens 0", None, ["--engine.max_new_tokens=0"], "engine.max_new_tokens"),
    ("max_new_tokens negative", None, ["--engine.max_new_tokens=-1"], "engine.max_new_tokens"),
    ("gpu memory over 1", None, ["--engine.gpu_memory_utilization=1.5"], "engine.gpu_memory_utilization"),
    ("gpu memory 0", None, ["--engine.gpu_memory_utilization=0"], "engine.gpu_memory_utilization"),
    ("max_num_seqs 0", None, ["--engine.max_num_seqs=0"], "engine.max_num_seqs"),
    ("max_model_len negative", None, ["--engine.max_model_len=-5"], "engine.max_model_len"),
    ("max_model_len beyond the model's positions", None, ["--engine.max_model_len=100000"],
     "engine.max_model_len=100000 exceeds the 2048 positions of model.shape=tiny"),
    ("lora mode", None, ["--engine.lora_mode=fused"], "engine.lora_mode"),
    ("cudagraph mode", None, ["--engine.cudagraph_mode=SOMETIMES"], "engine.cudagraph_mode"),
    ("max_capture_tokens negative", None, ["--engine.max_capture_tokens=-1"], "engine.max_capture_tokens"),
    ("batched tokens negative", None, ["--engine.max_num_batched_tokens=-1"], "engine.max_num_batched_tokens"),
    ("logprob kernel", None, ["--engine.logprob_kernel=triton"], "engine.logprob_kernel"),
    ("constraint masks", None, ["--engine.constraint_masks=llguidance"], "engine.constraint_masks"),
    ("quantization", None, ["--engine.quantization=int4"], "engine.quantization"),
    ("fp8 without a loss correction", None, ["--engine.quantization=fp8"], "loss.tis_cap"),
    ("fp8 merged without a loss correction", None, ["--engine.quantization=fp8", "--engine.lora_mode=merged"],
     "loss.tis_cap"),
    # env
    ("env name", None, ["--env.name=chess"], "env.name"),
    ("max_operand negative", None, ["--env.max_operand=-1"], "env.max_operand"),
    ("horizon 0", None, ["--env.name=diplomacy", "--env.horizon_years=0"], "env.horizon_years"),
    ("stall years 0", None, ["--env.name=diplomacy", "--env.stall_years=0"], "env.stall_years"),
    ("state cache missing", None, ["--env.name=diplomacy", "--env.state_cache=/nonexistent.jsonl"],
     "env.state_cache"),
    ("state cache garbage", None, ["--env.name=diplomacy", "--env.state_cache=<garbage>"], "env.state_cache"),
    ("reward target nan", None, ["--env.reward_target=nan"], "env.reward_target"),
    # dataset env, reward functions, custom envs, chat templates, reward shaping
    ("dataset without files", None, ["--env.name=dataset"], "env.data_files"),
    ("agent tools without an episode length", None, ["--env.name=dataset", "--env.data_files=<data>",
                                                     "--env.tools=[colocate.calculator:calculator]"],
     "engine.max_model_len"),
    ("agent tool parser", None, ["--env.name=dataset", "--env.data_files=<data>", "--engine.max_model_len=512",
                                 "--env.tools=[colocate.calculator:calculator]", "--env.tool_parser=xml"],
     "env.tool_parser"),
    ("agent max turns 0", None, ["--env.name=dataset", "--env.data_files=<data>", "--engine.max_model_len=512",
                                 "--env.tools=[colocate.calculator:calculator]", "--env.max_turns=0"], "env.max_turns"),
    ("agent tool timeout 0", None, ["--env.name=dataset", "--env.data_files=<data>", "--engine.max_model_len=512",
                                    "--env.tools=[colocate.calculator:calculator]", "--env.tool_timeout_s=0"], "env.tool_timeout_s"),
    ("agent tool budget 0", None, ["--env.name=dataset", "--env.data_files=<data>", "--engine.max_model_len=512",
                                   "--env.tools=[colocate.calculator:calculator]", "--env.tool_budget_s=0"], "env.tool_budget_s"),
    ("agent tools on the arithmetic env", None, ["--env.tools=[colocate.calculator:calculator]"],
     "env.name=arithmetic plays no tool episodes"),
    ("agent keys on a single-turn dataset env", None, ["--env.name=dataset", "--env.data_files=<data>",
                                                       "--env.max_turns=3"], "env.max_turns=3"),
    ("reward timeout 0", None, ["--env.name=dataset", "--env.data_files=<data>", "--env.reward_timeout_s=0"], "env.reward_timeout_s"),
    ("reward bound 0", None, ["--env.name=dataset", "--env.data_files=<data>", "--env.reward_max_abs=0"], "env.reward_max_abs"),
    ("dataset file missing", None, ["--env.name=dataset", "--env.data_files=/nonexistent/train.jsonl"],
     "'/nonexistent/train.jsonl' does not exist"),
    ("dataset file of unknown kind", None, ["--env.name=dataset", "--env.data_files=<file>"], "must all be one of"),
    ("dataset eval file missing", None, ["--env.name=dataset", "--env.data_files=<data>",
                                         "--env.eval_files=/nonexistent/eval.jsonl"], "env.eval_files"),
    ("dataset prompt column missing", None, ["--env.name=dataset", "--env.data_files=<data>",
                                             "--env.prompt_column=question"], "env.prompt_column='question' is no column"),
    ("dataset answer column missing", None, ["--env.name=dataset", "--env.data_files=<data>",
                                             "--env.answer_column=solution"], "env.answer_column='solution'"),
    ("dataset empty file", None, ["--env.name=dataset", "--env.data_files=<emptysplit>"], "is empty"),
    ("dataset empty split", None, ["--env.name=dataset", "--env.data_files=<data>", "--env.split=train[:0]"],
     "split 'train[:0]'"),
    ("dataset prompt neither text nor messages", None, ["--env.name=dataset", "--env.data_files=<badprompt>"],
     "a prompt must be text or a list of chat messages"),
    ("dataset not parseable", None, ["--env.name=dataset", "--env.data_files=<badjson>"],
     "badjson.jsonl line 1 column 21: not valid JSON"),
    ("reward path unknown", None, ["--env.name=dataset", "--env.data_files=<data>",
                                   "--env.reward=no_such_pkg.rewards:score"], "cannot import 'no_such_pkg.rewards'"),
    ("reward function missing", None, ["--env.name=dataset", "--env.data_files=<data>",
                                       "--env.reward=colocate.rewards:no_such_function"], "has no 'no_such_function'"),
    ("reward neither built-in nor path", None, ["--env.name=dataset", "--env.data_files=<data>", "--env.reward=accuracy"],
     "neither a built-in"),
    ("reward weights count", None, ["--env.name=dataset", "--env.data_files=<data>", "--env.reward_weights=1,2"],
     "env.reward_weights has 2 entries"),
    ("reward weight not a number", None, ["--env.name=dataset", "--env.data_files=<data>", "--env.reward_weights=x"],
     "env.reward_weights"),
    ("max reward errors 0", None, ["--env.name=dataset", "--env.data_files=<data>", "--env.max_reward_errors=0"], "env.max_reward_errors"),
    ("reward workers negative", None, ["--env.name=dataset", "--env.data_files=<data>", "--env.reward_workers=-1"], "env.reward_workers"),
    ("env processes negative", None, ["--env.processes=-1"], "env.processes"),
    ("env processes in the exact-resume mode", None, ["--env.processes=2"], "rollout.update=drain"),
    ("env processes with the dataset env", None, ["--env.name=dataset", "--env.data_files=<data>",
                                                  "--env.processes=2"], "env.name=dataset"),
    ("prefetch prompts negative", None, ["--env.name=dataset", "--env.data_files=<data>", "--env.prefetch_prompts=-1"], "env.prefetch_prompts"),
    ("custom env missing", None, ["--env.name=no_such_pkg.envs:MyEnv"], "cannot import 'no_such_pkg.envs'"),
    ("custom env not an Env", None, ["--env.name=colocate.rewards:RewardSet"], "not a subclass"),
    ("chat template", None, ["--model.chat_template=chatml"], "model.chat_template"),
    ("overlong buffer negative", None, ["--env.overlong_buffer=-1"], "env.overlong_buffer"),
    ("overlong buffer past max_new_tokens", None, ["--env.overlong_buffer=5"], "engine.max_new_tokens"),
    # rollout
    ("group size 1", None, ["--rollout.group_size=1", "--rollout.batch_size=16"], "rollout.group_size"),
    ("batch not divisible", None, ["--rollout.batch_size=130"], "rollout.batch_size"),
    ("groups per step 0", None, ["--rollout.groups_per_step=0"], "rollout.groups_per_step"),
    ("oversample negative", None, ["--rollout.oversample_groups=-1"], "rollout.oversample_groups"),
    ("oversample with lag 1", None, ["--rollout.oversample_groups=2"], "learner.max_policy_lag"),
    ("update not a mode", None, ["--rollout.update=never"], "rollout.update='never' is not one of"),
    ("inflight updates with lag 0", None, ["--rollout.update=inflight", "--learner.max_policy_lag=0"],
     "rollout.update=inflight needs learner.max_policy_lag >= 1"),
    ("drop uniform groups not a bool", None, ["--rollout.drop_uniform_groups=sometimes"], "rollout.drop_uniform_groups"),
    # learner
    ("lr negative", None, ["--learner.lr=-1"], "learner.lr"),
    ("lr nan", None, ["--learner.lr=nan"], "learner.lr"),
    ("lr 0", None, ["--learner.lr=0"], "learner.lr"),
    ("weight decay negative", None, ["--learner.weight_decay=-0.1"], "learner.weight_decay"),
    ("max grad norm negative", None, ["--learner.max_grad_norm=-1"], "learner.max_grad_norm"),
    ("num steps 0", None, ["--learner.num_steps=0"], "learner.num_steps"),
    ("micro batch tokens 0", None, ["--learner.micro_batch_tokens=0"], "learner.micro_batch_tokens"),
    ("max policy lag negative", None, ["--learner.max_policy_lag=-1"], "learner.max_policy_lag"),
    ("attention", None, ["--learner.attention=flash9"], "learner.attention"),
    ("prefix sharing", None, ["--learner.prefix_sharing=radix"], "learner.prefix_sharing"),
    ("updates per batch 0", None, ["--learner.updates_per_batch=0"], "learner.updates_per_batch"),
    # loss
    ("eps low negative", None, ["--loss.eps_low=-0.1"], "loss.eps_low"),
    ("eps high nan", None, ["--loss.eps_high=nan"], "loss.eps_high"),
    ("beta negative", None, ["--loss.beta=-1"], "loss.beta"),
    ("norm", None, ["--loss.norm=l2"], "loss.norm"),
    ("impl", None, ["--loss.impl=cuda"], "loss.impl"),
    ("ratio level", None, ["--loss.ratio_level=sentence"], "did you mean 'sequence'"),
    ("seq eps low 1", None, ["--loss.seq_eps_low=1"], "loss.seq_eps_low"),
    ("seq eps high negative", None, ["--loss.seq_eps_high=-1e-4"], "loss.seq_eps_high"),
    ("tis cap below 1", None, ["--loss.tis_cap=0.5"], "loss.tis_cap"),
    ("tis cap nan", None, ["--loss.tis_cap=nan"], "loss.tis_cap"),
    ("dual clip at 1 or below", None, ["--loss.clip_ratio_c=1"], "loss.clip_ratio_c"),
    ("unknown lr schedule", None, ["--learner.lr_schedule=linear"], "learner.lr_schedule"),
    ("warm-up as long as the run", None, ["--learner.warmup_steps=300"], "learner.warmup_steps"),
    ("min lr ratio without cosine", None, ["--learner.min_lr_ratio=0.1"], "learner.lr_schedule=cosine"),
    ("reward drop alert of 1", None, ["--metrics.reward_drop_alert=1"], "metrics.reward_drop_alert"),
    ("grad norm alert of 1", None, ["--metrics.grad_norm_alert=1"], "metrics.grad_norm_alert"),
    ("stop on collapse without its alert", None, ["--metrics.stop_on_collapse=true", "--metrics.reward_drop_alert=0",
                                                  "--checkpoint.enabled=true"], "metrics.reward_drop_alert > 0"),
    ("stop on collapse without checkpoints", None, ["--metrics.stop_on_collapse=true"], "checkpoint.enabled"),
    ("mis threshold negative", None, ["--loss.mis_threshold=-0.1"], "loss.mis_threshold"),
    # sync, topology
    ("sync backend", None, ["--sync.backend=mpi"], "sync.backend"),
    ("timeout 0", None, ["--topology.timeout_s=0"], "topology.timeout_s"),
    ("too many inference ranks", None, ["--topology.num_inference=5"], "topology"),
    ("no learner", None, ["--topology.num_inference=2"], "topology"),
    # metrics
    ("log every 0", None, ["--metrics.log_every=0"], "metrics.log_every"),
    ("run dir unwritable", None, ["--metrics.run_dir=/proc/colocate-run"], "metrics.run_dir"),
    ("run dir under a file", None, ["--metrics.run_dir=<file>/run"], "metrics.run_dir"),
    ("nvml interval negative", None, ["--metrics.nvml_interval_s=-1"], "metrics.nvml_interval_s"),
    ("stall timeout negative", None, ["--metrics.stall_timeout_s=-1"], "metrics.stall_timeout_s"),
    ("max nonfinite 0", None, ["--metrics.max_nonfinite_steps=0"], "metrics.max_nonfinite_steps"),
    ("peak tflops 0", None, ["--metrics.peak_tflops=0"], "metrics.peak_tflops"),
    ("profile active 0", None, ["--metrics.profile=true", "--metrics.profile_active=0"], "metrics.profile_active"),
    # checkpoint
    ("checkpoint every negative", None, ["--checkpoint.every=-1"], "checkpoint.every"),
    ("checkpoint keep negative", None, ["--checkpoint.keep=-1"], "checkpoint.keep"),
    ("resume dir missing", None, ["--checkpoint.resume=/nonexistent/step-000001"], "does not exist"),
    ("resume without a checkpoint", None, ["--checkpoint.resume=auto"], "no checkpoint found in"),
    ("resume and overwrite together", None, ["--resume", "--overwrite"], "--overwrite and --resume contradict"),
]
AGENT = ["--env.name=dataset", "--env.data_files=<data>", "--engine.max_model_len=512"]
USER_CASES = [  # user data and user code (tests/test_user_inputs.py has the run-time cases)
    ("duplicate YAML key", "learner:\n  lr: 0.003\n  lr: 30.0\n", [], "key 'lr' is given twice (line 2 and line 3)"),
    ("dataset row prompt null", None, ["--env.name=dataset", "--env.data_files=<rows:null>"],
     "line 3, column 'prompt': the prompt is missing or null"),
    ("dataset row prompt missing", None, ["--env.name=dataset", "--env.data_files=<rows:missing>"],
     "line 3, column 'prompt': the prompt is missing or null"),
    ("dataset row prompt empty", None, ["--env.name=dataset", "--env.data_files=<rows:empty>"],
     "line 3, column 'prompt': the prompt is empty or only whitespace"),
    ("dataset row prompt whitespace", None, ["--env.name=dataset", "--env.data_files=<rows:blank>"],
     "line 3, column 'prompt': the prompt is empty or only whitespace"),
    ("dataset row messages empty", None, ["--env.name=dataset", "--env.data_files=<rows:nomessages>"],
     "line 3, column 'prompt': the prompt is empty"),
    ("dataset row answer null", None, ["--env.name=dataset", "--env.data_files=<rows:noanswer>"],
     "line 3, column 'answer': the answer is missing or null"),
    ("dataset row prompt too long", None, ["--env.name=dataset", "--env.data_files=<rows:long>"],
     "line 3, column 'prompt': the prompt has"),
    ("dataset row over 1 MiB", None, ["--env.name=dataset", "--env.data_files=<rows:huge>"],
     "line 3, column 'prompt': the prompt is over 1 MiB"),
    ("dataset row in a split", None, ["--env.name=dataset", "--env.data_files=<rows:null>", "--env.split=train[1:]"],
     "line 3, column 'prompt'"),
    ("dataset directory without data files", None, ["--env.name=dataset", "--env.data_files=<emptydir>"],
     "is a directory with no json, jsonl, parquet or csv files"),
    ("dataset every row skipped", None, ["--env.name=dataset", "--env.data_files=<rows:allnull>",
                                         "--env.bad_rows=skip"], "every row is unusable"),
    ("bad rows policy", None, ["--env.bad_rows=ignore"], "env.bad_rows"),
    ("reward module syntax error", None, ["--env.name=dataset", "--env.data_files=<data>",
                                          "--env.reward=user_syntax_error:score"], "SyntaxError"),
    ("reward module raises at import", None, ["--env.name=dataset", "--env.data_files=<data>",
                                              "--env.reward=user_raises:score"], "ZeroDivisionError"),
    ("reward module imports a missing package", None, ["--env.name=dataset", "--env.data_files=<data>",
                                                       "--env.reward=user_missing_dep:score"], "no_such_dependency"),
    ("reward without prompts", None, ["--env.name=dataset", "--env.data_files=<data>",
                                      "--env.reward=user_reward_signature:score"],
     "user_reward_signature.py:1) cannot be called as TRL calls a reward function"),
    ("reward raises on the first row", None, ["--env.name=dataset", "--env.data_files=<data>",
                                              "--env.reward=user_reward_raises:score"],
     "user_reward_raises.py:1) raised KeyError: 'solution' at "),
    ("reward returns one number", None, ["--env.name=dataset", "--env.data_files=<data>",
                                         "--env.reward=user_reward_number:score"], "returned float 1.0, expected a list of 2 numbers"),
    ("reward returns too few", None, ["--env.name=dataset", "--env.data_files=<data>",
                                      "--env.reward=user_reward_short:score"], "returned 1 values for 2 completions"),
    ("reward returns text", None, ["--env.name=dataset", "--env.data_files=<data>",
                                   "--env.reward=user_reward_text:score"], "returned str '1' at position 0, expected a finite number"),
    ("custom env without requests", None, ["--env.name=user_envs:NoRequests"], "does not implement requests()"),
    ("custom env from_config signature", None, ["--env.name=user_envs:OldFromConfig"],
     "cannot be called as from_config(cfg, tokenizer, seed)"),
    ("custom env step signature", None, ["--env.name=user_envs:StepNoArgs"], "cannot be called as step(completions)"),
    ("custom env unknown option", None, ["--env.name=examples.guessing_game:GuessingGameEnv",
                                         "--env.options={max_numbr: 4}"], "did you mean 'max_number'"),
    ("agent tool path unknown", None, AGENT + ["--env.tools=[no_such_pkg.tools:search]"],
     "env.tools: 'no_such_pkg.tools:search': cannot import 'no_such_pkg.tools'"),
    ("agent tool not a function", None, AGENT + ["--env.tools=[user_tools:LIMIT]"], "is not a function"),
    ("agent tool without type hints", None, AGENT + ["--env.tools=[user_tools:no_hints]"],
     "env.tools: 'user_tools:no_hints' has no tool schema"),
    ("agent tool without a docstring", None, AGENT + ["--env.tools=[user_tools:no_docstring]"],
     "env.tools: 'user_tools:no_docstring' has no tool schema"),
    ("agent environment without reset", None, AGENT + ["--env.environment=user_tools:NoReset"],
     "is not a class with a reset(**row) method"),
    ("agent environment constructor raises", None, AGENT + ["--env.environment=user_tools:Broken"],
     "env.environment: user_tools:Broken() failed: RuntimeError"),
    ("agent environment method without a docstring", None, AGENT + ["--env.environment=user_tools:UndocumentedTool"],
     "env.environment: 'user_tools:UndocumentedTool.look' has no tool schema"),
    ("agent episode length below a turn", None, AGENT[:2] + ["--engine.max_model_len=4",
                                                             "--env.tools=[colocate.calculator:calculator]"],
     "cannot hold a prompt and one turn"),
    ("agent tools on a custom env that plays none", None, ["--env.name=examples.guessing_game:GuessingGameEnv",
                                                           "--env.tools=[colocate.calculator:calculator]"],
     "is not an AgentEnv"),
    ("agent env class without an episode length", None, ["--env.name=examples.calculator_agent:CalculatorEnv"],
     "needs engine.max_model_len > 0"),
    ("agent env class episode length below a turn", None, ["--env.name=examples.calculator_agent:CalculatorEnv",
                                                           "--engine.max_model_len=4"],
     "cannot hold a prompt and one turn"),
    ("calculator example unknown option", None, ["--env.name=examples.calculator_agent:CalculatorEnv",
                                                 "--engine.max_model_len=256", "--env.options={hihg: 50}"],
     "did you mean 'high'"),
    ("resume dir not a checkpoint", None, ["--checkpoint.resume=<emptydir>"], "missing from checkpoint"),
    ("resume without manifest", None, ["--checkpoint.resume=<nomanifest>"], "--checkpoint.trust_unverified=true"),
]
CASES = CONFIG_CASES + USER_CASES

ROWS = {  # fixture files of one bad row on line 3 (line 2 is blank: line numbers are the file's own)
    "null": '{"prompt": null, "answer": "3"}', "missing": '{"answer": "3"}', "empty": '{"prompt": "", "answer": "3"}',
    "blank": '{"prompt": " \\t\\n ", "answer": "3"}',
    "noanswer": '{"prompt": "add 1 and 2 ; answer :", "answer": null}',
    "nomessages": '{"prompt": [{"role": "user", "content": "  "}], "answer": "3"}',
    "long": '{"prompt": "' + " ".join(map(str, range(2000))) + '", "answer": "3"}',  # a token per digit
}
USER_MODULES = {  # user code, importable from the case's directory
    "user_syntax_error.py": "def score(prompts, completions, **kw)\n    return [1.0] * len(completions)\n",
    "user_raises.py": "RATE = 1 / 0\n",
    "user_reward_signature.py": "def score(completions):\n    return [0.0] * len(completions)\n",
    "user_reward_raises.py": ("def score(prompts, completions, **columns):\n"
                              "    return [float(c == columns['solution'][0]) for c in completions]\n"),
    "user_reward_number.py": "def score(prompts, completions, **columns):\n    return 1.0\n",
    "user_reward_short.py": "def score(prompts, completions, **columns):\n    return [1.0]\n",
    "user_reward_text.py": "def score(prompts, completions, **columns):\n    return ['1' for _ in completions]\n",
    "user_missing_dep.py": "import no_such_dependency  # noqa\n",
    "user_envs.py": ("from colocate.envs.base import Env\n\n\n"
                     "class NoRequests(Env):\n    @classmethod\n    def from_config(cls, cfg, tokenizer, seed):\n"
                     "        return cls()\n\n    def start_group(self, group_id):\n        pass\n\n"
                     "    def step(self, completions):\n        pass\n\n    def pop_finished(self):\n        return []\n\n\n"
                     "class OldFromConfig(NoRequests):\n    @classmethod\n    def from_config(cls, cfg):\n"
                     "        return cls()\n\n    def requests(self):\n        return []\n\n\n"
                     "class StepNoArgs(NoRequests):\n    def requests(self):\n        return []\n\n"
                     "    def step(self):\n        pass\n"),
    "user_tools.py": ('LIMIT = 3\n\n\ndef no_hints(x):\n    """\n    Echo.\n\n    Args:\n        x: A value.\n    """\n'
                      "    return x\n\n\ndef no_docstring(x: int) -> int:\n    return x\n\n\n"
                      "class NoReset:\n    pass\n\n\n"
                      "class Broken:\n    def __init__(self):\n        raise RuntimeError('no database')\n\n"
                      "    def reset(self, **row):\n        return None\n\n\n"
                      "class UndocumentedTool:\n    def reset(self, **row):\n        return None\n\n"
                      "    def look(self, where: str) -> str:\n        return where\n"),
}


def write_fixture_rows(tmp_path) -> dict[str, str]:
    """One JSONL file per kind of bad row (line 1 good, line 2 blank, line 3 bad, line 4 good) ->
    {"<rows:kind>": path}; and a directory holding a checkpoint's files without a manifest."""
    good = '{"prompt": "add 1 and 2 ; answer :", "answer": "3"}'
    out = {}
    for kind, row in ROWS.items():
        messages = '{"prompt": [{"role": "user", "content": "add 1 and 2"}], "answer": "3"}'
        first = good if kind != "nomessages" else messages
        (tmp_path / f"rows-{kind}.jsonl").write_text(f"{first}\n\n{row}\n{first}\n")
        out[f"<rows:{kind}>"] = str(tmp_path / f"rows-{kind}.jsonl")
    (tmp_path / "rows-allnull.jsonl").write_text('{"prompt": null, "answer": "3"}\n' * 3)
    out["<rows:allnull>"] = str(tmp_path / "rows-allnull.jsonl")
    for name, text in USER_MODULES.items():
        (tmp_path / name).write_text(text)
    old = tmp_path / "nomanifest"
    old.mkdir(exist_ok=True)
    from colocate.checkpoint import REQUIRED
    for name in REQUIRED:
        (old / name).write_text("{}")
    out["<nomanifest>"] = str(old)
    return out


def materialize(text, overrides: list[str], tmp_path) -> tuple[str, list[str]]:
    """Write the case's config file and fixtures; -> (config path, overrides with paths filled in).
    The cases' user modules (`user_*.py`) are written afresh: an earlier case's import of the same
    name, from another directory, is forgotten so that this one's file is the one imported."""
    for name in [m for m in sys.modules if m.startswith("user_")]:
        del sys.modules[name]
    if text == "<missing>":
        path = str(tmp_path / "missing.yaml")
    elif text == "<dir>":
        path = str(tmp_path)
    elif text is None:
        path = TINY
    else:
        path = str(tmp_path / "config.yaml")
        with open(path, "wb") as f:
            f.write(text if isinstance(text, bytes) else text.encode())
    (tmp_path / "emptydir").mkdir(exist_ok=True)
    (tmp_path / "badmodel").mkdir(exist_ok=True)
    (tmp_path / "badmodel" / "config.json").write_text("{not json")
    (tmp_path / "garbage.jsonl").write_text("this is not a saved game\n")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "data.jsonl").write_text('{"prompt": "add 1 and 2 ; answer :", "answer": "3"}\n')
    (tmp_path / "emptysplit.jsonl").write_text("")
    (tmp_path / "badprompt.jsonl").write_text('{"prompt": 17, "answer": "3"}\n')
    (tmp_path / "badjson.jsonl").write_text('{"prompt": "unclosed\n')
    fill = {"<data>": str(tmp_path / "data.jsonl"), "<emptysplit>": str(tmp_path / "emptysplit.jsonl"),
            "<badprompt>": str(tmp_path / "badprompt.jsonl"), "<badjson>": str(tmp_path / "badjson.jsonl"),"<emptydir>": str(tmp_path / "emptydir"), "<badmodel>": str(tmp_path / "badmodel"),
            "<garbage>": str(tmp_path / "garbage.jsonl"), "<file>": str(tmp_path / "afile"),
            **write_fixture_rows(tmp_path)}
    if any("<rows:huge>" in o for o in overrides):  # a single-line prompt over rows.MAX_PROMPT_BYTES, one word
        huge = '{"prompt": "' + "x" * ((1 << 20) + 1) + '", "answer": "3"}'
        (tmp_path / "rows-huge.jsonl").write_text(f'{{"prompt": "add 1 and 2", "answer": "3"}}\n\n{huge}\n')
        fill["<rows:huge>"] = str(tmp_path / "rows-huge.jsonl")
    out = []
    for o in overrides:
        for k, v in fill.items():
            o = o.replace(k, v)
        out.append(o)
    return path, out


def run_case(path: str, overrides: list[str], tmp_path, monkeypatch, capsys) -> tuple[int, str]:
    from colocate.rank_config import configure
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.syspath_prepend(str(tmp_path))  # the cases' user modules
    argv = ["--config", path, f"--metrics.run_dir={tmp_path / 'run'}", f"--model.cache_dir={tmp_path / 'cache'}",
            *overrides]
    with pytest.raises(SystemExit) as exit_info:
        configure(argv)
    return exit_info.value.code, capsys.readouterr().err


def catalogue() -> dict[str, list[str]]:
    """docs/errors.md's rows by case id -> [case, input, exit, message]."""
    with open(os.path.join(REPO, "docs", "errors.md")) as f:
        return {cells[0]: cells for cells in ([c.strip() for c in line.split("|")[1:-1]] for line in f
                                              if line.startswith("| ") and "---" not in line)}


@pytest.mark.parametrize("case_id,text,overrides,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(case_id, text, overrides, expected, tmp_path, monkeypatch, capsys):
    path, overrides = materialize(text, overrides, tmp_path)
    code, err = run_case(path, overrides, tmp_path, monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("colocate: ") and expected in lines[0], lines[0]
    shown = lines[0].replace(str(tmp_path), "<tmp>").replace(REPO + "/", "").replace("|", "/")
    assert catalogue()[case_id][3] == shown, "docs/errors.md is stale: run `python scripts/bad_inputs.py`"


def test_the_shipped_configs_pass_the_check(tmp_path, monkeypatch, capsys):
    """`python -m colocate.train --config FILE --check` (in-process: `train.main`) on each shipped CPU
    config; GPU presets without vLLM here: everything but the engine kind (their data files, values,
    roles)."""
    from colocate.train import main
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    for name, world, extra in (("cpu-tiny.yaml", 2, []), ("cpu-diplomacy-tiny.yaml", 2, []),
                               ("cpu-dataset-tiny.yaml", 2, []), ("gpu-1-gsm8k.yaml", 3, ["--engine.kind=hf"]),
                               ("cpu-calculator-agent.yaml", 2, [])):
        main(["--config", os.path.join("configs", name), "--check", f"--world-size={world}",
              f"--metrics.run_dir={tmp_path / 'run'}", *extra])
        assert "learner:" in capsys.readouterr().out, name
        assert not os.path.exists(tmp_path / "run")  # a check writes nothing


def test_a_rank_other_than_0_waits_for_rank_0_then_speaks_for_itself(tmp_path, monkeypatch, capsys):
    """Rank 1 refusing the same input stays silent while rank 0 reports (the launcher stops it); if it is
    still alive after the wait, rank 0 did not refuse, and rank 1 prints its own line, naming itself."""
    from colocate import rank_config
    waits = []
    monkeypatch.setattr(rank_config.time, "sleep", waits.append)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    argv = ["--config", os.path.join(REPO, "configs", "cpu-tiny.yaml"), "--engine.temperature=.nan",
            f"--metrics.run_dir={tmp_path / 'run'}"]
    with pytest.raises(SystemExit) as exit_info:
        rank_config.configure(argv)  # RANK without torchrun (a scheduler's pod): no wait, no rank in the line
    assert exit_info.value.code == 2 and waits == []
    assert capsys.readouterr().err.startswith("colocate: config error: engine.temperature")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    with pytest.raises(SystemExit) as exit_info:
        rank_config.configure(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and waits == [rank_config.OTHER_RANKS_WAIT_S]
    assert len(lines) == 1 and lines[0].startswith("colocate: config error (rank 1; rank 0 may not have refused it): "
                                                   "engine.temperature"), lines
    with pytest.raises(SystemExit):
        rank_config.configure([*argv, "--check"])  # a check is no launch: each process answers for itself
    assert waits == [rank_config.OTHER_RANKS_WAIT_S]


@pytest.mark.slow
def test_under_torchrun_the_line_is_printed_once(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "colocate.train",
           "--config", "configs/cpu-tiny.yaml", "--engine.temperature=.nan", f"--metrics.run_dir={tmp_path}"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0  # torchrun's own code: 1 whatever the ranks returned
    assert (out.stdout + out.stderr).count("colocate: config error: engine.temperature") == 1, out.stderr
    assert "(rank 1;" not in out.stderr  # rank 1 waited, and torchrun stopped it once rank 0 had exited
    assert "exitcode  : 2" in out.stderr, out.stderr[-2000:]


def test_the_catalogue_in_docs_lists_every_case():
    """docs/errors.md (written by scripts/bad_inputs.py) has a row for every case, with exit 2 (each
    case's test checks its message)."""
    rows = catalogue()
    missing = [c[0] for c in CASES if c[0] not in rows]
    assert not missing, f"run `python scripts/bad_inputs.py`: {missing}"
    assert all(rows[c[0]][2] == "2" for c in CASES)
