"""The run summary: one JSON object per run (printed, and summary.json)."""

from __future__ import annotations

import json
import os
import re
import resource

from tfdist.observe import hardware
from tfdist.training import optimizers
from tfdist.training.precision import Precision


def run_summary(config, controller, inputs, metrics: dict, *, peak_lr: float) -> dict:
    """What a run did and measured: engine, model, data, final metrics, speed."""
    tc, trainer = config.train, controller.trainer
    strategy, model, optimizer, task = (trainer.strategy, trainer.model, trainer.optimizer,
                                        trainer.task)
    summary = {
        "strategy": strategy.name,
        "replicas": strategy.num_replicas,
        "workers": strategy.num_workers,
        "global_batch_size": tc.global_batch_size,
        "model": model.name,
        "dataset": inputs.spec.name,
        "steps": metrics["steps"],
        "loss_function": task.loss_name,
        "metrics": task.metric_names,
        "loss": metrics.get("loss"),
        "test_loss": metrics.get("test_loss"),
        "examples_per_sec": metrics.get("examples_per_sec"),
        "tflops": metrics.get("tflops"),
        "mfu": metrics.get("mfu"),
        "peak_tflops": controller.peak_tflops,
        "flops_per_example": controller.flops_per_example,
        "jit_compile": trainer.jit_level,
        "grad_norm": metrics.get("grad_norm"),
        "nonfinite_steps": controller.nonfinite.skipped,   # --on_nonfinite=skip/rollback
        "rollbacks": controller.nonfinite.rollbacks,
        **controller.grad_agreement,
        "precision": tc.precision,
        "learning_rate": peak_lr,
        "final_learning_rate": optimizers.current_learning_rate(optimizer),
        "loss_scale": Precision.loss_scale(optimizer),
        "grad_compression": tc.grad_compression,
        "powersgd_rank": tc.powersgd_rank if tc.grad_compression == "powersgd" else None,
        "topk_fraction": tc.topk_fraction if tc.grad_compression == "topk" else None,
        "sync_every": tc.sync_every,
        "bytes_reduced_per_update": trainer.bytes_per_update,
        # This process's peak resident memory so far (Linux: ru_maxrss in KiB).
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "hardware": hardware.describe(),
        "cpu": hardware.cpu_model(),
        **strategy.summary_fields(model, optimizer),
    }
    # Each metric: its last training value as train_NAME, its test value as
    # NAME (None without evaluation), e.g. train_accuracy and accuracy.
    for name in _metric_keys(task, metrics):
        key = name if name not in summary else f"metric_{name}"
        summary[f"train_{name}"] = metrics.get(name)
        summary[key] = metrics.get(f"test_{name}")
    return summary


def _metric_keys(task, metrics: dict) -> list:
    """The metric values among a trainer's results (train `NAME`, test
    `test_NAME`; a vector-valued metric gives `NAME_0`, `NAME_1`, ...), also
    when a resumed run trained no step and only evaluated."""
    keys = []
    for key in metrics:
        name = key[len("test_"):] if key.startswith("test_") else key
        if name not in keys and any(re.fullmatch(rf"{re.escape(m)}(_\d+)?", name)
                                    for m in task.metric_names):
            keys.append(name)
    return keys


def write_summary(model_dir: str, summary: dict) -> None:
    """Write `summary.json` atomically (never a half-written file)."""
    path = os.path.join(model_dir, "summary.json")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
