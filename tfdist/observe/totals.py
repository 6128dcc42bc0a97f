"""What one loop of training steps returns, by name.

The trainer's in-graph loop returns a dict of tensors (`LoopTotals.fields`);
the host reads it into a `LoopTotals`. An engine that runs a loop's steps in
pieces (`ScheduledSteps`: each step a task on whichever worker is free) joins
the pieces' results with `LoopTotals.chain`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

# Positions in the counter vector every replica step returns (summed across
# replicas in the step's one reduction): the loss numerator and divisor
# (`Task.loss_terms`), then every metric's state change (`Task.metric_deltas`).
LOSS_NUMERATOR, LOSS_DIVISOR, METRICS = 0, 1, 2


@dataclasses.dataclass
class LoopTotals:
    """One loop's results on the host.

    counters: the finite steps' loss numerator, divisor and metric deltas, summed.
    grad_norm: the global gradient norm at the loop's last step.
    nonfinite: steps whose loss was not finite (left out of `counters`).
    first_nonfinite: the offset in the loop of the first such step, or -1.
    agreement: per-replica gradient agreement at the last step, when measured.
    """

    counters: np.ndarray
    grad_norm: float
    nonfinite: int
    first_nonfinite: int
    agreement: Optional[np.ndarray] = None

    fields = ("counters", "grad_norm", "nonfinite", "first_nonfinite", "agreement")

    @classmethod
    def from_tensors(cls, values: dict) -> "LoopTotals":
        """From the loop function's dict of (host) tensors."""
        agreement = values.get("agreement")
        return cls(counters=np.asarray(values["counters"], dtype=np.float64),
                   grad_norm=float(values["grad_norm"]),
                   nonfinite=int(values["nonfinite"]),
                   first_nonfinite=int(values["first_nonfinite"]),
                   agreement=None if agreement is None else np.asarray(agreement))

    @property
    def loss_numerator(self) -> float:
        return float(self.counters[LOSS_NUMERATOR])

    @property
    def loss_divisor(self) -> float:
        return float(self.counters[LOSS_DIVISOR])

    @property
    def metric_counters(self) -> np.ndarray:
        return self.counters[METRICS:]

    @classmethod
    def chain(cls, pieces: Sequence[tuple[int, "LoopTotals"]]) -> "LoopTotals":
        """One loop's totals from [(steps, totals), ...] of pieces that ran its
        steps in order: counters and non-finite counts add up, the first
        non-finite step is offset by the steps before its piece, and the
        gradient norm and agreement are the last piece's (the loop's last step)."""
        counters, nonfinite, first, offset = None, 0, -1, 0
        for steps, piece in pieces:
            counters = piece.counters.copy() if counters is None else counters + piece.counters
            nonfinite += piece.nonfinite
            if first < 0 <= piece.first_nonfinite:
                first = offset + piece.first_nonfinite
            offset += steps
        last = pieces[-1][1]
        return cls(counters=counters, grad_norm=last.grad_norm, nonfinite=nonfinite,
                   first_nonfinite=first, agreement=last.agreement)
