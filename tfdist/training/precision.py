"""Numeric precision: Keras 3 dtype policies plus loss scaling for float16.

    float32          everything in float32
    mixed_bfloat16   compute in bfloat16, variables float32 (same exponent
                     range as float32: no loss scaling; AMX-BF16 CPUs and
                     recent GPUs run it much faster)
    mixed_float16    compute in float16, variables float32, dynamic loss
                     scaling (Keras 3 `LossScaleOptimizer`)

Model builders end in a float32 logits layer, and the loss is computed on
those logits, so the loss stays float32 under every policy.
"""

from __future__ import annotations

import contextlib

import keras


class Precision:
    """The dtype policy to build the model under, and loss scaling for float16."""

    def __init__(self, policy: str = "float32", *, loss_scale_growth_steps: int = 2000):
        self.policy = policy
        self.loss_scale_growth_steps = loss_scale_growth_steps

    @property
    def loss_scaling(self) -> bool:
        return self.policy == "mixed_float16"

    @contextlib.contextmanager
    def policy_scope(self):
        """Build layers under this policy; the global policy is restored after
        (layers keep the policy they were created with)."""
        previous = keras.config.dtype_policy()
        keras.config.set_dtype_policy(self.policy)
        try:
            yield
        finally:
            keras.config.set_dtype_policy(previous)

    def wrap_optimizer(self, optimizer):
        """float16: `LossScaleOptimizer` (scale_loss before the gradient; apply()
        unscales, skips non-finite steps and lowers the scale)."""
        if not self.loss_scaling:
            return optimizer
        return keras.optimizers.LossScaleOptimizer(
            optimizer, dynamic_growth_steps=self.loss_scale_growth_steps)

    @staticmethod
    def dynamic_scale(optimizer):
        """The loss-scale variable of a `LossScaleOptimizer`, else None."""
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            return optimizer.dynamic_scale
        return None

    @staticmethod
    def applying_optimizer(optimizer):
        """The optimizer whose update steps change the variables (a
        `LossScaleOptimizer` hands the unscaled gradients to its inner one)."""
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            return optimizer.inner_optimizer
        return optimizer

    @staticmethod
    def loss_scale(optimizer):
        """The current loss scale, or None without loss scaling."""
        scale = Precision.dynamic_scale(optimizer)
        return None if scale is None else float(scale.numpy())
