"""`MicroBatchLoss`: how the trainer forms one micro-batch's loss, handed to
an engine that runs the forward and backward passes itself."""

from __future__ import annotations

import tensorflow as tf


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
