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
# One global order: epoch e of the training data is shuffled with seed
# `seed + EPOCH_SEED_STRIDE * e`; the epochs are counted up to MAX_EPOCHS.
EPOCH_SEED_STRIDE = 104_729
EPOCH_GRAPH_SEED = 1
MAX_EPOCHS = 1 << 40


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

    def undecoded_examples(self, split: str, context: tf.distribute.InputContext):
        """(examples as stored, `decode`): what `examples` yields before its
        decoding (an image's encoded bytes), and the function of one (x, y)
        that decodes and preprocesses it. The global order shuffles the
        stored form and decodes only this pipeline's rows. By default there is
        nothing to defer: (`examples`, None)."""
        return self.examples(split, context), None

    def example_signature(self):
        """`tf.TensorSpec`s of one training example's features, batch 1."""
        x_spec = self.examples("train", tf.distribute.InputContext()).element_spec[0]
        return tf.nest.map_structure(lambda s: tf.TensorSpec([1, *s.shape], s.dtype), x_spec)

    def built(self, model):
        """`model` with its variables: a subclassed model a `model_fn` returns
        unbuilt is called once on symbolic inputs of one example of this
        data (as Keras `fit` does on its first batch), so the optimizer, the
        layouts and the checkpoint see its variables before the first step."""
        if not model.weights:
            import keras
            model(tf.nest.map_structure(lambda s: keras.KerasTensor(s.shape, s.dtype),
                                        self.example_signature()))
        return model

    def check_sharding(self, num_pipelines: int) -> None:
        """Raise `UsageError` before training if the input cannot be split this way."""

    def train_batches(self, context, batch_size: int, seed: int, shuffle_buffer: int):
        """Infinite, shuffled batches of `batch_size` for training, of this
        pipeline's own share of the examples (`--autoshard=auto|file|data|off`)."""
        ds = with_weights(self.examples("train", context, shuffle_seed=seed))
        ds = ds.shuffle(shuffle_buffer, seed=seed + context.input_pipeline_id,
                        reshuffle_each_iteration=True)
        return ds.repeat().batch(batch_size, drop_remainder=True)

    def global_train_batches(self, context, global_batch_size: int, seed: int,
                             shuffle_buffer: int, start_example: int = 0):
        """Infinite batches of this replica's rows of one global order
        (`--autoshard=global`), from global example `start_example` on.

        Every pipeline reads every training example in file order; epoch e is
        shuffled with seed `seed + EPOCH_SEED_STRIDE * e` (the same in every
        pipeline) and the epochs follow one another; the stream is cut into
        global batches, and pipeline i of N keeps rows [i·B/N, (i+1)·B/N) of
        each, in per-replica batches (an image is decoded only by the
        pipeline that keeps it). So the same seed and global batch give
        the same global batches under every synchronous engine and cluster
        size, and a resumed run re-reads at most one epoch to get back to its
        position. With one pipeline whose id is not 0 (a parameter-server
        worker: each reads on its own), the seed is offset by the id."""
        pipelines = context.num_input_pipelines
        every = tf.distribute.InputContext()   # one pipeline: the whole split
        examples, decode = self.undecoded_examples("train", every)
        examples = with_weights(examples)
        base = tf.cast(seed, tf.int64)
        if pipelines == 1:
            base += tf.cast(context.input_pipeline_id, tf.int64)
        first_epoch, offset = 0, 0
        if start_example:
            # `//` and `%`, not divmod: traced by AutoGraph (a parameter-server
            # worker's dataset function) the split's size is a tensor.
            size = self.split_size("train", 1, 0)
            if isinstance(size, tf.Tensor):
                start_example, size = tf.cast(start_example, tf.int64), tf.cast(size, tf.int64)
            first_epoch, offset = start_example // size, start_example % size

        def epoch(e):
            # A fixed graph-level seed: the order follows `seed` and the epoch
            # alone, whatever the process's global seed; and TF 2.21's
            # `random_seed.get_seed` fails on a tensor op seed under a global
            # seed of 0 ("a symbolic tf.Tensor as a Python bool").
            tf.random.set_seed(EPOCH_GRAPH_SEED)
            return examples.shuffle(shuffle_buffer, seed=base + EPOCH_SEED_STRIDE * e,
                                    reshuffle_each_iteration=False)

        ds = tf.data.Dataset.range(first_epoch, MAX_EPOCHS).flat_map(epoch).skip(offset)
        return _own_rows(ds.batch(global_batch_size, drop_remainder=True), context,
                         global_batch_size, decode)


def _own_rows(ds, context, global_batch_size: int, decode):
    """Global batches `ds` -> this pipeline's rows of each, decoded (`decode`
    of one stored example, or None), in per-replica batches."""
    pipelines = context.num_input_pipelines
    rows = global_batch_size // pipelines
    if pipelines > 1:
        first = context.input_pipeline_id * rows
        ds = ds.map(plain(lambda *batch: tf.nest.map_structure(
            lambda t: t[first:first + rows], batch)))
    if decode is not None:   # only this pipeline's rows, in parallel
        ds = ds.unbatch().map(plain(lambda x, y, w: (*decode(x, y), w)),
                              num_parallel_calls=AUTOTUNE)
        ds = ds.batch(rows, drop_remainder=True)
    per_replica = context.get_per_replica_batch_size(global_batch_size)
    if per_replica != rows:
        ds = ds.rebatch(per_replica, drop_remainder=True)
    return ds


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
                     shuffle_buffer: int, global_order: bool = True, start_example: int = 0):
    """`dataset_fn(input_context)` for training: (x, y, weight) batches of
    one global order (`Inputs.global_train_batches`, from `start_example`),
    or of each pipeline's own share (`global_order=False`)."""

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        if global_order:
            ds = inputs.global_train_batches(context, global_batch_size, seed, shuffle_buffer,
                                             start_example)
        else:
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


def of_run(config, dataset_fn=None, spec=None) -> Inputs:
    """A run's input: the user's `dataset_fn` (described by `spec`), else the
    TFDS dataset `config.data` names."""
    from tfdist.data import function_inputs, tfds_inputs
    if dataset_fn:
        return function_inputs.FunctionInputs(dataset_fn, spec)
    return tfds_inputs.load(config.data, model_dir=config.train.model_dir)
