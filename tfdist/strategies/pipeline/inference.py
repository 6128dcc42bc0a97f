"""Inference through a pipeline's stages across processes
(`StagesInference`): evaluation's forward pass, and the predictions a
`tfdist.mesh_model.StagesModel` returns to every worker."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfdist.mesh_model import padded_batches
from tfdist.strategies.pipeline.collectives import EveryWorker, Transfer


class StagesInference:
    """The members of `PipelineStrategy` that run the stages forward only,
    across processes (a part of it, reading `local_stages`, `replica`,
    `_stage_models`, `_stage_outputs`, ...)."""

    def forward(self, x, y, instance_base: int = Transfer.EVAL_INSTANCE_BASE):
        """This worker's stages of the evaluation forward pass of one batch,
        in model order: (the model's output, []) where it runs the last
        stage, else (None, [the sends to the next stages]). Stage 0 reads
        `x`, the others receive their neighbour's output (or take it here);
        `y` gives the batch's rows."""
        transfer = Transfer(self, self.replica, tf.shape(tf.nest.flatten(y)[0])[0],
                            instance_base=instance_base)
        out, sends = None, []
        for stage in self.local_stages:
            with tf.name_scope(f"stage{stage}_E0"):
                if stage == 0:
                    source = x
                elif stage - 1 not in self.local_stages:
                    source = transfer.receive_activation(stage, 0)
                else:
                    source = out
                out = self._stage_models[stage](None if stage == 0 else source, x,
                                                training=False)
                if stage + 1 < self.num_stages and stage + 1 not in self.local_stages:
                    sends.append(transfer.send_activation(stage, 0, out))
        if self.num_stages - 1 not in self.local_stages:
            return None, sends
        with tf.control_dependencies(sends):   # the output, once this worker's sends ran
            return tf.nest.map_structure(tf.identity, out), []

    def predict_through_stages(self, x, batch: int):
        """The model's outputs for host inputs `x`, in padded batches of
        `batch` rows, each through this pipeline replica's stages as in
        evaluation; the last stage's outputs (replica 0's) are summed with
        zeros from every other worker, so every worker returns them. Every
        worker calls this with the same `x`."""
        if batch not in self._predict_steps:   # its own boundary instances (see Transfer)
            base = Transfer.PREDICT_INSTANCE_BASE + 2 * len(self._predict_steps)
            self._predict_steps[batch] = tf.function(
                lambda inputs: self.run(self._stages_output, inputs, base), autograph=False)
        outputs = []
        for chunk, real in padded_batches(x, batch):
            out = self._predict_steps[batch](tf.nest.pack_sequence_as(x, chunk))
            outputs.append(tf.nest.map_structure(lambda t, n=real: t.numpy()[:n], out))
        return tf.nest.map_structure(lambda *parts: np.concatenate(parts), *outputs)

    def _stages_output(self, inputs, instance_base: int):
        """One batch's outputs, on every worker (see `predict_through_stages`)."""
        out, sends = self.forward(inputs, inputs, instance_base)
        spec = self._stage_outputs[self.num_stages - 1]
        rows = tf.shape(tf.nest.flatten(inputs)[0])[0]
        # (`forward` returns no sends where it returns the output: they are
        # its control dependencies.)
        if out is None or self.replica:   # zeros, once this worker's stages have run
            ran = sends + (tf.nest.flatten(out) if out is not None else [])
            with tf.control_dependencies(ran):
                out = tf.nest.map_structure(lambda s: tf.zeros(
                    tf.concat([[rows], tf.constant(s.shape[1:], tf.int32)], 0), s.dtype), spec)
        wire = [tf.cast(t, tf.float32) for t in tf.nest.flatten(out)]
        summed = EveryWorker(self).sum(wire, instance_base + 1)
        return tf.nest.pack_sequence_as(spec, [tf.cast(t, s.dtype) for t, s in
                                               zip(summed, tf.nest.flatten(spec))])
