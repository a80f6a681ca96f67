"""The adapter channel and the trajectory transport across real processes (gloo): the inference
rank's engine ends up bit-identical to the learner's adapter, run-control flags arrive with their
version, and a batch crosses unchanged with its flags and (when given) the engine's canary score."""
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from colocate.data import TrajectoryBatch
from colocate.wire import ProbeScore, RunFlags
from tests.conftest import free_port

FLAGS = {1: RunFlags.NONE, 2: RunFlags.CHECKPOINT, 3: RunFlags.CHECKPOINT | RunFlags.STOP}


def _learner(model, spec, group, result_path):
    from colocate.channel import BroadcastSender
    from colocate.models import lora_state
    from colocate.wire import flatten_lora, recv_batch
    sender = BroadcastSender(spec, src=0, group=group, with_checksum=True)
    for version, flags in FLAGS.items():  # a trained-looking adapter, then a few updates
        with torch.no_grad():
            for p in lora_state(model).values():
                p.add_(torch.randn_like(p) * 0.1)
        sender.send(flatten_lora(lora_state(model), spec), version, flags)
    flat = flatten_lora(lora_state(model), spec)
    dist.broadcast(flat, src=1, group=group)  # the inference rank's copy, sent back
    shard = recv_batch(1, group)
    plain = recv_batch(1, group)
    from safetensors.torch import save_file
    save_file(shard.batch.tensors(), result_path + ".batch.safetensors")
    with open(result_path, "w") as f:
        json.dump({"bit_identical": torch.equal(flat, flatten_lora(lora_state(model), spec)),
                   "batch_flags": int(shard.flags), "canary_version": shard.canary.version,
                   "canary": shard.canary.logprobs.tolist(), "plain_canary": plain.canary is None,
                   "plain_flags": int(plain.flags), "busy": shard.busy, "plain_busy": plain.busy}, f)


def _inference(model, tok, spec, group, result_path):
    from colocate.channel import BroadcastReceiver
    from colocate.engine.hf import HFEngine
    from colocate.wire import flatten_lora, send_batch
    engine = HFEngine(model, tok)
    with torch.no_grad():
        for p in engine.lora_state().values():
            p.zero_()
    receiver = BroadcastReceiver(engine, spec, src=0, group=group, device="cpu")
    updates = []
    for _ in FLAGS:
        updates.append((receiver.receive(), engine.version))
    dist.broadcast(flatten_lora(engine.lora_state(), spec), src=1, group=group)
    send_batch(_example_batch(), 0, group, flags=RunFlags.STOP, canary=ProbeScore(5, -torch.arange(7.0) / 8),
               busy=0.4567)
    send_batch(_example_batch(), 0, group)
    with open(result_path + ".updates", "w") as f:
        json.dump([{"version": u.version, "flags": int(u.flags), "engine_version": version,
                    "checksum_ok": u.metrics.get("checksum_ok")} for u, version in updates], f)


def _channel_worker(rank, port, cache_dir, result_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from colocate.config import load_config
    from colocate.envs import env_corpus
    from colocate.models import load_tokenizer, lora_state
    from colocate.models import build_policy
    from colocate.wire import LoraSpec
    from tests.conftest import REPO
    cfg = load_config(os.path.join(REPO, "configs/cpu-tiny.yaml"), {"model": {"cache_dir": cache_dir}})
    tok = load_tokenizer(cfg.model, *reversed(env_corpus(cfg)))
    model = build_policy(cfg, tok, torch.device("cpu"))
    group = dist.new_group([0, 1])
    spec = LoraSpec.of(lora_state(model))
    if rank == 0:
        _learner(model, spec, group, result_path)
    else:
        _inference(model, tok, spec, group, result_path)
    dist.destroy_process_group()


def _example_batch() -> TrajectoryBatch:
    g = torch.Generator().manual_seed(0)
    return TrajectoryBatch(tokens=torch.randint(0, 100, (17,), generator=g, dtype=torch.int32),
                           seq_lens=torch.tensor([9, 8], dtype=torch.int32),
                           prompt_lens=torch.tensor([6, 5], dtype=torch.int32),
                           behaviour_logprobs=-torch.rand(6, generator=g),
                           advantages=torch.tensor([0.5, -0.5]), rewards=torch.tensor([1.0, 0.0]),
                           versions=torch.tensor([3, 3], dtype=torch.int32),
                           allowed_ids=torch.randint(-1, 100, (6, 4), generator=g, dtype=torch.int32))


def test_broadcast_channel_gives_the_engine_the_learners_bytes_with_flags(tmp_path):
    result = str(tmp_path / "result.json")
    mp.spawn(_channel_worker, args=(free_port(), str(tmp_path / "cache"), result), nprocs=2, join=True)
    with open(result) as f:
        learner = json.load(f)
    with open(result + ".updates") as f:
        updates = json.load(f)
    assert learner["bit_identical"]
    assert [(u["version"], u["flags"], u["engine_version"]) for u in updates] == \
        [(v, int(f), v) for v, f in FLAGS.items()]
    assert all(u["checksum_ok"] == 1.0 for u in updates)
    assert learner["batch_flags"] == int(RunFlags.STOP)
    assert learner["canary_version"] == 5 and learner["canary"] == (-torch.arange(7.0) / 8).tolist()
    assert learner["plain_canary"] and learner["plain_flags"] == 0
    assert learner["busy"] == 0.457 and learner["plain_busy"] is None  # permille in the header; none when not known
    from safetensors.torch import load_file
    got, want = load_file(result + ".batch.safetensors"), _example_batch().tensors()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_shard_and_concat_roundtrip():
    from colocate.data import shard_batch
    b = _example_batch()
    shards = shard_batch(b, 2)
    assert [s.num_sequences for s in shards] == [1, 1]
    back = TrajectoryBatch.concat(shards)
    for k, v in b.tensors().items():
        assert torch.equal(back.tensors()[k], v), k
