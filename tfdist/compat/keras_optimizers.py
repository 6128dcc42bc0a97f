"""Private names of Keras 3's optimizers (TensorFlow backend) tfdist reads or
replaces; see the package docstring (`tfdist/compat/__init__.py`). Imports no
TensorFlow or Keras until called."""

from __future__ import annotations

from tfdist.compat._guard import _changed, _require, _require_called
from tfdist.compat.tf_internals import sharded_variable_type


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


def learning_rate_times(optimizer, factor) -> None:
    """`optimizer`'s learning rate, as configured, times `factor()` per update.

    What: Keras's private `Optimizer._learning_rate`, replaced on this
    instance by a `schedules.PerUpdateFactor` of what it held (the learning
    rate variable, or a schedule). Why: an optimizer given a schedule at
    construction has no learning-rate variable, and Keras checkpoints an
    optimizer's variables by position, so a checkpoint of the parameter
    server (whose updates scale the rate by their staleness) would then not
    restore under another engine, nor another engine's under it ("incompatible
    tensor with shape (64, 32) ... learning_rate"). Wrapped after
    construction, the variable stays tracked where every engine has it.
    Verified: keras 3.15.1. Check: the attribute exists and
    `_get_current_learning_rate` still reads it.
    """
    from tfdist.training.schedules import PerUpdateFactor
    what = "keras Optimizer._learning_rate"
    base = _require(optimizer, "_learning_rate", what)
    _require_called(type(optimizer), "_get_current_learning_rate", "_learning_rate", what)
    optimizer._learning_rate = PerUpdateFactor(base, factor)


# -- parameter servers (BUILD_NOTES "ParameterServerStrategy with Keras 3") ----

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
    update_step, apply_weight_decay, use_weight_decay = _sharded_update_hooks(optimizer)

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


def _sharded_update_hooks(optimizer):
    """Keras's `(_distributed_tf_update_step, _apply_weight_decay,
    _use_weight_decay)` of `optimizer`, checked as
    `optimizer_updates_sharded_variables` says."""
    base = "keras Optimizer."
    update_step = _require(optimizer, "_distributed_tf_update_step",
                           base + "_distributed_tf_update_step")
    apply_weight_decay = _require(optimizer, "_apply_weight_decay", base + "_apply_weight_decay")
    use_weight_decay = _require(optimizer, "_use_weight_decay", base + "_use_weight_decay")
    _require_called(type(optimizer), "_backend_update_step", "_distributed_tf_update_step",
                    base + "_distributed_tf_update_step")
    _require_called(type(optimizer), "_backend_apply_gradients", "_apply_weight_decay",
                    base + "_apply_weight_decay")
    return update_step, apply_weight_decay, use_weight_decay


# -- DTensor (BUILD_NOTES "DTensor with Keras 3") ------------------------------

def variable_index(optimizer, variable) -> int:
    """The optimizer's index of `variable` (its slots' position).

    What: Keras's private `Optimizer._get_variable_index`. Why: tfdist's DTensor
    update steps (`dtensor.updates`) replace Keras's `update_step`, which must
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


# -- pipeline stages across processes -------------------------------------------

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
