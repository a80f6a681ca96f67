"""Adapter sync and trajectory transport across real processes (gloo), plus flatten/unflatten."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from colocate.data import TrajectoryBatch
from colocate.sync import LoraSpec, broadcast_lora, checksum, flatten_lora, receive_lora, unflatten_lora
from tests.conftest import free_port


def test_flatten_unflatten_roundtrip():
    tensors = {"b": torch.randn(3, 4), "a": torch.randn(5), "c": torch.randn(2, 2, 2)}
    spec = LoraSpec.of(tensors)
    assert spec.names == ("a", "b", "c") and spec.numel == 5 + 12 + 8
    flat = flatten_lora(tensors, spec)
    back = unflatten_lora(flat, spec)
    for n in tensors:
        assert torch.equal(back[n], tensors[n])
    assert back["a"].data_ptr() == flat.data_ptr()  # views, no copies
    flat2 = flat.clone()
    flat2[0] += 1e-3
    assert checksum(flat) != checksum(flat2)


def _sync_worker(rank, port, cache_dir, result_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from colocate.config import load_config
    from colocate.engine.hf import HFEngine
    from colocate.envs import env_corpus
    from colocate.models import load_tokenizer, lora_state
    from colocate.train import build_policy
    from tests.conftest import REPO
    cfg = load_config(os.path.join(REPO, "configs/cpu-tiny.yaml"), {"model": {"cache_dir": cache_dir}})
    tok = load_tokenizer(cfg.model, *reversed(env_corpus(cfg)))
    model = build_policy(cfg, tok, torch.device("cpu"))
    group = dist.new_group([0, 1])
    spec = LoraSpec.of(lora_state(model))
    if rank == 0:  # learner: a trained-looking adapter, then a few updates
        for version in (1, 2, 3):
            with torch.no_grad():
                for p in lora_state(model).values():
                    p.add_(torch.randn_like(p) * 0.1)
            broadcast_lora(lora_state(model), spec, version, src=0, group=group, with_checksum=True)
        flat = flatten_lora(lora_state(model), spec)
        dist.broadcast(flat, src=1, group=group)  # the inference rank's copy, sent back
        ok = torch.equal(flat, flatten_lora(lora_state(model), spec))
        torch.save({"bit_identical": torch.tensor(ok)}, result_path)
        # Transport: receive a batch and write it back for comparison.
        from colocate.rollout.transport import recv_batch
        batch = recv_batch(1, group)
        torch.save(batch.tensors(), result_path + ".batch")
    else:
        engine = HFEngine(model, tok)
        with torch.no_grad():
            for p in engine.lora_state().values():
                p.zero_()
        for expected in (1, 2, 3):
            version, tensors, sent, _ = receive_lora(spec, src=0, group=group, device="cpu")
            engine.load_lora(version, tensors)
            assert version == expected and engine.version == expected
            assert checksum(flatten_lora(engine.lora_state(), spec)) == sent
        dist.broadcast(flatten_lora(engine.lora_state(), spec), src=1, group=group)
        from colocate.rollout.transport import send_batch
        send_batch(_example_batch(), 0, group)
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


def test_inference_rank_adapter_is_bit_identical_after_sync(tmp_path):
    result = str(tmp_path / "result.pt")
    mp.spawn(_sync_worker, args=(free_port(), str(tmp_path / "cache"), result), nprocs=2, join=True)
    assert bool(torch.load(result, weights_only=True)["bit_identical"])
    got = torch.load(result + ".batch", weights_only=True)
    want = _example_batch().tensors()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_shard_and_concat_roundtrip():
    from colocate.rollout.transport import shard_batch
    b = _example_batch()
    shards = shard_batch(b, 2)
    assert [s.num_sequences for s in shards] == [1, 1]
    back = TrajectoryBatch.concat(shards)
    for k, v in b.tensors().items():
        assert torch.equal(back.tensors()[k], v), k
