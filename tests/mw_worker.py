"""A multi-worker test worker: trains through the Python API, saves its weights.

Run by tests under tfdist-launch (TF_CONFIG set per worker):
    python tests/mw_worker.py OUT_DIR STRATEGY STEPS [TRAIN_OVERRIDES_JSON]
Loads OUT_DIR/initial.npz, trains (TrainConfig fields overridden by the JSON,
e.g. {"accum_steps": 4}; its "strategy" and "model" entries override StrategyConfig
and ModelConfig fields, e.g. {"strategy": {"mesh": "batch:2,model:2"}}, "data" DataConfig
fields, "optimizer" OptimizerConfig fields; "skewed": true starts worker k from
the initial weights + 0.05k (only the chief's broadcast makes them agree; under
the pipeline, replica r's workers from + 0.05r: each stage's replicas take its
first worker's weights); "task" names
a case of test_tasks.CASES: its model, data, loss and metrics; "hub" names a
keras-hub CausalLM of test_pipeline (its data too), or is [name, decoder blocks]; "whole_build": true gives a
model_fn that fails unless variables have storage (a pipeline then builds the
model whole); "nan": true feeds
test_nonfinite's data, whose step NAN_STEP has a NaN loss), writes
(under the pipeline, made-<worker>.json: the elements of storage made for
trainable variables, and those held at the end) and
OUT_DIR/weights-<worker>.npz and optimizer-<worker>.npz (its variables), summary-<worker>.json (and, under
dtensor, predictions-<worker>.npy: the trained model's outputs on PROBE; under
the pipeline, where RunResult.model is a StagesModel, stages_model-<worker>.json:
its predictions on PROBE, or its refusal, and its refusal to save).
Errors end the process as tfdist-train's do (`tfdist.app.run`): a fault is one
line, `mw_worker.py: fault: ...`, exit status 1.

TRAIN_OVERRIDES_JSON may also be a list: one process (one TensorFlow start-up,
one cluster) then makes each of those runs in turn, run k in OUT_DIR/k (its
own initial.npz there, else OUT_DIR's; its outputs there), each with a fresh
strategy on collective keys of its own. A run that fails
(e.g. --on_nonfinite=stop) ends the process, so it must be the last.
"""

import dataclasses
import json
import os
import sys

import numpy as np

# The shared helpers (tests/) and the test modules whose cases a job runs
# (tests/integration/: test_tasks, test_nonfinite).
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                os.path.join(os.path.dirname(os.path.abspath(__file__)), "integration")]
from common import IMAGE_SPEC, PROBE, image_dataset_fn, mw_config, train_from  # noqa: E402


def main(out_dir, strategy, steps, overrides="{}"):
    overrides = json.loads(overrides)
    if isinstance(overrides, list):
        from tfdist.strategies.multi_worker.engine import MultiWorkerStrategy

        create = MultiWorkerStrategy._create
        run_dir = None

        def create_then_wait(self):
            # A new strategy re-enables collective ops (a new server
            # definition): no worker may start this run's collectives while a
            # peer still has the previous run's (they would be lost: a hang).
            strategy = create(self)
            _barrier(run_dir, "created")
            return strategy

        MultiWorkerStrategy._create = create_then_wait
        for k, run in enumerate(overrides):
            # (Each run's strategy gets its own collective keys from tfdist:
            # compat.next_collective_key_base.)
            run_dir = os.path.join(out_dir, str(k))
            if not os.path.exists(os.path.join(run_dir, "initial.npz")):
                os.makedirs(run_dir, exist_ok=True)
                run = {**run, "initial_from": out_dir}
            _main(run_dir, strategy, steps, run)
            _barrier(run_dir, "done")
        return
    _main(out_dir, strategy, steps, overrides)


def _barrier(run_dir, name, timeout_s=120):
    """Mark this worker's arrival at `name` in run_dir and wait for every
    worker's (the workers share the file system)."""
    import time
    config = json.loads(os.environ.get("TF_CONFIG", "{}"))
    cluster = config.get("cluster", {})
    count = len(cluster.get("chief", ())) + len(cluster.get("worker", ())) or 1
    task = config.get("task", {"type": "worker", "index": 0})
    me = task["index"] + (len(cluster.get("chief", ())) if task["type"] == "worker" else 0)
    open(os.path.join(run_dir, f"{name}-{me}"), "w").close()
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(os.path.join(run_dir, f"{name}-{i}")) for i in range(count)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the other workers did not reach {name} of {run_dir} in "
                               f"{timeout_s}s")
        time.sleep(0.05)


def _main(out_dir, strategy, steps, overrides):
    initial_dir = overrides.pop("initial_from", out_dir)
    initial = list(np.load(os.path.join(initial_dir, "initial.npz")).values())
    strategy_fields = overrides.pop("strategy", {})   # StrategyConfig fields, e.g. mesh
    model_fields = overrides.pop("model", {})
    data_fields = overrides.pop("data", {})
    optimizer_fields = overrides.pop("optimizer", {})
    task = overrides.pop("task", None)
    nan = overrides.pop("nan", False)
    hub = overrides.pop("hub", None)
    whole = overrides.pop("whole_build", False)
    if overrides.pop("skewed", False):   # every worker but the chief starts elsewhere
        worker = json.loads(os.environ.get("TF_CONFIG", '{"task":{"index":0}}'))["task"]["index"]
        if strategy == "pipeline":   # but each stage's first worker, whose values its replicas take
            worker //= strategy_fields.get("pipeline_stages", 1)
        initial = [a + 0.05 * worker for a in initial]
    config = mw_config(strategy, int(steps), **overrides)
    config = config.replace(strategy=dataclasses.replace(config.strategy, **strategy_fields),
                            model=dataclasses.replace(config.model, **model_fields),
                            data=dataclasses.replace(config.data, **data_fields),
                            optimizer=dataclasses.replace(config.optimizer, **optimizer_fields))
    index = os.environ.get("HOROVOD_RANK") or str(
        json.loads(os.environ.get("TF_CONFIG", '{"task":{"index":0}}'))["task"]["index"])
    if strategy != "pipeline":
        _save(out_dir, strategy, index, _train(config, initial, task, hub, nan, whole))
        return
    made = []   # elements of storage made for trainable tf.Variables (eagerly), this run
    with _trainable_storage_counted(made):
        result = _train(config, initial, task, hub, nan, whole)
    with open(os.path.join(out_dir, f"made-{index}.json"), "w") as f:
        json.dump({"trainable_made": sum(made),
                   "trainable_held": sum(int(np.size(v.numpy()))
                                         for v in result.model.trainable_variables),
                   "trainable_total": sum(int(np.prod(v.shape))
                                          for v in result.model.trainable_variables)}, f)
    _save(out_dir, strategy, index, result)


def _trainable_storage_counted(made):
    """A variable creator under every other (entered first): the elements of
    each trainable tf.Variable made eagerly, as made (empty where it was made
    without storage), appended to `made`."""
    import tensorflow as tf

    def creator(next_creator, **kwargs):
        variable = next_creator(**kwargs)
        if variable.trainable and tf.executing_eagerly():
            made.append(int(tf.size(variable.read_value())))
        return variable
    return tf.variable_creator_scope(creator)


def _train(config, initial, task, hub, nan, whole):
    if task:
        import tfdist
        from test_tasks import run_case
        result = run_case(tfdist.train, config, task, initial)
    elif hub:
        import tfdist
        from common import HUB_TOKENS, hub_causal_lm, hub_dataset_fn

        def model_fn(spec):   # "hub": a kind, or [kind, decoder blocks]
            model = hub_causal_lm(*([hub] if isinstance(hub, str) else hub))
            model.set_weights(initial)
            return model

        result = tfdist.train(config, model_fn=model_fn, dataset_fn=hub_dataset_fn,
                              spec=HUB_TOKENS)
    elif nan:
        from test_nonfinite import nan_dataset_fn
        result = train_from(config, initial, dataset_fn=nan_dataset_fn)
    elif whole:   # a model_fn that fails where no variable has storage (any reason)
        import tfdist
        from keras.src.backend.common.stateless_scope import in_stateless_scope

        from tfdist import models

        def model_fn(spec):
            if in_stateless_scope():
                raise ValueError("this model_fn reads a weight's storage while it builds")
            model = models.build(config.model, spec)
            model.set_weights(initial)
            return model

        result = tfdist.train(config, model_fn=model_fn, dataset_fn=image_dataset_fn,
                              spec=IMAGE_SPEC)
    else:
        result = train_from(config, initial)
    return result


def _save(out_dir, strategy, index, result):
    np.savez(os.path.join(out_dir, f"weights-{index}.npz"), *result.model.get_weights())
    np.savez(os.path.join(out_dir, f"optimizer-{index}.npz"),
             *[v.numpy() for v in result.optimizer.variables])
    if strategy == "dtensor":   # the trained model on host data, in every process
        np.save(os.path.join(out_dir, f"predictions-{index}.npy"),
                result.model.predict(PROBE, verbose=0))
    if strategy == "pipeline" and type(result.model).__name__ == "StagesModel":
        # Every worker predicts through the stages, or (the chief holding the
        # whole model) is told to predict on the chief.
        try:
            outcome = {"predictions": result.model.predict(PROBE, batch_size=6).tolist()}
        except RuntimeError as error:
            outcome = {"refusal": str(error)}
        try:
            result.model.save(os.path.join(out_dir, f"never-{index}.keras"))
        except RuntimeError as error:
            outcome["save_refusal"] = str(error)
        with open(os.path.join(out_dir, f"stages_model-{index}.json"), "w") as f:
            json.dump(outcome, f)
    with open(os.path.join(out_dir, f"summary-{index}.json"), "w") as f:
        json.dump(result.summary, f)


if __name__ == "__main__":
    from tfdist import app, startup
    startup.load("api")   # as tfdist's own processes load TensorFlow (frozen)
    app.run(lambda argv: main(*argv[1:]))
