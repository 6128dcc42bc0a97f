"""Core assertion: N replicas on a global batch match one device on that batch."""

import numpy as np
import pytest

import tfdist
from tfdist import models

from common import IMAGE_SPEC, assert_weights_close, image_dataset_fn, run_config


def _initial_weights(config):
    return models.build(config.model, IMAGE_SPEC).get_weights()


def _train(config, initial):
    def model_fn(spec):
        model = models.build(config.model, spec)
        model.set_weights(initial)
        return model

    result = tfdist.train(config, model_fn=model_fn, dataset_fn=image_dataset_fn, spec=IMAGE_SPEC)
    return result


@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.1), ("adam", 0.001)])
def test_mirrored_matches_default_mlp(optimizer, lr):
    default = run_config("default", optimizer=optimizer, learning_rate=lr, model="mlp")
    initial = _initial_weights(default)
    one = _train(default, initial)
    two = _train(run_config("mirrored", optimizer=optimizer, learning_rate=lr, model="mlp"),
                 initial)
    assert two.summary["replicas"] == 2 and one.summary["replicas"] == 1
    # The run really moved the weights (otherwise equality would prove nothing).
    assert max(np.abs(w - i).max() for w, i in zip(one.model.get_weights(), initial)) > 1e-3
    assert_weights_close(two.model.get_weights(), one.model.get_weights())
    assert two.summary["loss"] == pytest.approx(one.summary["loss"], rel=1e-5)


@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.1), ("adam", 0.001)])
def test_mirrored_batchnorm_matches_per_replica_statistics(optimizer, lr):
    """BatchNorm normalises with *per-replica* batch statistics under mirrored.

    So 2 replicas match one device that splits each batch into 2 micro-batches
    (accum_steps=2): the same per-half statistics, gradients summed once. The
    trainable weights agree to 1e-5. The moving averages differ by design: the
    replicas average two EMA updates per step (decay momentum=0.9), the
    micro-batches apply them in turn (decay 0.81). What must hold for them is
    that they moved, and that every replica holds the same values (tfdist
    averages them; Keras 3 alone would let each replica's copy drift apart).
    """
    cnn = dict(model="cnn", width=4, depth=1, optimizer=optimizer, learning_rate=lr)
    default = run_config("default", accum_steps=2, **cnn)
    initial = _initial_weights(default)
    one = _train(default, initial)
    two = _train(run_config("mirrored", **cnn), initial)
    assert_weights_close([v.numpy() for v in two.model.trainable_variables],
                         [v.numpy() for v in one.model.trainable_variables])
    initial_moving = [w for w, v in zip(initial, one.model.variables) if not v.trainable]
    for variable, start in zip(two.model.non_trainable_variables, initial_moving):
        replica_copies = [c.numpy() for c in variable.value.values]
        assert len(replica_copies) == 2
        np.testing.assert_array_equal(replica_copies[0], replica_copies[1])
        assert not np.allclose(replica_copies[0], start)


def test_default_batchnorm_differs_from_mirrored_without_micro_batches():
    """Guard for the test above: whole-batch statistics really are different."""
    cnn = dict(model="cnn", width=4, depth=1, optimizer="sgd", learning_rate=0.1)
    default = run_config("default", **cnn)
    initial = _initial_weights(default)
    one = _train(default, initial)
    two = _train(run_config("mirrored", **cnn), initial)
    diffs = [np.abs(a.numpy() - b.numpy()).max()
             for a, b in zip(two.model.trainable_variables, one.model.trainable_variables)]
    assert max(diffs) > 1e-5
