"""Keras 3 optimizers that leave the cross-replica reduction to the adapter."""

from __future__ import annotations

import keras
import tensorflow as tf

from tfdist import compat
from tfdist.config import OptimizerConfig
from tfdist.training import schedules


def peak_learning_rate(config: OptimizerConfig, global_batch_size: int) -> float:
    return schedules.scaled_learning_rate(config.learning_rate, config.lr_scaling,
                                          global_batch_size, config.base_batch_size)


def create(config: OptimizerConfig, *, global_batch_size: int, total_steps: int,
           lr_factor=None) -> keras.optimizers.Optimizer:
    """The optimizer `config` names, with its learning-rate schedule, times
    `lr_factor()` per update where the engine gives one (`PerUpdateFactor`,
    installed after construction so that the optimizer's variables are those
    of every engine: see `compat.learning_rate_times`).

    Clipping (`global_clipnorm`) runs inside `apply`, i.e. after the
    cross-replica sum, so every replica clips the same gradient.
    """
    lr = config.learning_rate
    if config.lr_scaling != "none" or config.warmup_steps or config.lr_decay != "constant":
        lr = schedules.WarmupDecay(peak_learning_rate(config, global_batch_size),
                                   warmup_steps=config.warmup_steps, total_steps=total_steps,
                                   decay=config.lr_decay)
    common = {"global_clipnorm": config.clip_grad_norm}
    if config.name == "sgd":
        optimizer = keras.optimizers.SGD(lr, **common)
    elif config.name == "momentum":
        optimizer = keras.optimizers.SGD(lr, momentum=config.momentum, **common)
    elif config.name == "adam":
        optimizer = keras.optimizers.Adam(lr, **common)
    else:
        optimizer = keras.optimizers.AdamW(lr, weight_decay=config.weight_decay, **common)
    if lr_factor is not None:
        compat.learning_rate_times(optimizer, lr_factor)
    return without_builtin_reduction(optimizer)


def inner(optimizer):
    """The optimizer that steps (a LossScaleOptimizer's inner one)."""
    return getattr(optimizer, "inner_optimizer", optimizer)


def current_learning_rate(optimizer) -> float:
    return float(tf.convert_to_tensor(inner(optimizer).learning_rate).numpy())


def without_builtin_reduction(optimizer: keras.optimizers.Optimizer):
    """Stop `optimizer.apply` from summing gradients across replicas itself:
    tfdist reduces once per update through the strategy adapter (so that
    accumulation, compression and Horovod share one path), and a second sum
    would multiply the gradients by the number of replicas. The private Keras
    hook this replaces, and its check, are in `tfdist.compat`."""
    return compat.disable_optimizer_all_reduce(optimizer)
