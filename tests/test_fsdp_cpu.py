"""FSDP2 on CPU (gloo): two learner ranks end with the adapter one unsharded rank gets on the same data.

The two ranks hold different numbers of sequences (so one of them runs dummy micro-batches), the
loss uses per-sequence normalization and a KL term (reference pass with the adapter disabled), and
the micro-batch budget forces several micro-batches per rank. Tolerance: fp32 everywhere, only the
order of summation differs, so the adapters agree to 1e-5 after two AdamW steps (lr 1e-3; an
update is ~lr, so a missed micro-batch shows as ~1e-3; a wrong gradient factor shows in the grad norm).
"""
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import REPO, free_port
from tests.test_packing import random_batch

SHAPES = [(9, 3), (14, 1), (5, 6), (11, 4), (7, 2), (12, 5), (6, 3), (10, 2)]
RANK_SEQUENCES = [[0, 1, 2, 3, 4], [5, 6, 7]]
# LoRA rank 3: lora_A's 3 rows shard unevenly (2 + 1), as FSDP2's chunking does for real shapes
OVERRIDES = {"lora": {"rank": 3, "alpha": 6.0},
             "learner": {"lr": 1e-3, "micro_batch_tokens": 32, "max_grad_norm": 1.0},
             "loss": {"beta": 0.04, "norm": "grpo", "impl": "torch"}}
NUM_STEPS = 2


def _setup(cache_dir: str, extra: dict):
    from colocate.config import load_config
    from colocate.envs import env_corpus
    from colocate.models import load_tokenizer
    cfg = load_config(os.path.join(REPO, "configs/cpu-tiny.yaml"),
                      {**OVERRIDES, "learner": {**OVERRIDES["learner"], **extra},
                       "model": {"cache_dir": cache_dir}})
    tok = load_tokenizer(cfg.model, *reversed(env_corpus(cfg)))
    return cfg, tok


def _train(cfg, tok, topo, batch):
    from colocate.learner.learner import Learner
    from colocate.models import build_policy
    learner = Learner(cfg, topo, build_policy(cfg, tok, "meta"), tok)
    initial = {n: t.clone() for n, t in learner.lora_state().items()}  # unsharded: views of the params
    losses = []  # (loss, grad norm) per step: Adam is blind to a gradient scale, the norm is not
    for _ in range(NUM_STEPS):
        batch.versions[:] = learner.version
        stats = learner.train_step(batch)
        losses.append((stats["loss"], stats["grad_norm"]))
    final = {n: t.clone() for n, t in learner.lora_state().items()}  # LoraGather: the sync's fast path
    return initial, final, losses, learner


def _worker(rank, port, cache_dir, result_path, variants):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from colocate.topology import Topology
    results = []
    for extra in variants:
        cfg, tok = _setup(cache_dir, extra)
        topo = Topology(rank=rank, world_size=2, local_rank=rank, num_inference=0, num_learners=2,
                        device=torch.device("cpu"), backend="gloo", learner_group=dist.new_group([0, 1]))
        batch = random_batch(len(tok), SHAPES).select(RANK_SEQUENCES[rank])
        initial, final, losses, learner = _train(cfg, tok, topo, batch)
        from colocate.learner.fsdp import gather_full_lora
        reference = gather_full_lora(learner.model)  # one full_tensor() per tensor
        assert list(reference) == list(final)
        for name in final:
            assert torch.equal(final[name], reference[name]), name
        results.append({"initial": initial, "final": final, "losses": torch.tensor(losses)})
    if rank == 0:
        torch.save(results, result_path)
    dist.destroy_process_group()


def _single_rank(cache_dir: str, extra: dict):
    from colocate.topology import Topology
    cfg, tok = _setup(cache_dir, {**extra, "fsdp": False})
    topo = Topology(rank=0, world_size=1, local_rank=0, num_inference=0, num_learners=1,
                    device=torch.device("cpu"), backend="gloo")
    return _train(cfg, tok, topo, random_batch(len(tok), SHAPES))[:3]


def test_two_fsdp_ranks_match_one_rank(tmp_path, tiny_cfg, tiny_tokenizer):
    """Plain, with activation checkpointing (the wrapper must not leak into the names), with the
    blocks kept gathered from forward to backward (`reshard_after_forward: false`), and with prefix
    trees (the prompts share a prefix; the dummy micro-batches are trees too)."""
    variants = [{}, {"activation_checkpointing": True}, {"reshard_after_forward": False}, {"prefix_sharing": "tree"}]
    cache = tiny_cfg.model.cache_dir  # the tokenizer the fixtures already built
    result = str(tmp_path / "result.pt")
    references = [_single_rank(cache, extra) for extra in variants]
    # fork: the children inherit the modules imported above (spawn would re-import them: +20 s)
    mp.start_processes(_worker, args=(free_port(), cache, result, variants), nprocs=2, join=True,
                       start_method="fork")
    for extra, got, reference in zip(variants, torch.load(result, weights_only=True), references):
        ref_initial, ref_final, ref_losses = reference
        assert list(got["final"]) == list(ref_final), extra  # the same canonical names, same order
        for name in ref_final:
            assert torch.equal(got["initial"][name], ref_initial[name]), name  # sharded init == unsharded
            torch.testing.assert_close(got["final"][name], ref_final[name], atol=1e-5, rtol=0, msg=name)
        moved = max(float((ref_final[n] - ref_initial[n]).abs().max()) for n in ref_final)
        assert moved > 5e-4  # the adapter did train
        torch.testing.assert_close(got["losses"], torch.tensor(ref_losses), atol=1e-6, rtol=1e-5)


def test_gathered_adapter_names_match_unsharded_lora_state(tiny_cfg, tiny_tokenizer):
    from colocate.learner.fsdp import gather_full_lora
    from colocate.models import lora_state
    from colocate.models import build_policy
    model = build_policy(tiny_cfg, tiny_tokenizer, "cpu")
    plain = lora_state(model)
    gathered = gather_full_lora(model)  # unsharded: no collective, same names and values
    assert list(gathered) == list(plain)
    for n in plain:
        assert torch.equal(gathered[n], plain[n])


class _Stack(torch.nn.Module):
    """The layout `fsdp.decoder_layers` expects (model.model.layers), three linear "blocks"."""
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        for layer in self.model.layers:
            x = layer(x)
        return x


def _reshard_worker(rank, port, result_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from colocate.learner.fsdp import apply_fsdp
    gathered = {}
    for keep in (False, True):
        model = _Stack()
        apply_fsdp(model, init_device_mesh("cpu", (1,)), reshard_after_forward=not keep)
        model(torch.randn(2, 4)).sum()  # forward only: what stays gathered until backward
        gathered[str(keep)] = [not isinstance(layer.weight, DTensor) for layer in model.model.layers]
    with open(result_path, "w") as f:
        json.dump(gathered, f)
    dist.destroy_process_group()


def test_reshard_after_forward_false_keeps_every_block_gathered_until_backward(tmp_path):
    result = str(tmp_path / "gathered.json")
    mp.start_processes(_reshard_worker, args=(free_port(), result), nprocs=1, join=True, start_method="fork")
    with open(result) as f:
        gathered = json.load(f)
    assert gathered["False"] == [False, False, True]  # default: only the last block (backward starts there)
    assert gathered["True"] == [True, True, True]


def test_step_stats_over_micro_batches_equal_one_pass_over_the_batch(tiny_cfg, tiny_tokenizer):
    """train_step accumulates the loss and the token-weighted stats on the device over several
    micro-batches; they equal one loss call over the whole batch packed as one micro-batch."""
    from colocate.kernels import LossBatch, LossSpec, grpo_loss
    from colocate.learner.learner import Learner
    from colocate.learner.packing import completion_logits, packed_micro_batch
    from colocate.learner.passes import reference_logprobs
    from colocate.topology import Topology
    from colocate.models import build_policy
    cfg, tok = _setup(tiny_cfg.model.cache_dir, {"fsdp": False})
    topo = Topology(rank=0, world_size=1, local_rank=0, num_inference=0, num_learners=1,
                    device=torch.device("cpu"), backend="gloo")
    learner = Learner(cfg, topo, build_policy(cfg, tok, "meta"), tok)
    batch = random_batch(len(tok), SHAPES)
    batch.versions[:] = learner.version
    assert len(learner.micro_batches(batch)) >= 3  # the budget (32 tokens) splits it
    whole = packed_micro_batch(batch, learner.device, learner.attention)
    with torch.no_grad():
        ref = reference_logprobs(learner, whole, None)
        loss, stats = grpo_loss(
            completion_logits(learner.model, whole),
            LossBatch(whole.targets, torch.ones_like(whole.targets, dtype=torch.bool), batch.behaviour_logprobs,
                      batch.advantages[whole.seq_ids], ref, seq_ids=whole.seq_ids, num_seqs=batch.num_sequences,
                      num_tokens=batch.num_completion_tokens),
            LossSpec(temperature=cfg.engine.temperature, eps_low=cfg.loss.eps_low, eps_high=cfg.loss.eps_high,
                     beta=cfg.loss.beta, norm=cfg.loss.norm, max_len=cfg.engine.max_new_tokens, impl="torch"))
    got = learner.train_step(batch)
    assert got["tokens"] == float(stats["num_tokens"]) == batch.num_completion_tokens
    assert got["model_tokens"] == int(batch.seq_lens.sum()) == whole.num_tokens
    for key, want in (("loss", loss), ("clip_fraction", stats["clip_fraction"]), ("kl", stats["kl"]),
                      ("ratio", stats["ratio"])):
        assert got[key] == pytest.approx(float(want), rel=1e-5, abs=1e-7), key


def test_scale_lr_by_signal_stops_adamw_drifting_on_a_batch_without_signal(tiny_cfg, tiny_tokenizer):
    """The drift behind a converged run's collapse (docs/design.md): after a batch whose sequences all
    have a zero advantage (zero gradient: beta 0 here), AdamW still moves the adapter, its momentum
    carrying the last step on. At the second step with g = 0, the bias-corrected update per
    coordinate is lr * (0.1 * 0.9 / 0.19) / sqrt(0.001 * 0.999 / 0.001999) = 0.67 lr where the
    first gradient was nonzero. With learner.scale_lr_by_signal the rate is lr times the fraction of
    sequences with a nonzero advantage: exactly lr / 2 for half of them, and 0 for none, where the
    adapter stays bit for bit."""
    from colocate.learner.learner import Learner
    from colocate.topology import Topology
    from colocate.models import build_policy
    topo = Topology(rank=0, world_size=1, local_rank=0, num_inference=0, num_learners=1,
                    device=torch.device("cpu"), backend="gloo")
    for scale in (False, True):
        cfg, tok = _setup(tiny_cfg.model.cache_dir, {"fsdp": False, "scale_lr_by_signal": scale})
        cfg.loss.beta = 0.0
        learner = Learner(cfg, topo, build_policy(cfg, tok, "meta"), tok)
        batch = random_batch(len(tok), SHAPES)
        assert bool((batch.advantages != 0).all())
        batch.advantages[: len(SHAPES) // 2] = 0.0  # half the sequences carry no signal
        batch.versions[:] = learner.version
        assert learner.train_step(batch)["lr"] == cfg.learner.lr * (0.5 if scale else 1.0)
        before = {n: t.clone() for n, t in learner.lora_state().items()}
        batch.advantages[:] = 0.0  # none does
        batch.versions[:] = learner.version
        stats = learner.train_step(batch)
        moved = max(float((t - before[n]).abs().max()) for n, t in learner.lora_state().items())
        if scale:
            assert stats["lr"] == 0.0 and moved == 0.0
        else:
            assert stats["lr"] == cfg.learner.lr and moved == pytest.approx(0.67 * cfg.learner.lr, rel=0.01)
