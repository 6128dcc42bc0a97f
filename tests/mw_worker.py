"""A multi-worker test worker: trains through the Python API, saves its weights.

Run by tests under tfdist-launch (TF_CONFIG set per worker):
    python tests/mw_worker.py OUT_DIR STRATEGY STEPS [TRAIN_OVERRIDES_JSON]
Loads OUT_DIR/initial.npz, trains (TrainConfig fields overridden by the JSON,
e.g. {"accum_steps": 4}; its "strategy" and "model" entries override StrategyConfig
and ModelConfig fields, e.g. {"strategy": {"mesh": "batch:2,model:2"}}; "task" names
a case of test_tasks.CASES: its model, data, loss and metrics), writes
OUT_DIR/weights-<worker>.npz (and, with a task, summary-<worker>.json).
"""

import dataclasses
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import mw_config, train_from  # noqa: E402


def main(out_dir, strategy, steps, overrides="{}"):
    initial = list(np.load(os.path.join(out_dir, "initial.npz")).values())
    overrides = json.loads(overrides)
    strategy_fields = overrides.pop("strategy", {})   # StrategyConfig fields, e.g. mesh
    model_fields = overrides.pop("model", {})
    task = overrides.pop("task", None)
    config = mw_config(strategy, int(steps), **overrides)
    config = config.replace(strategy=dataclasses.replace(config.strategy, **strategy_fields),
                            model=dataclasses.replace(config.model, **model_fields))
    if task:
        import tfdist
        from test_tasks import run_case
        result = run_case(tfdist.train, config, task, initial)
    else:
        result = train_from(config, initial)
    index = os.environ.get("HOROVOD_RANK") or str(
        json.loads(os.environ.get("TF_CONFIG", '{"task":{"index":0}}'))["task"]["index"])
    np.savez(os.path.join(out_dir, f"weights-{index}.npz"), *result.model.get_weights())
    if task:
        with open(os.path.join(out_dir, f"summary-{index}.json"), "w") as f:
            json.dump(result.summary, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
