"""Every private Keras, TensorFlow and Horovod name tfdist reads or replaces.

Keras 3 and TensorFlow 2.21 leave a few holes that tfdist can only fill by
reading or replacing an upstream name that is not public (BUILD_NOTES.md,
"Upstream patches"). Each such use lives here, in one small function whose
docstring says what it touches, why (the upstream bug and where BUILD_NOTES
reproduces it) and the versions it was verified on. Each checks, before it
relies on the name, that the name is there and is still used the way the
workaround assumes (e.g. that the Keras method tfdist replaces is still the one
Keras calls), and raises `UpstreamChanged` -- one line naming the attribute and
the versions -- when it is not: a patch never becomes a silent no-op.
`tests/test_compat.py` has a test per entry that fails if the patch stops
taking effect.

Importing this module is cheap (no TensorFlow, no Keras): `tfdist.app` imports
modules that import it before flags are parsed. TensorFlow and Keras are
imported inside the functions, which only run once they are loaded anyway.

Outside this module, tfdist code reads no `tensorflow.python`, `keras.src` or
`tf.__internal__` name and no underscore attribute of an upstream object.
"""

from __future__ import annotations

import contextlib
import sys
import types

VERIFIED = "tensorflow 2.21.0, keras 3.15.1"


class UpstreamChanged(RuntimeError):
    """A private upstream name tfdist relies on is missing or behaves differently."""


def _installed() -> str:
    found = [f"{name} {getattr(sys.modules.get(name), '__version__', '?')}"
             for name in ("tensorflow", "keras") if name in sys.modules]
    return ", ".join(found) or "unknown"


def _changed(what: str, how: str = "is missing", verified: str = VERIFIED) -> UpstreamChanged:
    return UpstreamChanged(f"{what} {how}: tfdist's workaround was verified on {verified} "
                           f"(installed: {_installed()}); see tfdist/compat.py")


def _require(owner, name: str, what: str):
    """`owner.name`, or `UpstreamChanged` naming `what`."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise _changed(what) from None


def _code_reads(function, name: str) -> bool:
    """Whether `function`'s code (or a function nested in it) reads attribute `name`."""
    code = getattr(function, "__code__", None)
    pending = [code] if code is not None else []
    while pending:
        code = pending.pop()
        if name in code.co_names:
            return True
        pending.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return False


def _require_called(cls, method: str, name: str, what: str) -> None:
    """`UpstreamChanged` unless `cls.method` still reads `name` (else replacing
    or setting `name` would change nothing)."""
    function = getattr(cls, method, None)
    if function is None or not _code_reads(function, name):
        raise _changed(what, f"is no longer used by {cls.__name__}.{method}")


# -- optimizers: the reduction tfdist does itself ---------------------------------

def disable_optimizer_all_reduce(optimizer):
    """Stop `optimizer.apply` from summing gradients across replicas itself.

    What: sets, on this optimizer instance only, Keras's private
    `Optimizer._all_reduce_sum_gradients` (TF backend) to the identity.
    Why: Keras 3's TF optimizer all-reduces gradients inside `apply` whenever
    it runs in a tf.distribute replica context. tfdist reduces once per update
    through the strategy adapter (one path for accumulation, compression and
    Horovod); a second sum would multiply the gradients by the number of
    replicas (BUILD_NOTES "Upstream facts": `_all_reduce_sum_gradients`).
    Verified: tensorflow 2.21.0, keras 3.15.1. Check: the method exists and
    `_backend_update_step` still calls it.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    what = "keras Optimizer._all_reduce_sum_gradients"
    _require(inner, "_all_reduce_sum_gradients", what)
    _require_called(type(inner), "_backend_update_step", "_all_reduce_sum_gradients", what)
    inner._all_reduce_sum_gradients = lambda grads_and_vars: grads_and_vars
    return optimizer


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
    """`(put, get)` on TensorFlow's coordination-service key-value store.

    What: `set_config_key_value(key, value)` and
    `get_config_key_value(key, timeout_in_ms)` of the eager context
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
    return put, get


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


def optimizer_updates_sharded_variables(optimizer) -> None:
    """Let a Keras 3 optimizer update ShardedVariables (BUILD_NOTES PS item 3).

    What: replaces, on this optimizer instance only, Keras's private
    `_distributed_tf_update_step` and `_apply_weight_decay` (and reads
    `_use_weight_decay`). Why: Keras's TF update goes through
    `distribution.extended.update(var, ...)`, which cannot colocate with a
    ShardedVariable ("ShardedVariable doesn't support being used as a
    reference", item 3 of the BUILD_NOTES script); AdamW's decay too. Those
    variables' update ops run where the step runs (their assignments write
    each shard where it lives); other variables keep Keras's path.
    Verified: tensorflow 2.21.0, keras 3.15.1. Check: the three methods
    exist and `_backend_update_step` / `_backend_apply_gradients` still call
    the two replaced.
    """
    import tensorflow as tf
    sharded = sharded_variable_type()
    base = "keras Optimizer."
    update_step = _require(optimizer, "_distributed_tf_update_step",
                           base + "_distributed_tf_update_step")
    apply_weight_decay = _require(optimizer, "_apply_weight_decay", base + "_apply_weight_decay")
    use_weight_decay = _require(optimizer, "_use_weight_decay", base + "_use_weight_decay")
    _require_called(type(optimizer), "_backend_update_step", "_distributed_tf_update_step",
                    base + "_distributed_tf_update_step")
    _require_called(type(optimizer), "_backend_apply_gradients", "_apply_weight_decay",
                    base + "_apply_weight_decay")

    def value_of(variable):
        return getattr(variable, "value", variable) if hasattr(variable, "path") else variable

    def distributed_update(distribution, grads_and_vars, learning_rate):
        plain = []
        for grad, variable in grads_and_vars:
            if isinstance(variable, sharded):
                optimizer.update_step(grad, variable, learning_rate)
            else:
                plain.append((grad, variable))
        update_step(distribution, plain, learning_rate)

    def weight_decay(variables):
        if optimizer.weight_decay is None:
            return
        for variable in variables:
            if isinstance(value_of(variable), sharded) and use_weight_decay(variable):
                lr = tf.cast(optimizer.learning_rate, variable.dtype)
                decay = tf.cast(optimizer.weight_decay, variable.dtype)
                value_of(variable).assign_sub(tf.convert_to_tensor(variable) * decay * lr)
        apply_weight_decay([v for v in variables if not isinstance(value_of(v), sharded)])

    optimizer._distributed_tf_update_step = distributed_update
    optimizer._apply_weight_decay = weight_decay


_CHECKED = set()   # behaviour checks that passed in this process


def _check_keras_delegates_checkpointing() -> None:
    """Keras's TF `Variable._serialize_to_tensors` / `_restore_from_tensors`
    must hand over to its value's methods (probed on a stand-in value)."""
    if "keras-delegates-checkpointing" in _CHECKED:
        return
    from keras.src.backend.tensorflow import core
    what = "keras.src.backend.tensorflow.core.Variable._serialize_to_tensors"
    serialize = _require(core.Variable, "_serialize_to_tensors", what)
    restore = _require(core.Variable, "_restore_from_tensors",
                       "keras.src.backend.tensorflow.core.Variable._restore_from_tensors")
    saved, restored = {"VARIABLE_VALUE": "saved"}, []

    class Value:
        def _serialize_to_tensors(self):
            return saved

        def _restore_from_tensors(self, tensors):
            restored.append(tensors)
            return "restored"

    probe = types.SimpleNamespace(value=Value())
    try:
        ok = serialize(probe) is saved and restore(probe, saved) == "restored" and \
            restored == [saved]
    except Exception:  # noqa: BLE001  (any other behaviour is a change)
        ok = False
    if not ok:
        raise _changed(what, "no longer delegates to its value's _serialize_to_tensors/"
                             "_restore_from_tensors")
    _CHECKED.add("keras-delegates-checkpointing")


def checkpoint_sharded_whole(variable):
    """Make one ShardedVariable checkpoint as one whole tensor (BUILD_NOTES PS item 4).

    What: gives this ShardedVariable *instance* `_serialize_to_tensors` and
    `_restore_from_tensors` (TF's checkpointing honours instance-level ones).
    Why: a Keras 3 variable's `_serialize_to_tensors` asks its value to
    serialize itself and, when it cannot (a ShardedVariable cannot), falls
    back to `{"VARIABLE_VALUE": self.value}`, for which the saver asks the
    ShardedVariable for a `.device` it does not have ("AttributeError
    'ShardedVariable' object has no attribute 'device'", item 4 of the
    BUILD_NOTES script). Serialized whole (read from its shards) and restored
    by assignment (which splits it again), the checkpoint has the same entry a
    plain variable has, so it restores under every engine and shard count.
    Scope: only the ShardedVariables the parameter_server engine creates (its
    variable creator calls this); no class is changed, so nothing else in the
    process checkpoints differently, and a Keras variable keeps the behaviour
    as long as it lives (also after the run). Verified: tensorflow 2.21.0,
    keras 3.15.1. Check: Keras's variable still delegates to its value.
    """
    import tensorflow as tf
    _check_keras_delegates_checkpointing()
    if not is_sharded(variable):
        raise TypeError(f"checkpoint_sharded_whole needs a ShardedVariable, got "
                        f"{type(variable).__name__}")

    def serialize():
        return {"VARIABLE_VALUE": tf.convert_to_tensor(variable)}

    def restore(restored_tensors):
        return variable.assign(restored_tensors["VARIABLE_VALUE"])

    variable._serialize_to_tensors = serialize
    variable._restore_from_tensors = restore
    return variable


# -- DTensor (BUILD_NOTES "DTensor with Keras 3") ------------------------------

def dtensor_dataset_one_client_per_replica(dataset):
    """Make a single-process `DTensorDataset` feed each replica its own rows.

    What: sets the private `DTensorDataset._num_clients_per_replica = 1` and
    `_partition_offset = 0` on this instance. Why: DTensor 2.21 counts a
    replica's devices from every device of the mesh's type in the process, not
    from the mesh; with more devices than the mesh uses it takes each replica
    to span 2 clients, repeats every batch and feeds every local replica the
    same examples (BUILD_NOTES "DTensorDataset counts a replica's devices",
    with the 4-CPU / 2-device-mesh reproduction). In one process no replica
    spans clients. Verified: tensorflow 2.21.0. Check: both attributes exist
    as ints and `__iter__` / `_partition` still read them.
    """
    readers = {"_num_clients_per_replica": "__iter__", "_partition_offset": "_partition"}
    for name in readers:
        what = f"tensorflow DTensorDataset.{name}"
        if not isinstance(_require(dataset, name, what), int):
            raise _changed(what, "is not an int")
    for name, reader in readers.items():
        _require_called(type(dataset), reader, name, f"tensorflow DTensorDataset.{name}")
    dataset._num_clients_per_replica = 1
    dataset._partition_offset = 0
    return dataset


def keras_variable_of(initial_value):
    """The Keras `Variable` whose deferred initial value `initial_value` is, or None.

    What: reads the closure of the callable Keras hands `tf.Variable` (Keras's
    TF `Variable._initialize_with_initializer` passes `lambda:
    initializer(self._shape, ...)`, closing over the Keras variable). Why:
    Keras creates the `tf.Variable` after its name scopes have closed, so a
    variable creator cannot learn a nested layer's path from
    `tf.get_current_name_scope()` (BUILD_NOTES "DTensor": `block0/kernel` for
    `block0/attn/query/kernel`); the DTensor engine needs the path for its
    layout rules. Verified: keras 3.15.1. Check: `check_keras_variable_of`.
    """
    import keras
    for cell in getattr(initial_value, "__closure__", None) or ():
        try:
            owner = cell.cell_contents
        except ValueError:   # an empty cell
            continue
        if isinstance(owner, keras.Variable):
            return owner
    return None


def keras_initializer_of(initial_value):
    """The Keras initializer object a Keras variable's deferred initial value
    calls, or None (a tensor or a plain callable given as the initializer).

    What: the closure of the same callable as `keras_variable_of` (`lambda:
    initializer(self._shape, dtype=self._dtype)`). Why: the DTensor engine
    draws a sharded variable's value shard by shard only for initializers it
    knows to be element-wise (`tfdist/strategies/dtensor_init.py`). Verified:
    keras 3.15.1. Check: `tests/test_dtensor_init.py` (a sharded variable of
    each kind matches one device's)."""
    import keras
    for cell in getattr(initial_value, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, keras.initializers.Initializer):
            return value
    return None


def check_keras_variable_of() -> None:
    """`UpstreamChanged` unless a variable creator still finds the Keras
    variable being created through `keras_variable_of` (probed once on a
    1-element variable outside any engine)."""
    if "keras-variable-of" in _CHECKED:
        return
    import keras
    import tensorflow as tf
    found = []

    def creator(next_creator, **kwargs):
        found.append(keras_variable_of(kwargs.get("initial_value")))
        return next_creator(**kwargs)

    with tf.init_scope(), tf.variable_creator_scope(creator):
        variable = keras.Variable(initializer="zeros", shape=(1,), name="tfdist_probe")
    if len(found) != 1 or found[0] is not variable:
        raise _changed("keras Variable._initialize_with_initializer's initial value",
                       "no longer closes over the keras Variable")
    _CHECKED.add("keras-variable-of")


def variable_index(optimizer, variable) -> int:
    """The optimizer's index of `variable` (its slots' position).

    What: Keras's private `Optimizer._get_variable_index`. Why: tfdist's DTensor
    update steps (`dtensor_updates`) replace Keras's `update_step`, which must
    never read a slot back after assigning it under DTensor (BUILD_NOTES
    "DTensor": loss 1.14 -> 132, weights not moving), and must find the slots
    exactly as Keras does. Verified: keras 3.15.1. Check: the method exists.
    """
    return _require(optimizer, "_get_variable_index",
                    "keras Optimizer._get_variable_index")(variable)


def adam_slots(optimizer) -> tuple:
    """(first moments, second moments) of a Keras Adam/AdamW, by variable index.

    What: Keras's private `Adam._momentums` and `Adam._velocities` (SGD's
    `momentums` is public). Why and verified: as `variable_index`. Check: both
    exist as lists and `Adam.update_step` still reads them.
    """
    names = ("_momentums", "_velocities")
    found = tuple(_require(optimizer, name, f"keras Adam.{name}") for name in names)
    for name, slots in zip(names, found):
        if not isinstance(slots, list):
            raise _changed(f"keras Adam.{name}", "is not a list")
        _require_called(type(optimizer), "update_step", name, f"keras Adam.{name}")
    return found


# -- losses and metrics (BUILD_NOTES "Users' losses, metrics, data and export") --

def keras_mask(tensor):
    """The Keras mask attached to `tensor` (e.g. by an `Embedding(mask_zero=True)`), or None.

    What: `keras.src.backend.common.masking.get_keras_mask` (Keras 3 has no
    public getter; the mask is the private `_keras_mask` attribute, or an entry
    in Keras's side table for tensors that take no attributes). Why: Keras
    averages a masked loss over the valid positions only; tfdist must too.
    Verified: keras 3.15.1. Check: the function imports.
    """
    what = "keras.src.backend.common.masking.get_keras_mask"
    try:
        from keras.src.backend.common.masking import get_keras_mask
    except ImportError:
        raise _changed(what) from None
    return get_keras_mask(tensor)


def align_ranks(y_true, y_pred):
    """`y_true`, `y_pred` brought to the same rank, as `keras.losses.Loss` does.

    What: `keras.src.losses.loss.squeeze_or_expand_to_same_rank`. Why: a Keras
    loss *function* (e.g. "mse") given (B,) targets and (B, 1) outputs would
    broadcast to (B, B) without it; a `Loss` object does it inside `__call__`,
    which tfdist cannot use (it needs unreduced values). Verified: keras 3.15.1.
    Check: the function imports.
    """
    what = "keras.src.losses.loss.squeeze_or_expand_to_same_rank"
    try:
        from keras.src.losses.loss import squeeze_or_expand_to_same_rank
    except ImportError:
        raise _changed(what) from None
    return squeeze_or_expand_to_same_rank(y_true, y_pred)


def keras_metric(identifier, y_true, y_pred):
    """The metric object `fit` would make of `identifier` for these targets/predictions.

    What: `keras.src.trainers.compile_utils.get_metric`. Why: it resolves
    "accuracy" to binary / sparse / categorical accuracy by the shapes, as
    `fit` does; Keras has no public equivalent. Verified: keras 3.15.1.
    Check: the function imports.
    """
    what = "keras.src.trainers.compile_utils.get_metric"
    try:
        from keras.src.trainers.compile_utils import get_metric
    except ImportError:
        raise _changed(what) from None
    return get_metric(identifier, y_true, y_pred)


def compiled_config(model):
    """What `model.compile(...)` was given (a dict with loss, metrics, ...), or None.

    What: the private `Model._compile_config.config`. Why: Keras 3 has no
    public getter of the un-serialized loss and metric objects a user compiled
    with, and tfdist trains a compiled model with them. Verified: keras 3.15.1.
    Check: a compiled model (public `model.compiled`) has it, with a dict.
    """
    compiled = getattr(model, "compiled", False)
    holder = getattr(model, "_compile_config", None)
    if holder is None:
        if compiled:
            raise _changed("keras Model._compile_config", "is missing on a compiled model")
        return None
    config = getattr(holder, "config", None)
    if not isinstance(config, dict):
        raise _changed("keras Model._compile_config.config", "is not a dict")
    return config


def build_metric(metric, y_shape, pred_shape) -> None:
    """Create the state variables of a metric that sizes them from the data.

    What: calls the private `_build` of a metric whose private `_built` is
    False (F1Score, FBetaScore, R2Score take (y_true_shape, y_pred_shape);
    AUC with `multi_label` takes the predictions' shape). Why: tfdist uses
    metrics statelessly and needs their variables before the first batch;
    Keras builds these only inside `update_state`, which tfdist never calls.
    Verified: keras 3.15.1. Check: a metric with `_built == False` has a
    `_build` that leaves `_built` True.
    """
    import inspect
    if getattr(metric, "_built", True):
        return
    name = type(metric).__name__
    build = _require(metric, "_build", f"keras {name}._build")
    if len(inspect.signature(build).parameters) == 1:
        build(pred_shape)
    else:
        build(y_shape, pred_shape)
    if not metric._built:
        raise _changed(f"keras {name}._build", "did not set _built")


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
    (`tfdist/strategies/dtensor_ops.py`, BUILD_NOTES: depthwise convolutions
    under DTensor). A public `tf.RegisterGradient` cannot replace an entry,
    and `gradient_override_map` is not consulted by the tape. Verified:
    tensorflow 2.21.0. Check: the registry, its entry dict and the tape's
    lookup through it exist (`tests/test_compat.py`; the depthwise models of
    `tests/test_user_models.py` fail to compile without the patch).
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
    (`tests/test_compat.py`; `tests/test_user_models.py` fails to compile
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


# -- DTensor: initial values drawn shard by shard --------------------------------------

KERAS_RANDOM_DRAWS = ("normal", "uniform", "truncated_normal")


@contextlib.contextmanager
def keras_random_draws(replacements: dict):
    """Within: Keras's TensorFlow backend draws `keras.random.normal`,
    `uniform` and `truncated_normal` with `replacements[name](original, shape,
    ..., seed=...)` (the keyword arguments Keras passes on).

    What: the functions of `keras.src.backend.tensorflow.random`, which
    `keras.random.*` (and so every Keras random initializer) call through
    `backend.random.<name>` at call time; restored on exit. Why: under a
    sharded layout the DTensor engine makes each device's shard of a
    variable's initial value equal to that slice of one device's draw, by
    drawing the slice alone (`tfdist/strategies/dtensor_init.py`); Keras has
    no public hook between an initializer and its random op. Verified: keras
    3.15.1. Check: each function exists and `keras.random.<name>` still calls
    it through `backend.random` (`tests/test_compat.py`; ZeRO-3's initial
    weights equal one device's in `tests/test_dtensor_init.py`).
    """
    from keras.src.backend.tensorflow import random as backend_random
    from keras.src.random import random as keras_random
    originals = {}
    for name in replacements:
        if name not in KERAS_RANDOM_DRAWS or not callable(getattr(backend_random, name, None)) \
                or not _code_reads(getattr(keras_random, name, None), "random"):
            raise _changed(f"keras.src.backend.tensorflow.random.{name}",
                           "is missing or no longer what keras.random calls")
        originals[name] = getattr(backend_random, name)
        if not (_code_reads(originals[name], "draw_seed")
                and _code_reads(originals[name], "_cast_seed")):
            raise _changed(f"keras.src.backend.tensorflow.random.{name}",
                           "no longer seeds with _cast_seed(draw_seed(seed))")
    for name, replacement in replacements.items():
        original = originals[name]
        setattr(backend_random, name,
                lambda *args, _r=replacement, _o=original, **kwargs: _r(_o, *args, **kwargs))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(backend_random, name, original)


def keras_seed_tensor(seed):
    """The int32 [2] seed tensor Keras's TensorFlow backend passes to
    `tf.random.stateless_*` for `seed` (an int, a `SeedGenerator` (advanced
    once) or a tensor): `_cast_seed(draw_seed(seed))` of
    `keras.src.backend.tensorflow.random`. Verified: keras 3.15.1. Check: both
    exist (and `keras_random_draws` checks that the draws still call them)."""
    from keras.src.backend.tensorflow import random as backend_random
    draw = _require(backend_random, "draw_seed", "keras tensorflow random.draw_seed")
    cast = _require(backend_random, "_cast_seed", "keras tensorflow random._cast_seed")
    return cast(draw(seed))


# -- DTensor: how stage 3 (FSDP) gathers --------------------------------------------

_GATHER_ENV = "LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2"
_COMBINE_ENV = "DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION"
_fsdp_env_latched: dict = {}   # the values this process's DTensor programs compile with


def dtensor_fsdp_lowering(mesh_axes: dict, stage: int) -> None:
    """Choose DTensor's lowering of ZeRO-3's gathers, before anything compiles
    (called by every DTensor run's setup; the first one in a process decides).

    What: two environment switches of TensorFlow's DTensor compiler, read once
    per process, by the first DTensor program it compiles (verified: setting
    one later changes nothing; `tests/test_compat.py`).

    - `DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION=0`. Why: by default
      DTensor merges the step's independent all-reduces into one, and on CPU
      every gather and reduce-scatter is an all-reduce, so the whole model's
      gathered weights and full gradients were alive at once. Measured: the
      mlp 2048x8 under stage 3 on 4 logical CPUs peaked at 4.2 GiB with it,
      2.4 GiB without, the same loss. It only makes fewer, larger collectives
      (a speed choice), so turning it off is safe for any mesh.
    - `LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2=1`, on a mesh with one
      axis larger than 1 only. Why: DTensor's default gather is a zero buffer
      plus an all-reduce, and the zero buffer of each gathered weight is a
      constant that every compiled program keeps for its lifetime (one more
      whole copy of the weights per device per traced step). The collective
      gather has none. Not on a 2-D mesh: there it is silently wrong (stage 3
      on `batch:2,model:2` ended 0.78 away from one device; `batch:4,model:1`
      matched), so such a mesh keeps the default, and is refused when this
      process already compiles with the collective gather.

    A value the user set is kept. Verified: tensorflow 2.21.0. Check: the
    refusal above (a wrong result is never silent); the memory is measured by
    `bench/dtensor.py`'s "does it fit" row and `tests/test_zero.py`.
    """
    import os
    from tfdist.errors import UsageError
    flat = sum(1 for size in mesh_axes.values() if size > 1) <= 1
    if not _fsdp_env_latched:
        if stage >= 3:
            os.environ.setdefault(_COMBINE_ENV, "0")
            if flat:
                os.environ.setdefault(_GATHER_ENV, "1")
        _fsdp_env_latched.update({name: os.environ.get(name, "")
                                  for name in (_GATHER_ENV, _COMBINE_ENV)})
    if stage >= 3 and not flat and _fsdp_env_latched.get(_GATHER_ENV) == "1":
        mesh = ",".join(f"{axis}:{size}" for axis, size in mesh_axes.items())
        raise UsageError(
            f"--zero_stage=3 on --mesh={mesh}: this process compiles DTensor gathers with "
            f"{_GATHER_ENV}=1, which TensorFlow 2.21 gets wrong on a mesh with two axes "
            f"larger than 1; run this training in a new process without it, or use a "
            f"mesh with one axis larger than 1")


def model_layers(model) -> list:
    """Every layer of `model`, nested ones included, itself excluded.

    What: Keras's private `Layer._flatten_layers`. Why: ZeRO-3 wraps the call
    of each layer that owns a gathered variable (`tfdist/strategies/dtensor.py`,
    `_gathered_per_layer`), and the layers that own variables are often nested
    (the transformer's attention projections); Keras 3 has no public recursive
    listing. Verified: keras 3.15.1. Check: the method exists.
    """
    flatten = _require(model, "_flatten_layers", "keras Layer._flatten_layers")
    return list(flatten(include_self=False, recursive=True))


# -- start-up: Keras's eager import of matplotlib -----------------------------------

# Keras's modules that import matplotlib when Keras is imported: {module: (its
# global, the matplotlib module that global holds)}.
_MATPLOTLIB_IMPORTERS = {
    "keras.src.visualization.plot_image_gallery": ("plt", "matplotlib.pyplot"),
    "keras.src.visualization.plot_bounding_box_gallery": ("patches", "matplotlib.patches"),
}


class _OnFirstUse:
    """Stands for a matplotlib module in a Keras module: imports it on first
    attribute use, so `keras.visualization.plot_*` work as before."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attribute):
        import importlib
        return getattr(importlib.import_module(self._name), attribute)

    def __repr__(self):
        return f"<{self._name}, imported on first use (tfdist.compat.defer_keras_matplotlib)>"


class _DeferMatplotlib:
    """A meta-path finder for Keras's modules that import matplotlib; it
    removes itself once it has handled them all."""

    def __init__(self):
        self.pending = set(_MATPLOTLIB_IMPORTERS)

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.pending:
            return None
        self.pending.discard(fullname)
        if not self.pending:
            sys.meta_path.remove(self)
        import importlib.machinery
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _DeferMatplotlibLoader(spec.loader, fullname)
        return spec


class _DeferMatplotlibLoader:
    def __init__(self, loader, fullname):
        self.loader, self.fullname = loader, fullname

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        if "matplotlib" in sys.modules:   # imported already: nothing to save
            self.loader.exec_module(module)
            return
        sys.modules["matplotlib"] = None   # its imports raise ImportError
        try:
            self.loader.exec_module(module)
        finally:
            if "matplotlib" in sys.modules and sys.modules["matplotlib"] is None:
                del sys.modules["matplotlib"]
        attribute, name = _MATPLOTLIB_IMPORTERS[self.fullname]
        if getattr(module, attribute, 0) is not None:
            raise _changed(f"{self.fullname}.{attribute}",
                           "is no longer None when matplotlib cannot be imported")
        setattr(module, attribute, _OnFirstUse(name))


def defer_keras_matplotlib() -> None:
    """Keep `import keras` (which `import tensorflow` does) from importing
    matplotlib until a Keras plot function uses it.

    What: two private Keras modules, `keras.src.visualization.plot_image_gallery`
    (`import matplotlib.pyplot as plt`) and `...plot_bounding_box_gallery`
    (`from matplotlib import patches`), import matplotlib when Keras is
    imported, falling back to None without it. A meta-path finder (removed
    once both are loaded) executes each with matplotlib made unimportable,
    then sets that global to a stand-in that imports the module on first
    attribute use. Why: tfdist installs matplotlib (`tfdist-compare`'s PNG),
    and its import cost 0.4-0.5 of the ~3.4 CPU-seconds of `import tensorflow`
    here (AMD EPYC, AVX-512), in every process of every run. Verified: keras
    3.15.1 (the modules in keras/src that import matplotlib at import time).
    Check: each global is None when matplotlib cannot be imported (else
    `UpstreamChanged`); tests/test_compat.py checks that nothing else imports
    matplotlib. A no-op when Keras is already imported.
    """
    if "keras" in sys.modules or any(isinstance(f, _DeferMatplotlib) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _DeferMatplotlib())


def symbolic_calls(layer) -> int:
    """How many places of a functional graph call `layer` (symbolic calls).

    What: Keras's private `Layer._inbound_nodes` (one node per symbolic call).
    Why: a pipeline stage must own its layers (`tfdist/pipeline/split.py`), and
    Keras 3's public `layer.input`/`layer.output` return the first call's
    tensors without complaint when a layer is called at several places.
    Verified: keras 3.15.1. Check: the attribute exists and is a list.
    """
    nodes = _require(layer, "_inbound_nodes", "keras Layer._inbound_nodes")
    if not isinstance(nodes, list):
        raise _changed("keras Layer._inbound_nodes", "is no longer a list")
    return len(nodes)


def move_variable(variable, device: str) -> None:
    """Move the storage of Keras variable `variable` to `device`, keeping the
    Keras object (which layers, optimizers and checkpoints refer to).

    What: a Keras 3 `Variable` on the TensorFlow backend keeps its storage, a
    `tf.Variable`, in `_value`, and `_initialize(value)` adopts a given
    `tf.Variable` as that storage. Why: pipeline stages (issue 22) must hold
    their layers' variables on their own device, but a functional model's
    variables are created when it is built, before the model can be split
    (the split reads the built graph), and Keras has no public way to place a
    built variable. A new `tf.Variable` with the old one's value, name,
    trainability and aggregation is made on `device` and adopted; the old one
    is freed. Verified on tensorflow 2.21.0, keras 3.15.1.
    """
    import tensorflow as tf
    what = "keras Variable._value (its tf.Variable storage) and _initialize"
    old = _require(variable, "_value", what)
    adopt = _require(variable, "_initialize", what)
    if not isinstance(old, tf.Variable):
        raise _changed(what, f"holds {type(old).__name__}, not a tf.Variable")
    with tf.device(device):
        new = tf.Variable(old.read_value(), trainable=old.trainable,
                          name=old.name.split(":")[0], aggregation=old.aggregation,
                          synchronization=old.synchronization)
    adopt(new)
    if variable.value is not new:
        raise _changed(what, "did not adopt the given tf.Variable")


def optimizer_slots(optimizer, variables) -> list:
    """For each of `variables` (trainable, the optimizer built on them), the
    optimizer's variables that hold state of that variable alone (Adam's two
    moments, SGD's momentum, ...), as lists in `variables`' order.

    What: Keras 3 names such a slot, in `add_variable_from_reference`, after
    its reference variable's path with "/" replaced by "_", then "_<slot>"
    (e.g. `dense_kernel_momentum`); Keras has no public map from a slot to
    its variable. Why: across processes a pipeline worker updates only its
    stage's variables and their slots, holds only those, and the chief
    gathers the others' from their owners for a checkpoint
    (`tfdist.strategies.pipeline`), so it must know which slots are whose. Verified on keras 3.15.1 (Adam, AdamW,
    SGD with momentum, RMSprop, Adagrad). Check: every optimizer variable
    that is not a scalar (the step counter, a learning rate) is matched to
    one of `variables` (the longest matching name prefix); an optimizer whose
    state is not named so fails here, loudly, rather than go stale.
    """
    prefixes = [v.path.replace("/", "_") + "_" for v in variables]
    slots = [[] for _ in variables]
    for slot in optimizer.variables:
        matches = [k for k, prefix in enumerate(prefixes) if slot.name.startswith(prefix)]
        if not matches:
            if len(slot.shape):
                raise _changed(f"keras optimizer slot naming ({slot.path!r} matches no "
                               "variable's path)", "has changed")
            continue
        owner = max(matches, key=lambda k: len(prefixes[k]))
        slots[owner].append(slot)
    return slots


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
