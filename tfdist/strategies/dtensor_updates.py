"""Optimizer updates that are correct on DTensor variables.

Keras 3's TensorFlow optimizers update a slot (`m.assign_add(...)`) and then
read the slot variable back to update the weight. Under DTensor's SPMD
expansion that read can return the value from *before* the assign: on the
first step Adam's m and v read as zero and the weights do not move, with no
error. It happens for embeddings, inside multi-step `tf.function` loops (the
trainer's) and whenever a slot's layout differs from its variable's (ZeRO-1);
only the equivalence tests against one device show it. These update steps
compute each new slot value once, assign it, and use the computed value (never
a read-back), with the same arithmetic as Keras (same formulas, same order).

With `--shard_optimizer_state` a slot may be split over more mesh axes than its
variable: the gradient is relaid out to the slot's layout, the update is
computed there, and relaid out to the variable's layout before it is applied.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor


class LayoutTable:
    """Layouts of each trainable variable and its slots, by the optimizer's index."""

    def __init__(self, var_layouts: list, slot_layouts: list):
        self.var_layouts, self.slot_layouts = var_layouts, slot_layouts

    def to_slot(self, index: int, value):
        layout = self.slot_layouts[index]
        return value if layout is None else dtensor.relayout(value, layout)

    def to_var(self, index: int, value):
        if self.slot_layouts[index] is None:
            return value
        return dtensor.relayout(value, self.var_layouts[index])


def _adam_update(self, gradient, variable, learning_rate):
    dtype = variable.dtype
    index = self._get_variable_index(variable)
    lr = tf.cast(learning_rate, dtype)
    g = self._tfdist_layouts.to_slot(index, tf.cast(gradient, dtype))
    step = tf.cast(self.iterations + 1, dtype)
    alpha = lr * tf.sqrt(1 - tf.pow(tf.cast(self.beta_2, dtype), step)) / (
        1 - tf.pow(tf.cast(self.beta_1, dtype), step))
    m, v = self._momentums[index], self._velocities[index]
    m_old, v_old = tf.convert_to_tensor(m), tf.convert_to_tensor(v)
    m_new = m_old + (g - m_old) * (1 - self.beta_1)
    v_new = v_old + (tf.square(g) - v_old) * (1 - self.beta_2)
    m.assign(m_new)
    v.assign(v_new)
    update = m_new * alpha / (tf.sqrt(v_new) + self.epsilon)
    variable.assign_sub(self._tfdist_layouts.to_var(index, update))


def _sgd_update(self, gradient, variable, learning_rate):
    dtype = variable.dtype
    index = self._get_variable_index(variable)
    lr = tf.cast(learning_rate, dtype)
    g = tf.cast(gradient, dtype)
    if not self.momentum:
        variable.assign_sub(g * lr)
        return
    g = self._tfdist_layouts.to_slot(index, g)
    m = self.momentums[index]
    m_new = tf.convert_to_tensor(m) * tf.cast(self.momentum, dtype) - g * lr
    m.assign(m_new)
    variable.assign_add(self._tfdist_layouts.to_var(index, m_new))


def install(optimizer, layouts: LayoutTable) -> None:
    """Replace `optimizer`'s per-variable update with a read-back-free one."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if isinstance(inner, keras.optimizers.Adam) and not inner.amsgrad:
        update = _adam_update          # AdamW too: Keras applies its decay before update_step
    elif type(inner) is keras.optimizers.SGD and not inner.nesterov:
        update = _sgd_update
    else:
        raise TypeError(f"--strategy=dtensor has no verified update for {type(inner).__name__}; "
                        "use sgd, momentum, adam or adamw")
    inner._tfdist_layouts = layouts
    inner.update_step = update.__get__(inner)
