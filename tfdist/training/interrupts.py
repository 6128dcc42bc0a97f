"""Ctrl-C and preemption (SIGTERM) during training, handled between loops.

Python runs signal handlers in the main thread only when it is back in the
interpreter, and a default SIGINT handler raises KeyboardInterrupt wherever
that happens to be (inside TensorFlow's or Keras's Python code, in a
checkpoint save). Instead, while the trainer runs, both signals only set a
flag; the trainer reads it after every loop (`steps_per_loop` steps):

- SIGINT: stop at once, raising KeyboardInterrupt there (the last complete
  checkpoint stays the latest). A second Ctrl-C raises immediately.
- SIGTERM (a Kubernetes eviction, a Slurm preemption, a spot VM, or
  `tfdist-launch` stopping its workers): every worker learns of it through a
  small agreement collective after the loop (a signal may reach one worker
  only), all save one checkpoint at the same step and exit with
  `PREEMPTED_EXIT`. If that has not happened within the grace period (a peer
  gone, a long loop), the process exits with the same status anyway.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

# 128 + SIGTERM: what schedulers read as "terminated by SIGTERM"; tfdist exits
# with it after saving (tfdist-launch --max_restarts and a re-run resume).
PREEMPTED_EXIT = 143


class Preempted(Exception):
    """Training stopped at `step` on SIGTERM (a checkpoint was saved if
    `saved` is set)."""

    def __init__(self, step: int, saved=None):
        self.step, self.saved = step, saved
        where = f"saved {saved}" if saved else "no --model_dir, nothing saved"
        super().__init__(f"preempted (SIGTERM) at step {step}: {where}; run again to resume")


DEADLINE_THREAD = "tfdist-preemption-deadline"


class StopSignals:
    """SIGINT/SIGTERM as flags while training (a context manager); only in the
    main thread (elsewhere signals keep their handlers)."""

    def __init__(self, grace_s: float, describe=lambda: "this process"):
        self.grace_s = grace_s
        self.describe = describe
        self.interrupted = False
        self.preempted = False
        self._previous: dict = {}
        self._stopped = threading.Event()   # the save ended: no deadline any more

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, exc_type, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        if exc_type is None or issubclass(exc_type, Preempted):
            # Training stopped in time (the save is done): the process goes on
            # or exits by itself. A Python program that catches `Preempted`
            # must not be killed grace_s later by the deadline below.
            self._stopped.set()
        return False

    def _handle(self, signum, frame):
        del frame
        if signum == signal.SIGINT:
            if self.interrupted:
                raise KeyboardInterrupt   # a second Ctrl-C: now
            self.interrupted = True
            return
        if not self.preempted:
            self.preempted = True
            threading.Thread(target=self._deadline, daemon=True,
                             name=DEADLINE_THREAD).start()

    def _deadline(self):
        """Exit with PREEMPTED_EXIT if the save has not ended the process in time."""
        if self._stopped.wait(self.grace_s):
            return
        with contextlib.suppress(Exception):
            sys.stderr.write(f"tfdist: {self.describe()}: preempted (SIGTERM) and not stopped "
                             f"within --preemption_grace_s={self.grace_s:g}s; exiting without "
                             "a new checkpoint (the last complete one is intact)\n")
            sys.stderr.flush()
        os._exit(PREEMPTED_EXIT)
