"""The config's loss section -> the run's `LossSpec`, built once (`kernels/` knows no config): which
policy objective, its clip range, the normalization, the KL weight, the sampler's temperature."""
from __future__ import annotations

from colocate.kernels import LossSpec, Objective

DECOUPLED_TIS_CAP = 2.0
"""The cap on the decoupled importance weight exp(old - behaviour) with K > 1 updates per batch when
`loss.tis_cap` is left at 0: the truncation TRL (vLLM importance sampling) and verl (rollout IS)
default to (AReaL's behav_imp_weight_cap drops the tokens above its cap instead). Uncapped, a token
the stale sampler rarely drew and the learner has since raised weighs many times its share and
steers the mini-batch step (cpu-tiny at K = 2: profiles/README.md)."""


def loss_spec(cfg) -> LossSpec:
    """The loss of a run: a sequence ratio has its own clip range; K > 1 updates per batch cap the
    decoupled importance weight at `DECOUPLED_TIS_CAP` unless `loss.tis_cap` is set; dr_grpo's fixed
    length is `engine.max_new_tokens`."""
    loss = cfg.loss
    tis_cap = loss.tis_cap or (DECOUPLED_TIS_CAP if cfg.learner.updates_per_batch > 1 else 0.0)
    objective = Objective(loss.ratio_level, tis_cap, loss.mis_threshold, loss.clip_ratio_c)
    sequence = loss.ratio_level == "sequence"
    return LossSpec(objective=objective, norm=loss.norm,
                    eps_low=loss.seq_eps_low if sequence else loss.eps_low,
                    eps_high=loss.seq_eps_high if sequence else loss.eps_high,
                    beta=loss.beta, temperature=cfg.engine.temperature, max_len=cfg.engine.max_new_tokens,
                    impl=loss.impl)
