"""The PyTorch reference loss against the float64 oracle (`tests/loss_oracle.py`), for every norm mode."""
import math
import zlib

import pytest
import torch

from colocate.kernels import LossBatch, LossRows, LossSpec, grpo_loss
from tests.loss_oracle import loss_float64, norm_weights


@pytest.mark.parametrize("norm", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_reference_matches_float64_formula(norm, beta):
    # crc32, not hash(): str hashes change per process (PYTHONHASHSEED), and so did this test's data
    g = torch.Generator().manual_seed(zlib.crc32(repr((norm, beta)).encode()))
    n, v = 29, 37
    logits = torch.randn(n, v, generator=g, dtype=torch.float64) * 2
    targets = torch.randint(0, v, (n,), generator=g)
    seq_ids = torch.sort(torch.randint(0, 5, (n,), generator=g)).values
    mask = torch.rand(n, generator=g) > 0.2
    mask[3] = False  # at least one masked token, whatever the draw
    with torch.no_grad():
        true_logp = torch.log_softmax(logits / 0.7, -1).gather(1, targets[:, None]).squeeze(1)
    old = true_logp + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)  # ratios on both sides of the clip
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    ref = true_logp + 0.2 * torch.randn(n, generator=g, dtype=torch.float64)
    spec = LossSpec(temperature=0.7, eps_low=0.2, eps_high=0.28, beta=beta, norm=norm, max_len=12, impl="torch")
    # the sampled log-probs are `old`: one update per batch, the ratio against the sampler
    expected = loss_float64(logits, LossRows(targets, norm_weights(mask, seq_ids, spec), old, adv, ref, seq_ids),
                            spec)

    x = logits.float().clone().requires_grad_(True)
    loss, stats = grpo_loss(x, LossBatch(targets, mask, old.float(), adv.float(), ref.float(), seq_ids=seq_ids), spec)
    loss.backward()
    assert math.isclose(loss.item(), expected.loss.item(), rel_tol=1e-5, abs_tol=1e-7)
    torch.testing.assert_close(x.grad.double(), expected.grad, rtol=1e-4, atol=1e-7)
    assert x.grad[~mask].abs().max() == 0  # masked tokens get no gradient
    assert 0.0 <= float(stats["clip_fraction"]) <= 1.0 and float(stats["num_tokens"]) == float(mask.sum())


def test_allowed_ids_restrict_the_softmax():
    """With allowed ids the loss equals the loss on logits with disallowed entries at -inf."""
    g = torch.Generator().manual_seed(1)
    n, v = 11, 50
    logits = torch.randn(n, v, generator=g)
    allowed = torch.stack([torch.randperm(v, generator=g)[:6] for _ in range(n)]).int()
    allowed[::3, 4:] = -1
    targets = allowed[:, 0].long()
    old, adv = -torch.rand(n, generator=g), torch.randn(n, generator=g)
    mask = torch.ones(n, dtype=torch.bool)
    masked = torch.full_like(logits, float("-inf"))
    valid = allowed >= 0
    for i in range(n):
        masked[i, allowed[i][valid[i]].long()] = logits[i, allowed[i][valid[i]].long()]
    a = logits.clone().requires_grad_(True)
    la, _ = grpo_loss(a, LossBatch(targets, mask, old, adv, allowed_ids=allowed), LossSpec(impl="torch"))
    la.backward()
    lb, _ = grpo_loss(masked, LossBatch(targets, mask, old, adv), LossSpec(impl="torch"))
    assert torch.allclose(la, lb, atol=1e-6)
    outside = torch.ones_like(logits, dtype=torch.bool)
    for i in range(n):
        outside[i, allowed[i][valid[i]].long()] = False
    assert a.grad[outside].abs().max() == 0


def test_target_outside_allowed_is_an_error():
    logits = torch.randn(2, 10)
    with pytest.raises(ValueError, match="not among its allowed ids"):
        grpo_loss(logits, LossBatch(torch.tensor([1, 2]), torch.ones(2), torch.zeros(2), torch.ones(2),
                                    allowed_ids=torch.tensor([[1, 3], [4, 5]])), LossSpec(impl="torch"))
