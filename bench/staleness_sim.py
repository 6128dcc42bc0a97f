"""Staleness alone, in one process: gradients applied one update late.

    .venv/bin/python bench/staleness_sim.py [--steps=600] [--seeds=3]

The parameter server's asynchronous accuracy could be lost to staleness (a
gradient computed on weights other workers have updated since), to races
between workers' updates (Adam's slots read and written concurrently), to
the step counting, or to the scheduling of 4 processes on 2 cores. This
bench removes all but the first: one process, one optimizer, no races, two
input streams read in turn (as two workers read theirs), and each gradient
computed on the weights of `delay` updates ago with probability `p` (a
parameter-server step with 2 workers is stale by one update about half the
time on this host, measured by bench/parameter_server.py). With p = 0 it is
one device's training on the two streams; if the delayed runs lose what the
parameter server loses, staleness is the cause.

Each row: the mlp of bench/parameter_server.py (512 wide, tfdist_shapes,
global batch 128) for --steps updates, test accuracy mean (min-max) over
--seeds seeds, and the loss in points against the same optimizer with no
delay. `--staleness_lr=divide` rows divide a stale update's learning rate by
1 + its staleness, as the parameter server does.
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import Clock, finish, hardware_header, print_row  # noqa: E402

NAME = "staleness_sim"
TITLE = "Staleness alone: gradients one update late, in one process (bench/staleness_sim.py)"
HEADER = ["optimizer", "learning rate", "stale steps", "--staleness_lr", "accuracy",
          "vs no delay (points)"]
# Adam and momentum SGD as the mlp is trained; plain SGD at a rate far from
# its stability limit and at one ten times larger.
OPTIMIZERS = [("adam", 1e-3), ("momentum", 0.01), ("sgd", 0.01), ("sgd", 0.1)]
CONDITIONS = [(0.0, "none"), (0.5, "none"), (0.5, "divide"), (1.0, "none")]


def _data(data_dir):
    import tensorflow_datasets as tfds

    import tfdist.data.builders  # noqa: F401  (registers tfdist_shapes)
    builder = tfds.builder("tfdist_shapes", data_dir=data_dir)

    def load(split):
        x, y = zip(*tfds.as_numpy(builder.as_dataset(split=split, as_supervised=True)))
        return np.stack(x).astype("float32") / 255.0, np.array(y, np.int32)

    return load("train"), load("test")


def train(data, optimizer: str, lr: float, stale: float, staleness_lr: str, steps: int,
          seed: int, batch: int = 128) -> float:
    """Test accuracy after `steps` updates, a fraction `stale` of them computed
    on the weights before the previous update."""
    import keras
    import tensorflow as tf
    (x_train, y_train), (x_test, y_test) = data
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(x_train.shape[1:])
    hidden = keras.layers.Flatten()(inputs)
    for _ in range(2):
        hidden = keras.layers.Dense(512, activation="relu")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(int(y_train.max()) + 1)(hidden))
    opt = {"adam": lambda: keras.optimizers.Adam(lr),
           "momentum": lambda: keras.optimizers.SGD(lr, momentum=0.9),

           "sgd": lambda: keras.optimizers.SGD(lr)}[optimizer]()
    rate = opt.learning_rate   # a variable, set per update
    weights = model.trainable_variables
    opt.build(weights)
    previous = [tf.Variable(w) for w in weights]

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(autograph=False)
    def step(x, y, late):
        read = [tf.where(late, p, w) for p, w in zip(previous, weights)]
        with tf.GradientTape() as tape:
            tape.watch(read)
            logits, _ = model.stateless_call(read, [], x, training=True)
            loss = loss_fn(y, logits)
        grads = tape.gradient(loss, read)
        for p, w in zip(previous, weights):
            p.assign(w)
        factor = 0.5 if staleness_lr == "divide" else 1.0
        rate.assign(lr * tf.where(late, factor, 1.0))
        opt.apply(grads, weights)

    rng = np.random.default_rng(seed)
    orders = [np.concatenate([rng.permutation(len(x_train)) for _ in range(steps // 50 + 2)])
              for _ in range(2)]   # two workers' streams, read in turn
    for s in range(steps):
        stream, position = s % 2, (s // 2) * batch
        rows = orders[stream][position:position + batch]
        late = tf.constant(bool(s) and rng.random() < stale)
        step(tf.constant(x_train[rows]), tf.constant(y_train[rows]), late)
    predictions = model.predict(x_test, batch_size=1000, verbose=0)
    return float(np.mean(np.argmax(predictions, -1) == y_test))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--data_dir", default=None)
    args = parser.parse_args()
    print(hardware_header().replace("  \n", "\n"), flush=True)
    clock, rows = Clock(), []
    data = _data(args.data_dir)
    for optimizer, lr in OPTIMIZERS:
        fresh = None
        for stale, staleness_lr in CONDITIONS:
            accuracy = [train(data, optimizer, lr, stale, staleness_lr, args.steps, seed)
                        for seed in range(1, args.seeds + 1)]
            mean = float(np.mean(accuracy))
            fresh = mean if stale == 0 else fresh
            row = [optimizer, f"{lr:g}", f"{stale:.0%}", staleness_lr,
                   f"{mean:.3f} ({min(accuracy):.3f}-{max(accuracy):.3f})",
                   f"{100 * (mean - fresh):+.1f}"]
            rows.append(row)
            print_row(row, HEADER)
    body = (f"The mlp (512 wide, 2 hidden layers) on tfdist_shapes, global batch 128, "
            f"{args.steps} updates, {args.seeds} seeds (initialisation and data order); two "
            "input streams read in turn; a stale step's gradient is computed on the weights "
            "before the previous update (one update stale), the fraction of steps shown. One "
            "process: no races between updates, no scheduling. Accuracy: test split, mean "
            "(min-max) over seeds.")
    finish(NAME, TITLE, body, rows, HEADER, clock)


if __name__ == "__main__":
    main()
