"""The divergence of two loss curves (`tfdist-compare`; pure NumPy): aligned
by step, smoothed by a trailing moving average, their gap relative to the
loss with a floor (the reasons: `tfdist/compare.py`'s docstring)."""

from __future__ import annotations

import dataclasses
import re

import numpy as np

DEFAULT_WINDOW = 5
DEFAULT_TOLERANCE = 0.1   # why 0.1: tfdist/compare.py's docstring
_REPLICA_TAG = re.compile(r"grad_agreement_replica_(\d+)$")


@dataclasses.dataclass(frozen=True)
class Divergence:
    steps: np.ndarray            # aligned steps
    default: np.ndarray          # default run's loss at `steps`
    distributed: np.ndarray      # distributed run's loss at `steps`
    window: int                  # the moving-average window actually used
    smooth_steps: np.ndarray     # last step of each full window
    smooth_default: np.ndarray
    smooth_distributed: np.ndarray
    relative_gap: np.ndarray     # at `smooth_steps`; inf where a loss is not finite
    tolerance: float

    @property
    def gap(self) -> np.ndarray:
        """Per-step (unsmoothed) gap, distributed - default."""
        return self.distributed - self.default

    @property
    def worst(self) -> int:
        """Index into the smoothed arrays of the largest relative gap."""
        return int(np.argmax(self.relative_gap))

    @property
    def max_relative_gap(self) -> float:
        return float(self.relative_gap[self.worst])

    @property
    def diverged(self) -> bool:
        return self.max_relative_gap > self.tolerance


# The relative gap's denominator never falls below this fraction of the
# default run's first smoothed loss (see the module docstring).
LOSS_FLOOR = 0.25


def align(a: dict, b: dict) -> tuple:
    """Put two {step: value} curves on one grid: the steps of the sparser one
    inside the range both cover; the other is read there by linear
    interpolation (exact where it has that step). Returns (steps, a, b)."""
    if not a or not b:
        raise ValueError("a curve has no points")
    sa, sb = np.array(sorted(a), dtype=np.int64), np.array(sorted(b), dtype=np.int64)
    grid = sa if len(sa) <= len(sb) else sb
    low, high = max(sa[0], sb[0]), min(sa[-1], sb[-1])
    steps = grid[(grid >= low) & (grid <= high)]
    if not len(steps):
        raise ValueError(f"the curves do not overlap (steps {sa[0]}-{sa[-1]} and "
                         f"{sb[0]}-{sb[-1]})")
    va = np.interp(steps, sa, [a[s] for s in sa])
    vb = np.interp(steps, sb, [b[s] for s in sb])
    return steps, va, vb


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over full windows: element i is the mean of values[i:i+window]."""
    return np.convolve(values, np.ones(window) / window, mode="valid")


def divergence(default: dict, distributed: dict, *, window: int = DEFAULT_WINDOW,
               tolerance: float = DEFAULT_TOLERANCE) -> Divergence:
    """Compare two {step: loss} curves (see the module docstring)."""
    steps, a, b = align(default, distributed)
    window = max(1, min(window, len(steps)))
    smooth_a, smooth_b = moving_average(a, window), moving_average(b, window)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        floor = max(LOSS_FLOOR * abs(smooth_a[0]), 1e-8) if np.isfinite(smooth_a[0]) else 1e-8
        relative = np.abs(smooth_b - smooth_a) / np.maximum(np.abs(smooth_a), floor)
    relative = np.where(np.isfinite(relative), relative, np.inf)  # NaN never passes
    return Divergence(steps=steps, default=a, distributed=b, window=window,
                      smooth_steps=steps[window - 1:], smooth_default=smooth_a,
                      smooth_distributed=smooth_b, relative_gap=relative,
                      tolerance=tolerance)


def agreement_table(scalars: dict) -> dict:
    """{replica: (min, mean, samples)} of the logged per-replica gradient cosines."""
    table = {}
    for tag, curve in scalars.items():
        match = _REPLICA_TAG.match(tag)
        if match and curve:
            values = np.array(list(curve.values()))
            table[int(match.group(1))] = (float(values.min()), float(values.mean()), len(values))
    return dict(sorted(table.items()))


# -- command line -------------------------------------------------------------
