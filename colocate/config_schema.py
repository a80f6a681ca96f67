"""The run configuration's schema: one dataclass per component, each field documented by the string
literal under it (the torchtitan habit; `field_docs` reads them for `--help` and the README), and
the choice tuples the string fields take their values from.

Only what the fields are and their defaults; how a run's config is built from YAML and overrides,
and checked, is `colocate.config`. This module imports nothing of colocate: it sits at the bottom
of the import graph, so the engine, topology and loss code import their choices from here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MODEL_SHAPES = ("tiny", "qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b")  # keys of colocate.models.SHAPES
DTYPES = ("float32", "bfloat16")
LORA_MODES = ("slot", "merged")
LOGPROB_KERNELS = ("ours", "vllm")
CONSTRAINT_MASKS = ("ours", "vllm")
CUDAGRAPH_MODES = ("", "FULL_AND_PIECEWISE", "FULL", "PIECEWISE")
CHAT_TEMPLATES = ("auto", "none")
BUILTIN_REWARDS = ("gsm8k", "boxed", "exact")  # keys of colocate.rewards.BUILTINS
BAD_ROWS = ("error", "skip")
TOOL_PARSERS = ("hermes",)  # keys of colocate.tools.PARSERS
NORM_MODES = ("grpo", "dapo", "dr_grpo")  # kernels.reference.NORM_MODES (kernels import nothing of colocate)
RATIO_LEVELS = ("token", "sequence")  # kernels.reference.RATIO_LEVELS
LOSS_IMPLS = ("auto", "triton", "torch")
LR_SCHEDULES = ("constant", "cosine")  # colocate.learner.schedule.lr_factor
ATTENTIONS = ("auto", "varlen", "sdpa")
PREFIX_SHARING = ("off", "group", "tree")
SYNC_BACKENDS = ("auto", "nccl", "gloo")
PLACEMENTS = ("by_node", "interleaved")
LOGGERS = ("tensorboard", "wandb", "mlflow", "trackio")  # colocate.trackers
EVAL_OPPONENTS = ("random", "hold", "greedy")  # keys of colocate.envs.diplomacy.bots.BOTS
UPDATE_MODES = ("drain", "inflight")  # rollout.update
QUANTIZATIONS = ("none", "fp8")  # engine.quantization


@dataclass
class ModelConfig:
    path: str = ""
    """Local HF model directory. Empty: build the embedded tiny model (random weights, local tokenizer)."""
    shape: str = "tiny"
    """Named random-init shape when `path` is empty: tiny, qwen2.5-0.5b, qwen2.5-7b, qwen2.5-14b, qwen2.5-32b."""
    dtype: str = "float32"
    """Parameter dtype of the base model: float32 or bfloat16."""
    cache_dir: str = ".cache/colocate"
    """Where the embedded tokenizer and tiny model are built once and reused."""
    compile_cache_dir: str = "~/.cache/colocate"
    """Where compiled code is kept across runs: vLLM's compile cache (VLLM_CACHE_ROOT), inductor's
    (TORCHINDUCTOR_CACHE_DIR) and Triton's (TRITON_CACHE_DIR) in its vllm/, inductor/ and triton/,
    unless those variables are set already; the start line says where. "": the libraries' defaults."""
    seed: int = 0
    """Seed of the random base weights (all ranks build the same model from it)."""
    chat_template: str = "auto"
    """auto: every env renders its prompts with the tokenizer's chat template when the tokenizer has
    one (a text prompt becomes one user message); none: raw text (what the embedded tiny tokenizer,
    which has no template, always gets)."""


@dataclass
class LoraConfig:
    rank: int = 8
    """LoRA rank r."""
    alpha: float = 16.0
    """LoRA alpha; the update is scaled by alpha / r."""
    dropout: float = 0.0
    """LoRA dropout (0 keeps sampler and learner log-probs identical)."""
    target_modules: list = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    """Linear layers that get an adapter."""
    fused_epilogue: bool = True
    """Add the LoRA term inside the up-projection GEMM (`addmm`) instead of peft's separate scale and
    add over [tokens, out] (`models.set_fused_lora`); false is the reference path."""


@dataclass
class EngineConfig:
    kind: str = "auto"
    """auto (vllm on CUDA when installed, else hf), hf or vllm: the kinds of the engine table
    (`colocate/engine/table.py`), which checks the value."""
    max_new_tokens: int = 8
    """Most tokens sampled per completion."""
    temperature: float = 1.0
    """Sampling temperature; the learner divides logits by the same value."""
    max_num_seqs: int = 512
    """vLLM: most sequences in flight."""
    gpu_memory_utilization: float = 0.85
    """vLLM: fraction of the GPU the engine may take."""
    kv_cache_gib: float = 0.0
    """vLLM: GiB of KV cache, fixed (vLLM's `kv_cache_memory_bytes`); 0 lets vLLM size it by profiling
    what is left of its `gpu_memory_utilization` share. Set it when other processes take or free GPU
    memory while the engine starts (several runs on one GPU, as the GPU tests run): the profile
    counts their memory as the engine's. vLLM still wants its share free at start. With it, a learner
    on the engine's GPU warms up (`learner.prewarm`) while the engine starts, not after."""
    max_model_len: int = 0
    """vLLM: context length; 0 sizes it from the workload (prompt + max_new_tokens)."""
    enforce_eager: bool = False
    """vLLM: disable CUDA graphs (debugging only)."""
    enable_prefix_caching: bool = True
    """vLLM: share KV blocks of common prompt prefixes."""
    max_num_batched_tokens: int = 0
    """vLLM: most tokens (prefill chunks + one per decoding sequence) in one engine step; 0 keeps
    vLLM's default. Streaming rollouts want it small, so new phases' prefills do not slow every
    other game's decode steps."""
    max_capture_tokens: int = 2048
    """vLLM: CUDA graphs for mixed steps (prefill chunks + decodes) up to min(max_num_batched_tokens,
    this) tokens; larger steps run eagerly. Decode sizes are always captured; 0 captures only those."""
    cudagraph_mode: str = ""
    """vLLM: "" keeps vLLM's FULL_AND_PIECEWISE (full graphs for decode steps, piecewise for mixed
    ones); FULL replays mixed steps as full graphs too; PIECEWISE. For trying graph modes."""
    lora_mode: str = "slot"
    """vLLM: how the adapter reaches the engine. slot: one pinned LoRA slot written in place (vLLM's
    LoRA kernels run every step). merged: W0 + (alpha/r) B A written into the base weights on each
    update (no LoRA kernels; keeps a copy of the adapted base weights; bf16 rounds away updates
    below half an ulp of W0, see engine/adapter_targets.py). With engine.quantization fp8: slot applies
    the adapter in bf16 beside the FP8 base; merged keeps W0 in FP8 (one byte a parameter) and
    requantizes W0 + (alpha/r) B A per tensor at each update (engine/fp8_merge.py)."""
    logprob_kernel: str = "ours"
    """vLLM: what computes the sampled token's log-prob in vLLM's sampler. ours: one read of the
    logits spread over the GPU (`colocate.kernels.sampled_logprob`); vllm: vLLM's own (one program
    per sequence, three reads). Same values up to float rounding (tested)."""
    constraint_masks: str = "ours"
    """vLLM: what enforces a Constraint. ours: the Constraint as an automaton on the GPU, walked and
    applied by one kernel before sampling (`colocate.kernels.trie_mask`): no host work per step,
    so vLLM's scheduling runs ahead (gpu-1.yaml 1.26x per step). vllm: vLLM's structured outputs
    (an llguidance grammar per request; the engine core fills each step's bitmasks on host threads
    once the previous step's tokens are back). Same allowed tokens after every prefix (tested)."""
    validate_grammars: bool = True
    """vLLM: let vLLM's client check every request's grammar with llguidance before queueing it.
    false skips that host time: our grammars are generated and tested, and the engine core
    compiles each one anyway (a bad one then fails at replay instead of at submit)."""
    quantization: str = "none"
    """none, or fp8: the inference ranks sample from the base weights rounded to float8 e4m3 (vLLM's
    online FP8 of a bf16 checkpoint: one scale per weight, the linear inputs scaled per token at
    every call; the HF engine emulates it, `engine/fp8.py`); the learner keeps full precision. The
    adapter, by engine.lora_mode: slot applies it beside the FP8 base in the model's dtype; merged
    writes W0 (FP8) + (alpha/r) B A into the weights, rounded to e4m3 again with a new per-tensor
    scale at each update: an update shows only where it moves a weight across a point of e4m3's
    grid, so the sampler lags the learner by more than in bf16 (the correction below weighs it).
    The sampler's log-probs are then the FP8 policy's, which the learner's differs from: it needs a
    correction in the loss (refused without one): loss.tis_cap (truncated importance sampling,
    e.g. 2.0) or loss.mis_threshold (or learner.updates_per_batch > 1, which turns TIS on). The
    canary's bound widens by e4m3's rounding (`colocate/canary.py`)."""
    prestart: bool = True
    """vLLM: start vLLM's engine core from a forkserver that each inference rank of `colocate train`
    starts as its first act (under a plain torchrun, when its engine is built), which imports vLLM
    while the rank makes its own imports, waits for the checks and builds its model: the engine
    core is then forked with its imports done instead of spawned to import them again (seconds of
    the engine's start-up; on a cold cache also vLLM's model inspection, another fresh process).
    false: vLLM spawns it. Whatever keeps the server from serving falls back to the spawn, with one
    line (`colocate/engine/prestart.py`)."""


@dataclass
class EnvConfig:
    name: str = "arithmetic"
    """Environment: arithmetic (synthetic, verifiable), diplomacy, dataset (prompts from local files,
    scored by `reward`), or a class of your own that subclasses `colocate.envs.base.Env`, by path:
    "my_pkg.my_env:MyEnv" (docs/envs.md)."""
    max_operand: int = 4
    """arithmetic: operands are drawn from 0..max_operand."""
    use_constraint: bool = True
    """Constrain sampling to well-formed answers (legal orders for diplomacy)."""
    horizon_years: int = 4
    """diplomacy: years played after the fork before the reward is taken."""
    stall_years: int = 2
    """diplomacy: a continuation stops early when no supply centre changed for this many years."""
    train_later_phases: bool = False
    """diplomacy: also train the phases after the fork with the continuation's advantage (multi-turn)."""
    unit_labels: bool = True
    """diplomacy: each order line starts with its unit (A PAR - BUR). false: the line's position
    names the unit (- BUR), saving the forced unit tokens' decode steps (envs/diplomacy/prompt.py).
    Meant for constrained sampling: in free text one stray line shifts all later ones."""
    list_supports: bool = True
    """diplomacy: the prompt lists each unit's legal supports and convoys. false: only moves, holds,
    convoyed moves and retreats are listed (the constraint still allows every legal order): a much
    shorter prefill per request, for a less informed policy (profiles/env.md)."""
    state_cache: str = ""
    """diplomacy: JSON-lines file of mid-game states to fork from; empty starts from the opening."""
    reward_target: float = 0.9
    """Mean reward the run is expected to reach; summary.json says whether it did."""
    data_files: list = field(default_factory=list)
    """dataset: local json / jsonl / parquet / csv files of prompts (one format per list), loaded with
    Hugging Face `datasets` into memory-mapped Arrow files under `model.cache_dir`."""
    split: str = "train"
    """dataset: the split of `data_files` to train on, in `datasets`' split syntax (train, train[:90%])."""
    prompt_column: str = "prompt"
    """dataset: the column holding each prompt: a string, or a list of chat messages ({role, content})."""
    answer_column: str = "answer"
    """dataset: the column the built-in rewards compare against (user functions get every column)."""
    answer_choices: bool = False
    """dataset: sample only completions that are one of the answer column's distinct values (a
    constraint, as the arithmetic env's): for short-answer tasks with few answers; free text if false."""
    bad_rows: str = "error"
    """dataset: what an unusable row does (a prompt missing, null, neither text nor chat messages,
    empty or whitespace, longer than the model's context less engine.max_new_tokens; a null answer
    where the rewards need one): error refuses the files at start-up naming the file, line and
    column; skip drops such rows and counts them (`data/dropped/<reason>`)."""
    eval_files: list = field(default_factory=list)
    """dataset: held-out files in the same format, scored by `eval` (every row, or `eval.max_samples`)."""
    reward: list = field(default_factory=lambda: ["exact"])
    """dataset: reward functions, summed with `reward_weights`: built-ins gsm8k (the completion's last
    number against the answer's "#### N"), boxed (the last \\boxed{...} against the answer, exactly),
    exact (the stripped completion against the answer), or a function by path "my_pkg.rewards:score"
    with TRL's signature fn(prompts, completions, **columns) -> list[float] (one per completion)."""
    reward_weights: list = field(default_factory=list)
    """dataset: one weight per entry of `reward`; empty = all 1.0."""
    reward_workers: int = 0
    """dataset: threads that compute rewards while the rollout keeps feeding the engine (for slow
    functions: judges, sandboxes); 0 waits for a group's rewards when its completions are in. Either
    way the functions run on worker threads (at least one), which bounds their time
    (`reward_timeout_s`): a function that needs the main thread (signal-based timeouts) must turn
    those off (docs/envs.md)."""
    prefetch_prompts: int = 64
    """dataset: prompt token ids (chat template and tokenizer) built ahead, for the next this many rows
    of the epoch's order, by one background thread while the engine decodes; 0 builds each when its
    group starts, on the thread that feeds the engine."""
    processes: int = 0
    """Copies of the env in worker processes, per inference rank: each plays the groups whose id is
    its own modulo N, so env stepping (Diplomacy: legal orders, adjudication, prompts, constraint
    tables) leaves the loop that feeds the engine; 0 runs the env on that loop. Group order within a
    batch then follows timing, so not with the exact-resume mode (update drain, no oversampling)."""
    max_reward_errors: int = 100
    """dataset: a reward function that raises (SystemExit too), outlasts `reward_timeout_s`, returns
    the wrong length, None, NaN / inf or a value beyond `reward_max_abs` scores that sample 0 from it
    and is counted (`rollout/reward_errors`, by kind `rollout/reward_errors/<kind>`); this many bad
    samples in a row from one function stop the run, naming it."""
    reward_timeout_s: float = 30.0
    """dataset: a reward function's call (one group) not answered within this many seconds is a
    `timeout` fault (its thread is abandoned: it cannot be killed; a function that runs code should
    bound itself)."""
    reward_max_abs: float = 1e6
    """dataset: a reward value beyond +-this is an `out_of_range` fault (it never reaches the loss:
    one huge value would swamp its group's advantages)."""
    options: dict = field(default_factory=dict)
    """Custom envs: keyword arguments handed to the env class's `from_config` (free-form)."""
    overlong_buffer: int = 0
    """DAPO's soft length penalty, for any env: a completion longer than engine.max_new_tokens minus
    this many tokens loses (length - (max_new_tokens - buffer)) / buffer of reward, up to 1 at
    max_new_tokens (applied by the rollout worker before advantages); 0 = off."""
    tools: list = field(default_factory=list)
    """dataset: functions the policy may call, by path ("my_pkg.tools:search"), as TRL's `tools=`:
    schema from type hints and the Google-style docstring, handed to the chat template's `tools=`.
    With tools or `environment` set, every row is a multi-turn episode trained as one trajectory
    (docs/agents.md)."""
    environment: str = ""
    """dataset: a class by path ("my_pkg.envs:MyEnv") in TRL's environment_factory shape: one
    instance per episode, `reset(**row)` returns None or text appended to the prompt, its public
    methods are tools, reward functions get the instances as `environments=` (docs/agents.md)."""
    tool_parser: str = "hermes"
    """Agents: how tool calls are read from a turn: hermes (Hermes / Qwen
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`)."""
    max_turns: int = 4
    """Agents: policy turns per episode; a turn that still calls a tool after this many ends it."""
    max_tool_calls: int = 8
    """Agents: tool calls per episode; a turn that would exceed it ends the episode."""
    tool_timeout_s: float = 10.0
    """Agents: a tool call not answered within this many seconds gets a timeout tool message (its
    thread is abandoned: docs/agents.md says how to sandbox tools that run code)."""
    tool_max_output_chars: int = 4000
    """Agents: a tool's output is cut to this many characters (counted as output_too_long)."""
    tool_workers: int = 8
    """Agents: the threads that run tool calls, per env (a fixed pool: a worker stuck in a hung call
    is abandoned and replaced, up to 8 threads beyond tool_workers; then the pool runs short)."""
    tool_budget_s: float = 60.0
    """Agents: wall time one episode may wait for its tool calls in all; a call's timeout is cut to
    what is left, and calls once it is spent are answered `over_budget` without running."""


@dataclass
class RolloutConfig:
    groups_per_step: int = 16
    """GRPO groups per learner step, summed over all inference ranks."""
    group_size: int = 8
    """Samples per group (G)."""
    batch_size: int = 0
    """Samples per learner step: derived as groups_per_step * group_size (leave it out; a value given
    must agree)."""
    seed: int = 0
    """Seed of prompt selection and sampling (offset per inference rank)."""
    oversample_groups: int = 0
    """Extra groups kept in play per inference rank; a batch ships as soon as enough groups finish,
    stragglers join a later batch (0 = every batch plays exactly its own groups). Needs
    learner.max_policy_lag >= 2: a batch then starts on a version one fresher than the budget
    allows, so a group carried over one batch is trained exactly at the budget (one carried twice
    is dropped as stale and counted)."""
    stream: bool = False
    """Each game sends its next phase to the engine as soon as its current one is answered, instead
    of every game waiting for the round's slowest completion (a phase barrier). Both engines
    stream: a poll hands back what finished while the rest keep decoding. With oversample_groups > 0
    the batch takes the groups that finish first in wall-clock time, which leans toward games with
    short completions."""
    update: str = "drain"
    """How a batch ends and an adapter update lands (docs/design.md, "Streamed rollouts"). drain:
    once its groups are complete the worker stops submitting and waits for every request in flight,
    so updates find the engine idle (exactly reproducible: the resume test's mode). inflight: the
    batch ships as soon as its groups are complete; requests in flight keep decoding, their groups
    join a later batch, a completed group is replaced at once (groups_per_step share +
    oversample_groups stay live), polls stream, and the next version lands between two engine steps
    under running requests. Each sample records the versions of its first and last token; the lag
    budget applies to the first, so batches start one version fresher than the budget (as with
    oversample_groups). Needs learner.max_policy_lag >= 1."""
    drop_uniform_groups: bool = False
    """DAPO dynamic sampling: a group whose rewards are all equal has zero advantage everywhere and
    carries no signal; drop it before the transport (counted as rollout/dropped_uniform_groups) and
    keep sampling new groups until the batch is full."""


@dataclass
class LearnerConfig:
    lr: float = 1e-3
    """AdamW learning rate of the adapter."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip; 0 disables."""
    num_steps: int = 50
    """Learner steps (= adapter versions) in the run."""
    micro_batch_tokens: int | str = 4096
    """Token budget of one forward/backward micro-batch, or auto: the largest the memory plan fits on
    the learner's GPU with 10 % of the card to spare (printed at start; 4096 without a GPU)."""
    activation_checkpointing: bool = False
    """Recompute decoder-block activations in backward."""
    compile: bool = False
    """torch.compile each decoder block (dynamic shapes); the first step pays the compilation."""
    prewarm: bool = True
    """Before the first batch arrives, while the engines start, run one synthetic update of
    `micro_batch_tokens` tokens through the step (compile, FSDP's all-gathers, attention, the loss
    kernel, the optimizer), then put the adapter, the optimizer state and the RNG back exactly: the
    first real step then costs about a steady one. Not the learning-rate warm-up (`warmup_steps`)."""
    reshard_after_forward: bool = True
    """FSDP2: free each decoder block's gathered weights after its forward (FSDP2's default). false
    keeps them until backward: half the all-gathers, for one unsharded copy of the blocks per
    learner GPU; for learners with memory to spare (profiles/HISTORY.md)."""
    fsdp: bool = True
    """Shard base model and adapter over the learner ranks with FSDP2 (one learner too). false: a full
    replica per learner, adapter gradients all-reduced (the reference path, for checking)."""
    attention: str = "auto"
    """Attention over packed micro-batches: varlen (flash-attention's varlen kernel on CUDA, causal SDPA
    per sequence length elsewhere), sdpa (block-diagonal causal mask, for comparison), auto (varlen)."""
    prefix_sharing: str = "off"
    """Forward shared prompt prefixes once per micro-batch (colocate/learner/prefix_tree.py): tree (a
    radix tree of the prompts, any depth: Diplomacy's instruction, board, power part), group (one level:
    each distinct whole prompt once, shared by its GRPO group), off (every sequence whole: the flat
    reference). Exact: the gradients equal off's up to rounding. Tree attention is FlexAttention on
    CUDA, a dense-mask SDPA elsewhere (or with attention sdpa)."""
    max_policy_lag: int = 0
    """A trajectory sampled with version v is trained at step s only if s - v <= this; 0 = synchronous."""
    updates_per_batch: int = 1
    """AdamW steps per rollout batch: the batch is split into this many shuffled mini-batches, one
    step each. Above 1, one no-grad forward at the start of the batch gives the policy the clip is
    taken against, and the importance weight against the sampler is applied apart from the clip
    (AReaL's decoupled objective), truncated at loss.tis_cap (2 unless set); 1 runs no extra
    forward. K steps move the adapter about K times as far per batch: with binary rewards turn on
    `scale_lr_by_signal` (cpu-tiny at K = 2 reaches 0.9 at the preset's rate with it, hovers
    without), or lower `lr` (profiles/README.md)."""
    lr_schedule: str = "constant"
    """constant, or cosine: the learning rate falls from `lr` to `lr * min_lr_ratio` along half a
    cosine over the steps after the warm-up (LR_SCHEDULES)."""
    warmup_steps: int = 0
    """Steps of linear warm-up from lr / warmup_steps to `lr`, before either schedule; 0 = none."""
    min_lr_ratio: float = 0.0
    """cosine: the learning rate at the last step, as a fraction of `lr`."""
    scale_lr_by_signal: bool = False
    """Multiply each batch's learning rate by the fraction of its sequences with a nonzero advantage
    (the groups that carry a gradient). AdamW divides a gradient by its running size, so without
    this a batch where 9 groups in 10 are uniform still moves every weight by about `lr`, steered by
    the few groups left: what makes a converged run drift and collapse (docs/design.md, "Why a
    converged run collapses"). With it the step shrinks with the signal, as SGD's would."""


@dataclass
class LossConfig:
    eps_low: float = 0.2
    """Lower clip of the importance ratio: ratio >= 1 - eps_low."""
    eps_high: float = 0.28
    """Upper clip of the importance ratio: ratio <= 1 + eps_high."""
    beta: float = 0.0
    """Weight of the k3 KL against the adapter-disabled model; 0 skips the reference pass."""
    norm: str = "dapo"
    """Token normalization: grpo (per-sequence mean), dapo (per-token mean), dr_grpo (fixed length)."""
    ratio_level: str = "token"
    """Importance ratio: token (GRPO), or sequence (GSPO: the geometric mean of the sequence's token
    ratios, clipped per sequence with seq_eps_low / seq_eps_high, its gradient spread over the
    sequence's tokens)."""
    seq_eps_low: float = 3e-4
    """ratio_level sequence: lower clip, ratio >= 1 - seq_eps_low."""
    seq_eps_high: float = 4e-4
    """ratio_level sequence: upper clip, ratio <= 1 + seq_eps_high."""
    tis_cap: float = 0.0
    """Truncated importance sampling: weight each token by min(pi_learner / pi_sampler, tis_cap),
    detached, apart from the clip (which is then taken against the learner's policy at the start
    of the batch); 0 = off with one update per batch, and 2 (TRL's and verl's default) with
    learner.updates_per_batch > 1, whose decoupled weight is otherwise unbounded (a large cap,
    e.g. 1000.0, leaves it in effect uncapped)."""
    mis_threshold: float = 0.0
    """Masked importance sampling: drop every sequence whose mean |log pi_learner - log pi_sampler|
    exceeds this (counted as learner/mis_masked_seqs); 0 = off."""
    clip_ratio_c: float = 0.0
    """Dual clip (verl's clip_ratio_c): a token with a negative advantage whose importance ratio
    passed this bound adds the constant -c A to the loss and no gradient, so one sample the policy
    has since made likelier cannot push its tokens down without limit; 0 = off, else > 1 (verl
    uses 3). The fused kernel takes it through its exact per-row path (docs/design.md)."""
    impl: str = "auto"
    """auto (triton on CUDA, torch elsewhere), triton or torch."""


@dataclass
class SyncConfig:
    backend: str = "auto"
    """auto (nccl on CUDA, gloo on CPU), nccl or gloo."""
    check_checksum: bool = False
    """Broadcast a checksum with every adapter and verify it on the receivers (debugging a sync)."""
    canary_every: int = 1
    """The sync canary (docs/design.md): every this many adapter versions, each engine and the learner
    score one fixed 48-token probe with that version, and the learner compares them
    (`sync/canary_gap`, ALERT canary_mismatch past a bound from the compute dtype's rounding); one
    short forward per side. 0 = off."""


@dataclass
class TopologyConfig:
    num_inference: int = 0
    """Inference ranks; 0 = half of the world (rounded down, at least 1)."""
    num_learners: int = 0
    """Learner ranks; 0 = the rest of the world."""
    timeout_s: float = 300.0
    """Collective timeout: a dead peer ends the job instead of hanging it."""
    placement: str = "by_node"
    """Roles over several nodes: by_node (inference ranks fill the first nodes, learners the rest:
    FSDP traffic stays inside nodes) or interleaved (every node holds both roles in the same
    proportion). One node: the first num_inference ranks infer either way."""


@dataclass
class MetricsConfig:
    run_dir: str = "runs/default"
    """Output directory: resolved config, TensorBoard events, summary.json, traces."""
    log_every: int = 1
    """Print a progress line every this many steps (one rank per role)."""
    tensorboard: bool = True
    """Write TensorBoard event files under <run_dir>/tb/<role> (when `loggers` names tensorboard)."""
    loggers: list = field(default_factory=lambda: ["tensorboard"])
    """Where scalars go: any of tensorboard, wandb, mlflow, trackio (LOGGERS). wandb, mlflow and
    trackio get the learner's scalars, the resolved config and the run name (the run directory's
    name); they are optional packages (`pip install -e ".[trackers]"`) and honour their own
    environment (WANDB_MODE=offline, MLFLOW_TRACKING_URI, TRACKIO_DIR ...)."""
    project: str = "colocate"
    """Tracker project (wandb project, mlflow experiment, trackio project)."""
    profile: bool = False
    """Record a torch.profiler trace window per role."""
    profile_wait: int = 1
    """Profiler: steps skipped before warm-up."""
    profile_warmup: int = 1
    """Profiler: warm-up steps."""
    profile_active: int = 2
    """Profiler: recorded steps."""
    profile_dir: str = "profiles"
    """Profiler traces go to <profile_dir>/<run name>/ (one trace file per role)."""
    profile_engine_steps: int = 40
    """vLLM inference rank 0: engine steps traced inside the engine core process (out of the role
    profiler's sight), from the profiled batch on, to <profile_dir>/<run name>/inference-engine/; 0 = none."""
    nvml_interval_s: float = 5.0
    """Seconds between NVML / CPU samples; 0 disables the sampler."""
    stall_timeout_s: float = 600.0
    """Alert when a role makes no progress (no trajectory produced or consumed) for this long; 0 = off."""
    max_nonfinite_steps: int = 3
    """A NaN/inf loss skips the update; this many in a row stop the run with an error."""
    reward_drop_alert: float = 0.1
    """ALERT reward_drop when the mean reward of the last `alert_window` steps falls this fraction
    below its running best (0.1: below 90 % of the best; on cpu-tiny's reproduction of a collapse
    it fires 18 steps into the slide, at 0.2 over 200 steps in, and never on the 5000-step soaks
    of the fixed preset: profiles/README.md); 0 = off."""
    entropy_alert: float = 0.0
    """ALERT entropy_collapse when the mean policy entropy (learner/entropy, nats per sampled token)
    of the last `alert_window` steps falls below this fraction of the mean of the window before
    it (a sudden fall, not the slow one of a converging policy); 0 = off."""
    grad_norm_alert: float = 10.0
    """ALERT grad_norm_spike when a step's gradient norm (before clipping) exceeds this many times
    the median of the previous `alert_window` steps; 0 = off."""
    alert_window: int = 20
    """Steps in the windows the alerts compare (reward, entropy, gradient norm)."""
    stop_on_collapse: bool = False
    """On ALERT reward_drop: write a checkpoint, name the newest checkpoint from before the drop in
    <run_dir>/checkpoints/last_good.json (never removed by checkpoint.keep), and end the run with
    exit code 3 (`colocate train`; under a bare torchrun every rank exits 3)."""
    stop_on_mismatch: bool = True
    """On ALERT canary_mismatch (an engine samples another policy than the learner trains: an update
    skipped, written to the wrong place or scaled wrong): stop before the next step, write a
    checkpoint when checkpoints are on and name the newest one from before that engine's samples
    were trained on in <run_dir>/checkpoints/last_good.json, and end the run with exit code 3."""
    peak_tflops: float = 790.0
    """Per-device dense bf16 peak for learner/mfu; the default is an H200's measured matmul peak,
    set it for other GPUs."""


@dataclass
class CheckpointConfig:
    every: int = 0
    """Write a checkpoint every this many steps (and at exit); 0 = only at exit."""
    keep: int = 2
    """Checkpoints kept (oldest removed); 0 keeps every one."""
    resume: str = ""
    """'' = fresh run, 'auto' = newest complete checkpoint in <run_dir>/checkpoints, or a path."""
    enabled: bool = False
    """Write checkpoints at all."""
    trust_unverified: bool = False
    """Resume from a checkpoint that has no manifest.json (written before manifests existed), after a
    one-line warning, or evaluate / export such an adapter: its files are still read and checked,
    only their hashes and base model cannot be."""


@dataclass
class EvalConfig:
    every: int = 0
    """Evaluate on the inference ranks every this many learner steps, between training batches;
    0 = only at the end of the run (when `at_end`)."""
    at_end: bool = False
    """Evaluate once more after the last step (results also go to summary.json)."""
    temperature: float = 0.0
    """Sampling temperature of evaluation; 0 = greedy."""
    games: int = 8
    """diplomacy: games per power and opponent kind: each of the 7 powers in turn plays the policy
    against six opponents of the kind (7 x games per kind)."""
    opponents: list = field(default_factory=lambda: ["random", "greedy"])
    """diplomacy: the fixed opponent kinds the policy plays against (EVAL_OPPONENTS)."""
    horizon_years: int = 2
    """diplomacy: years played from the opening before an evaluation game is scored."""
    max_samples: int = 0
    """dataset envs: rows of the eval split scored (0 = all)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


def field_docs(section_cls: type) -> dict[str, str]:
    """Field docstrings of a config dataclass (for `--help` and the README table)."""
    import ast
    import inspect
    tree = ast.parse(inspect.getsource(section_cls))
    docs, body = {}, tree.body[0].body
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = nxt.value.value
    return docs
