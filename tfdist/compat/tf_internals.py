"""Private TensorFlow names (core, tf.distribute, checkpoints, graphs,
gradients, resource variables) tfdist reads or replaces; see the package
docstring (`tfdist/compat/__init__.py`). Imports no TensorFlow until called."""

from __future__ import annotations

import contextlib
import sys

from tfdist.compat._guard import _changed, _code_reads, _require, _require_called


def strategy_supports_no_merge_call() -> bool:
    """Whether the current tf.distribute strategy can update without `merge_call`.

    What: `tf.__internal__.distribute.strategy_supports_no_merge_call()`.
    Why: the trainer's conditional update (`_apply_if`) must not call
    `merge_call` inside a `tf.cond` ("`merge_call` called while defining a new
    graph", BUILD_NOTES "Collectives inside tf.cond"); TF has no public way to
    ask a strategy whether it needs one. Verified: tensorflow 2.21.0.
    Check: the function exists and returns a bool.
    """
    import tensorflow as tf
    what = "tf.__internal__.distribute.strategy_supports_no_merge_call"
    function = _require(_require(tf.__internal__, "distribute", what),
                        "strategy_supports_no_merge_call", what)
    answer = function()
    if not isinstance(answer, bool):
        raise _changed(what, f"returned {type(answer).__name__}, not a bool")
    return answer


# -- multi_worker: one process, several MultiWorkerMirroredStrategy ----------------
COLLECTIVE_KEY_STRIDE = 10000   # group keys one strategy may use
_strategies_made = 0


def next_collective_key_base(strategy_class) -> None:
    """Give the next MultiWorkerMirroredStrategy made in this process its own
    collective keys.

    What: the class attribute `_collective_key_base` of
    `tf.distribute.MultiWorkerMirroredStrategy`, which its extended reads
    when a strategy is created (`group_key_start=1 + base`).
    Why: every new strategy starts its collective group keys from the same
    base, and TensorFlow's collective executor caches a collective's shape
    and type by its keys: a second multi_worker run in one process (the
    Python API, or a test that trains several times per worker) fails with a
    shape mismatch or hangs. TensorFlow's own multi-strategy tests set this
    base the same way (strategy_combinations.py). Every worker must make its
    strategies in the same order, as they do when each calls `tfdist.train`
    the same number of times. Verified: tensorflow 2.21.0.
    Check: the attribute exists and the extended still reads it.
    """
    global _strategies_made
    what = "tf.distribute.MultiWorkerMirroredStrategy._collective_key_base"
    _require(strategy_class, "_collective_key_base", what)
    extended = _require(sys.modules[strategy_class.__module__],
                        "CollectiveAllReduceExtended", what)
    _require_called(extended, "__init__", "_collective_key_base", what)
    strategy_class._collective_key_base = COLLECTIVE_KEY_STRIDE * _strategies_made
    _strategies_made += 1


def coordination_key_value():
    """`(put, get, delete)` on TensorFlow's coordination-service key-value store.

    What: `set_config_key_value(key, value)` and
    `get_config_key_value(key, timeout_in_ms)` and `delete_config_key_value(key)`
    of the eager context
    (`tensorflow.python.eager.context.context()`), which DTensor's own
    multi-client set-up uses; `get` blocks until the key is set.
    Why: in a DTensor mesh across processes the process of client 0 hosts
    the coordination service. A peer still in its last collective (the
    gather of the trained weights) when client 0 exits fails with
    "Failed to send RPC to coordination service" (seen under Slurm, 1 run in
    4 on a loaded machine), so every peer reports its end in the store and
    client 0 leaves last. TensorFlow has no public barrier or store for
    this. Verified: tensorflow 2.21.0.
    Check: both methods exist on the context.
    """
    from tensorflow.python.eager import context

    what = "tensorflow.python.eager.context.Context.{}"
    current = context.context()
    put = _require(current, "set_config_key_value", what.format("set_config_key_value"))
    get = _require(current, "get_config_key_value", what.format("get_config_key_value"))
    delete = _require(current, "delete_config_key_value",
                      what.format("delete_config_key_value"))
    return put, get, delete


# -- parameter servers (BUILD_NOTES "ParameterServerStrategy with Keras 3") ----

def sharded_variable_type() -> type:
    """`tf.__internal__.distribute.ShardedVariable`: what a partitioned variable is.

    Why: ParameterServerStrategy with a `variable_partitioner` creates them and
    Keras 3 breaks on them in four places; TF exports the class only under
    `tf.__internal__`. Verified: tensorflow 2.21.0. Check: it exists and is a class.
    """
    import tensorflow as tf
    what = "tf.__internal__.distribute.ShardedVariable"
    cls = _require(_require(tf.__internal__, "distribute", what), "ShardedVariable", what)
    if not isinstance(cls, type):
        raise _changed(what, "is not a class")
    return cls


def is_sharded(value) -> bool:
    """Whether `value` is a ShardedVariable (a partitioned tf.Variable)."""
    return isinstance(value, sharded_variable_type())


# -- checkpoints, graphs -------------------------------------------------------

def update_checkpoint_state(directory: str, path: str, *, all_paths) -> None:
    """Write `directory`'s `checkpoint` index: latest `path`, kept `all_paths`, relative.

    What: `tensorflow.python.checkpoint.checkpoint_management.
    update_checkpoint_state_internal` (what `tf.train.CheckpointManager` calls).
    Why: the public `tf.compat.v1.train.update_checkpoint_state` prints a
    three-line deprecation warning into every run's log, and tfdist writes
    the index itself, last, after verifying the checkpoint (BUILD_NOTES
    "Faults"). Paths are relative: the directory may move. Verified:
    tensorflow 2.21.0. Check: the function imports and takes `save_relative_paths`.
    """
    import inspect
    what = ("tensorflow.python.checkpoint.checkpoint_management."
            "update_checkpoint_state_internal")
    try:
        from tensorflow.python.checkpoint import checkpoint_management
    except ImportError:
        raise _changed(what) from None
    update = _require(checkpoint_management, "update_checkpoint_state_internal", what)
    if "save_relative_paths" not in inspect.signature(update).parameters:
        raise _changed(what, "takes no save_relative_paths")
    update(directory, path, all_model_checkpoint_paths=list(all_paths),
           save_relative_paths=True)


def serialized_object_graph(checkpoint) -> bytes:
    """The object graph `checkpoint.write()` would write now (its
    `_CHECKPOINTABLE_OBJECT_GRAPH` entry), without writing anything.

    What: `tensorflow.python.checkpoint.save_util.serialize_graph_view` over
    `graph_view.ObjectGraphView(checkpoint)`, as `tf.train.Checkpoint`'s own
    saver calls it. Why: a checkpoint written in parts (`tfdist/
    checkpoint_parts.py`) needs each variable's key before anything is
    written; the public way, a scratch `write()`, would write each process's
    stage to disk (to RAM where /tmp is memory) at every start. The values
    it serializes are read, not copied. Verified: tensorflow 2.21.0. Check:
    both names import and the last of what it returns serializes.
    """
    what = "tensorflow.python.checkpoint.save_util.serialize_graph_view"
    try:
        from tensorflow.python.checkpoint import graph_view, save_util
    except ImportError:
        raise _changed(what) from None
    serialize = _require(save_util, "serialize_graph_view", what)
    view = _require(graph_view, "ObjectGraphView", what)(checkpoint)
    proto = serialize(view)[-1]
    if not hasattr(proto, "SerializeToString"):
        raise _changed(what, f"returned {type(proto).__name__} last, not the object graph")
    return proto.SerializeToString()


def checkpoint_object_graph(serialized: bytes) -> list:
    """The nodes of a checkpoint's object graph (its `_CHECKPOINTABLE_OBJECT_GRAPH`
    entry), in order: ([(child node id, local name)], [(attribute name,
    checkpoint key)]) each; node 0 is the root `tf.train.Checkpoint`.

    What: `tensorflow.core.protobuf.trackable_object_graph_pb2.
    TrackableObjectGraph`, the proto TensorFlow writes into every checkpoint
    (not exported under `tf.*`). Why: a checkpoint whose processes each write
    and read their own part (`tfdist/checkpoint_parts.py`) must know each
    variable's key in the checkpoint, which TensorFlow derives from the
    object graph; reading the graph it wrote is exact where re-deriving its
    naming rules would not be. Verified: tensorflow 2.21.0. Check: the module
    imports and its nodes carry `children` (node_id, local_name) and
    `attributes` (name, checkpoint_key).
    """
    what = "tensorflow.core.protobuf.trackable_object_graph_pb2.TrackableObjectGraph"
    try:
        from tensorflow.core.protobuf import trackable_object_graph_pb2
    except ImportError:
        raise _changed(what) from None
    graph = _require(trackable_object_graph_pb2, "TrackableObjectGraph", what)()
    graph.ParseFromString(serialized)
    node_fields = graph.DESCRIPTOR.fields_by_name["nodes"].message_type.fields_by_name
    if not {"children", "attributes"} <= set(node_fields):
        raise _changed(what, "has no children or attributes per node")
    return [([(child.node_id, child.local_name) for child in node.children],
             [(attribute.name, attribute.checkpoint_key) for attribute in node.attributes])
            for node in graph.nodes]


def graph_function(graph, name: str):
    """The traced function `name` of `graph`'s library (with its FuncGraph), or None.

    What: the private `tf.Graph._get_function`. Why: counting a model's FLOPs
    (`tfdist/observe/flops.py`) walks into the functions a graph calls, with
    their static shapes; rebuilding them from `as_graph_def().library` would
    need private imports too. Verified: tensorflow 2.21.0. Check: the method
    exists.
    """
    return _require(graph, "_get_function", "tensorflow Graph._get_function")(name)


# -- DTensor: gradients of ops it cannot lay out ------------------------------------

@contextlib.contextmanager
def gradient_overridden(op_type: str, gradient):
    """Within: TensorFlow takes `gradient(op, grad)` as op type `op_type`'s gradient.

    What: the entry of `op_type` in TensorFlow's private gradient registry
    (`tensorflow.python.framework.ops._gradient_registry`), which both the
    tape (`backprop._gradient_function`) and `tf.gradients` look up when they
    differentiate an op; restored on exit. Why: DTensor (2.21) has no layout
    rule for some gradient ops (a depthwise convolution's two); the DTensor
    engine takes those gradients with ops it can shard while it traces a step
    (`tfdist/strategies/dtensor/ops.py`, BUILD_NOTES: depthwise convolutions
    under DTensor). A public `tf.RegisterGradient` cannot replace an entry,
    and `gradient_override_map` is not consulted by the tape. Verified:
    tensorflow 2.21.0. Check: the registry, its entry dict and the tape's
    lookup through it exist (`tests/unit/test_compat.py`; the depthwise models of
    `tests/integration/test_user_models.py` fail to compile without the patch).
    """
    from tensorflow.python.eager import backprop
    from tensorflow.python.framework import ops
    registry = getattr(ops, "_gradient_registry", None)
    entries = getattr(registry, "_registry", None)
    if not isinstance(entries, dict) or op_type not in entries or \
            not _code_reads(backprop._gradient_function, "_gradient_registry"):
        raise _changed(f"tensorflow's gradient registry entry for {op_type!r}")
    from tensorflow.python.framework import registry as registry_module
    tag = getattr(registry_module, "_TYPE_TAG", None)
    entry = entries[op_type]
    if tag not in entry or not callable(entry[tag]):
        raise _changed(f"tensorflow's gradient registry entry for {op_type!r}", "has no function")
    original = entry[tag]
    entry[tag] = gradient
    try:
        yield
    finally:
        entry[tag] = original


@contextlib.contextmanager
def custom_gradients_on_tape():
    """Within: a `tf.custom_gradient` traced into a graph records its gradient
    on the tape only, as it does eagerly, instead of wrapping its results,
    inputs and variables in one `IdentityN` op with a gradient override.

    What: `tensorflow.python.ops.custom_gradient._graph_mode_decorator`, which
    `tf.custom_gradient`'s wrapper looks up at each call, replaced by the same
    module's `_eager_mode_decorator` (tape recording plus an `Identity` per
    result; it runs on graph tensors as well). Why: DTensor (TF 2.21) fails to
    lower that `IdentityN` when an input is a constant or an integer ("operand
    #0 does not dominate this use", dtensor_graph_to_mlir_pass.cc): SiLU's
    `beta`, a user's own `tf.custom_gradient(x, n)`. tfdist differentiates
    the step with a `tf.GradientTape` inside the traced function, which sees
    the recorded gradient; only `tf.gradients` of the traced graph would not,
    and tfdist never calls it there. Verified: tensorflow 2.21.0. Check: both
    functions exist and the wrapper still reads the name it replaces
    (`tests/unit/test_compat.py`; `tests/integration/test_user_models.py` fails to compile
    without it).
    """
    module, _, eager_mode = _custom_gradient_modes()
    with _custom_gradient_mode(module, eager_mode):
        yield


def graph_custom_gradient(f, x):
    """`tf.custom_gradient(f)(x)` as TensorFlow traces it into a graph (one
    `IdentityN` with a gradient override), also within
    `custom_gradients_on_tape`, for tfdist's ZeRO-3 per-layer gather: its
    backward pass recomputes the layer, and recorded on the tape only, its
    orderings (`_zero_after`) formed a cycle ("601 nodes in a cycle"). Its
    input is a float tensor, which DTensor lowers. Custom gradients inside
    `f` follow the current mode."""
    _, graph_mode, _ = _custom_gradient_modes()
    return graph_mode(f, (x,), {})


_CUSTOM_GRADIENT_MODES = []   # (module, TensorFlow's graph-mode decorator, eager-mode)


def _custom_gradient_modes():
    if not _CUSTOM_GRADIENT_MODES:
        from tensorflow.python.ops import custom_gradient as module
        graph_mode = _require(module, "_graph_mode_decorator",
                              "tensorflow custom_gradient._graph_mode_decorator")
        eager_mode = _require(module, "_eager_mode_decorator",
                              "tensorflow custom_gradient._eager_mode_decorator")
        if not _code_reads(module.custom_gradient, "_graph_mode_decorator"):
            raise _changed("tensorflow custom_gradient._graph_mode_decorator",
                           "is no longer called by tf.custom_gradient")
        _CUSTOM_GRADIENT_MODES.append((module, graph_mode, eager_mode))
    return _CUSTOM_GRADIENT_MODES[0]


@contextlib.contextmanager
def _custom_gradient_mode(module, decorator):
    before, module._graph_mode_decorator = module._graph_mode_decorator, decorator
    try:
        yield
    finally:
        module._graph_mode_decorator = before


def set_storage(variable, value) -> None:
    """Make the storage of resource variable `variable` (a `tf.Variable`; for a
    Keras or distributed variable, each of its components) hold `value`, of
    any shape: an empty tensor frees it, a whole one gives it back. Works in
    a tf.function too.

    What: a resource variable's static shape lives in its Python object and
    handle; the tensor its resource holds may have another shape when it is
    written with `AssignVariableOp(validate_shape=False)` (a public raw op;
    `tf.Variable.assign` checks the stored tensor's shape at run time, so it
    cannot do this). Reading such a variable gives the stored tensor, which
    any op that needs the static shape refuses. Why: across processes a
    pipeline worker holds only its stage's weights and optimizer slots; the
    model is built whole (a split needs the built graph) and checkpoints
    need every variable object, so the others' objects stay but their
    storage is freed, and refilled when the whole model is wanted
    (`tfdist.strategies.pipeline`). Verified on tensorflow 2.21.0: the
    freed memory is reused by later allocations (TensorFlow's CPU allocator
    keeps it in the process). Check: in eager mode, the stored shape after
    the write is `value`'s, else `UpstreamChanged`. In a tf.function, returns
    the assign op (to chain on).
    """
    import tensorflow as tf
    handle = _require(variable, "handle", "tf.Variable.handle (a resource variable)")
    op = tf.raw_ops.AssignVariableOp(resource=handle, value=tf.cast(value, variable.dtype),
                                     validate_shape=False)
    if not tf.executing_eagerly():
        return op
    stored = tf.raw_ops.ReadVariableOp(resource=handle, dtype=variable.dtype)
    if stored.shape != tf.convert_to_tensor(value).shape:
        raise _changed("AssignVariableOp(validate_shape=False) on a resource variable",
                       f"stored shape {stored.shape}, not the value's")
    return None


LOCAL, EMPTY = "local", "empty"   # `created_without_broadcast`'s choices


@contextlib.contextmanager
def created_without_broadcast(strategy_scope, decide):
    """Enter `strategy_scope`, a MultiWorkerMirroredStrategy's, so that each
    variable made while `decide()` returns LOCAL or (EMPTY, shape) skips the
    strategy's broadcast of the chief's initial value: LOCAL, this process's
    own initial value; EMPTY, no storage (an empty tensor, as `set_storage`
    leaves a variable it frees; the static shape is `shape`, so traces of
    the model still see it). While `decide()` returns None, variables are
    made as usual. Every process must make the same choices for the same
    variables, in the same order (each skipped broadcast is one the strategy
    no longer counts).

    What: the strategy's variable creator hands the next creator an
    `initial_value_fn` that computes the value and then broadcasts it from
    the chief; a creator below the strategy's (entered before its scope)
    replaces it with the value a creator above it (entered after) received,
    or makes a resource variable with no value (TensorFlow's private
    `resource_variable_ops.UninitializedVariable`, which tf.saved_model's
    loader uses) and gives it empty storage. Why: a process that runs one
    pipeline stage must not hold, or receive, the other stages' weights.
    Verified: tensorflow 2.21.0. Check: the value the creator below receives
    is the strategy's `initial_value_fn`, and `UninitializedVariable` exists,
    else `UpstreamChanged`."""
    import tensorflow as tf
    given = []   # the initial value each variable being made was given

    def below(next_creator, **kwargs):
        choice = decide()
        if choice is None:
            return next_creator(**kwargs)
        if getattr(kwargs.get("initial_value"), "__name__", None) != "initial_value_fn" or \
                not given:
            raise _changed("MultiWorkerMirroredStrategy's variable creator",
                           "no longer hands the next creator its broadcasting initial_value_fn")
        if choice == LOCAL:
            kwargs["initial_value"] = given[-1]
            return next_creator(**kwargs)
        return _empty_variable(choice[1], kwargs)

    def above(next_creator, **kwargs):
        if decide() is None:
            return next_creator(**kwargs)
        given.append(kwargs.get("initial_value"))
        try:
            return next_creator(**kwargs)
        finally:
            given.pop()

    with tf.variable_creator_scope(below), strategy_scope, tf.variable_creator_scope(above):
        yield


def _empty_variable(shape, kwargs):
    """A resource variable of static shape `shape` holding an empty tensor,
    never any other (see `created_without_broadcast`)."""
    import tensorflow as tf
    from tensorflow.python.ops import resource_variable_ops
    uninitialized = _require(resource_variable_ops, "UninitializedVariable",
                             "tensorflow resource_variable_ops.UninitializedVariable")
    dtype = tf.as_dtype(kwargs.get("dtype") or tf.float32)
    variable = uninitialized(
        shape=tf.TensorShape(shape), dtype=dtype, name=kwargs.get("name"),
        trainable=kwargs.get("trainable"), aggregation=kwargs.get("aggregation"),
        synchronization=kwargs.get("synchronization"))
    set_storage(variable, tf.zeros([0], dtype))
    return variable
