"""One run, any engine: a checkpoint written by one device resumes under
every in-process synchronous engine, continuing as if it had never stopped.
(Fresh runs from the seed alone: `tests/integration/test_dtensor_init.py` for ZeRO-3 on
2x2, `tests/integration/test_multi_worker.py` for two shuffled workers.)

A user's own functional model (a residual tower of Dense, Add and
LayerNormalization layers with the user's names), regression with sample
weights, momentum SGD (slots to reshard), no weights set from the host: the
seed alone. Every run reads the one global order (`--autoshard=global`). Each
run's weights are compared with one device's uninterrupted run: another
engine sums in another order, so equality is to float32 rounding grown over a
few steps (1e-5 of the weight scale; a different batch or initial weight moves
them by 1e-2 or more, as the controls show).
"""

import os
import shutil
import sys

import keras
import numpy as np
import pytest

import tfdist

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "conformance"))
import resume_script  # noqa: E402  (the user's script of `make resume-matrix`)

STEPS, RESUME_AT, BATCH = 6, 2, 16
TOLERANCE = 1e-5
# The user's model, data and 2x2 layout rules: those of the user's script
# the resume matrix runs (`make resume-matrix`).
user_model, dataset_fn, SPEC, RULES = (resume_script.model_fn, resume_script.dataset_fn,
                                       resume_script.SPEC, resume_script.RULES)


ENGINES = {
    "default": dict(name="default"),
    "mirrored": dict(name="mirrored", virtual_devices=2),
    "zero1_batch4": dict(name="dtensor", virtual_devices=4, mesh="batch:4,model:1",
                         zero_stage=1),
    "zero3_2x2": dict(name="dtensor", virtual_devices=4, mesh="batch:2,model:2", zero_stage=3),
    "pipeline": dict(name="pipeline", virtual_devices=2, pipeline_stages=2),
}


def _config(engine, steps, model_dir=None):
    train = dict(global_batch_size=BATCH, train_steps=steps, steps_per_loop=RESUME_AT,
                 checkpoint_every=RESUME_AT if model_dir else 0, model_dir=model_dir,
                 jit_compile="off", seed=7)
    if engine == "pipeline":
        train["accum_steps"] = 2
    return tfdist.RunConfig(
        strategy=tfdist.StrategyConfig(**ENGINES[engine]),
        optimizer=tfdist.OptimizerConfig(name="momentum", learning_rate=0.05),
        data=tfdist.DataConfig(shuffle_buffer=32),
        train=tfdist.TrainConfig(**train))


def _train(engine, steps, model_dir=None):
    return tfdist.train(_config(engine, steps, model_dir), model_fn=user_model,
                        dataset_fn=dataset_fn, spec=SPEC, loss=keras.losses.MeanSquaredError(),
                        layout_rules=RULES if "2x2" in engine else None)


def _difference(result, reference) -> float:
    """The largest |w - w_ref| over all weights, relative to the weights' scale."""
    got = [np.asarray(v) for v in result.model.weights]
    want = [np.asarray(v) for v in reference.model.weights]
    assert [w.shape for w in got] == [w.shape for w in want]
    scale = max(float(np.abs(w).max()) for w in want)
    return max(float(np.abs(a - b).max()) for a, b in zip(got, want)) / scale


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One device uninterrupted (the reference) and its checkpoint at step 2."""
    written = str(tmp_path_factory.mktemp("written"))
    return {"reference": _train("default", STEPS), "written": _train("default", RESUME_AT,
                                                                      written)}, written


# zero1_batch4 in make slow; make test: the zero3_2x2 resume, test_zero.py's stages
@pytest.mark.parametrize("engine", [pytest.param(e, marks=pytest.mark.slow) if e == "zero1_batch4"
                                    else e for e in ENGINES if e != "default"])
def test_a_checkpoint_of_one_device_resumes_under_another_engine(runs, engine, tmp_path,
                                                                 caplog):
    results, written = runs
    model_dir = str(tmp_path / "resumed")
    shutil.copytree(written, model_dir)
    with caplog.at_level("WARNING"):
        resumed = _train(engine, STEPS, model_dir)
    assert resumed.summary["steps"] == STEPS
    assert "fresh permutation" not in caplog.text
    assert _difference(resumed, results["reference"]) <= TOLERANCE, engine


@pytest.mark.parametrize("rate", [0.0, 0.3])
def test_equality_holds_for_models_without_random_ops(rate):
    """Dropout draws its mask the shape of each replica's batch from the one
    seed, so two replicas drop other units than one device does for the same
    examples: with random ops in the model, engines agree in distribution, not
    weight by weight. The same model with the dropout off is the other side
    of that line."""
    def model_fn(spec):
        inputs = keras.Input(spec.input_shape, name="features")
        x = keras.layers.Dense(32, activation="gelu", name="stem")(inputs)
        x = keras.layers.Dropout(rate, name="user_dropout")(x)
        return keras.Model(inputs, keras.layers.Dense(spec.num_classes, name="head")(x))

    def train(engine):
        return tfdist.train(_config(engine, STEPS), model_fn=model_fn, dataset_fn=dataset_fn,
                            spec=SPEC, loss=keras.losses.MeanSquaredError())

    difference = _difference(train("mirrored"), train("default"))
    if rate:
        assert difference > 1e-3
    else:
        assert difference <= TOLERANCE


def test_the_controls_differ(runs, tmp_path, caplog):
    """Without the input position a resumed run reads other batches; a run
    from another seed starts elsewhere: both far outside the tolerance."""
    results, written = runs
    model_dir = str(tmp_path / "no_position")
    shutil.copytree(written, model_dir)
    shutil.rmtree(os.path.join(model_dir, "checkpoints", "input"))
    with caplog.at_level("WARNING"):
        fresh = _train("mirrored", STEPS, model_dir)
    assert "fresh permutation" in caplog.text
    assert _difference(fresh, results["reference"]) > 1e-3
    other_seed = tfdist.train(
        _config("default", STEPS).replace(train=_config("default", STEPS).train.replace(seed=8)),
        model_fn=user_model, dataset_fn=dataset_fn, spec=SPEC,
        loss=keras.losses.MeanSquaredError())
    assert _difference(other_seed, results["reference"]) > 1e-2
