"""Variables on the mesh: how a Keras variable lands there (the creator
`DTensorStrategy.scope` installs, `VariableCreation`), `MeshVariable`, which
also takes and gives host values, and the moves between host and mesh."""

from __future__ import annotations

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist import compat, sharding
from tfdist.errors import UsageError


def _keras_path(initial_value, name: str) -> str:
    """The Keras path (e.g. `transformer/block0/attn/query/kernel`) of a variable
    being created.

    Keras creates the `tf.Variable` lazily, after its name scopes have closed,
    so `tf.get_current_name_scope()` loses nested layers' scopes; the deferred
    initial value is a closure over the Keras `Variable`, which knows its path
    (`compat.keras_variable_of`). Other variables take the name scope's path.
    """
    owner = compat.keras_variable_of(initial_value)
    if owner is not None:
        return owner.path
    scope = tf.get_current_name_scope()
    return f"{scope}/{name}" if scope else name


def _read(variable):
    """The current value (a DTensor) of a Keras or TensorFlow variable."""
    # A Keras Variable wraps a tf.Variable (its `value` outside autocast scopes).
    inner = variable.value if isinstance(variable, keras.Variable) else variable
    return inner.read_value() if isinstance(inner, tf.Variable) else tf.convert_to_tensor(inner)


def _lay_out(value, layout):
    """A host tensor as a DTensor with `layout` (copied to the mesh, then split)."""
    value = tf.convert_to_tensor(value)
    replicated = dtensor.Layout.replicated(layout.mesh, value.shape.rank)
    return dtensor.relayout(dtensor.copy_to_mesh(value, replicated), layout)


def _gather(value):
    """A DTensor as one host tensor holding the whole (global) value."""
    layout = dtensor.fetch_layout(value)
    replicated = dtensor.Layout.replicated(layout.mesh, value.shape.rank)
    return dtensor.unpack(dtensor.relayout(value, replicated))[0]


class MeshVariable(dtensor.DVariable):
    """A DTensor variable that also takes and gives host values eagerly.

    So a model on the mesh works like any Keras model outside the step:
    `set_weights`/`load_weights` (a user's `model_fn` may load pretrained
    weights), `get_weights`, `numpy()`, `save`: host arrays are laid out on
    assignment and shards are gathered on reading.
    """

    def _host_to_mesh(self, value):
        if not tf.executing_eagerly():
            if self.compute_layout is not None and not self.trainable:
                # A split state variable assigned in the step (BatchNormalization's
                # moving statistics under ZeRO-3): the value is made whole, then
                # split. Assigned directly, DTensor's layout propagation pulls the
                # variable's split back into the ops that compute the value and on
                # into the activations, onto dimensions it does not divide
                # ("requires dimension 3 to be divisible ... size=6", EfficientNet's
                # BatchNormalization(axis=3) beside a 6-wide squeeze-excite). The
                # relayout to the computing layout is a boundary it cannot cross.
                # Not for trainable variables: their updates arrive in the stored
                # layout already (`updates`), and made whole they would cost
                # every process the whole update.
                value = dtensor.relayout(dtensor.relayout(value, self.compute_layout),
                                         self.layout)
            return value
        if dtensor.is_dtensor(value):
            return value
        return _lay_out(tf.cast(tf.convert_to_tensor(value), self.dtype), self.layout)

    def assign(self, value, *args, **kwargs):
        return super().assign(self._host_to_mesh(value), *args, **kwargs)

    def assign_add(self, value, *args, **kwargs):
        return super().assign_add(self._host_to_mesh(value), *args, **kwargs)

    def assign_sub(self, value, *args, **kwargs):
        return super().assign_sub(self._host_to_mesh(value), *args, **kwargs)

    # Under --zero_stage=3, the layout its reads take inside `compute_scope`,
    # and its strategy's `Gathering` (which says when that is).
    compute_layout = None
    gathering = None

    def _read_variable_op(self, *args, **kwargs):
        value = super()._read_variable_op(*args, **kwargs)
        if self.compute_layout is not None and self.gathering.active:
            # FSDP: all-gather for use; its gradient is the reduce-scatter
            # back to the stored layout. Read on every use, not kept.
            if self.gathering.after is not None:
                value = value + tf.cast(self.gathering.after, value.dtype)
            value = dtensor.relayout(value, self.compute_layout)
        return value

    def numpy(self):
        return _gather(self.read_value()).numpy()

    def __array__(self, dtype=None, copy=None):
        array = self.numpy()   # a fresh host array: a copy whatever `copy` asks
        return array if dtype is None else array.astype(dtype)


class VariableCreation:
    """The variable creator of `DTensorStrategy.scope` and the layouts it
    gives: a part of `DTensorStrategy`, which holds the state it reads
    (`mesh`, `axes`, `zero`, `layout_rules`, `_var_specs`, `_initial_values`)."""

    def _spec_for(self, path: str, shape) -> tuple:
        """(the spec it computes in, the spec it is stored in, "variable" or
        "slot") of the variable being created at `path`.

        A rule that puts `batch` on a dimension (keras-hub's layout maps do:
        FSDP on JAX) stores the variable so and computes with that dimension
        whole, as ZeRO-3 does with every variable.
        """
        for var_path, (compute, stored) in sorted(self._var_specs.items(),
                                                  key=lambda kv: -len(kv[0])):
            flat = var_path.replace("/", "_")
            if "/" in path and path.split("/", 1)[1].startswith(flat + "_") and \
                    len(compute) == len(shape):
                # An optimizer slot, `<optimizer>/<variable path with _>_<slot>`:
                # its variable's layout (plus `batch` under ZeRO).
                slot = sharding.zero_spec(stored, shape, self.axes) if self.zero else stored
                return slot, slot, "slot"
        spec = self.layout_rules.spec_for(path, shape, self.axes)
        compute = tuple(None if a == sharding.BATCH else a for a in spec)
        stored = spec
        if self.zero >= 3:
            stored = sharding.zero_spec(spec, shape, self.axes)
            sharding.check_fsdp_split(path, compute, stored, shape, self.axes)
        return compute, stored, "variable"

    def _layout(self, spec):
        return dtensor.Layout([a or dtensor.UNSHARDED for a in spec], self.mesh)

    def _creator(self, next_creator, **kwargs):
        initial_value = kwargs["initial_value"]
        owner = compat.keras_variable_of(initial_value) if callable(initial_value) else None
        path = owner.path if owner is not None else _keras_path(initial_value,
                                                                 kwargs.get("name") or "")
        dtype = kwargs.get("dtype")
        with tf.init_scope():
            value = None
            if owner is None:
                value = initial_value() if callable(initial_value) else initial_value
                value = tf.convert_to_tensor(value, dtype=dtype)
                if dtensor.is_dtensor(value):
                    # Optimizer slots are made "colocated with" their variable, so
                    # their zeros arrive as DTensors already, on some layout: gather.
                    value = self.to_host(value)
            shape = value.shape.as_list() if value is not None else list(owner.shape)
            try:
                spec, stored, kind = self._spec_for(path, shape)
            except UsageError as error:
                self._refused = error   # raised by `scope` over Keras' wrapping
                raise
            if kind == "variable":
                self._var_specs[path] = spec, stored
            layout = self._layout(stored)
            if value is None and any(stored):
                # Each shard drawn alone, equal to one device's (`init`).
                initial = dtensor.pack(self._initial_values.shards(
                    initial_value, path, shape, dtype, layout), layout)
            else:
                if value is None:
                    value = tf.convert_to_tensor(initial_value(), dtype=dtype)
                    if dtensor.is_dtensor(value):   # an optimizer slot's zeros (see above)
                        value = self.to_host(value)
                initial = _lay_out(value, layout)
        variable = MeshVariable(initial, trainable=kwargs.get("trainable", True),
                                name=kwargs.get("name"), dtype=dtype)
        if kind == "variable" and stored != spec:
            variable.compute_layout = self._layout(spec)
            variable.gathering = self.gathering
        return variable
