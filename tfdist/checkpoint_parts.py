"""A checkpoint that the processes of one run write and read together, each
its own part, so that no process ever holds the whole state.

An engine that splits the trained state across processes (the pipeline's
stages, each held by its own workers) does not gather it onto the chief to
save it. Each process writes the variables it is the writer of into a part
(`tf.raw_ops.SaveV2` under the very keys a whole `tf.train.Checkpoint.write`
would give them), the chief writes everything else (the state every process
keeps, and the object graph), and once every part is written the chief
merges them into one ordinary checkpoint (`tf.raw_ops.MergeV2Checkpoints`,
which moves the files and merges their indexes; no tensor passes through
memory). Any engine, at any size, restores it as usual.

A restore reads the checkpoint's own object graph to find each variable's key
and each process reads only the variables it keeps (`tf.raw_ops.RestoreV2`,
at most `READ_BYTES` at a time): a checkpoint written under another split,
another number of processes or another engine restores in place.

The keys come from the object graph TensorFlow writes into a checkpoint (the
one a whole write would write, `compat.serialized_object_graph`; on restore,
the checkpoint's own), matched to the run's objects by local name from the
root, as TensorFlow's own restore matches them (`compat.checkpoint_object_graph`
and the public `tf.train.TrackableView`). A model whose checkpoint holds anything but
variables (a lookup table, a dataset iterator) is saved the usual way
(`CheckpointParts.prepare` says so).

Every process calls `write` and `restore` together; each ends with an
agreement between the processes (`Strategy.any_worker`), so a failure on one
is an error on all, and the previous checkpoints stay intact.
"""

from __future__ import annotations

import math
import os
import shutil
from typing import Callable, Optional

import tensorflow as tf
from absl import logging

from tfdist import compat
from tfdist.errors import first_line
from tfdist.strategies.base import runs_within

OBJECT_GRAPH = "_CHECKPOINTABLE_OBJECT_GRAPH"
READ_BYTES = 64 << 20   # restored per RestoreV2: a transient copy of at most this much


class NotVariables(ValueError):
    """The checkpoint holds something other than variables."""


class PartsFailed(RuntimeError):
    """A process could not write or read its part (every process raises it)."""


def _is_variable(obj) -> bool:
    import keras
    return isinstance(obj, (tf.Variable, keras.Variable))


class CheckpointParts:
    """How the processes of `strategy` write and read `checkpoint` in parts.

    `pairs()`: (variable, owner) for each variable split across the processes
    (a weight is its own owner; an optimizer slot's owner is its weight);
    every other variable of the checkpoint is kept by every process and
    written by the chief. `writer(variable, owner)`: the worker that writes
    it; `keeps(variable, owner)`: whether this process holds it.
    """

    def __init__(self, strategy, checkpoint: tf.train.Checkpoint, *,
                 pairs: Callable[[], list], writer: Callable[..., int],
                 keeps: Callable[..., bool]):
        self._strategy, self._checkpoint = strategy, checkpoint
        self._pairs, self._writer, self._keeps = pairs, writer, keeps
        self._graph: Optional[bytes] = None
        self._mine: list = []      # (key, variable) this process writes
        self._writers: list = []   # the workers that write a part, in order

    # -- what is where ------------------------------------------------------------
    def variables_by_key(self, graph: bytes) -> dict:
        """{checkpoint key: this run's variable} for the object graph `graph`
        (nodes this run does not have are left out, as a restore with
        `expect_partial` leaves them). `NotVariables` for an attribute that is
        not a variable's value."""
        objects, found = {0: self._checkpoint}, {}
        for index, (children, attributes) in enumerate(compat.checkpoint_object_graph(graph)):
            obj = objects.get(index)
            if obj is None:
                continue
            named = tf.train.TrackableView.children(obj)
            for node_id, name in children:
                if name in named:
                    objects.setdefault(node_id, named[name])
            for name, key in attributes:
                if name != "VARIABLE_VALUE" or not _is_variable(obj):
                    raise NotVariables(f"{key} ({type(obj).__name__})")
                found[key] = obj
        return found

    def _split(self) -> dict:
        """id(variable) -> (variable, owner) for the split variables."""
        return {id(v): (v, owner) for v, owner in self._pairs()}

    def prepare(self) -> bool:
        """Learn the keys from the object graph a whole write would write
        (`compat.serialized_object_graph`: nothing is written); plan who
        writes what. False (saved the usual way) where the checkpoint holds
        anything but variables."""
        graph = compat.serialized_object_graph(self._checkpoint)
        try:
            by_key = self.variables_by_key(graph)
        except NotVariables as error:
            logging.info("checkpoints are written by the chief alone: %s is not a variable", error)
            return False
        split, me, writers = self._split(), self._strategy.worker_index, {0}
        for key, variable in by_key.items():
            writer = self._writer(*split[id(variable)]) if id(variable) in split else 0
            writers.add(writer)
            if writer == me:
                self._mine.append((key, variable))
        self._graph, self._writers = graph, sorted(writers)
        return True

    # -- save ---------------------------------------------------------------------
    def write(self, path: str, finish: Callable[[str], None]) -> None:
        """Write checkpoint `path` (every process: its part); the chief
        merges the parts into `path` and calls `finish(path)` (verify it,
        index it). `PartsFailed` on every process if any step failed."""
        strategy = self._strategy
        parts = os.path.join(os.path.dirname(path), f".parts-{os.path.basename(path)}")
        error = None
        if self._mine or strategy.is_chief:
            try:
                self._write_part(_part(parts, strategy.worker_index))
            except Exception as failure:  # noqa: BLE001  (the others must learn of it)
                error = first_line(failure)
        self._agree(error, f"write its part of checkpoint {path}")
        error = None
        if strategy.is_chief:
            try:
                tf.raw_ops.MergeV2Checkpoints(
                    checkpoint_prefixes=[_part(parts, w) for w in self._writers],
                    destination_prefix=path, delete_old_dirs=True)
                finish(path)
            except Exception as failure:  # noqa: BLE001  (the others must learn of it)
                error = first_line(failure)
                shutil.rmtree(parts, ignore_errors=True)
        self._agree(error, f"merge the parts of checkpoint {path}")

    def _write_part(self, prefix: str) -> None:
        for stale in tf.io.gfile.glob(f"{prefix}.*"):   # of a save that failed here before
            tf.io.gfile.remove(stale)
        tf.io.gfile.makedirs(os.path.dirname(prefix))
        names = [key for key, _ in self._mine]
        values = [tf.convert_to_tensor(variable) for _, variable in self._mine]
        if self._strategy.is_chief:
            names.append(OBJECT_GRAPH)
            values.append(tf.constant(self._graph, tf.string))
        tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names,
                          shape_and_slices=[""] * len(names), tensors=values)

    # -- restore ------------------------------------------------------------------
    def restore(self, path: str) -> None:
        """Every process reads the variables it keeps from checkpoint `path`.
        `PartsFailed` on every process if any could not."""
        error = None
        try:
            self._read(path)
        except Exception as failure:  # noqa: BLE001  (the others must learn of it)
            error = first_line(failure)
        self._agree(error, f"read checkpoint {path}")

    def _read(self, path: str) -> None:
        reader = tf.train.load_checkpoint(path)
        shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
        split = self._split()
        wanted = [(key, variable) for key, variable in
                  self.variables_by_key(reader.get_tensor(OBJECT_GRAPH)).items()
                  if id(variable) not in split or self._keeps(*split[id(variable)])]
        for key, variable in wanted:
            if tuple(shapes[key]) != tuple(variable.shape):
                raise ValueError(f"its {key} has shape {tuple(shapes[key])}, the model's "
                                 f"{variable.path} {tuple(variable.shape)}")
        for chunk in runs_within(wanted, [math.prod(shapes[key]) * dtypes[key].size
                                          for key, _ in wanted], READ_BYTES):
            values = tf.raw_ops.RestoreV2(prefix=path, tensor_names=[key for key, _ in chunk],
                                          shape_and_slices=[""] * len(chunk),
                                          dtypes=[dtypes[key] for key, _ in chunk])
            for (_, variable), value in zip(chunk, values):
                variable.assign(tf.cast(value, variable.dtype))

    def _agree(self, error: Optional[str], doing: str) -> None:
        """Every process learns whether any failed `doing`; each raises."""
        if self._strategy.any_worker(error is not None):
            here = self._strategy.describe_process()
            raise PartsFailed(f"{here}: cannot {doing}: {error}" if error else
                              f"{here}: another worker could not {doing} (its log says why)")


def _part(parts: str, worker: int) -> str:
    return os.path.join(parts, f"worker-{worker}")
