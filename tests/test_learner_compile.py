"""`learner.compile` on the GPU's prefix-tree path, on the CPU: the graphs the warm-up compiles, and
the steps after it against the eager learner's.

FlexAttention has no CPU backward, so `dense_flex` stands in for the compiled kernel behind the same
compiler-disabled call (`tree_attention.tree_flex_attention`): the compiled blocks break their graphs
where the GPU's do. Dynamo's graphs and AOTAutograd's traces do not depend on the backend behind
them, so `aot_eager` counts them in seconds (inductor's code generation is what it leaves out)."""
import torch
import torch.nn.functional as F
import pytest

from tests.test_startup import SHAPES, _learner, blocks_compiled_with

BLOCK_GRAPHS = 2
"""The decoder block's graphs, one set for every block: before the attention call and after it."""


def dense_flex(query, key, value, block_mask=None, scale=None, enable_gqa=False):
    """flex_attention's stand-in: SDPA under the BlockMask's own rule, evaluated on every (query, key)."""
    idx = torch.arange(query.shape[2], device=query.device)
    mask = block_mask.mask_mod(0, 0, idx[:, None], idx[None, :])
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


@pytest.fixture
def tree_flex_on_cpu(monkeypatch, compile_configs):
    """Learners built now take the GPU's tree attention (TREE_FLEX, `dense_flex` inside) and compile
    their blocks with `aot_eager`; the attention registry, the compile configs (`compile_configs`) and
    Dynamo's caches are put back after."""
    from transformers import AttentionInterface
    from colocate.learner import fsdp, packing, tree_attention
    from colocate.learner import learner as learner_module
    monkeypatch.setattr(AttentionInterface, "_global_mapping", dict(AttentionInterface._global_mapping))
    monkeypatch.setattr(packing, "_REGISTERED", set())  # set_attention registers ours again, `dense_flex` bound
    monkeypatch.setattr(tree_attention, "_flex", lambda compiled: dense_flex)
    monkeypatch.setattr(learner_module, "resolve_attention", lambda *args: tree_attention.TREE_FLEX)
    monkeypatch.setattr(fsdp, "apply_compile", blocks_compiled_with("aot_eager"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _single_rank():
    from colocate.topology import Topology
    return Topology(rank=0, world_size=1, local_rank=0, num_inference=0, num_learners=1,
                    device=torch.device("cpu"), backend="gloo")


def _compiled() -> tuple[int, int, int]:
    """Dynamo's counts so far in this process: (graphs, AOTAutograd traces begun, finished)."""
    from torch._dynamo.utils import counters
    aot = counters["aot_autograd"]
    return int(counters["stats"]["unique_graphs"]), int(aot["total"]), int(aot["ok"])


def test_the_warm_up_compiles_each_block_graph_once_for_every_block(tree_flex_on_cpu, tiny_cfg, tiny_tokenizer):
    """The warm-up (the canary's probe riding it) compiles the block's graphs once for all blocks: one
    on each side of the attention call (Dynamo resumes after the break where it happened: no graphs
    of the frames above it), the first block's input requires grad as the others' do (no
    `requires_grad` guard gives it graphs of its own), and no AOTAutograd trace is abandoned (LoRA's
    float scale traced as a symbol restarted every graph holding a projection). A step after it,
    micro-batches of other lengths and the probe riding, compiles nothing."""
    from tests.test_packing import random_batch
    learner, vocab = _learner(tiny_cfg.model.cache_dir, {"learner": {"compile": True, "prefix_sharing": "tree"}},
                              _single_rank())
    assert learner.attention == "colocate_tree_flex" and learner.model.config.num_hidden_layers > 1
    graphs0, begun0, done0 = _compiled()
    learner.warm_up(probe=list(range(2, 40)))
    graphs, begun, done = _compiled()
    assert (graphs - graphs0, begun - begun0, done - done0) == (BLOCK_GRAPHS, BLOCK_GRAPHS, BLOCK_GRAPHS)
    batch = random_batch(vocab, SHAPES, seed=0)
    learner.train_step(batch, list(range(2, 40)))
    assert _compiled() == (graphs, begun, done)


def _loss_and_grads(learner, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The step's forward/backward over its micro-batches -> (loss, {canonical name: LoRA gradient})."""
    from colocate.learner.passes import forward_backward
    from colocate.models import canonical_name
    learner.model.zero_grad(set_to_none=True)
    work = learner.micro_batches(batch)
    passes = forward_backward(learner, work, len(work), batch.num_sequences, float(batch.num_completion_tokens))
    return passes.sums[0], {canonical_name(n): p.grad.clone() for n, p in learner.model.named_parameters()
                            if p.requires_grad}


def test_compiled_tree_blocks_compute_the_eager_loss_and_gradients(tree_flex_on_cpu, tiny_cfg, tiny_tokenizer):
    """After the warm-up, compiled blocks (the first block's input made to require grad) against eager
    ones on the same tree path and micro-batches of several lengths: the loss and every LoRA gradient
    within float32 rounding of sums taken in another order (`aot_eager` runs the same ops, its
    backward accumulates in its own order)."""
    from tests.test_packing import random_batch, randomize_adapter
    runs = []
    for compiled in (True, False):
        learner, vocab = _learner(tiny_cfg.model.cache_dir, {"learner": {"compile": compiled, "prefix_sharing": "tree"}},
                                  _single_rank())
        randomize_adapter(learner.model)  # B non-zero: every LoRA gradient is
        learner.warm_up()
        runs.append((learner.lora_state(), *_loss_and_grads(learner, random_batch(vocab, SHAPES))))
    (adapter_c, loss_c, grads_c), (adapter, loss, grads) = runs
    assert all(torch.equal(adapter_c[n], t) for n, t in adapter.items())
    torch.testing.assert_close(loss_c, loss, rtol=1e-5, atol=0)
    scale = max(float(g.abs().max()) for g in grads.values())
    assert grads_c.keys() == grads.keys() and all(float(g.abs().max()) > 0 for g in grads.values())
    for name, g in grads.items():
        torch.testing.assert_close(grads_c[name], g, rtol=1e-5, atol=1e-6 * scale, msg=name)
