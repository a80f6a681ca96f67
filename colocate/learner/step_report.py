"""What each learner step reports beside its scalars: the step line (`step_line`, with the inference
ranks' busy share and the ETA, `StepClock`) and its row of `summary.json`'s timeline (`TimelineRow`,
read back by the e2e benchmark)."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TimelineRow:
    """One learner step's times (unix seconds) and sync costs; `summary.json`'s `timeline` holds one
    per step, as a JSON object, and the e2e benchmark takes its steady-state figures from them."""
    wait_start: float   # the step began waiting for its shards
    train_start: float  # they arrived
    train_end: float    # the train step ended
    step_end: float     # the adapter was sent and the step logged
    policy_lag: float   # mean policy lag of the trained sequences
    gather_s: float     # the adapter gather
    send_s: float       # the adapter send
    canary_s: float = 0.0  # the learner's canary probe (`RankCanary.score_apart`); 0: the version was not scored
    canary_device_ms: float = 0.0  # an earlier probe's device time, read at this step (`DeviceTimer`); 0: none
    canary_rode: bool = False  # the probe rode this step's first forward (the version it started from): its
    # cost is inside the train time, no time of its own

    def to_json(self) -> dict:
        return asdict(self)


def step_line(step: int, num_steps: int, stats: dict, waits: dict, tail: str) -> str:
    """The step's line: its stats, its wait and the inference ranks' busy share (`waits`), then
    `tail` (the canary's gap, the ETA)."""
    errors = int(stats["reward_errors"])  # samples no reward function scored: say so on the line
    return (f"step {step + 1}/{num_steps} reward {stats['reward']:.3f} "
            + (f"({errors} reward errors) " if errors else "") +
            f"loss {stats['loss']:+.4f} kl {stats['kl']:.4f} clip {stats['clip_fraction']:.3f} "
            f"ent {stats['entropy']:.3f} gnorm {stats['grad_norm']:.3f} "
            f"ratio {stats['ratio']:.3f}/{stats['ratio_max']:.2f} zadv {stats['zero_adv_fraction']:.2f} "
            f"lag {stats['policy_lag_mean']:.1f} tok/s {stats['tokens_per_s']:.0f} "
            f"step {stats['step_s']:.2f}s wait {waits['wait_s']:.2f}s{busy_text(waits)}{tail}")


def busy_text(waits: dict) -> str:
    """The step line's inference busy share: the inference ranks' time collecting their last batch
    over the interval it took them (mean over ranks), beside the learner's `wait`."""
    busy = waits.get("inference_busy")
    return "" if busy is None else f" inf {busy:.0%} busy"


class StepClock:
    """The ETA on a step line: the mean time of the steps since the first one this process logged
    (the first includes warm-up), times the steps left."""

    def __init__(self, num_steps: int):
        self.num_steps, self.first = num_steps, None

    def text(self, step: int) -> str:
        now = time.perf_counter()
        if self.first is None:
            self.first = (step, now)
        done, left = step - self.first[0], self.num_steps - 1 - step
        if done <= 0 or left <= 0:
            return ""
        eta = (now - self.first[1]) / done * left
        return f" eta {int(eta // 3600)}:{int(eta % 3600 // 60):02d}:{int(eta % 60):02d}"
