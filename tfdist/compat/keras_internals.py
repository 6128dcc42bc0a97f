"""Private names of Keras 3 (variables, layers, losses, metrics, random draws
on the TensorFlow backend) tfdist reads or replaces; optimizers are in
`keras_optimizers.py`, the start-up matplotlib deferral in
`keras_matplotlib.py`. See the package docstring (`tfdist/compat/__init__.py`).
Imports no TensorFlow or Keras until called."""

from __future__ import annotations

import contextlib
import types

from tfdist.compat._guard import _changed, _code_reads, _require, _require_called
from tfdist.compat.tf_internals import is_sharded


# -- parameter servers (BUILD_NOTES "ParameterServerStrategy with Keras 3") ----

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
    knows to be element-wise (`tfdist/strategies/dtensor/init.py`). Verified:
    keras 3.15.1. Check: `tests/integration/test_dtensor_init.py` (a sharded variable of
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
    drawing the slice alone (`tfdist/strategies/dtensor/init.py`); Keras has
    no public hook between an initializer and its random op. Verified: keras
    3.15.1. Check: each function exists and `keras.random.<name>` still calls
    it through `backend.random` (`tests/unit/test_compat.py`; ZeRO-3's initial
    weights equal one device's in `tests/integration/test_dtensor_init.py`).
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


# -- layers and variables (DTensor ZeRO-3, pipeline stages) ----------------------

def model_layers(model) -> list:
    """Every layer of `model`, nested ones included, itself excluded.

    What: Keras's private `Layer._flatten_layers`. Why: ZeRO-3 wraps the call
    of each layer that owns a gathered variable (`tfdist/strategies/dtensor/gather.py`,
    `_gathered_per_layer`), and the layers that own variables are often nested
    (the transformer's attention projections); Keras 3 has no public recursive
    listing. Verified: keras 3.15.1. Check: the method exists.
    """
    flatten = _require(model, "_flatten_layers", "keras Layer._flatten_layers")
    return list(flatten(include_self=False, recursive=True))


def replace_batchnorm_moments(layer, moments) -> None:
    """`layer` (a BatchNormalization) computes its training batch's moments
    with `moments(inputs, mask) -> (mean, variance)` instead of its own.

    What: Keras's private `BatchNormalization._moments`, replaced on the
    instance. Why: under Horovod the step runs in tf.distribute's default
    replica context, whose all-reduce is the identity, so Keras's
    `synchronized=True` silently keeps each rank's statistics; Horovod's own
    `SyncBatchNormalization` fails on Keras 3 (it passes `fused=` and calls
    an old `_moments` signature). The engine reduces the moments' sums with
    Horovod's all-reduce instead. Verified: keras 3.15.1. Check:
    `BatchNormalization.call` still calls `self._moments`.
    """
    import keras
    _require(keras.layers.BatchNormalization, "_moments", "keras BatchNormalization._moments")
    _require_called(keras.layers.BatchNormalization, "call", "_moments",
                    "keras BatchNormalization._moments")
    layer._moments = moments


def fuse_batchnorm(layer) -> bool:
    """`layer` (a BatchNormalization) normalises with TensorFlow's fused kernel
    (`FusedBatchNormV3`: one op forward, one backward) where its input allows;
    returns whether it was replaced.

    What: the instance's `call`, replaced by one that computes what Keras's
    `BatchNormalization.call` computes (the batch's moments in training,
    the moving statistics updated with the layer's momentum, otherwise the
    moving statistics; gamma, beta, epsilon) with the fused kernel. Why:
    Keras 3 has no fused path on TensorFlow: it casts a 16-bit input to
    float32, computes the moments as `mean(x^2) - mean(x)^2` and normalises
    in about a dozen element-wise ops, each a pass over the activations, and
    as many in the backward pass; the fused kernel (what Keras 2 used for 4-D
    inputs) makes each direction one pass and keeps 16-bit activations 16-bit.
    The cnn trained 1.81x faster in mixed_bfloat16 and 1.30x in float32 on
    an AMX Xeon (bench/vs_fit.py, docs/benchmarks.md). The kernel returns the batch
    variance with Bessel's correction; Keras tracks the biased one, which is
    what the moving variance gets here too. Inputs the kernel does not take
    (a mask, a channel axis other than the last, a symbolic tensor while
    Keras infers shapes, an epsilon below 1.001e-5: Keras 2's limit for its
    fused path, cuDNN's minimum) go to Keras's own call; so does every call
    of a layer with renorm or synchronized statistics, or of a subclass with
    its own `call` (never replaced). Ranks other than 4 are reshaped to
    [N, 1, 1, C], which keeps the moments over every axis but the last.
    Verified: tensorflow 2.21.0, keras 3.15.1. Check: once per process, the
    fused call and Keras's own on a probe layer give the same output, moving
    statistics and gradients (float32 rounding).
    """
    import keras
    import tensorflow as tf
    if (type(layer).call is not keras.layers.BatchNormalization.call or layer.renorm
            or layer.synchronized or not layer.built or "_moments" in vars(layer)):
        return False   # (a layer whose moments were replaced keeps the call that uses them)
    _check_fused_batchnorm_matches_keras()
    layer.call = types.MethodType(_fused_batchnorm_call(tf, keras), layer)
    return True


def _fused_batchnorm_call(tf, keras):
    keras_call = keras.layers.BatchNormalization.call

    def call(self, inputs, training=None, mask=None):
        rank = len(inputs.shape)
        if (mask is not None or keras.backend.is_keras_tensor(inputs) or rank < 2
                or self.axis not in (rank - 1, -1) or self.epsilon < 1.001e-5
                or self.compute_dtype not in ("float32", "bfloat16", "float16")):
            return keras_call(self, inputs, training=training, mask=mask)
        x = tf.cast(inputs, self.compute_dtype)
        shape, channels = tf.shape(x), x.shape[-1]
        if rank != 4:
            x = tf.reshape(x, [-1, 1, 1, channels])
        gamma = tf.cast(self.gamma, "float32") if self.scale else tf.ones([channels])
        beta = tf.cast(self.beta, "float32") if self.center else tf.zeros([channels])
        if training and self.trainable:
            y, mean, variance = tf.compat.v1.nn.fused_batch_norm(
                x, gamma, beta, epsilon=self.epsilon, data_format="NHWC", is_training=True)
            count = tf.cast(tf.size(x) // channels, "float32")
            variance = variance * ((count - 1.0) / tf.maximum(count, 1.0))   # biased, as Keras
            momentum = self.momentum
            self.moving_mean.assign(self.moving_mean * momentum + mean * (1.0 - momentum))
            self.moving_variance.assign(
                self.moving_variance * momentum + variance * (1.0 - momentum))
        else:
            y, _, _ = tf.compat.v1.nn.fused_batch_norm(
                x, gamma, beta, mean=tf.cast(self.moving_mean, "float32"),
                variance=tf.cast(self.moving_variance, "float32"), epsilon=self.epsilon,
                data_format="NHWC", is_training=False)
        if rank != 4:
            y = tf.reshape(y, shape)
        return tf.cast(y, self.compute_dtype)

    return call


def _check_fused_batchnorm_matches_keras() -> None:
    """The fused call and Keras's on one probe (eager, float32): output,
    moving statistics and input gradient within float32 rounding, in
    training and in inference; `UpstreamChanged` otherwise. The probe runs
    on a thread of its own, outside the caller's strategy, variable creators
    and Keras naming (all per thread), so its variables are nobody's."""
    if "fused-batchnorm" in _CHECKED:
        return
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(_probe_fused_batchnorm).result()
    _CHECKED.add("fused-batchnorm")


def _probe_fused_batchnorm() -> None:
    import keras
    import numpy as np
    import tensorflow as tf
    x = tf.constant(np.random.default_rng(0).normal(1.5, 2.0, (6, 3, 2, 5)), "float32")
    results = []
    for fused in (False, True):
        layer = keras.layers.BatchNormalization(momentum=0.8, dtype="float32")
        layer.build(x.shape)
        layer.gamma.assign(np.linspace(0.5, 1.5, 5))
        layer.beta.assign(np.linspace(-1.0, 1.0, 5))
        if fused:
            layer.call = types.MethodType(_fused_batchnorm_call(tf, keras), layer)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(y * tf.range(5, dtype="float32"))
        results.append([y, layer.moving_mean, layer.moving_variance, tape.gradient(loss, x),
                        layer(x, training=False)])
    for keras_value, fused_value in zip(*results):
        if not np.allclose(np.asarray(keras_value), np.asarray(fused_value), rtol=1e-4,
                           atol=1e-4):
            raise _changed("keras BatchNormalization.call",
                           "no longer computes what tfdist's fused BatchNorm computes "
                           "(use --nofused_batchnorm)")


@contextlib.contextmanager
def keras_name_scopes_restored():
    """Keras's stack of name scopes as it was on entry, whatever happens inside.

    What: Keras's private global attribute "name_scope_stack" (keras
    `backend.common.global_state`), which prefixes the path of every variable
    made while a scope is on it. Why: a trace of a model that fails inside its
    call (a subclassed model branching in Python on a tensor's value) leaves
    the model's name scope on the stack, and every variable made afterwards
    in the process is then named under it ("__branches_in_python/dense/
    kernel"); tfdist traces a user's model to count its FLOPs and goes on when
    that fails. Verified: keras 3.15.1. Check: the attribute is a list (or
    not set yet).
    """
    from keras.src.backend.common import global_state
    get = _require(global_state, "get_global_attribute",
                   "keras backend.common.global_state.get_global_attribute")
    stack = get("name_scope_stack")
    if stack is not None and not isinstance(stack, list):
        raise _changed("keras global_state name_scope_stack", "is no longer a list")
    depth = len(stack or ())
    try:
        yield
    finally:
        stack = get("name_scope_stack")
        if isinstance(stack, list) and len(stack) > depth:
            del stack[depth:]
