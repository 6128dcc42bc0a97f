"""Keras 3 optimizers that leave the cross-replica reduction to the adapter."""

from __future__ import annotations

import keras

from tfdist.config import OptimizerConfig


def create(config: OptimizerConfig, learning_rate=None) -> keras.optimizers.Optimizer:
    """The optimizer `config` names; `learning_rate` may be a schedule."""
    lr = config.learning_rate if learning_rate is None else learning_rate
    if config.name == "sgd":
        optimizer = keras.optimizers.SGD(lr)
    elif config.name == "momentum":
        optimizer = keras.optimizers.SGD(lr, momentum=config.momentum)
    elif config.name == "adam":
        optimizer = keras.optimizers.Adam(lr)
    else:
        optimizer = keras.optimizers.AdamW(lr, weight_decay=config.weight_decay)
    return without_builtin_reduction(optimizer)


def without_builtin_reduction(optimizer: keras.optimizers.Optimizer):
    """Stop `optimizer.apply` from summing gradients across replicas itself.

    Keras 3's TensorFlow optimizer all-reduces gradients inside `apply` when it
    runs in a tf.distribute replica context (`_all_reduce_sum_gradients`).
    tfdist reduces once per update through the strategy adapter instead, so
    that accumulation, compression and Horovod share one path; a second sum
    would multiply the gradients by the number of replicas. This is the one
    place tfdist relies on a private Keras method; the equivalence tests fail
    loudly if Keras changes it.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if not hasattr(inner, "_all_reduce_sum_gradients"):
        raise RuntimeError("this Keras version has no Optimizer._all_reduce_sum_gradients; "
                           "tfdist's gradient reduction needs updating for it")
    inner._all_reduce_sum_gradients = lambda grads_and_vars: grads_and_vars
    return optimizer
