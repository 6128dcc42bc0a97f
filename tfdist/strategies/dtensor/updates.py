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

Under ZeRO (`--zero_stage`) slots, gradients and variables may be split over
more mesh axes than the layout the update is computed in: see `LayoutTable`.
"""

from __future__ import annotations

import functools

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist import compat


class LayoutTable:
    """Layouts of each trainable variable, its slots and its update, by the
    optimizer's index.

    The update is computed in one layout: the variable's (stage 0), or the
    slots', split over `batch` (stages 1-3). A slot stored in another layout
    would be relayouted for the update (`read`) and back when stored
    (`store`); the weight update is relayouted to the variable's layout when
    that differs (`to_variable`: ZeRO-1 and 2 gather it, as ZeRO's all-gather
    of the updated parameters). The gradient: ZeRO-2 splits it as it leaves
    the backward pass (`DTensorStrategy.shard_gradients`), ZeRO-3's comes back
    split, ZeRO-1's is split here (`gradient`). Relaying a gradient out to the
    split layout directly let DTensor's layout propagation push the split back
    into the backward pass, which then failed to compile (EmitAllScatter, and
    "'tf.Tile' op requires ..."); pinned to its variable's layout first, it
    compiles.
    """

    def __init__(self, var_layouts: list, slot_layouts: list, update_layouts: list,
                 split_gradients: bool = False):
        self.var_layouts, self.slot_layouts = var_layouts, slot_layouts
        self.update_layouts = update_layouts
        self.split_gradients = split_gradients

    def gradient(self, index: int, value):
        """The gradient in the update's layout. ZeRO-1's arrives whole over
        `batch` (in its variable's layout) and is split here, a local slice
        (`split_gradient`)."""
        if not self.split_gradients or self.var_layouts[index] == self.update_layouts[index]:
            return value
        return split_gradient(value, self.var_layouts[index], self.update_layouts[index])

    def read(self, index: int, slot):
        value = tf.convert_to_tensor(slot)
        if self.slot_layouts[index] == self.update_layouts[index]:
            return value
        return dtensor.relayout(value, self.update_layouts[index])

    def store(self, index: int, slot, value):
        if self.slot_layouts[index] != self.update_layouts[index]:
            value = dtensor.relayout(value, self.slot_layouts[index])
        slot.assign(value)

    def to_variable(self, index: int, value):
        if self.var_layouts[index] != self.update_layouts[index]:
            value = dtensor.relayout(value, self.var_layouts[index])
        return value


def split_gradient(gradient, variable_layout, layout):
    """`gradient` (whole over `batch`) relayouted to the more split `layout`,
    pinned to its variable's layout first: the split alone, propagated back
    into the backward pass by DTensor's layout propagation, failed to compile
    there (EmitAllScatter; on the transformer "'tf.Tile' op requires
    input.shape[0] (32) * 1 to be equal to output.shape[0] (16)")."""
    return dtensor.relayout(dtensor.relayout(gradient, variable_layout), layout)


def _adam_update(self, layouts, gradient, variable, learning_rate):
    dtype = variable.dtype
    index = compat.variable_index(self, variable)
    lr = tf.cast(learning_rate, dtype)
    g = layouts.gradient(index, tf.cast(gradient, dtype))
    step = tf.cast(self.iterations + 1, dtype)
    alpha = lr * tf.sqrt(1 - tf.pow(tf.cast(self.beta_2, dtype), step)) / (
        1 - tf.pow(tf.cast(self.beta_1, dtype), step))
    momentums, velocities = compat.adam_slots(self)
    m, v = momentums[index], velocities[index]
    m_old, v_old = layouts.read(index, m), layouts.read(index, v)
    m_new = m_old + (g - m_old) * (1 - self.beta_1)
    v_new = v_old + (tf.square(g) - v_old) * (1 - self.beta_2)
    layouts.store(index, m, m_new)
    layouts.store(index, v, v_new)
    variable.assign_sub(layouts.to_variable(index, m_new * alpha / (tf.sqrt(v_new) + self.epsilon)))


def _sgd_update(self, layouts, gradient, variable, learning_rate):
    dtype = variable.dtype
    index = compat.variable_index(self, variable)
    lr = tf.cast(learning_rate, dtype)
    g = layouts.gradient(index, tf.cast(gradient, dtype))
    if not self.momentum:
        variable.assign_sub(layouts.to_variable(index, g * lr))
        return
    m = self.momentums[index]
    m_new = layouts.read(index, m) * tf.cast(self.momentum, dtype) - g * lr
    layouts.store(index, m, m_new)
    variable.assign_add(layouts.to_variable(index, m_new))


def install(optimizer, layouts: LayoutTable) -> None:
    """Replace `optimizer`'s per-variable update with a read-back-free one."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if isinstance(inner, keras.optimizers.Adam) and not inner.amsgrad:
        update = _adam_update          # AdamW too: Keras applies its decay before update_step
        compat.adam_slots(inner)       # fails here, in one line, if Keras renamed them
    elif type(inner) is keras.optimizers.SGD and not inner.nesterov:
        update = _sgd_update
    else:
        raise TypeError(f"--strategy=dtensor has no verified update for {type(inner).__name__}; "
                        "use sgd, momentum, adam or adamw")
    inner.update_step = functools.partial(update, inner, layouts)
