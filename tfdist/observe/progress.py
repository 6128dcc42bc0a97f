"""Progress: a bar on a terminal, plain log lines otherwise (CI, files, pipes)."""

from __future__ import annotations

import sys

from absl import logging

# Shown as their latest value, not averaged over the run.
_METRICS = ("loss", "accuracy", "examples_per_sec", "tflops", "mfu", "grad_norm", "test_loss",
            "test_accuracy", "learning_rate", "loss_scale")


def _format(metrics: dict) -> str:
    parts = []
    for key, value in metrics.items():
        if key in ("examples_per_sec", "loss_scale"):
            parts.append(f"{key}={value:.1f}")
        elif key in ("learning_rate", "grad_norm"):
            parts.append(f"{key}={value:.3g}")
        else:
            parts.append(f"{key}={value:.4f}")
    return " ".join(parts)


class Progress:
    """Reports training progress (from the chief only, unless --log_all_ranks)."""

    def __init__(self, total_steps: int, *, start: int = 0, enabled: bool = True,
                 metric_names=()):
        self.total_steps = total_steps
        self.enabled = enabled
        self._bar = None
        if enabled and sys.stdout.isatty():
            import keras
            names = (*_METRICS, *metric_names, *(f"test_{name}" for name in metric_names))
            self._bar = keras.utils.Progbar(total_steps, unit_name="step", stateful_metrics=names)
            self._bar.update(start)

    def update(self, step: int, metrics: dict, *, log: bool = True) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(step, values=[(k, v) for k, v in metrics.items()], finalize=False)
            if step >= self.total_steps:
                sys.stdout.write("\n")
        elif log:
            logging.info("step %d/%d %s", step, self.total_steps, _format(metrics))
