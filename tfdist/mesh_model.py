"""A trained model too large for one process, used where it lives: on the mesh.

Under tensor sharding (`--strategy=dtensor`) a run's `RunResult.model` is a
whole host copy of the trained model when that fits the process. When it does
not (`TensorSharding.host_copy_refusal`), `RunResult.model` is a `MeshModel`:
`predict`, `model(x)` and `evaluate` take host data like Keras's and run the
model's forward pass SPMD on the mesh, in batches split over its `batch` axis
(no process ever holds the whole model; only outputs come back whole), and
`save` writes a Keras `.keras` file one variable at a time. On a mesh across
processes every process must make the same calls with the same data: the
forward pass and the gathers are collectives.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Optional

import numpy as np
import tensorflow as tf


class MeshModel:
    """`predict`, `__call__`, `evaluate` and `save` of the model on the mesh."""

    def __init__(self, sharded_model, strategy, task, *, is_chief: bool = True):
        self.sharded_model = sharded_model
        self._strategy, self._task, self.is_chief = strategy, task, is_chief

    @property
    def name(self) -> str:
        return self.sharded_model.name

    @property
    def inputs(self):
        return getattr(self.sharded_model, "inputs", None)

    def count_params(self) -> int:
        return self.sharded_model.count_params()

    def predict(self, x, batch_size: Optional[int] = None, verbose="auto"):
        """Outputs for host inputs `x` (arrays, or a list/dict of them), as NumPy."""
        del verbose   # no progress bar: batches are few and collective
        return self._strategy.predict_on_mesh(self.sharded_model, x, batch_size)

    def __call__(self, x, training: bool = False):
        if training:
            raise ValueError("a MeshModel only runs inference; train with tfdist.train")
        return tf.nest.map_structure(tf.convert_to_tensor, self.predict(x))

    def evaluate(self, x, y, batch_size: Optional[int] = None, sample_weight=None,
                 return_dict: bool = False, verbose="auto"):
        """The run's loss and metrics over (x, y): the outputs are computed on
        the mesh, then scored on the host with the run's own loss and metrics
        (the same code as training's evaluation)."""
        del verbose
        y_pred = self.predict(x, batch_size)
        n = len(tf.nest.flatten(y)[0])
        weight = tf.ones([n]) if sample_weight is None else tf.cast(sample_weight, tf.float32)
        real = tf.ones([n])
        y_pred = tf.nest.map_structure(tf.convert_to_tensor, y_pred)
        numerator, divisor, _ = self._task.loss_terms(y, y_pred, weight, real)
        deltas = self._task.metric_deltas(y, y_pred, weight)
        results = self._task.results(float(numerator), float(divisor), deltas.numpy())
        return results if return_dict else list(results.values())

    def save(self, path: str) -> Optional[str]:
        """Write a Keras `.keras` file (architecture and weights) to `path`.

        Keras writes each variable's value as it goes; reading a sharded
        variable gathers it, so one whole variable at a time is in this
        process, never the whole model. Every process of a mesh must call this
        (the gathers are collectives); the chief writes `path` (atomically),
        the others a scratch file they delete. Returns the path written, or
        None on the others."""
        if not path.endswith(".keras"):
            raise ValueError(f"{path}: a MeshModel saves the Keras format (a .keras file)")
        target = path if self.is_chief else os.path.join(tempfile.mkdtemp(), "scratch.keras")
        staging = f"{target}.tmp-{os.getpid()}.keras"
        try:
            self.sharded_model.save(staging)
            os.replace(staging, target)
        finally:
            if os.path.exists(staging):
                os.remove(staging)
            if not self.is_chief:
                shutil.rmtree(os.path.dirname(target), ignore_errors=True)
        return path if self.is_chief else None


def padded_batches(x, batch: int):
    """(chunk, real rows) pairs of `x` in batches of exactly `batch` rows, the
    last padded by repeating its final row (its outputs are dropped)."""
    leaves = [np.asarray(t) for t in tf.nest.flatten(x)]
    n = len(leaves[0])
    for start in range(0, n, batch):
        chunk = [leaf[start:start + batch] for leaf in leaves]
        real = len(chunk[0])
        if real < batch:
            chunk = [np.concatenate([c, np.repeat(c[-1:], batch - real, axis=0)]) for c in chunk]
        yield chunk, real
