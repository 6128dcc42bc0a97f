"""The parameter server's staleness-aware learning rate (`--staleness_lr`):
an update's rate divided by 1 + the updates of other workers that landed
while it computed its gradient. In one process: the schedule wrapper on a
real optimizer, and the engine's staleness read on a real update counter
(the cluster runs are in tests/integration/test_parameter_server.py)."""

import types

import keras
import numpy as np
import tensorflow as tf

from tfdist.config import OptimizerConfig
from tfdist.strategies.parameter_server import engine as parameter_server
from tfdist.training import optimizers, schedules


def _one_sgd_step(lr_factor, **config):
    optimizer = optimizers.create(OptimizerConfig(name="sgd", learning_rate=0.1, **config),
                                  global_batch_size=8, total_steps=10, lr_factor=lr_factor)
    variable = keras.Variable(np.ones([2], np.float32))
    optimizer.apply([tf.constant([1.0, 2.0])], [variable])
    return variable.numpy()


def test_the_factor_scales_each_update_and_the_schedule_beneath_it():
    np.testing.assert_allclose(_one_sgd_step(lambda: tf.constant(0.25)), [0.975, 0.95])
    # The control: without a factor, the full step.
    np.testing.assert_allclose(_one_sgd_step(None), [0.9, 0.8])
    # Under a warm-up (step 0 of 2: half the rate), times the factor.
    np.testing.assert_allclose(_one_sgd_step(lambda: tf.constant(0.5), warmup_steps=2),
                               [0.975, 0.95])


def _engine(staleness_lr, counter):
    """The adapter's staleness methods, on a real counter, without a cluster."""
    engine = parameter_server.ParameterServerStrategy.__new__(
        parameter_server.ParameterServerStrategy)
    engine.config = types.SimpleNamespace(staleness_lr=staleness_lr)
    engine._optimizer = types.SimpleNamespace(iterations=counter)
    engine._step_read, engine._step_staleness = None, None
    return engine


def test_staleness_is_the_updates_since_the_read_and_divides_the_rate():
    counter = tf.Variable(5, dtype=tf.int64)
    engine = _engine("divide", counter)
    factor = engine.learning_rate_factor()
    assert float(factor()) == 1.0   # outside a step: the host logging the rate
    engine._step_read = tf.constant(5, tf.int64)    # the step read the weights at update 5
    counter.assign(8)                                # 3 other updates landed meanwhile
    engine._all_reduce_sum([tf.constant(1.0)])       # its gradients are computed
    assert int(engine._step_staleness) == 3
    assert float(factor()) == 0.25
    # A fresh step: the factor is 1.
    engine._step_read = tf.constant(8, tf.int64)
    engine._all_reduce_sum([tf.constant(1.0)])
    assert float(factor()) == 1.0
    # The control: --staleness_lr=none gives no factor at all.
    assert _engine("none", counter).learning_rate_factor() is None


def test_the_staleness_read_waits_for_the_gradients():
    """The counter is read after the step's gradients: without the dependency
    TensorFlow may read it first thing, before the forward pass (it touches
    no other variable), and under-count (measured: 13% of a run's steps
    stale where 40% were)."""
    counter = tf.Variable(0, dtype=tf.int64)
    engine = _engine("divide", counter)
    found = {}

    @tf.function(autograph=False)
    def step(x):
        engine._step_read = tf.constant(0, tf.int64)
        found["gradient"] = tf.square(x, name="the_gradient")
        engine._all_reduce_sum([found["gradient"]])
        return engine._step_staleness

    graph = step.get_concrete_function(tf.TensorSpec([], tf.float32)).graph
    reads = [op for op in graph.get_operations() if op.type == "ReadVariableOp"]
    assert reads and all(found["gradient"].op in op.control_inputs for op in reads), reads

def test_the_wrapped_schedule_serializes_its_base():
    wrapped = schedules.PerUpdateFactor(0.1, lambda: tf.constant(1.0))
    assert wrapped.get_config() == {"base": 0.1}


def test_high_staleness_with_momentum_or_adam_warns_and_names_what_helps():
    adam, sgd = keras.optimizers.Adam(), keras.optimizers.SGD()
    line = parameter_server.staleness_warning(0.4, "none", adam)
    assert "mean staleness 0.40" in line and "--staleness_lr=divide" in line, line
    line = parameter_server.staleness_warning(0.4, "divide", keras.optimizers.SGD(momentum=0.9))
    assert "SGD" in line and "multi_worker" in line, line
    # The controls: low staleness, and plain SGD (which staleness did not hurt).
    assert parameter_server.staleness_warning(0.1, "none", adam) is None
    assert parameter_server.staleness_warning(0.4, "none", sgd) is None
