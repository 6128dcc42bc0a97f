"""`--synthetic`: random tensors of the dataset's shapes, for benchmarking.

The batch is made once per pipeline and repeated, so throughput measures the
model and the engine, not the input pipeline.
"""

from __future__ import annotations

import tensorflow as tf

from tfdist.data.inputs import Inputs
from tfdist.data.spec import DatasetSpec


class SyntheticInputs(Inputs):
    has_eval = False

    def __init__(self, spec: DatasetSpec):
        self.spec = spec

    def _random_example_batch(self, n: int, seed: int):
        spec = self.spec
        if spec.kind == "tokens":
            x = tf.random.stateless_uniform((n, *spec.input_shape), (seed, 0), 0,
                                            spec.num_classes, dtype=tf.int32)
            y = tf.roll(x, shift=-1, axis=1)
        elif spec.kind == "text":   # token ids of the vocabulary, one class per example
            x = tf.random.stateless_uniform((n, *spec.input_shape), (seed, 0), 0,
                                            spec.vocab_size, dtype=tf.int32)
            y = tf.random.stateless_uniform((n,), (seed, 1), 0, spec.num_classes,
                                            dtype=tf.int32)
        else:
            x = tf.random.stateless_uniform((n, *spec.input_shape), (seed, 0))
            y = tf.random.stateless_uniform((n,), (seed, 1), 0, spec.num_classes,
                                            dtype=tf.int32)
        return x, y

    def examples(self, split, context, *, shuffle_seed=None):
        return tf.data.Dataset.from_tensor_slices(self._random_example_batch(256, 0))

    def split_size(self, split, num_pipelines, pipeline_id):
        return 256

    def train_batches(self, context, batch_size, seed, shuffle_buffer):
        batch = self._random_example_batch(batch_size, seed + context.input_pipeline_id)
        return tf.data.Dataset.from_tensors(batch).repeat()

    def global_train_batches(self, context, global_batch_size, seed, shuffle_buffer,
                             start_example=0):
        """The same batch every step (a benchmark measures the engine, not
        the data): this pipeline's per-replica batch, as `train_batches`."""
        return self.train_batches(context, context.get_per_replica_batch_size(global_batch_size),
                                  seed, shuffle_buffer)
