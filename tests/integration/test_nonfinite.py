"""--on_nonfinite: a NaN injected into the data at a chosen step (every
replica sees the same global loss, so every replica takes the same decision)."""

import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist import checkpointing, models
from tfdist.errors import NonFiniteLoss

from common import IMAGE_SPEC, image_dataset_fn, run_config

BATCH, NAN_STEP, STEPS = 32, 7, 12   # 512 examples: 16 batches before the data repeats


def nan_dataset_fn(split, context):
    """The test images in order, with a NaN sample weight on the first example
    of the global batch of step NAN_STEP (every strategy's global batch k holds
    examples (k-1)*B .. k*B-1 when the data is not shuffled): that step's loss
    and gradients are NaN. (NaN or infinite *inputs* would not do: the mlp's
    ReLU turns NaN into 0.)"""
    ds = image_dataset_fn(split, tf.distribute.InputContext())
    if split == "train":
        poisoned = (NAN_STEP - 1) * BATCH
        ds = ds.enumerate().map(lambda i, xy: (
            xy[0], xy[1], tf.where(i == poisoned, float("nan"), 1.0)))
    if context.num_input_pipelines > 1:
        ds = ds.shard(context.num_input_pipelines, context.input_pipeline_id)
    return ds


def _config(strategy, mode, model_dir):
    config = run_config(strategy, steps=STEPS, batch=BATCH, steps_per_loop=4,
                        checkpoint_every=4, model_dir=model_dir, on_nonfinite=mode)
    config = config.replace(data=config.data.replace(shuffle_buffer=1),
                            strategy=config.strategy.replace(mesh="batch:2,model:1"))
    return config


def _train(config):
    return tfdist.train(config, model_fn=lambda spec: models.build(config.model, spec),
                        dataset_fn=nan_dataset_fn, spec=IMAGE_SPEC)


STRATEGIES = ["default", "mirrored", "dtensor"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_stop_names_the_step_and_the_last_good_checkpoint(tmp_path, strategy):
    with pytest.raises(NonFiniteLoss) as raised:
        _train(_config(strategy, "stop", str(tmp_path)))
    message = str(raised.value)
    assert "\n" not in message
    assert f"not finite at step {NAN_STEP} (--on_nonfinite=stop)" in message
    assert message.endswith("continue past such steps") and "ckpt-4" in message
    assert checkpointing.saved_steps(str(tmp_path)) == [4]   # nothing saved after the NaN


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_skip_drops_that_update_and_finishes(tmp_path, strategy):
    result = _train(_config(strategy, "skip", str(tmp_path)))
    assert result.summary["steps"] == STEPS and result.summary["nonfinite_steps"] == 1
    assert np.isfinite(result.summary["loss"])
    assert all(np.isfinite(w).all() for w in result.model.get_weights())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_rollback_restores_and_goes_past_the_bad_batch(tmp_path, strategy):
    result = _train(_config(strategy, "rollback", str(tmp_path)))
    assert result.summary["steps"] == STEPS and result.summary["rollbacks"] == 1
    assert all(np.isfinite(w).all() for w in result.model.get_weights())
    assert checkpointing.saved_steps(str(tmp_path)) == [4, 8, 12]


def test_skip_equals_a_run_that_never_saw_the_update():
    """The skipped step changes nothing: skipping step 7 equals training on the
    same batches with batch 7's update removed (as SGD without state: a run
    of 6 steps, then the rest from batch 8 on)."""
    config = run_config("default", steps=STEPS, batch=BATCH, steps_per_loop=4,
                        on_nonfinite="skip", optimizer="sgd", learning_rate=0.05)
    config = config.replace(data=config.data.replace(shuffle_buffer=1))
    initial = models.build(config.model, IMAGE_SPEC).get_weights()

    def model_fn(spec):
        model = models.build(config.model, spec)
        model.set_weights(initial)
        return model

    skipped = tfdist.train(config, model_fn=model_fn, dataset_fn=nan_dataset_fn, spec=IMAGE_SPEC)

    def without_batch(split, context):
        ds = image_dataset_fn(split, context)
        if split == "train":   # drop batch NAN_STEP; 12 real updates -> 11
            ds = ds.enumerate().filter(lambda i, xy: tf.logical_or(
                i < (NAN_STEP - 1) * BATCH, i >= NAN_STEP * BATCH)).map(
                    lambda i, xy: (xy[0], xy[1], 1.0))
        return ds

    reference = tfdist.train(config.replace(train=config.train.replace(train_steps=STEPS - 1)),
                             model_fn=model_fn, dataset_fn=without_batch, spec=IMAGE_SPEC)
    for a, b in zip(skipped.model.get_weights(), reference.model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_rollback_needs_a_model_dir():
    with pytest.raises(tfdist.ConfigError, match="on_nonfinite='rollback'"):
        run_config("default", on_nonfinite="rollback")
