"""Learning rate: scaling with the global batch, warm-up, decay.

Large global batches want a proportionally larger learning rate (Goyal et
al.: linear; square root is the gentler rule, common with Adam), reached by
a linear warm-up so the first steps don't diverge.
"""

from __future__ import annotations

import math

import keras
from keras import ops


def scaled_learning_rate(base_lr: float, rule: str, global_batch: int, base_batch: int) -> float:
    """The peak learning rate for `global_batch`, given `base_lr` tuned at `base_batch`."""
    ratio = global_batch / base_batch
    return base_lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]


class WarmupDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up from 0 to `peak` over `warmup_steps`, then constant or a
    cosine decay to 0 at `total_steps`."""

    def __init__(self, peak: float, *, warmup_steps: int, total_steps: int, decay: str):
        self.peak = peak
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.decay = decay

    def __call__(self, step):
        step = ops.cast(step, "float32")
        warmup = ops.minimum(1.0, (step + 1.0) / max(1, self.warmup_steps))
        if self.decay == "constant":
            return self.peak * warmup
        progress = ops.clip((step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps),
                            0.0, 1.0)
        return self.peak * warmup * 0.5 * (1.0 + ops.cos(math.pi * progress))

    def get_config(self):
        return {"peak": self.peak, "warmup_steps": self.warmup_steps,
                "total_steps": self.total_steps, "decay": self.decay}


class PerUpdateFactor(keras.optimizers.schedules.LearningRateSchedule):
    """`base` (a schedule, a constant or the optimizer's learning-rate
    variable) times `factor()`: a float32 tensor the engine computes for the
    update being applied, traced inside its step (a parameter-server
    update's 1 / (1 + staleness)), or 1.0 outside one."""

    def __init__(self, base, factor):
        self.base = base
        self.factor = factor

    def __call__(self, step):
        schedule = isinstance(self.base, keras.optimizers.schedules.LearningRateSchedule)
        base = self.base(step) if schedule else ops.cast(self.base, "float32")
        return base * self.factor()

    def get_config(self):
        if isinstance(self.base, keras.optimizers.schedules.LearningRateSchedule):
            return {"base": keras.optimizers.schedules.serialize(self.base)}
        return {"base": float(ops.convert_to_numpy(self.base))}
