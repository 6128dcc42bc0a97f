"""Input sources and the batching that turns them into per-replica pipelines.

An `Inputs` yields the unbatched, preprocessed (x, y) or (x, y, sample_weight)
examples one input pipeline reads from a split; `x` may be a dict of named
features, `y` class indices, floats, multi-hot vectors or token sequences. The functions below wrap it into what
`Strategy.distribute_dataset` wants: a function of `tf.distribute.InputContext`
that returns batches of the per-replica size. Training data repeats forever
(every worker runs the same number of steps however the data divides, so no
collective waits on a worker that ran out); evaluation data is padded with
zero-weight examples to the same number of full batches on every pipeline, so
metrics are exact and no replica ever sees a short batch.
"""

from __future__ import annotations

import abc
import math

import tensorflow as tf

from tfdist.data.spec import DatasetSpec

AUTOTUNE = tf.data.AUTOTUNE


class Inputs(abc.ABC):
    """A source of supervised examples, sharded per input pipeline."""

    spec: DatasetSpec
    has_eval = True

    @abc.abstractmethod
    def examples(self, split: str, context: tf.distribute.InputContext, *,
                 shuffle_seed=None) -> tf.data.Dataset:
        """Unbatched, preprocessed (x, y) examples this pipeline reads from `split`."""

    @abc.abstractmethod
    def split_size(self, split: str, num_pipelines: int, pipeline_id: int) -> int:
        """Examples pipeline `pipeline_id` of `num_pipelines` reads from `split`."""

    def check_sharding(self, num_pipelines: int) -> None:
        """Raise `UsageError` before training if the input cannot be split this way."""

    def train_batches(self, context, batch_size: int, seed: int, shuffle_buffer: int):
        """Infinite, shuffled batches of `batch_size` for training."""
        ds = with_weights(self.examples("train", context, shuffle_seed=seed))
        ds = ds.shuffle(shuffle_buffer, seed=seed + context.input_pipeline_id,
                        reshuffle_each_iteration=True)
        return ds.repeat().batch(batch_size, drop_remainder=True)


def check_structure(element_spec) -> None:
    """Raise `UsageError` unless examples are (x, y) or (x, y, sample_weight)."""
    from tfdist.errors import UsageError
    if not isinstance(element_spec, tuple) or len(element_spec) not in (2, 3):
        raise UsageError(f"the dataset yields {element_spec}; it must yield (x, y) or "
                         "(x, y, sample_weight) examples (x may be a dict of features)")


def plain(fn):
    """`fn` traced without AutoGraph. tfdist's own graph functions have no
    tensor-dependent Python control flow (loops are `tf.while_loop`s), as in
    Keras 3's own `fit`; converting them cost about a second of start-up per
    process (AutoGraph parses their source)."""
    return tf.autograph.experimental.do_not_convert(fn)


def with_weights(ds: tf.data.Dataset, *, batched: bool = False) -> tf.data.Dataset:
    """(x, y, weight) from (x, y) (weight 1 per example) or (x, y, weight) elements."""
    check_structure(ds.element_spec)
    if len(ds.element_spec) == 3:
        return ds.map(plain(lambda x, y, w: (x, y, tf.cast(w, tf.float32))))
    if batched:
        return ds.map(plain(lambda x, y: (x, y, tf.ones(tf.shape(tf.nest.flatten(y)[0])[:1]))))
    return ds.map(plain(lambda x, y: (x, y, tf.constant(1.0))))


def train_dataset_fn(inputs: Inputs, *, global_batch_size: int, seed: int,
                     shuffle_buffer: int):
    """`dataset_fn(input_context)` for training: (x, y, weight) batches."""

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        batch = context.get_per_replica_batch_size(global_batch_size)
        ds = inputs.train_batches(context, batch, seed, shuffle_buffer)
        return _batch_weights(ds).prefetch(AUTOTUNE)

    return dataset_fn


def eval_steps(inputs: Inputs, *, global_batch_size: int, num_pipelines: int) -> int:
    """Steps that cover the largest pipeline's share of the test split."""
    per_pipeline_batch = global_batch_size // num_pipelines
    largest = max(inputs.split_size("test", num_pipelines, i) for i in range(num_pipelines))
    return max(1, math.ceil(largest / per_pipeline_batch))


def eval_dataset_fn(inputs: Inputs, *, global_batch_size: int, steps: int,
                    replicas_per_pipeline: int):
    """`dataset_fn(input_context)` for evaluation: (x, y, weight, real) batches.

    Each pipeline yields exactly `steps * replicas_per_pipeline` full batches:
    its real examples (real 1, their own sample weight), then padding (real 0,
    weight 0), so losses and metrics count only real examples.
    """

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        batch = context.get_per_replica_batch_size(global_batch_size)
        real = with_weights(inputs.examples("test", context)).map(
            plain(lambda x, y, w: (x, y, w, tf.constant(1.0))))
        padding = tf.data.Dataset.from_tensors(tf.nest.map_structure(
            lambda s: tf.zeros(s.shape, s.dtype), real.element_spec))
        ds = real.concatenate(padding.repeat()).batch(batch, drop_remainder=True)
        return ds.take(steps * replicas_per_pipeline).prefetch(AUTOTUNE)

    return dataset_fn


def _batch_weights(ds: tf.data.Dataset) -> tf.data.Dataset:
    """Batches as (x, y, weight): weight 1 per example where a source gave none."""
    return with_weights(ds, batched=True)
