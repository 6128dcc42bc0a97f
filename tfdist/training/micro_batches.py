"""Micro-batches: `summed`, how a replica's gradients are summed over its
micro-batches, and `MicroBatchLoss`, how the trainer forms one micro-batch's
loss, handed to an engine that runs the forward and backward passes itself."""

from __future__ import annotations

import tensorflow as tf

from tfdist.strategies.capabilities import LocalGradients


def summed(gradients, batch, k: int, unrolled: bool) -> LocalGradients:
    """`gradients` (x, y, weight -> `LocalGradients`) of `batch` split into
    `k` micro-batches along the batch, summed: in TensorFlow's loop, one
    micro-batch's activations alive at a time, or `unrolled` (k copies).

    Unrolled on a mesh: DTensor re-exports a while loop nested in another
    (the train loop's) under its op name, and a later training in the same
    process then failed to add it ("Cannot add function 'while/while_body'
    because a different function with the same name already exists"; TF
    2.21, also with a unique name scope per trace)."""
    parts = tf.nest.map_structure(lambda t: tf.reshape(t, [k, -1, *t.shape[1:]]), batch)
    first = gradients(*_take(parts, 0))
    data, separate, counters = first.data, first.regularization, first.counters

    def add(i, data, separate, counters):
        more = gradients(*_take(parts, i))
        return ([g + m for g, m in zip(data, more.data)],
                [g + m for g, m in zip(separate, more.regularization)],
                counters + more.counters)

    if unrolled:
        for i in range(1, k):
            data, separate, counters = add(i, data, separate, counters)
    else:
        # The loop starts once the first micro-batch is done: its body's
        # forward pass needs only the counter, and TensorFlow otherwise ran it
        # beside the first (two micro-batches' activations alive: the
        # transformer at 2 micro-batches peaked as high as at one).
        with tf.control_dependencies([*data, *separate, counters]):
            start = tf.identity(tf.constant(1))
        _, data, separate, counters = tf.while_loop(
            lambda i, *_: i < k, lambda i, *state: (i + 1, *add(i, *state)),
            (start, data, separate, counters), parallel_iterations=1)
    return LocalGradients(data, separate, counters, first.provisional_divisor)


def _take(parts, i):
    """Micro-batch `i` of (x, y, weight) split into [k, ...] along the batch."""
    return tf.nest.map_structure(lambda t: t[i], parts)


class MicroBatchLoss:
    """How the trainer forms one micro-batch's loss, for an engine that runs
    the forward and backward passes itself (`PipelineStages`): the same
    scaling, counters and regularization as `Trainer._micro_batch_gradients`."""

    def __init__(self, trainer: "Trainer"):
        self._trainer = trainer
        self.micro_batches = trainer.train_config.accum_steps
        self.variables = trainer.model.trainable_variables
        self._final = True

    def loss(self, y, y_pred, weight):
        """(the micro-batch's share of the global loss, its counters, whether
        that share is final: False when the divisor depends on the data and
        the gradients are rescaled after the sum, `LocalGradients`)."""
        loss, counters, global_divisor = self._trainer._loss_and_counters(y, y_pred, weight)
        self._final = bool(global_divisor)
        return loss, counters, self._final

    def regularization(self, losses):
        """A micro-batch's share of regularization losses `losses`."""
        return self._trainer._regularization_share(losses)

    def scale(self, loss):
        """The loss as differentiated (scaled by a mixed_float16 loss scale)."""
        return self._trainer.optimizer.scale_loss(loss)

    def provisional_divisor(self):
        """`LocalGradients.provisional_divisor` for the losses formed so far."""
        return None if self._final else tf.constant(
            float(self._trainer.global_batch_size), tf.float32)
