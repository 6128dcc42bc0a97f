"""A user's own script for tests/integration/test_plan.py: a subclassed
Keras model tfdist did not build and a `dataset_fn`, planned through the
Python API (`tfdist.plan`). Prints the plan's rows and flagfile as JSON."""

import json
import sys

import numpy as np

import tfdist
from tfdist.data.spec import DatasetSpec

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

SPEC = DatasetSpec(name="user_vectors", kind="image", input_shape=(64,), num_classes=4,
                   train_examples=2048, eval_examples=64)


class Residual(keras.Model):
    """Subclassed: two residual blocks of Dense layers."""

    def __init__(self, width=256, classes=4, **kwargs):
        super().__init__(**kwargs)
        self.inp = keras.layers.Dense(width, activation="relu")
        self.blocks = [keras.layers.Dense(width, activation="relu") for _ in range(2)]
        self.out = keras.layers.Dense(classes)

    def call(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def model_fn(spec):
    return Residual(classes=spec.num_classes)


def dataset_fn(split, context):
    rng = np.random.default_rng(0 if split == "train" else 1)
    n = SPEC.train_examples if split == "train" else SPEC.eval_examples
    x = rng.normal(size=(n, 64)).astype(np.float32)
    y = (x[:, :4].argmax(axis=1)).astype(np.int32)
    return tfdist.shard(tf.data.Dataset.from_tensor_slices((x, y)), context)


if __name__ == "__main__":
    config = tfdist.RunConfig(
        strategy=tfdist.StrategyConfig(virtual_devices=2),
        optimizer=tfdist.OptimizerConfig(name="adam"),
        train=tfdist.TrainConfig(global_batch_size=128, train_steps=20))
    plan = tfdist.plan(config, model_fn=model_fn, dataset_fn=dataset_fn, spec=SPEC,
                       trials=int(sys.argv[1]), search_seconds=float(sys.argv[2]))
    print("PLAN " + json.dumps({"rows": plan.rows(), "flagfile": plan.flagfile(),
                                "winner": plan.winner.engine,
                                "runtime": {c.describe(): c.estimate.memory.get("runtime")
                                            for c in plan.candidates if c.estimate},
                                "splits": {str(k): v for k, v in
                                           plan.facts.model.splits.items()},
                                "seconds": plan.seconds}), flush=True)
