"""`tfdist.compat`: every private upstream name tfdist relies on.

For each entry: a test that fails if the patch stops taking effect (the
upstream behaviour it works around is shown to come back without it, or the
patched behaviour is checked directly), and a test that its check fails in one
line naming the attribute and the verified versions when the attribute is
missing or no longer used. In process, on the suite's 4 virtual CPUs.
"""

import contextlib
import os
import types

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.backend.tensorflow import core as keras_tf_core
from tensorflow.experimental import dtensor

from tfdist import compat
from tfdist.errors import first_line
from tfdist.strategies.parameter_server import engine as parameter_server

CPUS = [d.name for d in tf.config.list_logical_devices("CPU")]
ShardedVariable = tf.__internal__.distribute.ShardedVariable


def assert_one_line_change(raises, *names):
    message = str(raises.value)
    assert "\n" not in message and compat.VERIFIED in message, message
    for name in names:
        assert name in message, message


# -- optimizers -------------------------------------------------------------------

def _mirrored_sgd_step(optimizer_fn):
    """One SGD(lr=1) step of a mirrored variable (0) with gradient 1 on each of 2 replicas."""
    strategy = tf.distribute.MirroredStrategy(
        CPUS[:2], cross_device_ops=tf.distribute.ReductionToOneDevice())
    with strategy.scope():
        variable = keras.Variable(np.zeros([1], np.float32))
        optimizer = optimizer_fn(keras.optimizers.SGD(1.0))
        optimizer.build([variable])

    @tf.function
    def step():
        strategy.run(lambda: optimizer.apply([tf.ones([1])], [variable]))

    step()
    return float(variable.numpy()[0])


def test_optimizer_all_reduce_is_disabled():
    # Keras sums the replicas' gradients itself (2 replicas x 1 = 2) ...
    assert _mirrored_sgd_step(lambda o: o) == -2.0
    # ... tfdist's adapter already summed them: each replica's gradient is applied as it is.
    assert _mirrored_sgd_step(compat.disable_optimizer_all_reduce) == -1.0


def test_optimizer_all_reduce_check(monkeypatch):
    with pytest.raises(compat.UpstreamChanged) as raised:
        compat.disable_optimizer_all_reduce(types.SimpleNamespace())
    assert_one_line_change(raised, "_all_reduce_sum_gradients")
    optimizer = keras.optimizers.SGD(1.0)
    monkeypatch.setattr(type(optimizer), "_backend_update_step",
                        lambda self, grads, variables, lr: None)
    with pytest.raises(compat.UpstreamChanged, match="no longer used by") as raised:
        compat.disable_optimizer_all_reduce(optimizer)
    assert_one_line_change(raised, "_all_reduce_sum_gradients")


def _adam_checkpoint_restores(tmp_path, name, saved, restored) -> bool:
    """Whether an Adam checkpoint of `saved` (an optimizer) restores into
    `restored`, both built on one variable of shape [3, 2]."""
    for optimizer in (saved, restored):
        optimizer.build([keras.Variable(np.ones([3, 2], np.float32))])
    path = tf.train.Checkpoint(optimizer=saved).write(str(tmp_path / name))
    try:
        tf.train.Checkpoint(optimizer=restored).read(path).expect_partial()
        return True
    except (ValueError, tf.errors.OpError):
        return False


def test_learning_rate_times_keeps_the_checkpoint_of_every_engine(tmp_path):
    from tfdist.training import schedules
    factor = lambda: tf.constant(0.5)  # noqa: E731
    scaled = keras.optimizers.Adam(0.01)
    compat.learning_rate_times(scaled, factor)
    assert float(scaled.learning_rate) == pytest.approx(0.005)
    # A parameter server's checkpoint restores under another engine, and back.
    assert _adam_checkpoint_restores(tmp_path, "a", scaled, keras.optimizers.Adam(0.01))
    again = keras.optimizers.Adam(0.01)
    compat.learning_rate_times(again, factor)
    assert _adam_checkpoint_restores(tmp_path, "b", keras.optimizers.Adam(0.01), again)
    # Without the patch (the factor given at construction) the rate is no
    # variable, and the positions of the optimizer's variables shift.
    built_with = keras.optimizers.Adam(schedules.PerUpdateFactor(0.01, factor))
    assert not _adam_checkpoint_restores(tmp_path, "c", built_with, keras.optimizers.Adam(0.01))


def test_learning_rate_times_check(monkeypatch):
    with pytest.raises(compat.UpstreamChanged) as raised:
        compat.learning_rate_times(types.SimpleNamespace(), lambda: 1.0)
    assert_one_line_change(raised, "_learning_rate")
    optimizer = keras.optimizers.Adam(0.01)
    monkeypatch.setattr(type(optimizer), "_get_current_learning_rate", lambda self: 0.01)
    with pytest.raises(compat.UpstreamChanged, match="no longer used by") as raised:
        compat.learning_rate_times(optimizer, lambda: 1.0)
    assert_one_line_change(raised, "_learning_rate")


def test_strategy_supports_no_merge_call(monkeypatch):
    strategy = tf.distribute.MirroredStrategy(
        CPUS[:2], cross_device_ops=tf.distribute.ReductionToOneDevice())
    assert compat.strategy_supports_no_merge_call() is True   # the default strategy
    with strategy.scope():
        expected = tf.__internal__.distribute.strategy_supports_no_merge_call()
        assert compat.strategy_supports_no_merge_call() is expected
    monkeypatch.delattr(tf.__internal__.distribute, "strategy_supports_no_merge_call")
    with pytest.raises(compat.UpstreamChanged) as raised:
        compat.strategy_supports_no_merge_call()
    assert_one_line_change(raised, "strategy_supports_no_merge_call")


# -- parameter servers: Keras variables over a ShardedVariable, in one process ----

def _split_in_two(next_creator, **kwargs):
    """A creator that stores a variable of 2+ rows as a ShardedVariable of two
    halves, as ParameterServerStrategy's partitioner does (without servers)."""
    initial = kwargs["initial_value"]
    value = tf.convert_to_tensor(initial() if callable(initial) else initial,
                                 dtype=kwargs.get("dtype"))
    if value.shape.rank == 0 or value.shape[0] < 2:
        return next_creator(**kwargs)
    half = value.shape[0] // 2
    name = kwargs.get("name") or "v"
    return ShardedVariable([next_creator(initial_value=part, name=f"{name}/part_{i}",
                                         trainable=kwargs.get("trainable", True))
                            for i, part in enumerate((value[:half], value[half:]))])


def _keras_sharded(values, *creators):
    """A Keras variable over a ShardedVariable; `creators` run before the split
    (as the parameter_server engine's creator runs before the strategy's)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(tf.variable_creator_scope(_split_in_two))
        for creator in creators:
            stack.enter_context(tf.variable_creator_scope(creator))
        variable = keras.Variable(np.asarray(values, np.float32))
    assert isinstance(variable.value, ShardedVariable)
    return variable


def test_sharded_variable_type(monkeypatch):
    sharded = _keras_sharded([[1.0], [2.0]])
    assert compat.is_sharded(sharded.value) and not compat.is_sharded(tf.Variable(1.0))
    monkeypatch.delattr(tf.__internal__.distribute, "ShardedVariable")
    with pytest.raises(compat.UpstreamChanged) as raised:
        compat.is_sharded(sharded.value)
    assert_one_line_change(raised, "ShardedVariable")


def test_optimizer_updates_sharded_variables():
    start = np.array([[2.0], [4.0], [6.0], [8.0]], np.float32)

    def step(patch):
        strategy = tf.distribute.MirroredStrategy(CPUS[:1])
        with strategy.scope():
            variable = _keras_sharded(start)
            optimizer = keras.optimizers.SGD(1.0, weight_decay=0.5)
            optimizer.build([variable])
        if patch:
            compat.optimizer_updates_sharded_variables(optimizer)

        @tf.function
        def apply():
            strategy.run(lambda: optimizer.apply([tf.ones([4, 1])], [variable]))

        apply()
        return variable

    # Keras's own path (extended.update) refuses a ShardedVariable under a strategy.
    with pytest.raises(AssertionError, match="distributed_apply_weight_decay"):
        step(patch=False)
    variable = step(patch=True)
    # decay first (x - 0.5 x), then the gradient step, written into each shard
    np.testing.assert_allclose(variable.numpy(), start * 0.5 - 1.0)
    np.testing.assert_allclose(variable.value.variables[1].numpy(), start[2:] * 0.5 - 1.0)


def test_optimizer_updates_sharded_variables_check(monkeypatch):
    for missing in ("_distributed_tf_update_step", "_apply_weight_decay", "_use_weight_decay"):
        stand_in = types.SimpleNamespace(_distributed_tf_update_step=None,
                                         _apply_weight_decay=None, _use_weight_decay=None)
        delattr(stand_in, missing)
        with pytest.raises(compat.UpstreamChanged) as raised:
            compat.optimizer_updates_sharded_variables(stand_in)
        assert_one_line_change(raised, missing)
    optimizer = keras.optimizers.SGD(1.0)
    monkeypatch.setattr(type(optimizer), "_backend_update_step",
                        lambda self, grads, variables, lr: None)
    with pytest.raises(compat.UpstreamChanged, match="no longer used") as raised:
        compat.optimizer_updates_sharded_variables(optimizer)
    assert_one_line_change(raised, "_distributed_tf_update_step")


def test_sharded_variables_checkpoint_whole(tmp_path):
    values = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    unpatched = _keras_sharded(values)
    with pytest.raises(AttributeError, match="device"):   # BUILD_NOTES PS item 4
        tf.train.Checkpoint(v=unpatched).write(str(tmp_path / "upstream"))
    # The parameter_server engine's creator patches each ShardedVariable it creates.
    sharded = _keras_sharded(values, parameter_server._variable_creator)
    path = tf.train.Checkpoint(v=sharded).write(str(tmp_path / "whole"))
    plain = keras.Variable(np.zeros([3, 2], np.float32))   # restores under any other engine
    tf.train.Checkpoint(v=plain).read(path).assert_consumed()
    np.testing.assert_array_equal(plain.numpy(), values)
    sharded.assign(np.zeros([3, 2], np.float32))          # and back, split again
    tf.train.Checkpoint(v=sharded).read(path).assert_consumed()
    np.testing.assert_array_equal(sharded.value.variables[1].numpy(), values[1:])
    assert unpatched.value.__dict__.get("_serialize_to_tensors") is None   # per instance only


def test_sharded_checkpoint_check(monkeypatch):
    monkeypatch.setattr(compat.keras_internals, "_CHECKED", set())
    monkeypatch.setattr(keras_tf_core.Variable, "_serialize_to_tensors",
                        lambda self: {"VARIABLE_VALUE": self.value})
    with pytest.raises(compat.UpstreamChanged, match="no longer delegates") as raised:
        _keras_sharded([[1.0], [2.0]], parameter_server._variable_creator)
    assert_one_line_change(raised, "Variable._serialize_to_tensors")


# -- DTensor -----------------------------------------------------------------------

def _dtensor_first_batch(patch):
    """BUILD_NOTES' reproduction: a 2-device mesh in this 4-device process."""
    mesh = dtensor.create_mesh([("batch", 2)], devices=CPUS[:2])
    dataset = dtensor.DTensorDataset(tf.data.Dataset.range(64), mesh=mesh,
                                     layouts=dtensor.Layout.batch_sharded(mesh, "batch", 1),
                                     global_batch_size=8, batch_dim="batch")
    if patch:
        compat.dtensor_dataset_one_client_per_replica(dataset)
    return [t.numpy().tolist() for t in dtensor.unpack(next(iter(dataset)))]


def test_dtensor_dataset_one_client_per_replica():
    assert len(CPUS) > 2   # the bug needs more devices in the process than in the mesh
    assert _dtensor_first_batch(patch=False) == [[0, 1, 2, 3], [0, 1, 2, 3]]   # upstream
    assert _dtensor_first_batch(patch=True) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_dtensor_dataset_check(monkeypatch):
    for missing in ("_num_clients_per_replica", "_partition_offset"):
        stand_in = types.SimpleNamespace(_num_clients_per_replica=2, _partition_offset=1)
        delattr(stand_in, missing)
        with pytest.raises(compat.UpstreamChanged) as raised:
            compat.dtensor_dataset_one_client_per_replica(stand_in)
        assert_one_line_change(raised, missing)
    mesh = dtensor.create_mesh([("batch", 2)], devices=CPUS[:2])
    dataset = dtensor.DTensorDataset(tf.data.Dataset.range(8), mesh=mesh,
                                     layouts=dtensor.Layout.batch_sharded(mesh, "batch", 1),
                                     global_batch_size=8, batch_dim="batch")
    monkeypatch.setattr(type(dataset), "__iter__", lambda self: iter(()))
    with pytest.raises(compat.UpstreamChanged, match="no longer used by") as raised:
        compat.dtensor_dataset_one_client_per_replica(dataset)
    assert_one_line_change(raised, "_num_clients_per_replica")


def test_keras_variable_of():
    owners = []

    def creator(next_creator, **kwargs):
        owners.append(compat.keras_variable_of(kwargs["initial_value"]))
        return next_creator(**kwargs)

    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(2, name="query")

        def build(self, shape):
            self.dense.build(shape)

    with tf.variable_creator_scope(creator):
        block = Block(name="attn")
        block.build((None, 3))
    assert [id(o) for o in owners] == [id(block.dense.kernel), id(block.dense.bias)]
    assert owners[0].path == "attn/query/kernel"   # the name scope would not say so
    assert compat.keras_variable_of(lambda: 1) is None
    compat.check_keras_variable_of()


def test_keras_variable_of_check(monkeypatch):
    monkeypatch.setattr(compat.keras_internals, "_CHECKED", set())
    monkeypatch.setattr(keras_tf_core.Variable, "_initialize_with_initializer",
                        lambda self, init: self._initialize(tf.zeros(self._shape, self._dtype)))
    with pytest.raises(compat.UpstreamChanged, match="no longer closes over") as raised:
        compat.check_keras_variable_of()
    assert_one_line_change(raised, "_initialize_with_initializer")


def test_adam_slots_and_variable_index():
    a, b = keras.Variable(np.zeros([2], np.float32), name="a"), \
        keras.Variable(np.zeros([3], np.float32), name="b")
    optimizer = keras.optimizers.Adam()
    optimizer.build([a, b])
    momentums, velocities = compat.adam_slots(optimizer)
    index = compat.variable_index(optimizer, b)
    assert index == 1 and momentums[index].shape == (3,) and velocities[index].shape == (3,)
    # These are the slots Keras's own update_step moves.
    optimizer.apply([tf.zeros([2]), tf.ones([3])], [a, b])
    assert np.all(momentums[1].numpy() > 0) and np.all(velocities[1].numpy() > 0)
    assert np.all(momentums[0].numpy() == 0)


def test_adam_slots_and_variable_index_check():
    with pytest.raises(compat.UpstreamChanged) as raised:
        compat.variable_index(types.SimpleNamespace(), None)
    assert_one_line_change(raised, "_get_variable_index")
    with pytest.raises(compat.UpstreamChanged) as raised:
        compat.adam_slots(types.SimpleNamespace(_momentums=[]))
    assert_one_line_change(raised, "_velocities")


# -- losses and metrics ------------------------------------------------------------

def test_keras_mask():
    embedded = keras.layers.Embedding(5, 2, mask_zero=True)(tf.constant([[0, 3, 0]]))
    np.testing.assert_array_equal(compat.keras_mask(embedded), [[False, True, False]])
    assert compat.keras_mask(tf.ones([2])) is None


def test_align_ranks():
    y, p = compat.align_ranks(tf.ones([4]), tf.ones([4, 1]))
    assert y.shape.rank == p.shape.rank
    assert keras.losses.mean_squared_error(y, p).shape == (4,)   # not (4, 4)


def test_keras_metric():
    sparse = compat.keras_metric("accuracy", tf.TensorSpec([None]), tf.TensorSpec([None, 5]))
    binary = compat.keras_metric("accuracy", tf.TensorSpec([None, 1]), tf.TensorSpec([None, 1]))
    assert isinstance(sparse, keras.metrics.SparseCategoricalAccuracy)
    assert isinstance(binary, keras.metrics.BinaryAccuracy)


@pytest.mark.parametrize("function,module,name", [
    (lambda: compat.keras_mask(tf.ones([1])), "keras.src.backend.common.masking",
     "get_keras_mask"),
    (lambda: compat.align_ranks(tf.ones([1]), tf.ones([1])), "keras.src.losses.loss",
     "squeeze_or_expand_to_same_rank"),
    (lambda: compat.keras_metric("mae", None, None), "keras.src.trainers.compile_utils",
     "get_metric"),
    (lambda: compat.update_checkpoint_state("/nonexistent", "/nonexistent/x", all_paths=[]),
     "tensorflow.python.checkpoint.checkpoint_management", "update_checkpoint_state_internal"),
])
def test_private_functions_check(monkeypatch, function, module, name):
    import importlib
    monkeypatch.delattr(importlib.import_module(module), name)
    with pytest.raises(compat.UpstreamChanged) as raised:
        function()
    assert_one_line_change(raised, name)


def test_compiled_config():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    assert compat.compiled_config(model) is None
    loss = keras.losses.MeanSquaredError()
    model.compile(loss=loss, metrics=["mae"])
    config = compat.compiled_config(model)
    assert config["loss"] is loss and config["metrics"] == ["mae"]
    with pytest.raises(compat.UpstreamChanged) as raised:
        compat.compiled_config(types.SimpleNamespace(compiled=True))
    assert_one_line_change(raised, "_compile_config")


def test_build_metric():
    from tfdist.training.task import Task
    f1 = keras.metrics.F1Score()
    assert f1.variables == []   # Keras builds it only inside update_state
    compat.build_metric(f1, tf.TensorShape([None, 3]), tf.TensorShape([None, 3]))
    assert len(f1.variables) == 4
    auc = keras.metrics.AUC(multi_label=True)   # its _build takes one shape
    compat.build_metric(auc, tf.TensorShape([None, 3]), tf.TensorShape([None, 3]))
    assert auc.variables and auc.variables[0].shape[-1] == 3
    # A task with F1Score and R2Score builds and measures (it did not, before).
    task = Task(keras.losses.CategoricalCrossentropy(),
                [keras.metrics.F1Score(average="micro"), keras.metrics.R2Score()])
    spec = tf.TensorSpec([None, 3])
    task.build(spec, spec, tf.TensorSpec([None]), global_batch_size=4)
    assert all(layout.shapes for layout in task._layouts)   # state variables exist


def test_build_metric_check():
    with pytest.raises(compat.UpstreamChanged) as raised:
        compat.build_metric(types.SimpleNamespace(_built=False), None, None)
    assert_one_line_change(raised, "_build")
    lazy = types.SimpleNamespace(_built=False, _build=lambda y, p: None)
    with pytest.raises(compat.UpstreamChanged, match="did not set _built") as raised:
        compat.build_metric(lazy, None, None)
    assert_one_line_change(raised, "_build")


# -- checkpoints, graphs ----------------------------------------------------------

def test_update_checkpoint_state(tmp_path):
    directory = str(tmp_path)
    paths = [os.path.join(directory, f"ckpt-{i}") for i in (1, 2)]
    compat.update_checkpoint_state(directory, paths[1], all_paths=paths)
    text = (tmp_path / "checkpoint").read_text()
    assert 'model_checkpoint_path: "ckpt-2"' in text and directory not in text   # relative
    state = tf.train.get_checkpoint_state(directory)
    assert state.model_checkpoint_path == paths[1]
    assert list(state.all_model_checkpoint_paths) == paths


def test_checkpoint_object_graph(tmp_path):
    """Node 0 is the root; each variable's attribute names the key it is saved under."""
    dense = keras.layers.Dense(2)
    dense.build((None, 3))
    path = tf.train.Checkpoint(layer=dense).write(str(tmp_path / "ckpt"))
    reader = tf.train.load_checkpoint(path)
    nodes = compat.checkpoint_object_graph(reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
    assert [name for _, name in nodes[0][0]] == ["layer"]
    keys = {key for _, attributes in nodes for _, key in attributes}
    assert keys == set(reader.get_variable_to_shape_map()) - {"_CHECKPOINTABLE_OBJECT_GRAPH"}


def test_serialized_object_graph_is_the_one_a_write_writes(tmp_path):
    dense = keras.layers.Dense(2)
    dense.build((None, 3))
    checkpoint = tf.train.Checkpoint(layer=dense, step=tf.Variable(1))
    path = checkpoint.write(str(tmp_path / "ckpt"))
    written = tf.train.load_checkpoint(path).get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH")
    assert compat.serialized_object_graph(checkpoint) == written
    assert sorted(os.listdir(tmp_path)) == ["ckpt.data-00000-of-00001", "ckpt.index"]


def test_serialized_object_graph_check(monkeypatch):
    from tensorflow.python.checkpoint import save_util
    monkeypatch.delattr(save_util, "serialize_graph_view")
    with pytest.raises(compat.UpstreamChanged) as raised:
        compat.serialized_object_graph(tf.train.Checkpoint())
    assert_one_line_change(raised, "serialize_graph_view")


def test_checkpoint_object_graph_check(monkeypatch):
    from tensorflow.core.protobuf import trackable_object_graph_pb2
    monkeypatch.delattr(trackable_object_graph_pb2, "TrackableObjectGraph")
    with pytest.raises(compat.UpstreamChanged) as raised:
        compat.checkpoint_object_graph(b"")
    assert_one_line_change(raised, "TrackableObjectGraph")


def test_graph_function():
    @tf.function
    def inner(x):
        return tf.matmul(x, x)

    @tf.function
    def outer(x):
        return inner(x) + 1

    graph = outer.get_concrete_function(tf.TensorSpec([2, 2])).graph
    called = [op.type for op in graph.get_operations()
              if op.type in ("PartitionedCall", "StatefulPartitionedCall")]
    assert called
    name = next(op for op in graph.get_operations()
                if op.type in ("PartitionedCall", "StatefulPartitionedCall")).get_attr("f").name
    function = compat.graph_function(graph, name)
    assert "MatMul" in [op.type for op in function.graph.get_operations()]
    with pytest.raises(compat.UpstreamChanged) as raised:
        compat.graph_function(types.SimpleNamespace(), name)
    assert_one_line_change(raised, "_get_function")


# -- compat itself --------------------------------------------------------------------

def test_compat_imports_no_tensorflow():
    import subprocess
    import sys
    code = ("import sys, tfdist.compat; "
            "assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_first_line():
    assert first_line(ValueError("\n  bad value\nmore")) == "bad value"
    assert first_line(ValueError("Traceback (most recent)\nFile x\nwhy")) == "why"
    assert first_line(ValueError("")) == "ValueError"
    assert first_line(ValueError("x" * 400)) == "x" * 300
    assert first_line(tf.errors.UnknownError(None, None, "from message\nline 2")) == \
        "from message"


def test_each_multi_worker_strategy_gets_its_own_collective_keys(monkeypatch):
    """Without it a second MultiWorkerMirroredStrategy in one process reuses the
    first's group keys (tests/integration/test_multi_worker.py trains several runs per
    worker process on it); with a stand-in lacking the name, one loud line."""
    cls = tf.distribute.MultiWorkerMirroredStrategy
    monkeypatch.setattr(cls, "_collective_key_base", cls._collective_key_base)
    compat.next_collective_key_base(cls)
    first = cls._collective_key_base
    compat.next_collective_key_base(cls)
    assert cls._collective_key_base == first + compat.COLLECTIVE_KEY_STRIDE
    with pytest.raises(compat.UpstreamChanged, match="_collective_key_base"):
        compat.next_collective_key_base(type("NoBase", (), {"__module__": cls.__module__}))


def test_coordination_key_value(monkeypatch):
    """The store DTensor's client 0 waits on at the end of a run across
    processes (used by tests/integration/test_dtensor.py's and tests/integration/test_slurm_runs.py's
    2-process meshes); a TensorFlow without it is one line."""
    from tensorflow.python.eager import context
    assert all(map(callable, compat.coordination_key_value()))
    for name in ("get_config_key_value", "delete_config_key_value"):
        with monkeypatch.context() as patch:
            patch.delattr(context.Context, name)
            with pytest.raises(compat.UpstreamChanged) as raised:
                compat.coordination_key_value()
        assert_one_line_change(raised, name)


# -- DTensor: stage 3's gathers ------------------------------------------------------

def test_dtensor_fsdp_lowering(monkeypatch):
    """The first DTensor run of a process decides; stage 3 on a 1-D mesh picks
    the collective gather and no all-reduce combining, a value the user set is
    kept, and a 2-D stage-3 mesh is refused in one line once the collective
    gather is in effect (TF 2.21 reads it once per process, and it is wrong on
    2-D meshes: BUILD_NOTES "ZeRO stages 2 and 3")."""
    from tfdist.errors import UsageError
    gather, combine = compat.dtensor_internals._GATHER_ENV, compat.dtensor_internals._COMBINE_ENV
    flat, square = {"batch": 4, "model": 1}, {"batch": 2, "model": 2}

    def fresh(**env):
        # A copy of the environment as a plain dict: the switches must not reach
        # this process's real environment, which TensorFlow reads at its first
        # DTensor compile (a later test in this process would then compile its
        # 2-D meshes with the collective gather: seen, wrong weights).
        monkeypatch.setattr(compat.dtensor_internals, "_fsdp_env_latched", {})
        environ = {k: v for k, v in os.environ.items() if k not in (gather, combine)}
        monkeypatch.setattr(os, "environ", {**environ, **env})

    fresh()
    compat.dtensor_fsdp_lowering(flat, 3)
    assert os.environ[gather] == "1" and os.environ[combine] == "0"
    compat.dtensor_fsdp_lowering(flat, 0)           # later runs change nothing
    with pytest.raises(UsageError) as raised:
        compat.dtensor_fsdp_lowering(square, 3)
    assert "\n" not in str(raised.value) and "--mesh=batch:2,model:2" in str(raised.value)
    compat.dtensor_fsdp_lowering(square, 2)         # only stage 3 is refused

    fresh()                                          # a first run of another stage: defaults
    compat.dtensor_fsdp_lowering(flat, 0)
    compat.dtensor_fsdp_lowering(flat, 3)
    assert gather not in os.environ and combine not in os.environ
    compat.dtensor_fsdp_lowering(square, 3)          # the default gather: allowed

    fresh()                                          # 2-D first: the default gather
    compat.dtensor_fsdp_lowering(square, 3)
    assert gather not in os.environ and os.environ[combine] == "0"

    fresh(**{gather: "0", combine: "1"})             # the user's values are kept
    compat.dtensor_fsdp_lowering(flat, 3)
    assert os.environ[gather] == "0" and os.environ[combine] == "1"


def test_model_layers():
    """Nested layers are listed (ZeRO-3 wraps the ones that own variables)."""
    inputs = keras.Input((4, 8))
    attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    model = keras.Model(inputs, keras.layers.Dense(3)(attention(inputs, inputs)))
    layers = compat.model_layers(model)
    assert attention in layers and model not in layers
    assert any(isinstance(layer, keras.layers.EinsumDense) and layer.path.startswith(attention.path)
               for layer in layers)


def test_model_layers_check(monkeypatch):
    monkeypatch.delattr(keras.layers.Layer, "_flatten_layers")
    with pytest.raises(compat.UpstreamChanged) as raised:
        compat.model_layers(keras.Sequential([keras.layers.Dense(1)]))
    assert_one_line_change(raised, "_flatten_layers")


def test_keras_matplotlib_check():
    class Loader:   # a Keras whose module no longer falls back to plt = None
        def exec_module(self, module):
            module.plt = "pyplot"

    import types
    loader = compat.keras_matplotlib._DeferMatplotlibLoader(
        Loader(), "keras.src.visualization.plot_image_gallery")
    with pytest.raises(compat.UpstreamChanged) as raised:
        loader.exec_module(types.ModuleType("stand_in"))
    assert_one_line_change(raised, "plot_image_gallery.plt")


def test_keras_name_scopes_restored():
    # A model named with a leading underscore, traced at the root: TensorFlow
    # refuses the root scope "_private" after Keras has pushed it, and Keras's
    # stack keeps it (the control: without the guard, a variable made
    # afterwards is named under it); inside the guard it is taken off again.
    import tensorflow as tf

    from tfdist.observe import flops
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs), name="_private")

    def failing_trace():
        with pytest.raises(ValueError, match="not a valid root scope name"):
            flops.forward_flops_by_op(model, tf.TensorSpec((1, 2)))

    from keras.src.backend.common import global_state
    try:
        with compat.keras_name_scopes_restored():
            failing_trace()
        assert keras.Variable(1.0, name="after").path == "after"
        failing_trace()
        leaked = keras.Variable(1.0, name="after").path
    finally:
        global_state.set_global_attribute("name_scope_stack", [])
    assert leaked == "_private/after", leaked


def test_replay_functional():
    # Every node is called through the hook, nested models as one call (the
    # caller looks through them), shared layers once per call; the hook's
    # results are the outputs. Control: Keras's own call runs no hook.
    inputs = keras.Input((4,), name="x")
    twice, inner = keras.layers.Dense(4, name="twice"), keras.layers.Dense(4, name="inner")
    inner_in = keras.Input((4,))
    nested = keras.Model(inner_in, inner(inner_in), name="nested")
    model = keras.Model(inputs, twice(nested(twice(inputs))))
    seen = []

    def call(operation, *args, **kwargs):
        seen.append(operation.name)
        return operation(*args, **kwargs)

    out = compat.replay_functional(model, call)
    assert seen == ["twice", "nested", "twice"]
    assert tuple(out[0].shape if isinstance(out, list) else out.shape) == (None, 4)
    seen.clear()
    model(np.zeros((1, 4), "float32"))
    assert seen == []
    sequential = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="only")])
    compat.replay_functional(sequential, call)
    assert seen == ["only"]


def test_replay_functional_check():
    with pytest.raises(compat.UpstreamChanged) as raised:
        compat.replay_functional(keras.layers.Dense(2), lambda *a, **k: None)
    assert_one_line_change(raised, "Functional")
    assert compat.functional_graph(keras.layers.Dense(2)) is None


def test_standardize_inputs():
    # A dict of the data is mapped onto the model's inputs by name, in the
    # model's order (its inputs sorted by key), as Keras maps it when called.
    a, b = keras.Input((2,), name="a"), keras.Input((3,), name="b")
    model = keras.Model({"b": b, "a": a}, keras.layers.Concatenate()([a, b]))
    data = {"b": np.ones((1, 3), "float32"), "a": np.zeros((1, 2), "float32")}
    flat = compat.standardize_inputs(model, data)
    assert [tuple(t.shape) for t in flat] == [tuple(t.shape) for t in
                                              [np.zeros((1, 2)), np.zeros((1, 3))]]
    assert [t.name for t in model.inputs] == ["a", "b"]
    with pytest.raises(compat.UpstreamChanged):
        compat.standardize_inputs(object(), data)


def test_move_variable():
    # The CPU is split into virtual devices by conftest; without the move a
    # built layer's variables stay where they were made (the control).
    layer = keras.layers.Dense(3)
    layer.build((None, 2))
    kernel, before = layer.kernel, layer.kernel.numpy()
    assert layer.kernel.value.device.endswith("CPU:0")
    compat.move_variable(kernel, "/device:CPU:1")
    assert layer.kernel is kernel and kernel.value.device.endswith("CPU:1")
    np.testing.assert_array_equal(kernel.numpy(), before)
    kernel.assign(kernel * 2)   # still the layer's variable, written where it lives
    np.testing.assert_array_equal(layer.kernel.numpy(), before * 2)


def test_move_variable_check():
    with pytest.raises(compat.UpstreamChanged) as raised:
        compat.move_variable(object(), "/device:CPU:1")
    assert_one_line_change(raised, "_value")


@pytest.mark.parametrize("optimizer", [
    lambda: keras.optimizers.Adam(), lambda: keras.optimizers.AdamW(),
    lambda: keras.optimizers.SGD(momentum=0.9), lambda: keras.optimizers.RMSprop(momentum=0.5),
    lambda: keras.optimizers.Adagrad()])
def test_optimizer_slots(optimizer):
    # Paths chosen so that one is a prefix of another's ("dense" and "dense_1";
    # "dense/kernel" -> "dense_kernel_" vs "dense_1/kernel" -> "dense_1_kernel_").
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="dense"),
                              keras.layers.Dense(2, name="dense_1")])
    optimizer = optimizer()
    optimizer.build(model.trainable_variables)
    slots = compat.optimizer_slots(optimizer, model.trainable_variables)
    found = [s for group in slots for s in group]
    assert found and len({id(s) for s in found}) == len(found)
    for variable, group in zip(model.trainable_variables, slots):
        assert group and all(tuple(s.shape) == tuple(variable.shape) for s in group)
    # Every non-scalar optimizer variable is someone's slot (the control: the
    # scalars left over are the step counter and such).
    left = [v for v in optimizer.variables if id(v) not in {id(s) for s in found}]
    assert left and all(len(v.shape) == 0 for v in left)
    # What the slots are for: each holds its own variable's state only.
    grads = [tf.ones_like(v) if k == 0 else tf.zeros_like(v)
             for k, v in enumerate(model.trainable_variables)]
    before = [[s.numpy().copy() for s in group] for group in slots]
    optimizer.apply(grads[:1], model.trainable_variables[:1])
    assert any(not np.array_equal(s.numpy(), b) for s, b in zip(slots[0], before[0]))
    for group, was in zip(slots[1:], before[1:]):
        for s, b in zip(group, was):
            np.testing.assert_array_equal(s.numpy(), b)


def test_optimizer_slots_check():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="dense")])
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    with tf.init_scope():
        stray = optimizer.add_variable((4,), name="not_a_slot")   # named after no variable
    with pytest.raises(compat.UpstreamChanged) as raised:
        compat.optimizer_slots(optimizer, model.trainable_variables)
    assert_one_line_change(raised, "not_a_slot")
    assert stray is not None


def test_set_storage():
    # Freed and given back, the static shape kept throughout. The control: a
    # plain assign of the whole value to the freed variable is refused.
    variable = keras.Variable(np.ones((3, 4), np.float32))
    (component,) = tf.distribute.get_strategy().experimental_local_results(variable.value)
    compat.set_storage(component, tf.zeros([0]))
    stored = tf.raw_ops.ReadVariableOp(resource=component.handle, dtype=tf.float32)
    assert tuple(variable.shape) == (3, 4) and tuple(stored.shape) == (0,)
    with pytest.raises(tf.errors.InvalidArgumentError):
        component.assign(tf.ones([3, 4]))
    @tf.function
    def refill():   # in a traced function it returns the assign op
        assert compat.set_storage(component, tf.fill([3, 4], 2.0)) is not None

    refill()
    np.testing.assert_array_equal(variable.numpy(), np.full((3, 4), 2.0, np.float32))


def test_set_storage_check():
    with pytest.raises(compat.UpstreamChanged) as raised:
        compat.set_storage(object(), tf.zeros([0]))
    assert_one_line_change(raised, "handle")


def _two_layers(made_from_a_value=False):
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2, name="b")(
        keras.layers.Dense(4, name="a")(inputs)))
    if made_from_a_value:   # as keras-hub's tasks compile themselves
        keras.optimizers.Adam()   # its step counter is made from 0
    return model


def test_build_without_storage():
    # No variable has storage; each given it later holds what a normal build
    # with the same seed holds, bit for bit, in any order; values the build
    # assigned are returned (and given); a variable made from a value is
    # made. The controls: a plain StatelessScope refuses that variable, and a
    # later default StatelessScope's exit initialises nothing left listed.
    keras.utils.set_random_seed(3)
    expected = [v.numpy() for v in _two_layers().weights]
    keras.utils.set_random_seed(3)

    def build():
        model = _two_layers(made_from_a_value=True)
        model.get_layer("b").bias.assign(np.full((2,), 7.0, np.float32))
        return model

    model, made, assigned = compat.build_without_storage(build)
    assert {id(v) for v in model.weights} <= {id(v) for v in made}
    assert all(v._value is None for v in made)
    with keras.StatelessScope():
        pass
    assert all(v._value is None for v in made)
    bias = model.get_layer("b").bias
    assert list(assigned) == [id(bias)]
    for variable in reversed(made):
        compat.give_storage(variable, assigned.get(id(variable)))
    expected[3] = np.full((2,), 7.0, np.float32)
    for variable, want in zip(model.weights, expected):
        np.testing.assert_array_equal(variable.numpy(), want)
    with pytest.raises(ValueError, match="stateless scope"):
        with keras.StatelessScope(initialize_variables=False):
            _two_layers(made_from_a_value=True)


def test_build_without_storage_check():
    from keras.src.backend.common import global_state
    before = global_state.get_global_attribute("uninitialized_variables")
    global_state.set_global_attribute("uninitialized_variables", "not a list")
    try:
        with pytest.raises(compat.UpstreamChanged) as raised:
            compat.build_without_storage(_two_layers)
    finally:
        global_state.set_global_attribute("uninitialized_variables", before)
    assert_one_line_change(raised, "uninitialized_variables")
    with pytest.raises(compat.UpstreamChanged) as raised:
        compat.give_storage(object())
    assert_one_line_change(raised, "_deferred_initialize")


def test_created_without_broadcast_check_and_empty_variables():
    # The creator below must receive the strategy's broadcasting
    # initial_value_fn: without a MultiWorkerMirroredStrategy's scope it
    # receives Keras's own value and fails in one line. An EMPTY variable
    # has the static shape asked for and holds an empty tensor until filled.
    for choice in (compat.LOCAL, (compat.EMPTY, (3, 4))):
        with compat.created_without_broadcast(contextlib.nullcontext(), lambda: choice):
            with pytest.raises(compat.UpstreamChanged) as raised:
                keras.Variable(initializer="zeros", shape=(3, 4))
        assert_one_line_change(raised, "initial_value_fn")
    from tfdist.compat import tf_internals
    empty = tf_internals._empty_variable((3, 4), {"dtype": "float32", "name": "e"})
    stored = tf.raw_ops.ReadVariableOp(resource=empty.handle, dtype=tf.float32)
    assert tuple(empty.shape) == (3, 4) and tuple(stored.shape) == (0,)
    compat.set_storage(empty, tf.ones([3, 4]))
    np.testing.assert_array_equal(empty.numpy(), np.ones((3, 4), np.float32))


def test_gradient_overridden_takes_effect_in_its_scope_only():
    """The DTensor engine's depthwise gradient is TensorFlow's registered one
    only inside the scope, and undone after."""
    from tensorflow.python.framework import ops
    from tfdist.strategies.dtensor import ops as dtensor_ops
    before = ops._gradient_registry.lookup(dtensor_ops.DEPTHWISE)
    with compat.gradient_overridden(dtensor_ops.DEPTHWISE, dtensor_ops._depthwise_grad):
        assert ops._gradient_registry.lookup(dtensor_ops.DEPTHWISE) is \
            dtensor_ops._depthwise_grad
    assert ops._gradient_registry.lookup(dtensor_ops.DEPTHWISE) is before


def test_custom_gradients_on_tape_trace_no_identity_n():
    """Traced within the scope, a custom gradient is no `IdentityN` (the op
    DTensor fails to lower) and its gradient is still the custom one; traced
    outside (the control), it is."""
    @tf.custom_gradient
    def doubled_gradient(x, n):
        return x * tf.cast(n, x.dtype), lambda dy: (2.0 * dy * tf.cast(n, dy.dtype), None)

    def traced():
        @tf.function(autograph=False)
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = doubled_gradient(x, tf.constant(3))
            return tape.gradient(y, x)
        concrete = step.get_concrete_function(tf.TensorSpec([2], tf.float32))
        ops = {op.type for op in concrete.graph.get_operations()}
        return "IdentityN" in ops, concrete(tf.ones([2])).numpy()

    with compat.custom_gradients_on_tape():
        identity_n, gradient = traced()
    assert not identity_n and list(gradient) == [6.0, 6.0]
    identity_n, gradient = traced()
    assert identity_n and list(gradient) == [6.0, 6.0]


def test_keras_random_draws_reach_keras_initializers_in_their_scope_only():
    """Inside the scope a Keras initializer's draw goes through the
    replacement, with the seed Keras would use; outside (the control) it does
    not."""
    seen = []

    def replacement(original, shape, **kwargs):
        seen.append((tuple(shape), compat.keras_seed_tensor(kwargs["seed"]).shape))
        return tf.fill(shape, 7.0)

    initializer = keras.initializers.GlorotUniform(seed=1)
    with compat.keras_random_draws({"uniform": replacement}):
        inside = initializer((3, 2)).numpy()
    outside = initializer((3, 2)).numpy()
    assert (inside == 7.0).all() and seen == [((3, 2), (2,))]
    assert not (outside == 7.0).any()


def test_replace_batchnorm_moments():
    """The layer's training call normalises with the replaced moments (what
    Horovod's global statistics go through); its moving statistics follow them."""
    import numpy as np
    layer = keras.layers.BatchNormalization(momentum=0.0, epsilon=0.0, center=False,
                                            scale=False)
    x = np.arange(12, dtype="float32").reshape(4, 3)
    layer.build(x.shape)
    compat.replace_batchnorm_moments(
        layer, lambda inputs, mask: (keras.ops.zeros((3,)), keras.ops.ones((3,))))
    np.testing.assert_allclose(np.asarray(layer(x, training=True)), x)   # (x - 0) / 1
    np.testing.assert_allclose(np.asarray(layer.moving_mean), 0.0)


def test_replace_batchnorm_moments_check(monkeypatch):
    monkeypatch.delattr(keras.layers.BatchNormalization, "_moments")
    with pytest.raises(compat.UpstreamChanged) as raised:
        compat.replace_batchnorm_moments(keras.layers.BatchNormalization(), None)
    assert_one_line_change(raised, "_moments")


def _batchnorm_pair(dtype, shape):
    """Two identical built BatchNormalization layers (gamma, beta, moving
    statistics away from their initial values), the second fused."""
    pair = []
    for _ in range(2):
        layer = keras.layers.BatchNormalization(momentum=0.8, dtype=dtype)
        layer.build(shape)
        for variable, value in zip((layer.gamma, layer.beta, layer.moving_mean,
                                    layer.moving_variance), (1.3, -0.4, 0.2, 1.7)):
            variable.assign(np.linspace(value, 2 * value, 5))
        pair.append(layer)
    assert compat.fuse_batchnorm(pair[1])
    return pair


@pytest.mark.parametrize("dtype,shape", [("float32", (6, 3, 2, 5)), ("float32", (12, 5)),
                                         ("mixed_bfloat16", (6, 3, 2, 5))])
def test_fuse_batchnorm(dtype, shape):
    """The fused layer's step runs TensorFlow's fused kernels (the control: Keras's
    own runs none) and computes what Keras's does: output, gradients of the input,
    gamma and beta, the moving statistics after a training call, and the inference
    output. Tolerances: float32, two computation orders of the same moments (1e-4);
    mixed_bfloat16, Keras casts its float32 result to bfloat16 and the kernel writes
    bfloat16 directly, so outputs and input gradients may differ by one bfloat16
    step (2^-8 relative), and the float32 statistics by float32 rounding."""
    x = tf.constant(np.random.default_rng(1).normal(1.5, 2.0, shape), "float32")
    tight = dict(rtol=1e-4, atol=1e-4)
    loose = dict(rtol=2e-2, atol=2e-2) if dtype == "mixed_bfloat16" else tight
    results, graphs = [], []
    for layer in _batchnorm_pair(dtype, shape):
        @tf.function
        def step(layer=layer):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x, training=True)
                loss = tf.reduce_sum(tf.cast(y, "float32") * tf.range(5, dtype="float32"))
            grads = tape.gradient(loss, [x, layer.gamma, layer.beta])
            return y, grads
        graphs.append({op.type for op in step.get_concrete_function().graph.get_operations()})
        y, (dx, dgamma, dbeta) = step()
        results.append(dict(y=(y, loose), dx=(dx, loose), dgamma=(dgamma, loose),
                            dbeta=(dbeta, tight), mean=(layer.moving_mean, tight),
                            variance=(layer.moving_variance, tight),
                            inference=(layer(x, training=False), loose)))
    assert {"FusedBatchNormV3", "FusedBatchNormGradV3"} <= graphs[1]
    assert not {"FusedBatchNormV3", "FusedBatchNormGradV3"} & graphs[0]
    for name, (keras_value, tolerance) in results[0].items():
        fused_value = results[1][name][0]
        np.testing.assert_allclose(np.asarray(tf.cast(fused_value, "float32")),
                                   np.asarray(tf.cast(keras_value, "float32")),
                                   err_msg=name, **tolerance)


def test_fuse_batchnorm_tracks_the_biased_variance_as_keras_does():
    """The kernel's own batch variance is Bessel-corrected, Keras tracks the biased
    one: on this probe the two differ by more than the tolerance above (the control
    showing `test_fuse_batchnorm` would catch a missing correction)."""
    x = np.random.default_rng(1).normal(1.5, 2.0, (4, 5)).astype("float32")
    _, _, corrected = tf.compat.v1.nn.fused_batch_norm(
        x.reshape(4, 1, 1, 5), tf.ones([5]), tf.zeros([5]), is_training=True)
    np.testing.assert_allclose(np.asarray(corrected), x.var(axis=0) * 4 / 3, rtol=1e-5)
    assert not np.allclose(np.asarray(corrected), x.var(axis=0), rtol=1e-4, atol=1e-4)


def test_fuse_batchnorm_leaves_what_the_kernel_cannot_do_to_keras():
    """Not replaced: renorm, synchronized statistics, a subclass's own call; replaced
    but calling Keras's own: a mask, a channel axis other than the last."""
    assert not compat.fuse_batchnorm(keras.layers.BatchNormalization(renorm=True))

    class Own(keras.layers.BatchNormalization):
        def call(self, inputs, training=None, mask=None):
            return super().call(inputs, training=training, mask=mask)

    for layer in (keras.layers.BatchNormalization(synchronized=True), Own()):
        layer.build((None, 5))
        assert not compat.fuse_batchnorm(layer)
    x = tf.constant(np.random.default_rng(2).normal(size=(4, 5, 3)), "float32")
    mask = tf.constant([[True] * 5, [True] * 3 + [False] * 2] * 2)
    for kwargs, call in ((dict(), dict(mask=mask)), (dict(axis=1), dict())):
        keras_layer, fused_layer = [keras.layers.BatchNormalization(**kwargs) for _ in "kf"]
        for layer in (keras_layer, fused_layer):
            layer.build(x.shape)
        assert compat.fuse_batchnorm(fused_layer)
        np.testing.assert_array_equal(np.asarray(fused_layer(x, training=True, **call)),
                                      np.asarray(keras_layer(x, training=True, **call)))


def test_fuse_batchnorm_check(monkeypatch):
    from tfdist.compat import keras_internals
    monkeypatch.setattr(keras_internals, "_CHECKED", set())
    keras_call = keras.layers.BatchNormalization.call
    monkeypatch.setattr(keras.layers.BatchNormalization, "call",
                        lambda self, inputs, training=None, mask=None:
                        keras_call(self, inputs, training=training, mask=mask) * 2.0)
    layer = keras.layers.BatchNormalization()
    layer.build((None, 5))
    with pytest.raises(compat.UpstreamChanged) as raised:
        compat.fuse_batchnorm(layer)
    assert_one_line_change(raised, "BatchNormalization.call")


def test_fuse_batchnorm_check_makes_no_variable_of_the_callers():
    """The check's probe layers are made on a thread of their own: a variable
    creator of the caller's (as engines install) sees none of them; the
    control: the same probe on the caller's thread is seen."""
    from tfdist.compat import keras_internals
    seen = []

    def creator(next_creator, **kwargs):
        seen.append(kwargs.get("name"))
        return next_creator(**kwargs)

    layer = keras.layers.BatchNormalization()
    layer.build((None, 5))
    with tf.variable_creator_scope(creator):
        keras_internals._CHECKED.discard("fused-batchnorm")
        assert compat.fuse_batchnorm(layer)
        assert seen == []
        keras_internals._probe_fused_batchnorm()
    assert seen


# -- DTensor: grappler's memory scheduling --------------------------------------------

def test_dtensor_without_grappler_memory_scheduling():
    """Inside, a function's call carries a ConfigProto with grappler's memory
    optimizer off (the rest of the config as it was); outside, the original
    options again. The failure it prevents is reproduced by
    tests/integration/test_dtensor.py::test_eight_micro_batches_of_a_wide_model_match_one_device."""
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
    from tensorflow.python.eager import context

    def memory_optimization():
        serialized = context.context().function_call_options.config_proto_serialized
        return config_pb2.ConfigProto.FromString(serialized).graph_options.rewrite_options \
            .memory_optimization

    before = context.context().function_call_options
    assert memory_optimization() != rewriter_config_pb2.RewriterConfig.NO_MEM_OPT   # the control
    with compat.dtensor_without_grappler_memory_scheduling():
        assert memory_optimization() == rewriter_config_pb2.RewriterConfig.NO_MEM_OPT
        expected = config_pb2.ConfigProto.FromString(before.config_proto_serialized)
        expected.graph_options.rewrite_options.memory_optimization = (
            rewriter_config_pb2.RewriterConfig.NO_MEM_OPT)
        assert config_pb2.ConfigProto.FromString(
            context.context().function_call_options.config_proto_serialized) == expected
    assert context.context().function_call_options is before


def test_dtensor_without_grappler_memory_scheduling_check(monkeypatch):
    from tensorflow.python.eager import context
    monkeypatch.delattr(context.FunctionCallOptions, "config_proto_serialized")
    with pytest.raises(compat.UpstreamChanged) as raised:
        compat.dtensor_without_grappler_memory_scheduling()
    assert_one_line_change(raised, "config_proto_serialized")
