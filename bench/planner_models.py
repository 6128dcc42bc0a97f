"""Two models tfdist did not build, for bench/planner.py: a subclassed
residual MLP and a functional wide-and-deep model over token ids, with
their data (module-level functions: the planner's trial processes import
them again by this file's path)."""

import keras
import numpy as np
import tensorflow as tf

import tfdist
from tfdist.data.spec import DatasetSpec

VECTORS = DatasetSpec(name="bench_vectors", kind="image", input_shape=(256,), num_classes=16,
                      train_examples=8192, eval_examples=256)
TOKENS = DatasetSpec(name="bench_ids", kind="image", input_shape=(32,), num_classes=8,
                     train_examples=8192, eval_examples=256)
VOCAB = 20000


class Residual(keras.Model):
    """Subclassed: residual blocks of Dense layers."""

    def __init__(self, width=1024, blocks=3, classes=16, **kwargs):
        super().__init__(**kwargs)
        self.inp = keras.layers.Dense(width, activation="relu")
        self.blocks = [keras.layers.Dense(width, activation="relu") for _ in range(blocks)]
        self.out = keras.layers.Dense(classes)

    def call(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def residual_fn(spec):
    return Residual(classes=spec.num_classes)


def vectors_fn(split, context):
    rng = np.random.default_rng(0 if split == "train" else 1)
    n = VECTORS.train_examples if split == "train" else VECTORS.eval_examples
    x = rng.normal(size=(n, 256)).astype(np.float32)
    y = x[:, :16].argmax(axis=1).astype(np.int32)
    return tfdist.shard(tf.data.Dataset.from_tensor_slices((x, y)), context)


def wide_deep_fn(spec):
    """Functional: an embedding of 32 ids, averaged (deep) beside a one-hot
    count of the first id's bucket (wide)."""
    ids = keras.Input((32,), dtype="int32")
    deep = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(VOCAB, 128)(ids))
    deep = keras.layers.Dense(512, activation="relu")(deep)
    deep = keras.layers.Dense(512, activation="relu")(deep)
    wide = keras.layers.Embedding(VOCAB, spec.num_classes)(ids[:, 0])
    return keras.Model(ids, keras.layers.Add()([keras.layers.Dense(spec.num_classes)(deep),
                                                wide]))


def ids_fn(split, context):
    rng = np.random.default_rng(2 if split == "train" else 3)
    n = TOKENS.train_examples if split == "train" else TOKENS.eval_examples
    x = rng.integers(0, VOCAB, size=(n, 32)).astype(np.int32)
    y = (x[:, 0] % TOKENS.num_classes).astype(np.int32)
    return tfdist.shard(tf.data.Dataset.from_tensor_slices((x, y)), context)
