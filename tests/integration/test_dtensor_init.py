"""Sharded variables start from one device's initial values.

Each device's shard is drawn alone (tfdist/strategies/dtensor/init.py); the
values are compared bit for bit: the same Philox elements go through the same
float operations, only fewer of them, so nothing is reordered.
"""

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfdist
from tfdist import models
from tfdist.strategies.dtensor import init as dtensor_init

from common import IMAGE_SPEC, image_dataset_fn
from test_dtensor import _assert_matches, _config

U = dtensor.UNSHARDED
INITIALIZERS = {
    "glorot_uniform": "glorot_uniform",
    "he_normal": "he_normal",
    # EfficientNet's convolution initializer
    "truncated_fan_out": keras.initializers.VarianceScaling(2.0, "fan_out", "truncated_normal"),
    "random_normal_seeded": keras.initializers.RandomNormal(0.1, 0.2, seed=3),
    "orthogonal": "orthogonal",          # not element-wise: made whole, then sliced
    "zeros": "zeros",
    "constant": keras.initializers.Constant(0.5),
}
LAYOUTS = [((64, 48), ("batch", "model")),            # both dimensions split
           ((3, 3, 8, 16), (U, U, "batch", "model")),  # a convolution kernel: 9 row runs
           ((300, 8), (U, "model")),                   # 300 runs: drawn whole, sliced
           ((512, 256), ("batch", U))]                 # contiguous shards, > 65536 elements


def _mesh():
    return dtensor.create_mesh([("batch", 2), ("model", 2)],
                               devices=[f"CPU:{i}" for i in range(4)])


def _deferred(initializer, shape):
    """The deferred initial value Keras hands `tf.Variable` for a variable."""
    captured = {}

    def creator(next_creator, **kwargs):
        captured["initial_value"] = kwargs["initial_value"]
        return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        keras.Variable(initializer=initializer, shape=shape)
    return captured["initial_value"]


def _whole(packed, rank, mesh):
    return dtensor.unpack(dtensor.relayout(packed, dtensor.Layout.replicated(mesh, rank)))[0]


def test_each_shard_is_its_slice_of_one_devices_value():
    mesh = _mesh()
    made = dtensor_init.ShardedInit()
    for name, initializer in INITIALIZERS.items():
        for shape, spec in LAYOUTS:
            keras.utils.set_random_seed(5)
            expected = keras.Variable(initializer=initializer, shape=shape).numpy()
            keras.utils.set_random_seed(5)
            layout = dtensor.Layout(list(spec), mesh)
            shards = made.shards(_deferred(initializer, shape), f"{name}{shape}", shape,
                                 tf.float32, layout)
            got = _whole(dtensor.pack(shards, layout), len(shape), mesh).numpy()
            np.testing.assert_array_equal(got, expected, err_msg=f"{name} {shape} {spec}")
    # Only the orthogonal initializer's large variable was made whole (the
    # element-wise ones were drawn shard by shard, also where they are large).
    assert [path for path, _ in made.made_whole] == ["orthogonal(512, 256)"], made.made_whole


def test_dtensors_own_draw_on_the_mesh_differs():
    """The control: DTensor draws a random op on a split layout with a
    per-device seed, so the comparison above can fail."""
    mesh = _mesh()
    layout = dtensor.Layout(["batch", "model"], mesh)
    keras.utils.set_random_seed(5)
    expected = keras.Variable(initializer="glorot_uniform", shape=(64, 48)).numpy()
    keras.utils.set_random_seed(5)
    initial_value = _deferred("glorot_uniform", (64, 48))

    @tf.function(autograph=False)
    def on_mesh():
        return dtensor.relayout(tf.convert_to_tensor(initial_value()), layout)

    with dtensor.default_mesh(mesh):
        got = _whole(on_mesh(), 2, mesh).numpy()
    assert not np.array_equal(got, expected)


def test_zero3_with_tensor_parallel_rules_trains_from_one_devices_weights():
    """No weights set from the host: the seed alone. ZeRO-3 on 2x2 (each
    variable split over both axes) against one device."""
    model_config, spec = tfdist.ModelConfig(name="mlp", width=16, depth=2), IMAGE_SPEC
    keras.utils.set_random_seed(_config("default", model_config).train.seed)
    initial = models.build(model_config, spec).get_weights()
    runs = {}
    for name, zero in (("default", 0), ("dtensor", 3)):
        config = _config(name, model_config, steps=2)
        if zero:
            config = config.replace(strategy=config.strategy.replace(zero_stage=zero))
        runs[name] = tfdist.train(config, dataset_fn=image_dataset_fn, spec=spec,
                                  layout_rules=models.layout_rules(model_config))
    _assert_matches(runs["dtensor"], runs["default"], initial)
