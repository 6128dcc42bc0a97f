"""Users' own tasks: any Keras loss and metrics, sample weights, masks, dict inputs.

The core assertion, as everywhere: 2 mirrored replicas with 2 micro-batches
each train exactly like one device on the same global batches (weights within
1e-5 relative, as in test_equivalence; metric values within 1e-6 relative:
they are sums of the same per-example terms in another order), and the loss
tfdist optimises is Keras's own (one SGD step equals the step computed from
`keras.losses.Loss.__call__` with the same sample weights and masks).
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.data.function_inputs import shard

from common import assert_weights_close, mw_config
from conftest import BIN, REPO

N_TRAIN, N_TEST = 256, 72  # 72: evaluation needs zero-weight padding at batch 32
FEATURES, LABELS, VOCAB, LENGTH = 6, 4, 12, 8


def _config(strategy, *, accum_steps=1, steps=6, batch=32, lr=0.05, **train):
    # dtensor: data parallel over 2 devices (your own model's weights replicate).
    return tfdist.RunConfig(
        strategy=tfdist.StrategyConfig(name=strategy, virtual_devices=2, mesh="batch:2,model:1"),
        data=tfdist.DataConfig(shuffle_buffer=1),
        optimizer=tfdist.OptimizerConfig(name="sgd", learning_rate=lr),
        train=tfdist.TrainConfig(global_batch_size=batch, train_steps=steps,
                                 steps_per_loop=3, accum_steps=accum_steps, jit_compile="off",
                                 **train))


def _arrays(split, seed):
    rng = np.random.default_rng(seed + (0 if split == "train" else 100))
    n = N_TRAIN if split == "train" else N_TEST
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    return rng, n, x


def regression_fn(split, context):
    rng, n, x = _arrays(split, 1)
    y = (x @ np.linspace(-1, 1, FEATURES) + 0.1 * rng.normal(size=n)).astype(np.float32)
    w = rng.uniform(0.0, 2.0, size=n).astype(np.float32)  # per-example sample weights
    return shard(tf.data.Dataset.from_tensor_slices((x, y, w)), context)


def multilabel_fn(split, context):
    rng, n, x = _arrays(split, 2)
    y = (x[:, :LABELS] + 0.3 * rng.normal(size=(n, LABELS)) > 0).astype(np.float32)
    return shard(tf.data.Dataset.from_tensor_slices((x, y)), context)


def tokens_fn(split, context):
    """Sequences padded with 0 after a random length; targets are 0 there too."""
    rng = np.random.default_rng(3 if split == "train" else 4)
    n = N_TRAIN if split == "train" else N_TEST
    x = rng.integers(1, VOCAB, size=(n, LENGTH)).astype(np.int32)
    lengths = rng.integers(2, LENGTH + 1, size=n)
    keep = np.arange(LENGTH)[None, :] < lengths[:, None]
    x = np.where(keep, x, 0)
    y = np.where(keep, (x * 3 + 1) % VOCAB, 0).astype(np.int32)
    y = np.where(keep & (y == 0), 1, y)
    return shard(tf.data.Dataset.from_tensor_slices((x, y)), context)


def weighted_tokens_fn(split, context):
    """The same, with the padding masked by per-position sample weights."""
    return tokens_fn(split, context).map(
        lambda x, y: (x, y, tf.cast(tf.not_equal(y, 0), tf.float32)))


def dict_fn(split, context):
    rng, n, x = _arrays(split, 5)
    kind = rng.integers(0, 3, size=n).astype(np.int32)
    y = ((x[:, 0] + kind) > 1).astype(np.int32)
    return shard(tf.data.Dataset.from_tensor_slices(({"numbers": x, "kind": kind}, y)), context)


def dense_model(outputs):
    def build(spec):
        inputs = keras.Input((FEATURES,), name="x")
        hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
        return keras.Model(inputs, keras.layers.Dense(outputs, name="out")(hidden))
    return build


def token_model(spec):
    inputs = keras.Input((LENGTH,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(VOCAB, 8, name="embed")(inputs)
    x = keras.layers.Dense(16, activation="relu", name="hidden")(x)
    return keras.Model(inputs, keras.layers.Dense(VOCAB, name="logits")(x))


def dict_model(spec):
    numbers = keras.Input((FEATURES,), name="numbers")
    kind = keras.Input((), dtype="int32", name="kind")
    embedded = keras.layers.Embedding(3, 4, name="kind_embed")(kind)
    x = keras.layers.Concatenate()([numbers, embedded])
    x = keras.layers.Dense(8, activation="relu", name="hidden")(x)
    return keras.Model({"numbers": numbers, "kind": kind},
                       keras.layers.Dense(2, name="logits")(x))


def _with_weights(build, initial):
    def model_fn(spec):
        model = build(spec)
        model.set_weights(initial)
        return model
    return model_fn


def _train(strategy, build, dataset_fn, *, loss, metrics, accum_steps=1, initial=None, **kw):
    keras.utils.set_random_seed(0)
    initial = initial if initial is not None else build(None).get_weights()
    result = tfdist.train(_config(strategy, accum_steps=accum_steps, **kw),
                          model_fn=_with_weights(build, initial), dataset_fn=dataset_fn,
                          loss=loss, metrics=metrics)
    return result, initial


CASES = {
    # name: (model, data, loss factory, metrics factory)
    "regression": (dense_model(1), regression_fn, lambda: "mse", lambda: ["mae"]),
    "multilabel": (dense_model(LABELS), multilabel_fn,
                   lambda: keras.losses.BinaryCrossentropy(from_logits=True),
                   lambda: ["auc", "binary_accuracy"]),
    "tokens_weighted": (token_model, weighted_tokens_fn,
                        lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                        lambda: ["accuracy"]),
    "tokens_ignore_class": (token_model, tokens_fn,
                            lambda: keras.losses.SparseCategoricalCrossentropy(
                                from_logits=True, ignore_class=0),
                            lambda: []),
    "tokens_mean_with_sample_weight": (
        token_model, weighted_tokens_fn,
        lambda: keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight"),
        lambda: [keras.metrics.SparseCategoricalAccuracy(name="token_accuracy")]),
}


@pytest.mark.parametrize("strategy,case", [("mirrored", case) for case in sorted(CASES)]
                         + [("dtensor", "regression"), ("dtensor", "tokens_ignore_class")])
def test_two_replicas_accumulating_match_one_device(strategy, case):
    build, data, loss, metrics = CASES[case]
    one, initial = _train("default", build, data, loss=loss(), metrics=metrics())
    two, _ = _train(strategy, build, data, loss=loss(), metrics=metrics(), accum_steps=2,
                    initial=initial)
    assert two.summary["replicas"] == 2
    moved = max(np.abs(w - i).max() for w, i in zip(one.model.get_weights(), initial))
    assert moved > 1e-3
    assert_weights_close(two.model.get_weights(), one.model.get_weights())
    keys = ["loss", "test_loss", *(f"train_{m}" for m in one.summary["metrics"]),
            *one.summary["metrics"]]
    assert len(keys) == 2 + 2 * len(metrics())
    for key in keys:
        assert one.summary[key] is not None and np.isfinite(one.summary[key]), key
        np.testing.assert_allclose(two.summary[key], one.summary[key], rtol=1e-6, atol=1e-7,
                                   err_msg=key)


@pytest.mark.parametrize("case", ["regression", "tokens_ignore_class",
                                  "tokens_mean_with_sample_weight", "tokens_weighted"])
def test_one_step_is_keras_loss(case):
    """One SGD step on the whole train set equals the step from Keras's own loss
    (`Loss.__call__` with the sample weights; its mask and reduction rules)."""
    build, data, loss, _ = CASES[case]
    lr = 0.5
    result, initial = _train("default", build, data, loss=loss(), metrics=[], steps=1,
                             batch=N_TRAIN, lr=lr)
    model = build(None)
    model.set_weights(initial)
    x, y, *w = next(iter(data("train", tf.distribute.InputContext()).batch(N_TRAIN)))
    loss_fn = keras.losses.MeanSquaredError() if loss() == "mse" else loss()
    with tf.GradientTape() as tape:
        value = loss_fn(y, model(x), sample_weight=w[0] if w else None)
    grads = tape.gradient(value, model.trainable_variables)
    expected = [v.numpy() - lr * tf.convert_to_tensor(g).numpy()
                for v, g in zip(model.trainable_variables, grads)]
    assert_weights_close([v.numpy() for v in result.model.trainable_variables], expected,
                         rtol=1e-5, atol=1e-6)
    assert result.summary["loss"] == pytest.approx(float(value), rel=1e-5)


def test_eval_metrics_equal_keras_metrics_on_the_test_split():
    """Padding (72 test examples in batches of 32) carries weight 0: tfdist's test
    AUC, loss and accuracy are Keras's over exactly the 72 examples."""
    build, data, loss, metrics = CASES["multilabel"]
    result, _ = _train("mirrored", build, data, loss=loss(), metrics=metrics())
    x, y = next(iter(data("test", tf.distribute.InputContext()).batch(N_TEST)))
    logits = result.model(x)
    auc = keras.metrics.AUC(from_logits=True)
    auc.update_state(y, logits)
    accuracy = keras.metrics.BinaryAccuracy(threshold=0.0)
    accuracy.update_state(y, logits)
    np.testing.assert_allclose(result.summary["auc"], float(auc.result()), rtol=1e-6)
    np.testing.assert_allclose(result.summary["binary_accuracy"], float(accuracy.result()),
                               rtol=1e-6)
    np.testing.assert_allclose(result.summary["test_loss"], float(loss()(y, logits)), rtol=1e-5)


def test_compiled_model_supplies_loss_and_metrics():
    def build(spec):
        model = dense_model(1)(spec)
        model.compile(loss="mae", metrics=["mse", keras.metrics.RootMeanSquaredError()])
        return model

    result = tfdist.train(_config("mirrored", steps=2), model_fn=build, dataset_fn=regression_fn)
    assert result.summary["loss_function"] == "mae"
    assert result.summary["metrics"] == ["mse", "root_mean_squared_error"]
    assert result.summary["train_root_mean_squared_error"] > 0


class _BranchesInPython(keras.Model):
    """A model whose call branches on a tensor's value in Python."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        if tf.reduce_sum(x) > 0:      # needs AutoGraph, which neither tfdist nor fit uses
            return self.dense(x)
        return self.dense(-x)

    def build(self, input_shape):     # without calling `call` symbolically
        self.dense.build(input_shape)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], 1)


def _branching_model(spec):
    model = _BranchesInPython()
    model.build((None, FEATURES))
    return model


def test_python_control_flow_on_a_tensor_is_one_line_naming_the_cure():
    with pytest.raises(tfdist.UsageError, match=r"^the model uses a tensor's value in Python "
                       r"control flow .*write keras.ops.cond, tf.cond or tf.while_loop"):
        tfdist.train(_config("default", steps=1), model_fn=_branching_model,
                     dataset_fn=regression_fn, loss="mse", metrics=[])


@pytest.mark.parametrize("strategy", ["default", "mirrored", "dtensor"])
def test_dict_inputs_with_sample_weights_train(strategy):
    """(multi_worker and horovod: examples/custom_script.py, a dict-input model,
    in test_examples.py and test_horovod.py.)"""
    def data(split, context):
        return dict_fn(split, context).map(lambda x, y: (x, y, 1.0 + tf.cast(y, tf.float32)))

    result = tfdist.train(_config(strategy, steps=12, lr=0.3, accum_steps=2),
                          model_fn=dict_model, dataset_fn=data)
    assert result.summary["train_accuracy"] > 0.5 and result.summary["accuracy"] > 0.5


@pytest.mark.parametrize("loss,metrics,message", [
    ("no_such_loss", None, "loss='no_such_loss' is not a Keras loss"),
    ("mse", [keras.metrics.F1Score()], "metric 'f1_score' does not fit targets"),
    (keras.losses.CategoricalCrossentropy(), None, "does not fit targets int32 (None,)"),
    ("mse", ["no_such_metric"], "metric 'no_such_metric' is not a Keras metric"),
])
def test_bad_loss_or_metric_is_a_usage_error(loss, metrics, message):
    with pytest.raises(tfdist.UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tfdist.train(_config("default", steps=1), model_fn=dict_model, dataset_fn=dict_fn,
                     loss=loss, metrics=metrics)


def test_metric_dtensor_cannot_compute_is_a_usage_error():
    """DTensor 2.21 has no SPMD rule for ReverseV2 (Keras's AUC): one line at
    start-up, naming the metric, not a failed first step."""
    build, data, loss, _ = CASES["multilabel"]
    with pytest.raises(tfdist.UsageError, match="metric 'auc' cannot run under --strategy=dtensor"):
        _train("dtensor", build, data, loss=loss(), metrics=["auc"], steps=1)


def test_unreduced_values_are_required():
    with pytest.raises(tfdist.UsageError, match="per-example"):
        tfdist.train(_config("default", steps=1), model_fn=dense_model(1),
                     dataset_fn=regression_fn,
                     loss=lambda y, p: tf.reduce_mean(tf.square(y - p[:, 0])))


def test_mirrored_predictions_export(tmp_path):
    """export: model.keras and the SavedModel reload and predict like the
    trained model, within 1e-6 (the same weights; the SavedModel's graph may
    fuse bias and activation into the matmul, a last-bit difference)."""
    build, data, loss, metrics = CASES["multilabel"]
    result, _ = _train("mirrored", build, data, loss=loss(), metrics=metrics(), steps=3)
    x = next(iter(data("test", tf.distribute.InputContext()).batch(16)))[0]
    expected = result.model(x).numpy()
    paths = tfdist.export(result, str(tmp_path / "export"))
    reloaded = keras.saving.load_model(paths["keras"])
    np.testing.assert_allclose(reloaded(x).numpy(), expected, rtol=1e-6, atol=1e-6)
    served = tf.saved_model.load(paths["saved_model"])
    np.testing.assert_allclose(served.serve(x).numpy(), expected, rtol=1e-6, atol=1e-6)
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["model.keras",
                                                                       "saved_model"]


def run_case(train, config, case, initial):
    """Train `config` on CASES[case] from `initial` (tests/mw_worker.py uses it).

    The loss and metrics come from `model.compile` in model_fn: Keras metric
    objects create variables, and under multi_worker no TensorFlow may run
    before `tfdist.train` has set up the cluster."""
    build, data, loss, metrics = CASES[case]

    def model_fn(spec):
        model = _with_weights(build, initial)(spec)
        model.compile(loss=loss(), metrics=metrics())
        return model

    return train(config, model_fn=model_fn, dataset_fn=data)


# The multi-process task runs and their one-device reference: XLA off, as in
# _config (the tasks are about Keras losses, metrics and their reductions, not
# XLA's fusions; the plain multi_worker and horovod equivalence runs keep
# --jit_compile=auto), which also spares each process and the reference an
# XLA compile.
TASK_TRAIN = {"jit_compile": "off"}


def run_case_workers(launcher_args, tmp_path, engine, cases):
    """CASES[case] for each of `cases` on 2 processes under `engine` (one
    cluster makes them in turn: tests/mw_worker.py with a list, run k in
    tmp_path/k); returns the directory of each case's run."""
    runs = []
    for k, case in enumerate(cases):
        (tmp_path / str(k)).mkdir()
        np.savez(tmp_path / str(k) / "initial.npz", *CASES[case][0](None).get_weights())
        runs.append({"task": case, **TASK_TRAIN})
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run([*launcher_args, sys.executable, "tests/mw_worker.py", str(tmp_path),
                             engine, "10", json.dumps(runs)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    return {case: tmp_path / str(k) for k, case in enumerate(cases)}


def check_case_workers(run_dir, case):
    """The workers' weights (identical) match one device's on the same global
    batches (each worker reads every other example; tfdist concatenates
    them), and the chief's summary matches one device's."""
    initial = list(np.load(run_dir / "initial.npz").values())
    workers = [list(np.load(run_dir / f"weights-{i}.npz").values()) for i in (0, 1)]
    for a, b in zip(*workers):
        np.testing.assert_array_equal(a, b)
    single = run_case(tfdist.train, mw_config("default", 10, **TASK_TRAIN), case, initial)
    assert_weights_close(workers[0], single.model.get_weights(), rtol=1e-4, atol=1e-6)
    chief = json.loads((run_dir / "summary-0.json").read_text())
    for key in ["loss", "test_loss", *single.summary["metrics"]]:
        np.testing.assert_allclose(chief[key], single.summary[key], rtol=1e-5, err_msg=key)


TWO_WORKER_CASES = ["regression", "tokens_mean_with_sample_weight"]


@pytest.fixture(scope="module")
def two_worker_runs(tmp_path_factory):
    """One 2-worker multi_worker cluster makes every case of TWO_WORKER_CASES."""
    return run_case_workers([os.path.join(BIN, "tfdist-launch"), "--workers=2", "--"],
                            tmp_path_factory.mktemp("two_workers"), "multi_worker",
                            TWO_WORKER_CASES)


@pytest.mark.integration
@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", TWO_WORKER_CASES)
def test_two_workers_match_one_device(two_worker_runs, case):
    check_case_workers(two_worker_runs[case], case)
