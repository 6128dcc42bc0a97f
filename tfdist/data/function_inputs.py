"""Inputs from a user's own function (the Python API's `dataset_fn`)."""

from __future__ import annotations

from typing import Callable, Optional

import tensorflow as tf

from tfdist.data.inputs import Inputs, check_structure
from tfdist.data.spec import DatasetSpec

DatasetFn = Callable[[str, tf.distribute.InputContext], tf.data.Dataset]


def shard(dataset: tf.data.Dataset,
          context: Optional[tf.distribute.InputContext]) -> tf.data.Dataset:
    """This pipeline's share of `dataset`, by example (a helper for `dataset_fn`s).
    `context` None (a `dataset_fn` called outside training) is one pipeline:
    the whole dataset."""
    if context is None or context.num_input_pipelines == 1:
        return dataset
    return dataset.shard(context.num_input_pipelines, context.input_pipeline_id)


def _infer_spec(dataset: tf.data.Dataset) -> DatasetSpec:
    check_structure(dataset.element_spec)
    x_spec = dataset.element_spec[0]
    if isinstance(x_spec, dict):   # named features of a multi-input model
        return DatasetSpec(name="custom", kind="features", num_classes=0,
                           input_shape={k: tuple(s.shape) for k, s in x_spec.items()})
    tokens = x_spec.dtype.is_integer and x_spec.shape.rank == 1
    return DatasetSpec(name="custom", kind="tokens" if tokens else "image",
                       input_shape=tuple(x_spec.shape), num_classes=0)


class FunctionInputs(Inputs):
    """Wraps `dataset_fn(split, input_context) -> unbatched examples`: (x, y) or
    (x, y, sample_weight), `x` a tensor or a dict of named features.

    The function returns the examples of `split` ("train" or "test") that the
    given input pipeline should read (use `shard` when there are several).
    tfdist shuffles, repeats, batches and pads them like any other source.
    """

    def __init__(self, dataset_fn: DatasetFn, spec: Optional[DatasetSpec] = None):
        self._fn = dataset_fn
        self.spec = spec or _infer_spec(dataset_fn("train", tf.distribute.InputContext()))

    def examples(self, split, context, *, shuffle_seed=None):
        return self._fn(split, context)

    def split_size(self, split, num_pipelines, pipeline_id):
        context = tf.distribute.InputContext(num_pipelines, pipeline_id, num_pipelines)
        ds = self._fn(split, context)
        size = int(ds.cardinality())
        if size < 0:  # unknown: count once (evaluation sets are small)
            size = int(ds.reduce(tf.constant(0, tf.int64), lambda n, *_: n + 1))
        return size
