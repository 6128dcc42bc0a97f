"""A multi-worker test worker: trains through the Python API, saves its weights.

Run by tests under tfdist-launch (TF_CONFIG set per worker):
    python tests/mw_worker.py OUT_DIR STRATEGY STEPS
Loads OUT_DIR/initial.npz, trains, writes OUT_DIR/weights-<worker>.npz.
"""

import os
import sys

import numpy as np

import tfdist
from tfdist import models

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import IMAGE_SPEC, image_dataset_fn  # noqa: E402


def main(out_dir, strategy, steps):
    config = tfdist.RunConfig(
        strategy=tfdist.StrategyConfig(name=strategy, collective_timeout_s=60),
        model=tfdist.ModelConfig(name="mlp", width=16, depth=1),
        data=tfdist.DataConfig(shuffle_buffer=1),  # no shuffling: batches in file order
        optimizer=tfdist.OptimizerConfig(name="sgd", learning_rate=0.1),
        train=tfdist.TrainConfig(global_batch_size=32, train_steps=int(steps), steps_per_loop=5))
    initial = list(np.load(os.path.join(out_dir, "initial.npz")).values())

    def model_fn(spec):
        model = models.build(config.model, spec)
        model.set_weights(initial)
        return model

    result = tfdist.train(config, model_fn=model_fn, dataset_fn=image_dataset_fn, spec=IMAGE_SPEC)
    index = os.environ.get("TFDIST_TEST_WORKER") or str(
        __import__("json").loads(os.environ.get("TF_CONFIG", '{"task":{"index":0}}'))["task"]["index"])
    np.savez(os.path.join(out_dir, f"weights-{index}.npz"), *result.model.get_weights())


if __name__ == "__main__":
    main(*sys.argv[1:])
