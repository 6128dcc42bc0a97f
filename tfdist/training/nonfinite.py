"""Steps whose loss is not finite (`--on_nonfinite=stop|skip|rollback`), in one place.

In the graph, each step's update is applied only where its (reduced, so
everywhere equal) loss is finite, unless the run stops at the first such step
anyway (`apply_unless_nonfinite`); each loop counts such steps and leaves them
out of its metrics (`tally_add`). On the host, after each loop, `Policy.react`
stops the run, counts the skipped updates, or rolls back to the last
checkpoint.
"""

from __future__ import annotations

from typing import Callable, Optional

import tensorflow as tf
from absl import logging

from tfdist.errors import NonFiniteLoss
from tfdist.observe.totals import LOSS_NUMERATOR, LoopTotals


def apply_unless_nonfinite(strategy, policy: str, counters, apply: Callable, grads) -> None:
    """`apply(grads)` (the optimizer update) in replica context; under `skip`
    and `rollback` only where this step's reduced loss is finite (the same on
    every replica), so a skipped step equals never seeing its batch."""
    if policy == "stop":
        apply(grads)   # the run stops after this loop anyway
        return
    strategy.apply_if(tf.math.is_finite(counters[LOSS_NUMERATOR]), apply, grads)


def tally(size: int) -> tuple:
    """The in-graph running state of a loop's steps: (sum of the finite steps'
    counters, number of non-finite steps, offset of the first one or -1)."""
    return tf.zeros([size]), tf.constant(0.0), tf.constant(-1.0)


def tally_add(state: tuple, counters, index) -> tuple:
    """`state` after the step at offset `index` with these reduced counters.
    Arithmetic, not `tf.where`: a select on a scalar condition crashes
    DTensor's SPMD expansion (TF 2.21, segmentation fault)."""
    totals, bad, first_bad = state
    finite = tf.cast(tf.math.is_finite(counters[LOSS_NUMERATOR]), tf.float32)
    totals += tf.math.multiply_no_nan(counters, tf.fill(tf.shape(counters), finite))
    first = (1.0 - finite) * tf.cast(first_bad < 0, tf.float32)   # 1: the first bad step
    return totals, bad + (1.0 - finite), first_bad + first * (tf.cast(index, tf.float32) + 1.0)


class Policy:
    """The host's reaction to a loop's non-finite steps (see module doc)."""

    def __init__(self, train_config, strategy, checkpointer=None, *,
                 restore_state: Callable[[], int],
                 before_restore: Callable[[], None] = lambda: None):
        self.config, self.strategy, self.checkpointer = train_config, strategy, checkpointer
        self.before_restore = before_restore   # e.g. storage for every variable again
        self.restore_state = restore_state   # restores the latest checkpoint; returns its step
        self.skipped, self.rollbacks = 0, 0

    def _where(self) -> str:
        last_good = self.checkpointer.latest if self.checkpointer else None
        return (f"the last good checkpoint is {last_good}" if last_good
                else "no checkpoint was saved (no --model_dir)" if not self.checkpointer
                else "no checkpoint was saved yet")

    def _fail(self, first: int, why: str) -> NonFiniteLoss:
        return NonFiniteLoss(f"{self.strategy.describe_process()}: the loss is not finite at "
                             f"step {first}{why}")

    def react(self, totals: LoopTotals, start: int) -> Optional[int]:
        """React to the non-finite steps of the loop that began at `start`:
        raise `NonFiniteLoss`, count skipped updates, or roll back (returns
        the step training resumes at)."""
        count, first, tc = totals.nonfinite, start + totals.first_nonfinite + 1, self.config
        if tc.on_nonfinite == "stop" and tc.precision == "mixed_float16":
            # fp16's dynamic loss scaling owns these: it skipped the update and
            # halved the scale, as it always has.
            self.skipped += count
            logging.warning("%d step(s) with a non-finite loss, the first at step %d: "
                            "skipped by mixed_float16's loss scaling", count, first)
            return None
        if tc.on_nonfinite == "stop":
            raise self._fail(first, f" (--on_nonfinite=stop); {self._where()}; "
                                    "--on_nonfinite=skip or rollback continue past such steps")
        self.skipped += count
        if tc.on_nonfinite == "skip":
            logging.warning("skipped the update of %d step(s) with a non-finite loss, the "
                            "first at step %d (--on_nonfinite=skip)", count, first)
            return None
        return self._roll_back(first)

    def _roll_back(self, first: int) -> int:
        tc = self.config
        if self.rollbacks >= tc.max_rollbacks:
            raise self._fail(first, f" after {self.rollbacks} rollback(s) (--max_rollbacks="
                                    f"{tc.max_rollbacks}); {self._where()}")
        restored = None
        if self.checkpointer and self.checkpointer.candidates():
            self.before_restore()
            restored = self.checkpointer.restore_latest()
        if restored is None:
            raise self._fail(first, " and there is no checkpoint to roll back to yet "
                                    "(--on_nonfinite=rollback; lower --checkpoint_every)")
        step = self.restore_state()
        self.rollbacks += 1
        logging.warning("the loss is not finite at step %d: rolled back to %s (step %d), "
                        "continuing past the offending batches (rollback %d of %d)", first,
                        restored, step, self.rollbacks, tc.max_rollbacks)
        return step
