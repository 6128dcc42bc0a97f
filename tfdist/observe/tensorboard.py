"""TensorBoard output: scalars under `model_dir/tensorboard/{train,eval}` and
profiler traces of chosen steps.

The chief writes the scalars (one event file per split, read back by
TensorBoard, `tf.compat.v1.train.summary_iterator` or `tfdist-compare`);
other ranks write nothing unless asked to profile. Tags are the metric names
of the progress lines, so what a user reads in the log is what they plot.
"""

from __future__ import annotations

import os
from typing import Optional

import tensorflow as tf
from absl import logging

# Evaluation metrics in progress lines start with this; in TensorBoard they go
# to the eval split under their name without it (test_loss -> eval/loss).
_EVAL_PREFIX = "test_"


def directory(model_dir: str) -> str:
    return os.path.join(model_dir, "tensorboard")


class TensorBoard:
    """Scalar writers for the train and eval splits (no-ops when disabled)."""

    def __init__(self, model_dir: Optional[str], *, enabled: bool):
        self.enabled = bool(model_dir) and enabled
        self._root = directory(model_dir) if model_dir else None
        self._writers: dict = {}

    def _writer(self, split: str):
        if split not in self._writers:
            self._writers[split] = tf.summary.create_file_writer(os.path.join(self._root, split))
        return self._writers[split]

    def write(self, step: int, metrics: dict) -> None:
        """Write `metrics` (a progress line's keys) at global `step`."""
        if not self.enabled:
            return
        by_split: dict = {}
        for key, value in metrics.items():
            if value is None:
                continue
            if key.startswith(_EVAL_PREFIX):
                by_split.setdefault("eval", {})[key[len(_EVAL_PREFIX):]] = value
            else:
                by_split.setdefault("train", {})[key] = value
        for split, values in by_split.items():
            with self._writer(split).as_default(step=step):
                for tag, value in values.items():
                    tf.summary.scalar(tag, float(value))

    def close(self) -> None:
        for writer in self._writers.values():
            writer.flush()
            writer.close()
        self._writers.clear()


class Profiler:
    """Captures a TensorFlow profiler trace of global steps [first, last].

    The trainer stops its in-graph loop just before `first` and at `last`
    (`boundaries`), so the trace covers exactly those steps; TensorBoard's
    profile tab reads it from `model_dir/tensorboard` (non-chief ranks, with
    --profile_all_ranks, from `tensorboard/worker_<i>`).
    """

    def __init__(self, steps: tuple, log_dir: Optional[str], *, enabled: bool):
        self.first, self.last = steps if steps else (0, 0)
        self.enabled = bool(steps) and bool(log_dir) and enabled
        self.log_dir = log_dir
        self._active = False

    def boundaries(self) -> tuple:
        return (self.first - 1, self.last) if self.enabled else ()

    def before_loop(self, step: int) -> None:
        """Start tracing if the loop about to run begins at `first`."""
        if self.enabled and not self._active and step == self.first - 1:
            tf.profiler.experimental.start(self.log_dir)
            self._active = True

    def after_loop(self, step: int) -> None:
        if self._active and step >= self.last:
            self.stop()
            logging.info("profiler trace of steps %d-%d written to %s", self.first, self.last,
                         self.log_dir)

    def stop(self) -> None:
        if self._active:
            tf.profiler.experimental.stop()
            self._active = False
