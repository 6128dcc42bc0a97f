"""Core assertion: N replicas on a global batch match one device on that batch."""

import numpy as np
import pytest

import tfdist
from tfdist import models

from common import IMAGE_SPEC, assert_weights_close, image_dataset_fn, run_config


def _initial_weights(config):
    return models.build(config.model, IMAGE_SPEC).get_weights()


def _train(config, initial, prepare=None):
    def model_fn(spec):
        model = models.build(config.model, spec)
        model.set_weights(initial)
        if prepare:
            prepare(model)
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


# The synchronised moments are E[x^2] - E[x]^2 of all-reduced sums (Keras's
# synchronized path), one device's the two-pass variance: they differ by
# float32 cancellation, eps * E[x^2] / Var[x] of the variance (measured: 1e-6
# of a variable's largest entry after 5 steps). 1e-5 relative bounds that and
# is 10^5 times below what per-replica statistics move (the control).
SYNC_TOLERANCE = dict(rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("engine", ["mirrored", "dtensor"])
def test_sync_batchnorm_matches_one_device_on_the_global_batch(engine):
    """With --sync_batchnorm, 2 replicas of per-replica batch 4 match one
    device on the batch of 8: trainable weights and moving statistics (each
    replica's copy). dtensor's statistics are the global batch's already.
    The control: mirrored without it differs by at least 10x the tolerance."""
    cnn = dict(model="cnn", width=4, depth=1, optimizer="sgd", learning_rate=0.1, batch=8)
    default = run_config("default", **cnn)
    initial = _initial_weights(default)
    one = _train(default, initial)
    reference = [v.numpy() for v in one.model.variables]

    def copies(result):
        found = []
        for variable in result.model.variables:
            values = getattr(variable.value, "values", None)   # mirrored: each replica's
            found.append([c.numpy() for c in values] if values else [variable.numpy()])
        return found

    synced = _train(run_config(engine, sync_batchnorm=True, **cnn), initial)
    for index, (held, expected) in enumerate(zip(copies(synced), reference)):
        for value in held:
            np.testing.assert_allclose(value, expected, **SYNC_TOLERANCE,
                                       err_msg=f"variable {index}")
    if engine == "mirrored":
        local = _train(run_config(engine, **cnn), initial)
        bound = max(SYNC_TOLERANCE["atol"] + SYNC_TOLERANCE["rtol"] * np.abs(b).max()
                    for b in reference)
        worst = max(np.abs(a.numpy() - b).max()
                    for a, b in zip(local.model.variables, reference))
        assert worst > 10 * bound


def _reduced_moments(stop_gradient: bool):
    """Each BatchNorm layer's moments from the sums over every replica's
    batch (one-pass variance, as Keras's synchronized path), optionally
    without gradients through them (installed with tfdist's own compat hook)."""
    import tensorflow as tf

    from tfdist import compat
    from tfdist.training import batchnorm

    def moments(inputs, mask):
        del mask
        axes = list(range(len(inputs.shape) - 1))
        count = tf.cast(tf.reduce_prod(tf.shape(inputs)[:-1]), inputs.dtype)
        total, squares, count = tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, [tf.reduce_sum(inputs, axes),
                                         tf.reduce_sum(tf.square(inputs), axes), count])
        mean = total / count
        variance = squares / count - tf.square(mean)
        return (tf.stop_gradient(mean), tf.stop_gradient(variance)) if stop_gradient \
            else (mean, variance)

    def prepare(model):
        for layer in batchnorm.layers(model):
            compat.replace_batchnorm_moments(layer, moments)
    return prepare


def test_the_sync_batchnorm_equivalence_needs_gradients_through_the_reduced_moments():
    """The control of the equivalence above: the moments reduced over the
    replicas as there, but with their gradients stopped, differ from one
    device by at least 10x the tolerance; the same moments with gradients
    match it (so the stop is the only difference)."""
    cnn = dict(model="cnn", width=4, depth=1, optimizer="sgd", learning_rate=0.1, batch=8)
    default = run_config("default", **cnn)
    initial = _initial_weights(default)
    reference = _train(default, initial).model.trainable_variables
    bound = max(SYNC_TOLERANCE["atol"] + SYNC_TOLERANCE["rtol"] * np.abs(b.numpy()).max()
                for b in reference)
    worst = {}
    for stop in (False, True):
        trained = _train(run_config("mirrored", **cnn), initial, _reduced_moments(stop))
        worst[stop] = max(np.abs(a.numpy() - b.numpy()).max()
                          for a, b in zip(trained.model.trainable_variables, reference))
    assert worst[False] < bound < 10 * bound < worst[True], (worst, bound)


@pytest.mark.parametrize("name", ["parameter_server", "pipeline", "mirrored"])
def test_sync_batchnorm_is_refused_in_one_line_where_the_engine_cannot(name):
    """From the engine's capabilities, before anything is built; the control:
    mirrored has them."""
    import dataclasses
    from tfdist import strategies
    from tfdist.errors import UsageError
    from tfdist.training import batchnorm
    config = run_config(name, sync_batchnorm=True)
    strategy = strategies.create(config.strategy)
    if name == "mirrored":
        strategy.setup()   # its replicas: a collective only among several
        batchnorm.check(config.train, strategy)
        with pytest.raises(UsageError) as error:   # but not inside an XLA-compiled step
            batchnorm.check(dataclasses.replace(config.train, jit_compile="on"), strategy)
        assert "--sync_batchnorm with --jit_compile=on" in str(error.value)
        return
    with pytest.raises(UsageError) as error:
        batchnorm.check(config.train, strategy)
    assert str(error.value) == (
        f"--sync_batchnorm needs BatchNorm statistics reduced over every replica's batch; "
        f"--strategy={name} has none (engines that do: default, mirrored, multi_worker, "
        "horovod, dtensor)")


def test_sync_batchnorm_with_micro_batches_is_refused():
    with pytest.raises(tfdist.ConfigError) as error:
        run_config("mirrored", sync_batchnorm=True, accum_steps=2)
    assert "each micro-batch would normalise with its own statistics" in str(error.value)


def _normalised_mlp(synchronized=False):
    import keras

    def model_fn(spec):
        inputs = keras.Input(spec.input_shape)
        x = keras.layers.Dense(16)(keras.layers.Flatten()(inputs))
        x = keras.layers.BatchNormalization(synchronized=synchronized, name="norm")(x)
        return keras.Model(inputs, keras.layers.Dense(spec.num_classes)(x))
    return model_fn


@pytest.mark.parametrize("sync", [True, False])
def test_a_synchronised_forward_is_not_compiled_whole_by_xla(sync):
    """`--jit_compile=auto` compiles a dense model's whole step under mirrored;
    with the statistics' all-reduce in its forward pass, the optimizer update
    alone (XLA cannot compile the collective on CPU). The control: without it,
    the whole step."""
    config = run_config("mirrored", sync_batchnorm=sync, jit_compile="auto", steps=2)
    result = tfdist.train(config, model_fn=_normalised_mlp(), dataset_fn=image_dataset_fn,
                          spec=IMAGE_SPEC)
    assert result.summary["jit_compile"] == ("optimizer" if sync else "step")


def test_a_layers_own_synchronized_is_honoured_or_refused():
    """A layer built with synchronized=True asks for global statistics as the
    flag does: honoured under mirrored (Keras's own path), refused in one line
    where the engine has no such reduction (the control)."""
    from tfdist import strategies
    from tfdist.errors import UsageError
    from tfdist.training import batchnorm
    model = _normalised_mlp(synchronized=True)(IMAGE_SPEC)
    config = run_config("parameter_server")
    with pytest.raises(UsageError) as error:
        batchnorm.synchronize(config.train, strategies.create(config.strategy), model, "off")
    assert str(error.value).startswith("synchronized=True on layer 'norm' needs BatchNorm "
                                       "statistics reduced over every replica's batch")
    result = tfdist.train(run_config("mirrored", steps=2), model_fn=_normalised_mlp(True),
                          dataset_fn=image_dataset_fn, spec=IMAGE_SPEC)
    assert result.summary["jit_compile"] == "off"   # run_config's; it trained
