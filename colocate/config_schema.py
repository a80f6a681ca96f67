"""The run configuration's schema: one dataclass per component, each field documented by the string
literal under it (the torchtitan habit; `field_docs` reads them for `--help` and the README).

Only what the fields are and their defaults; how a run's config is built from YAML and overrides,
and checked, is `colocate.config`.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    path: str = ""
    """Local HF model directory. Empty: build the embedded tiny model (random weights, local tokenizer)."""
    shape: str = "tiny"
    """Named random-init shape when `path` is empty: tiny, qwen2.5-0.5b, qwen2.5-7b."""
    dtype: str = "float32"
    """Parameter dtype of the base model: float32 or bfloat16."""
    cache_dir: str = ".cache/colocate"
    """Where the embedded tokenizer and tiny model are built once and reused."""
    seed: int = 0
    """Seed of the random base weights (all ranks build the same model from it)."""


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
    """Add the LoRA term inside the up-projection GEMM (`addmm`, beta=1, alpha=scaling) instead of
    peft's separate `* scaling` and `+` over [tokens, out] (`models.set_fused_lora`)."""


@dataclass
class EngineConfig:
    kind: str = "auto"
    """auto (vllm on CUDA when installed, else hf), hf or vllm."""
    max_new_tokens: int = 8
    """Most tokens sampled per completion."""
    temperature: float = 1.0
    """Sampling temperature; the learner divides logits by the same value."""
    max_num_seqs: int = 512
    """vLLM: most sequences in flight."""
    gpu_memory_utilization: float = 0.85
    """vLLM: fraction of the GPU the engine may take."""
    max_model_len: int = 0
    """vLLM: context length; 0 sizes it from the workload (prompt + max_new_tokens)."""
    enforce_eager: bool = False
    """vLLM: disable CUDA graphs (debugging only)."""
    enable_prefix_caching: bool = True
    """vLLM: share KV blocks of common prompt prefixes."""
    max_num_batched_tokens: int = 0
    """vLLM: most tokens (prefill chunks + one per decoding sequence) in one engine step; 0 keeps
    vLLM's default (16384 on an H200). Streaming rollouts want it small, so that prefills of new
    phases do not slow every other game's decode steps."""
    max_capture_tokens: int = 2048
    """vLLM: CUDA graphs for mixed steps (prefill chunks + decodes) up to min(max_num_batched_tokens,
    this) tokens; larger steps run every kernel from Python. Decode sizes (up to max_num_seqs) are
    always captured; 0 captures only those, which left the mixed steps of streamed rollouts
    without graphs, host-bound (profiles/e2e.md, session 10: 1.20x end to end). jump_forward
    captures its own sizes."""
    cudagraph_mode: str = ""
    """vLLM: "" keeps vLLM's FULL_AND_PIECEWISE (full graphs for decode steps, piecewise ones with
    eager attention for mixed steps); FULL replays mixed steps as full graphs too; PIECEWISE. Not
    with jump_forward."""
    lora_mode: str = "slot"
    """vLLM: how the adapter reaches the engine. slot: one pinned LoRA slot written in place (vLLM's
    LoRA kernels run every step). merged: W0 + (alpha/r) B A written into the base weights on each
    update (no LoRA kernels; keeps a copy of the adapted base weights, ~12 GiB at 7B; bf16 rounds
    away updates below half an ulp of W0, see engine/vllm_worker.py)."""
    jump_forward: int = 0
    """vLLM: most grammar-forced tokens taken in one engine step (0 = off). Each constrained
    request's next forced tokens go to vLLM as a speculative draft; with token grammars (the
    default) the rejection sampler always accepts them, and sampling stays exact for any draft
    (engine/vllm_ff.py). Needs vLLM's synchronous scheduling and V1 model runner, which it selects;
    with lora_mode=slot, max_num_batched_tokens >= max_num_seqs * (1 + jump_forward). Not yet
    measured on GPUs."""
    validate_grammars: bool = True
    """vLLM: let vLLM's client check every request's grammar with llguidance before it queues the
    request (~1 ms of the inference rank's host time per request at a 152k vocabulary). Our
    grammars are generated (engine/vllm_grammar.py, checked against llguidance in the tests) and
    the engine core compiles each one anyway. false skips the check in the inference rank's
    process: a grammar the core could not compile would then surface when its completion's replay
    disagrees with the Constraint (an error either way; with the check, at submit)."""


@dataclass
class EnvConfig:
    name: str = "arithmetic"
    """Environment: arithmetic (synthetic, verifiable) or diplomacy."""
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
    """diplomacy: each order line starts with its unit (A PAR - BUR). false: the line leaves the unit
    out (- BUR) and its position names it; under the constraint those tokens are forced, so this
    saves about a third of the decode steps (envs/diplomacy/prompt.py). Meant for constrained
    sampling: in free text one stray line shifts the positions of all later ones."""
    list_supports: bool = True
    """diplomacy: the prompt lists each unit's legal supports and convoys. false: only moves, holds,
    convoyed moves and retreats are listed (the constraint still allows every legal order). Supports
    are 70 % of a power's own part, which is what the engine prefills per request: false cuts the
    prefill per request by about two thirds, at the cost of a less informed policy."""
    state_cache: str = ""
    """diplomacy: JSON-lines file of mid-game states to fork from; empty starts from the opening."""
    reward_target: float = 0.9
    """Mean reward the run is expected to reach; summary.json says whether it did."""


@dataclass
class RolloutConfig:
    groups_per_step: int = 16
    """GRPO groups per learner step, summed over all inference ranks."""
    group_size: int = 8
    """Samples per group (G)."""
    batch_size: int = 128
    """Samples per learner step = groups_per_step * group_size; checked."""
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
    of every game waiting for the round's slowest completion (a phase barrier). Needs an engine
    that streams (vLLM); the HF engine answers all pending requests at once either way. With
    oversample_groups > 0 the batch takes the groups that finish first in wall-clock time, which
    leans toward games with short completions."""


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
    micro_batch_tokens: int = 4096
    """Token budget of one forward/backward micro-batch."""
    activation_checkpointing: bool = False
    """Recompute decoder-block activations in backward."""
    compile: bool = False
    """torch.compile each decoder block (dynamic shapes); the first step pays the compilation."""
    reshard_after_forward: bool = True
    """FSDP2: free each decoder block's gathered weights after its forward and gather them again in
    backward (FSDP2's default). false keeps them from forward to backward: half the all-gathers per
    micro-batch, for one unsharded copy of the blocks' weights per learner GPU (+11.4 GiB at 7B with 2
    learners), measured 1.02x on 2 x H200 (profiles/trainer.md, run 9)."""
    prefetch_blocks: int = 0
    """FSDP2: all-gather this many decoder blocks ahead in forward (and behind in backward),
    explicitly; 0 keeps FSDP2's implicit one-block prefetch. Each costs one more gathered block per
    GPU (~0.47 GB at 7B). 2 measured 1.003x on 4 x H200 (profiles/trainer.md, run 11)."""
    fsdp: bool = True
    """Shard base model and adapter over the learner ranks with FSDP2 (one learner too: same code path,
    and bf16 compute with fp32 reductions on GPU). False: a full replica per learner, adapter gradients
    all-reduced (the reference path)."""
    attention: str = "auto"
    """Attention over packed micro-batches: varlen (flash-attention varlen kernel, sequence boundaries
    from cu_seqlens), sdpa (block-diagonal causal mask), auto (varlen on CUDA, sdpa elsewhere)."""
    max_policy_lag: int = 0
    """A trajectory sampled with version v is trained at step s only if s - v <= this; 0 = synchronous."""


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
    impl: str = "auto"
    """auto (triton on CUDA, torch elsewhere), triton or torch."""


@dataclass
class SyncConfig:
    backend: str = "auto"
    """auto (nccl on CUDA, gloo on CPU), nccl or gloo."""
    check_checksum: bool = False
    """Broadcast a checksum with every adapter and verify it on the receivers."""
    fanout: str = "broadcast"
    """vLLM engines: how each adapter version reaches them. broadcast: one NCCL group of learner
    rank 0 and every engine, so every engine takes a version at the same moment (one that finished
    its batch first waits at the broadcast for the others). per_engine: one group per engine, each
    send on its own CUDA stream, so each engine takes a version when it is ready; the learner's
    later kernels still wait until every engine has it. The HF engine always takes the broadcast
    on the torch sync group."""


@dataclass
class TopologyConfig:
    num_inference: int = 0
    """Inference ranks; 0 = half of the world (rounded down, at least 1)."""
    num_learners: int = 0
    """Learner ranks; 0 = the rest of the world."""
    timeout_s: float = 300.0
    """Collective timeout: a dead peer ends the job instead of hanging it."""


@dataclass
class MetricsConfig:
    run_dir: str = "runs/default"
    """Output directory: resolved config, TensorBoard events, summary.json, traces."""
    log_every: int = 1
    """Print a progress line every this many steps (one rank per role)."""
    tensorboard: bool = True
    """Write TensorBoard event files under <run_dir>/tb/<role>."""
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
    """vLLM inference rank 0: engine steps recorded in the engine core's own trace, from the first
    batch the role profiler records (the engine's GPU work runs in that child process, out of the
    role profiler's sight); written to <profile_dir>/<run name>/inference-engine/. 0 = none."""
    nvml_interval_s: float = 5.0
    """Seconds between NVML / CPU samples; 0 disables the sampler."""
    stall_timeout_s: float = 600.0
    """Alert when a role makes no progress (no trajectory produced or consumed) for this long; 0 = off."""
    max_nonfinite_steps: int = 3
    """A NaN/inf loss skips the update; this many in a row stop the run with an error."""
    peak_tflops: float = 790.0
    """Per-device dense bf16 peak for learner/mfu (790 = measured H200 matmul peak)."""


@dataclass
class CheckpointConfig:
    every: int = 0
    """Write a checkpoint every this many steps (and at exit); 0 = only at exit."""
    keep: int = 2
    """Checkpoints kept (oldest removed)."""
    resume: str = ""
    """'' = fresh run, 'auto' = newest complete checkpoint in <run_dir>/checkpoints, or a path."""
    enabled: bool = False
    """Write checkpoints at all."""


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
