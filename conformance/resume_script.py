"""A user's own absl script for the resume matrix (`conformance/resume_matrix.py`).

A regression with sample weights on the user's functional model: a residual
tower of Dense, Add and LayerNormalization layers with the user's own names.
The layout rules split the tower's kernels on `model` when the mesh has one
(`--strategy=dtensor --mesh=batch:2,model:2`). Everything else is tfdist's
flags; the chief exports the trained model (`--export_dir`).
"""

import keras
import numpy as np
import tensorflow as tf

import tfdist
from tfdist import app
from tfdist import flags as tfdist_flags  # defines tfdist's flags
from tfdist.data.spec import DatasetSpec

SPEC = DatasetSpec(name="user_regression", kind="image", input_shape=(8,), num_classes=4,
                   train_examples=96, eval_examples=16)
RULES = [(r"block\d_(up|down)/kernel", (None, "model")), (r"head/kernel", (None, "model"))]


def model_fn(spec):
    inputs = keras.Input(spec.input_shape, name="features")
    x = keras.layers.Dense(16, name="stem")(inputs)
    for i in range(2):
        y = keras.layers.Dense(16, activation="gelu", name=f"block{i}_up")(x)
        y = keras.layers.Dense(16, name=f"block{i}_down")(y)
        x = keras.layers.LayerNormalization(name=f"block{i}_norm")(keras.layers.Add()([x, y]))
    return keras.Model(inputs, keras.layers.Dense(spec.num_classes, name="head")(x))


def dataset_fn(split, context):
    rng = np.random.default_rng(0 if split == "train" else 1)
    n = SPEC.train_examples if split == "train" else SPEC.eval_examples
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = (x[:, :4] * 2 - x[:, 4:]).astype(np.float32)
    weight = rng.uniform(0.2, 1.0, size=n).astype(np.float32)
    return tfdist.shard(tf.data.Dataset.from_tensor_slices((x, y, weight)), context)


def main(argv):
    del argv
    config = tfdist_flags.run_config()
    mesh = config.strategy.mesh or ""
    rules = RULES if config.strategy.name == "dtensor" and "model:" in mesh else None
    tfdist.train(config, model_fn=model_fn, dataset_fn=dataset_fn, spec=SPEC,
                 loss=keras.losses.MeanSquaredError(), layout_rules=rules)


if __name__ == "__main__":
    app.run(main)
