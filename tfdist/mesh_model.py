"""A trained model too large for one process, used where it lives: on the
mesh (`MeshModel`) or in a pipeline's stages (`StagesModel`).

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
from absl import logging


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
        return scored(self._task, y, self.predict(x, batch_size), sample_weight, return_dict)

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


class StagesModel:
    """`RunResult.model` of a pipeline worker across processes that does not
    hold the whole trained model: the worker's Keras model (its stages'
    weights; the other stages' are empty) for everything but inference and
    saving, which need the other stages. Where no process holds the whole
    model (--nopipeline_gather, or the chief's memory refused the gather),
    `predict`, `model(x)` and `evaluate` run the stages as a pipeline across
    the processes: every worker must make the same calls with the same data
    (the boundaries and the outputs' return are collectives), and each gets
    the outputs. Where the chief holds the whole model, they say so on the
    other workers. `save` needs the whole model in one process: it says how
    to get it."""

    def __init__(self, model, strategy, task, *, through_stages: bool):
        self.local_model = model
        self._strategy, self._task, self._through_stages = strategy, task, through_stages

    @classmethod
    def of(cls, model, strategy, task) -> "StagesModel":
        """The `StagesModel` of `model` on this worker of `strategy`, which
        does not hold the whole model; it says which kind in the log."""
        through = not strategy.chief_holds_model()
        logging.info("%s holds its pipeline stages only: RunResult.model is a StagesModel%s",
                     strategy.describe_process(),
                     " whose predict and evaluate run the stages as a pipeline (every worker "
                     "calls them with the same data)" if through else
                     "; the chief holds the whole trained model (--pipeline_gather)")
        return cls(model, strategy, task, through_stages=through)

    def __getattr__(self, name):   # weights, get_weights, layers, name, ...: this worker's
        if name.startswith("__") or name == "local_model":
            raise AttributeError(name)
        return getattr(self.local_model, name)

    def _refusal(self, what: str) -> str:
        where = self._strategy.describe_process()
        return (f"{what}: RunResult.model on {where} holds its pipeline stages only; the chief "
                "holds the whole trained model (call it where result.is_chief), or train with "
                "--nopipeline_gather so that every worker's RunResult.model runs the stages "
                "as a pipeline")

    def predict(self, x, batch_size: Optional[int] = None, verbose="auto"):
        """Outputs for host inputs `x` (arrays, or a list/dict of them), as
        NumPy, through the stages; every worker calls it with the same `x`."""
        del verbose
        if not self._through_stages:
            raise RuntimeError(self._refusal("predict"))
        return self._strategy.predict_through_stages(x, batch_size or 32)

    def __call__(self, x, training: bool = False):
        if training:
            raise ValueError("a pipeline's StagesModel only runs inference; train with "
                             "tfdist.train")
        return tf.nest.map_structure(tf.convert_to_tensor, self.predict(x))

    def evaluate(self, x, y, batch_size: Optional[int] = None, sample_weight=None,
                 return_dict: bool = False, verbose="auto"):
        """The run's loss and metrics over (x, y), the outputs computed
        through the stages and scored on the host (as `MeshModel.evaluate`)."""
        del verbose
        return scored(self._task, y, self.predict(x, batch_size), sample_weight, return_dict)

    def save(self, path: str, *args, **kwargs):
        del args, kwargs
        raise RuntimeError(
            f"save {path}: a Keras file needs the whole model in one process, and "
            f"{self._strategy.describe_process()} holds its pipeline stages only; export the "
            "run's last checkpoint with tfdist-export --model_dir=... on a machine with the "
            "memory, or train with --pipeline_gather (the chief then holds the whole model)")


def scored(task, y, y_pred, sample_weight=None, return_dict: bool = False):
    """The run's loss and metrics of outputs `y_pred` against `y`, on the
    host, with the task's own code (training's evaluation)."""
    n = len(tf.nest.flatten(y)[0])
    weight = tf.ones([n]) if sample_weight is None else tf.cast(sample_weight, tf.float32)
    real = tf.ones([n])
    y_pred = tf.nest.map_structure(tf.convert_to_tensor, y_pred)
    numerator, divisor, _ = task.loss_terms(y, y_pred, weight, real)
    deltas = task.metric_deltas(y, y_pred, weight)
    results = task.results(float(numerator), float(divisor), deltas.numpy())
    return results if return_dict else list(results.values())


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
