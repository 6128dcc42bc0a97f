"""Checkpoints of model, optimizer and step, written only by the chief.

`tf.train.CheckpointManager` writes each checkpoint's files first and updates
the `checkpoint` index last, so an interrupted save (Ctrl-C, a killed worker)
leaves the index pointing at the last complete checkpoint.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Optional

import tensorflow as tf
from absl import logging


class Checkpointer:
    """Saves and restores `trackables` (e.g. model=, optimizer=, step=) in `directory`.

    Every worker calls `save` (saving may run collectives under multi-worker
    strategies), but only the chief writes into `directory`; the others write
    to a private temporary directory and delete it at once (the pattern of
    TensorFlow Model Garden), so they never clobber the chief's files.
    """

    def __init__(self, directory: str, *, keep: int, is_chief: bool, **trackables):
        self.directory = directory
        self.is_chief = is_chief
        self.checkpoint = tf.train.Checkpoint(**trackables)
        self.manager = None
        if is_chief:
            self.manager = tf.train.CheckpointManager(self.checkpoint, directory, max_to_keep=keep)

    @property
    def latest(self) -> Optional[str]:
        return tf.train.latest_checkpoint(self.directory)

    def restore_latest(self) -> Optional[str]:
        """Restore the newest checkpoint if there is one; return its path."""
        path = self.latest
        if path:
            # expect_partial: optimizer slots of a different optimizer config, or
            # a checkpoint without them, must not abort a resume.
            self.checkpoint.restore(path).expect_partial()
            logging.info("restored %s", path)
        return path

    def save(self, step: int) -> Optional[str]:
        if not self.is_chief:
            scratch = tempfile.mkdtemp(prefix="tfdist-worker-ckpt-")
            try:
                self.checkpoint.write(os.path.join(scratch, "ckpt"))
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            return None
        if self.latest and self.latest.endswith(f"-{step}"):
            return self.latest  # already saved at this step
        path = self.manager.save(checkpoint_number=step)
        logging.info("saved %s", path)
        return path


def checkpoint_dir(model_dir: str) -> str:
    return os.path.join(model_dir, "checkpoints")


def saved_steps(model_dir: str) -> list[int]:
    """Steps of the checkpoints kept in `model_dir` (oldest first)."""
    state = tf.train.get_checkpoint_state(checkpoint_dir(model_dir))
    if not state:
        return []
    return [int(p.rsplit("-", 1)[1]) for p in state.all_model_checkpoint_paths]
