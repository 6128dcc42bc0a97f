"""Your own absl script on tfdist: your flags, model, data, loss and metrics.

A click-through-rate style task: each example has a dict of named features
(8 numbers and a category id), a 0/1 label and a sample weight (positives,
being rare, weigh more). The model is your own functional Keras model with
two inputs; tfdist brings the engines, the flags and the training loop.

    python examples/custom_script.py --strategy=default
    tfdist-launch --workers=2 -- python examples/custom_script.py --strategy=multi_worker
    horovodrun -np 2 --gloo python examples/custom_script.py --strategy=horovod

Every tfdist flag works here too (--global_batch_size, --model_dir,
--export_dir, --accum_steps, ...; see docs/reference/flags.md), next to
this script's own (--examples, --hidden_units, --positive_weight). A flag of
yours with the name of one of tfdist's is reported as one line at start-up.
"""

import json

import keras
import numpy as np
import tensorflow as tf
from absl import flags

import tfdist
from tfdist import app
from tfdist import flags as tfdist_flags  # defines tfdist's flags beside yours

_EXAMPLES = flags.DEFINE_integer("examples", 4096, "Training examples to generate.")
_HIDDEN_UNITS = flags.DEFINE_integer("hidden_units", 32, "Units of the hidden layer.")
_POSITIVE_WEIGHT = flags.DEFINE_float("positive_weight", 2.0, "Sample weight of positives.")

NUMBERS, CATEGORIES = 8, 20


def make_examples(n: int, seed: int):
    """Features, labels and sample weights of a fixed, learnable rule."""
    rng = np.random.default_rng(seed)
    numbers = rng.normal(size=(n, NUMBERS)).astype(np.float32)
    category = rng.integers(CATEGORIES, size=n).astype(np.int32)
    score = numbers @ np.linspace(-1.0, 1.0, NUMBERS) + np.sin(category) - 1.0
    label = (rng.uniform(size=n) < 1 / (1 + np.exp(-3 * score))).astype(np.float32)
    weight = np.where(label > 0, _POSITIVE_WEIGHT.value, 1.0).astype(np.float32)
    return {"numbers": numbers, "category": category}, label, weight


def dataset_fn(split: str, context: tf.distribute.InputContext) -> tf.data.Dataset:
    """Unbatched (features, label, weight) examples for this input pipeline;
    tfdist shuffles, batches and distributes them."""
    n = _EXAMPLES.value if split == "train" else _EXAMPLES.value // 4
    features, label, weight = make_examples(n, seed=0 if split == "train" else 1)
    ds = tf.data.Dataset.from_tensor_slices((features, label, weight))
    return tfdist.shard(ds, context)   # each worker reads its own share


def model_fn(spec) -> keras.Model:
    """Built by tfdist inside the engine's scope."""
    numbers = keras.Input((NUMBERS,), name="numbers")
    category = keras.Input((), dtype="int32", name="category")
    embedded = keras.layers.Embedding(CATEGORIES, 4, name="category_embedding")(category)
    x = keras.layers.Concatenate()([numbers, embedded])
    x = keras.layers.Dense(_HIDDEN_UNITS.value, activation="relu", name="hidden")(x)
    logit = keras.layers.Dense(1, dtype="float32", name="logit")(x)
    return keras.Model({"numbers": numbers, "category": category}, logit, name="ctr")


def main(argv):
    del argv
    config = tfdist_flags.run_config()
    # This script's own defaults where the command line left tfdist's.
    if not flags.FLAGS["train_steps"].present and not flags.FLAGS["epochs"].present:
        config = config.replace(train=config.train.replace(train_steps=300))
    if not flags.FLAGS["learning_rate"].present:
        config = config.replace(optimizer=config.optimizer.replace(learning_rate=0.01))
    result = tfdist.train(config, model_fn=model_fn, dataset_fn=dataset_fn,
                          loss=keras.losses.BinaryCrossentropy(from_logits=True),
                          metrics=["auc", "binary_accuracy"])
    if result.is_chief:
        print(json.dumps(result.summary, sort_keys=True), flush=True)


if __name__ == "__main__":
    app.run(main)
