"""A multi-worker test worker: trains through the Python API, saves its weights.

Run by tests under tfdist-launch (TF_CONFIG set per worker):
    python tests/mw_worker.py OUT_DIR STRATEGY STEPS [TRAIN_OVERRIDES_JSON]
Loads OUT_DIR/initial.npz, trains (TrainConfig fields overridden by the JSON,
e.g. {"accum_steps": 4}; its "strategy" and "model" entries override StrategyConfig
and ModelConfig fields, e.g. {"strategy": {"mesh": "batch:2,model:2"}}, "data" DataConfig
fields; "task" names
a case of test_tasks.CASES: its model, data, loss and metrics; "nan": true feeds
test_nonfinite's data, whose step NAN_STEP has a NaN loss), writes
OUT_DIR/weights-<worker>.npz (and, with a task or "nan", summary-<worker>.json).
Errors end the process as tfdist-train's do (`tfdist.app.run`): a fault is one
line, `mw_worker.py: fault: ...`, exit status 1.
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
    data_fields = overrides.pop("data", {})
    task = overrides.pop("task", None)
    nan = overrides.pop("nan", False)
    config = mw_config(strategy, int(steps), **overrides)
    config = config.replace(strategy=dataclasses.replace(config.strategy, **strategy_fields),
                            model=dataclasses.replace(config.model, **model_fields),
                            data=dataclasses.replace(config.data, **data_fields))
    if task:
        import tfdist
        from test_tasks import run_case
        result = run_case(tfdist.train, config, task, initial)
    elif nan:
        from test_nonfinite import nan_dataset_fn
        result = train_from(config, initial, dataset_fn=nan_dataset_fn)
    else:
        result = train_from(config, initial)
    index = os.environ.get("HOROVOD_RANK") or str(
        json.loads(os.environ.get("TF_CONFIG", '{"task":{"index":0}}'))["task"]["index"])
    np.savez(os.path.join(out_dir, f"weights-{index}.npz"), *result.model.get_weights())
    if task or nan:
        with open(os.path.join(out_dir, f"summary-{index}.json"), "w") as f:
            json.dump(result.summary, f)


if __name__ == "__main__":
    from tfdist import app
    app.run(lambda argv: main(*argv[1:]))
