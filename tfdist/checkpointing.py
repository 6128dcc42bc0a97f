"""Checkpoints of model, optimizer and step, written only by the chief.

A save writes the checkpoint's files, reads them back (the index and every
tensor's entry), and only then updates the `checkpoint` index and deletes
checkpoints beyond `keep`: an interrupted or failed save (Ctrl-C, a killed
worker, a full or read-only disk) never touches the previous checkpoints, and
the index never points at a checkpoint that cannot be read. A restore tries
the newest checkpoint first and falls back, with a warning, to older ones
when one is truncated or corrupted.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile
from typing import Optional

import tensorflow as tf
from absl import logging

from tfdist import compat
from tfdist.errors import UsageError, WorkerFault, first_line

_PREFIX = "ckpt"


class CheckpointWriteError(WorkerFault):
    """A checkpoint could not be written (the previous ones are intact)."""


def _step_of(path: str) -> int:
    return int(path.rsplit("-", 1)[1])


def _digest(signature: dict) -> str:
    """A short, stable name for the settings a saved state depends on."""
    import hashlib
    import json
    return hashlib.sha256(json.dumps(signature, sort_keys=True, default=str)
                          .encode()).hexdigest()[:12]


def _prune(directory: str, pattern: str, keep: int, remove) -> None:
    """Keep the newest `keep` of the steps saved in `directory` as files
    named `pattern` (with a `(\\d+)` for the step); `remove(step)` the rest.
    Several processes may prune the same directory: a file another removed
    first is not an error."""
    steps = sorted((int(m.group(1)) for m in (re.fullmatch(pattern, name)
                                               for name in tf.io.gfile.listdir(directory)) if m),
                   reverse=True)
    for old in steps[keep:]:
        try:
            remove(old)
        except (OSError, tf.errors.NotFoundError):
            pass


class Checkpointer:
    """Saves and restores `trackables` (e.g. model=, optimizer=, step=) in `directory`.

    Every worker calls `save` (saving may run collectives under multi-worker
    strategies), but only the chief writes into `directory`; the others write
    to a private temporary directory and delete it at once (the pattern of
    TensorFlow Model Garden), so they never clobber the chief's files.
    """

    def __init__(self, directory: str, *, keep: int, is_chief: bool, shared_write: bool = False,
                 **trackables):
        self.directory = directory
        self.shared_write = shared_write
        self.keep = keep
        self.is_chief = is_chief
        self.checkpoint = tf.train.Checkpoint(**trackables)
        self._current: Optional[str] = None   # saved or restored by this process
        # This process's input position, saved with every checkpoint (when the
        # engine's input iterator can be checkpointed; see `InputPosition`).
        self.input_position = None   # InputPosition or GlobalInputPosition
        # State each replica keeps for itself (error feedback, local optimizer
        # state), saved by every process with every checkpoint (`ReplicaState`).
        self.replica_state: Optional[ReplicaState] = None
        # Where the engine splits the state across processes and each writes
        # and reads its own part (`tfdist.checkpoint_parts`); None: the chief
        # writes the whole checkpoint.
        self.parts = None

    # -- what is there ---------------------------------------------------------
    def candidates(self) -> list[str]:
        """Checkpoint prefixes in `directory`, newest first: those the index
        lists, and any other complete-looking ones (an index lost or damaged)."""
        listed = []
        try:
            state = tf.train.get_checkpoint_state(self.directory)
            if state:
                listed = list(state.all_model_checkpoint_paths)
        except Exception as error:  # noqa: BLE001  (a corrupted index file)
            logging.warning("checkpoint index in %s is damaged (%s); looking at the files",
                            self.directory, first_line(error))
        found = [path[:-len(".index")] for path in
                 glob.glob(os.path.join(self.directory, f"{_PREFIX}-*.index"))]
        paths = {os.path.join(self.directory, os.path.basename(p)) for p in listed + found}
        paths = [p for p in paths if re.fullmatch(rf"{_PREFIX}-\d+", os.path.basename(p))]
        return sorted(paths, key=_step_of, reverse=True)

    @property
    def latest(self) -> Optional[str]:
        return tf.train.latest_checkpoint(self.directory)

    # -- restore -----------------------------------------------------------------
    def restore_latest(self) -> Optional[str]:
        """Restore the newest readable checkpoint; return its path (None: none).

        A truncated or corrupted checkpoint is skipped with a warning; if
        checkpoints exist but none can be read, that is an error (training
        from scratch over them would silently throw the run away)."""
        candidates = self.candidates()
        for path in candidates:
            try:
                if self.parts is not None:   # every process: its own variables
                    self.parts.restore(path)
                else:
                    # expect_partial: optimizer slots of a different optimizer
                    # config, or a checkpoint without them, must not abort a resume.
                    self.checkpoint.restore(path).expect_partial()
            except Exception as error:  # noqa: BLE001  (damage shows as OpError, IndexError, ...)
                older = [p for p in candidates if _step_of(p) < _step_of(path)]
                logging.warning("checkpoint %s cannot be read (%s); %s", path,
                                first_line(error),
                                f"falling back to {older[0]}" if older else "no older one")
                continue
            logging.info("restored %s", path)
            self._current = path
            return path
        if candidates:
            raise UsageError(f"--model_dir={os.path.dirname(self.directory)}: none of its "
                             f"{len(candidates)} checkpoint(s) can be read (damaged); move "
                             f"{self.directory} away to train from scratch")
        return None

    # -- save --------------------------------------------------------------------
    def save(self, step: int) -> Optional[str]:
        if self.input_position is not None:   # every process: its own pipeline's
            self.input_position.save(step)
        if self.replica_state is not None:    # every process: its own replicas'
            self.replica_state.save(step)
        if self.parts is not None:
            return self._save_parts(step)
        if not self.is_chief and self.shared_write:
            # A mesh over processes (DTensor clients): each writes the shards
            # it holds into the same checkpoint; the chief verifies and indexes.
            self.checkpoint.write(os.path.join(self.directory, f"{_PREFIX}-{step}"))
            return None
        if not self.is_chief:
            scratch = tempfile.mkdtemp(prefix="tfdist-worker-ckpt-")
            try:
                self.checkpoint.write(os.path.join(scratch, _PREFIX))
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            return None
        path = os.path.join(self.directory, f"{_PREFIX}-{step}")
        if self._current == path:
            return path  # this state is that checkpoint already (saved or restored here)
        try:
            written = self.checkpoint.write(path)
            _verify(written)
        except (tf.errors.OpError, OSError, ValueError) as error:
            _remove(path)
            previous = self.latest
            raise CheckpointWriteError(
                f"cannot save the checkpoint of step {step} in {self.directory}: "
                f"{first_line(error)}; "
                + (f"the previous checkpoint {os.path.basename(previous)} is intact"
                   if previous else "no earlier checkpoint exists")) from None
        self._index(written)
        return written

    def _save_parts(self, step: int) -> Optional[str]:
        """Every process writes its part; the chief merges, verifies and indexes."""
        path = os.path.join(self.directory, f"{_PREFIX}-{step}")
        if self._current == path:
            return path if self.is_chief else None
        try:
            self.parts.write(path, finish=self._verified_and_indexed)
        except Exception as error:  # noqa: BLE001  (PartsFailed; raised on every process)
            if self.is_chief:
                _remove(path)
            raise CheckpointWriteError(
                f"{first_line(error)}; the previous checkpoints are intact") from None
        self._current = path
        return path if self.is_chief else None

    def _verified_and_indexed(self, written: str) -> None:
        _verify(written)
        self._index(written)

    def _index(self, written: str) -> None:
        """After `written` was verified: the index names it, older ones beyond `keep` go."""
        kept = [p for p in self.candidates() if p != written][:self.keep - 1]
        kept = sorted([written, *kept], key=_step_of)
        try:
            # The index last: it only ever names complete, readable checkpoints.
            compat.update_checkpoint_state(self.directory, written, all_paths=kept)
        except (tf.errors.OpError, OSError) as error:
            _remove(written)
            raise CheckpointWriteError(
                f"cannot update the checkpoint index in {self.directory}: "
                f"{first_line(error)}; the previous checkpoints are intact") from None
        for old in self.candidates():
            if old not in kept:
                _remove(old)
        logging.info("saved %s", written)
        self._current = written


class InputPosition:
    """This input pipeline's position (its tf.data iterator state), saved beside
    each checkpoint so a resumed run reads exactly the batches an uninterrupted
    run reads.

    Every process keeps its own, in `checkpoints/input/<signature>-pipeline-<i>-of-<n>/`:
    pipelines hold different shards, so the chief cannot save the others'. The
    signature (a hash of batch size, shuffle buffer, sharding and the dataset)
    keeps a run with other input settings from restoring a position that
    means something else; it then draws a fresh permutation instead. Beside
    each position, `ckpt-S.seed` holds the seed its pipeline was built with
    (a run that once drew a fresh permutation goes on with that one). The
    state holds the shuffle buffer's examples (see BUILD_NOTES.md for why not
    symbolic checkpointing); `--nocheckpoint_input` turns this off.
    """

    def __init__(self, directory: str, *, signature: dict, pipeline: int, pipelines: int,
                 keep: int):
        self.directory = os.path.join(directory, "input",
                                      f"{_digest(signature)}-pipeline-{pipeline}-of-{pipelines}")
        self.keep = keep
        self.checkpoint, self.seed, self.enabled = None, None, True

    def track(self, iterator, seed: int) -> None:
        """Save and restore `iterator`, whose pipeline was built with `seed`."""
        self.checkpoint, self.seed = tf.train.Checkpoint(iterator=iterator), seed

    def _path(self, step: int) -> str:
        return os.path.join(self.directory, f"{_PREFIX}-{step}")

    def saved_seed(self, step: int) -> Optional[int]:
        """The seed of the pipeline whose position was saved at `step` (None: none saved)."""
        path = self._path(step)
        try:
            with open(path + ".seed") as f:
                seed = int(f.read())
        except (OSError, ValueError):
            return None
        return seed if os.path.exists(path + ".index") else None

    def save(self, step: int) -> None:
        """Write the position at `step`; a failure only costs exactness on resume."""
        if not self.enabled:
            return
        path = self._path(step)
        try:
            os.makedirs(self.directory, exist_ok=True)
            _verify(self.checkpoint.write(path))
            with open(path + ".seed", "w") as f:   # last: it marks the position complete
                f.write(str(self.seed))
        except Exception as error:  # noqa: BLE001  (any pipeline op may refuse to be saved)
            _remove(path)
            self.enabled = False
            logging.warning("cannot save the input position (%s); a run resumed from a later "
                            "checkpoint draws a fresh permutation of the data", first_line(error))
            return
        _prune(self.directory, rf"{_PREFIX}-(\d+)\.index", self.keep,
               lambda old: _remove(self._path(old)))

    def restore(self, step: int) -> bool:
        """Move the iterator to the position saved at `step`; False if there is none."""
        if self.saved_seed(step) is None:
            return False
        try:
            self.checkpoint.read(self._path(step)).assert_consumed()
        except Exception as error:  # noqa: BLE001  (damaged, or another pipeline layout)
            logging.warning("the input position of step %d cannot be read (%s)", step,
                            first_line(error))
            return False
        return True


class GlobalInputPosition:
    """Where a run is in the one global order of its training data
    (`--autoshard=global`): the seed the order was drawn with and the global
    examples read, saved beside each checkpoint as
    `checkpoints/input/global-<signature>/ckpt-S.json`.

    It does not depend on the engine, the cluster size or the global batch
    (only the data, the shuffle buffer and the order's seed enter the
    signature), so a checkpoint resumes under any synchronous engine and size
    at the same example. Every process writes the same file (written to a
    temporary name and renamed: never half-written), so a run whose processes
    do not share a file system finds it too.
    """

    def __init__(self, directory: str, *, signature: dict, keep: int):
        self.directory = os.path.join(directory, "input", f"global-{_digest(signature)}")
        self.keep = keep
        self.seed = self.start_example = self.start_step = self.global_batch = None

    def track(self, seed: int, start_example: int, start_step: int, global_batch: int) -> None:
        """The order drawn with `seed` was entered at `start_example` at
        `start_step`; each step reads `global_batch` examples."""
        self.seed, self.start_example = seed, start_example
        self.start_step, self.global_batch = start_step, global_batch

    def _path(self, step: int) -> str:
        return os.path.join(self.directory, f"{_PREFIX}-{step}.json")

    def save(self, step: int) -> None:
        import json
        examples = self.start_example + (step - self.start_step) * self.global_batch
        path = self._path(step)
        try:
            os.makedirs(self.directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
            with os.fdopen(fd, "w") as f:
                json.dump({"seed": self.seed, "examples": examples}, f)
            os.replace(tmp, path)
        except OSError as error:
            logging.warning("cannot save the input position (%s); a run resumed from step %d "
                            "draws a fresh permutation of the data", first_line(error), step)
            return
        _prune(self.directory, rf"{_PREFIX}-(\d+)\.json", self.keep,
               lambda old: os.remove(self._path(old)))

    def restore(self, step: int) -> Optional[tuple]:
        """(seed, global examples read) saved at `step`, or None."""
        import json
        try:
            with open(self._path(step)) as f:
                saved = json.load(f)
            return int(saved["seed"]), int(saved["examples"])
        except (OSError, ValueError, KeyError, TypeError):
            return None


class ReplicaState:
    """The state each of this process's replicas keeps for itself (the
    compression's error feedback and PowerSGD's Q; local SGD's optimizer
    state), saved beside each checkpoint so a resumed run continues exactly.

    As with `InputPosition`, every process keeps its own, in
    `checkpoints/replicas/<signature>-process-<i>-of-<n>/state-<step>.npz`
    (written to a temporary name and renamed: never half-written); the
    signature (the variables' names and shapes and the exchange's settings)
    keeps another configuration from restoring state that means something
    else. Where none is found for the step resumed from (none was saved, or
    it was saved by another number of processes or replicas: it is not
    re-partitioned), the state starts from its initial values (zero error
    feedback; local SGD's optimizer state from the chief's) and a warning says
    which.
    """

    def __init__(self, directory: str, *, signature: dict, process: int, processes: int,
                 keep: int, variables: list, replica_values):
        self.variables, self.replica_values, self.keep = list(variables), replica_values, keep
        signature = {**signature, "variables": [(v.name, list(v.shape)) for v in variables]}
        self.directory = os.path.join(directory, "replicas",
                                      f"{_digest(signature)}-process-{process}-of-{processes}")

    def _path(self, step: int) -> str:
        return os.path.join(self.directory, f"state-{step}.npz")

    def save(self, step: int) -> None:
        import io

        import numpy as np
        arrays = {f"v{j}_r{r}": copy.numpy() for j, variable in enumerate(self.variables)
                  for r, copy in enumerate(self.replica_values(variable))}
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        path = self._path(step)
        try:
            tf.io.gfile.makedirs(self.directory)
            with tf.io.gfile.GFile(path + ".tmp", "wb") as f:
                f.write(buffer.getvalue())
            tf.io.gfile.rename(path + ".tmp", path, overwrite=True)
        except (tf.errors.OpError, OSError) as error:
            raise CheckpointWriteError(f"cannot save the per-replica state of step {step} in "
                                       f"{self.directory}: {first_line(error)}") from None
        _prune(self.directory, r"state-(\d+)\.npz", self.keep,
               lambda old: tf.io.gfile.remove(self._path(old)))

    def restore(self, step: int) -> bool:
        """Set every replica's state to the one saved at `step`; False if none."""
        import io

        import numpy as np
        path = self._path(step)
        if not tf.io.gfile.exists(path):
            parent = os.path.dirname(self.directory)
            others = sorted({os.path.basename(os.path.dirname(p)) for p in tf.io.gfile.glob(
                os.path.join(parent, "*", f"state-{step}.npz"))})
            where = (f"it was saved under another number of processes or replicas or other "
                     f"compression settings ({', '.join(others)}; this run: "
                     f"{os.path.basename(self.directory)}), and is not re-partitioned"
                     if others else f"none was saved with step {step} in {parent}")
            logging.warning("the per-replica state of step %d is not restored: %s; error "
                            "feedback starts from zero, local SGD's optimizer state from the "
                            "chief's", step, where)
            return False
        with tf.io.gfile.GFile(path, "rb") as f:
            arrays = np.load(io.BytesIO(f.read()))
            for j, variable in enumerate(self.variables):
                for r, copy in enumerate(self.replica_values(variable)):
                    copy.assign(arrays[f"v{j}_r{r}"])
        logging.info("restored the per-replica state of step %d", step)
        return True


def _verify(path: str) -> None:
    """Read a written checkpoint back: its index and each tensor's entry."""
    reader = tf.train.load_checkpoint(path)
    dtypes = reader.get_variable_to_dtype_map()
    if not dtypes:
        raise ValueError(f"{path} holds no tensors")
    for name, dtype in dtypes.items():
        if dtype != tf.variant:   # an iterator's state: not readable as an array
            reader.get_tensor(name)


def _remove(path: str) -> None:
    for name in glob.glob(f"{path}.*"):
        try:
            os.remove(name)
        except OSError:
            pass


def checkpoint_dir(model_dir: str) -> str:
    return os.path.join(model_dir, "checkpoints")


def saved_steps(model_dir: str) -> list[int]:
    """Steps of the checkpoints kept in `model_dir` (oldest first)."""
    state = tf.train.get_checkpoint_state(checkpoint_dir(model_dir))
    if not state:
        return []
    return [_step_of(p) for p in state.all_model_checkpoint_paths]
