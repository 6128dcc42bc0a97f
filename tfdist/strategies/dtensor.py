"""`dtensor`: tensor sharding (model parallel and hybrid data x model) with
`tf.experimental.dtensor`, for unchanged Keras 3 models.

The whole step runs SPMD on DTensor values: one program over the global
batch, split over the mesh's `batch` axis, with variables split over its
`model` axis by the model's layout rules (`tfdist/sharding.py`). There are
no replicas to reduce across: DTensor inserts the collectives a layout needs,
so `all_reduce_sum` is the identity and `step_copies` is 1.

How a Keras 3 model lands on the mesh (Keras has no DTensor path on the
TensorFlow backend): the model and optimizer are built inside
`tf.variable_creator_scope`, whose creator turns each variable's initial value
into a DTensor with the layout its rule gives. Optimizer slots always take
their variable's layout (a slot on another layout makes Adam silently wrong);
the updates run through `dtensor_updates`, which never reads a slot back.

ZeRO (`--zero_stage`) also splits state over the `batch` axis, on a dimension
the variable's rule leaves whole (`sharding.zero_spec`):
  1: optimizer slots (gathered to the variable's layout for the update);
  2: slots and gradients: each gradient leaves the backward pass in its slot's
     layout (the data-parallel sum becomes a reduce-scatter), accumulates and
     updates there; only the weight update is gathered to the variable;
  3 (FSDP): slots, gradients and the variables themselves. A variable is
     stored split; inside `compute_scope` (the trainer's forward and backward
     passes) every read of it is relayouted to its rule's layout (an
     all-gather), and the gradient of that relayout comes back split as
     stored (a reduce-scatter).
Under every split layout (any stage, tensor parallel too) each device's shard
of a Keras variable's initial value is drawn alone, equal to that slice of one
device's value (`dtensor_init`): the same seed gives the same initial weights
on every mesh and engine, and no process makes a whole variable whose
initializer is element-wise.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
from typing import Optional

from absl import logging
import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist import cluster, compat, sharding
from tfdist.errors import UsageError
from tfdist.strategies.base import Strategy
from tfdist.strategies.capabilities import TensorSharding
from tfdist.observe import hardware, logs
from tfdist.strategies import watchdog
from tfdist.strategies import dtensor_init, dtensor_ops, dtensor_updates, multi_worker


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


class _Gathering(threading.local):
    active = False
    recomputing = False   # a layer's forward again, for its backward pass
    after = None          # a scalar zero the gathers wait for (see _gathered_per_layer)


_gathering = _Gathering()   # inside DTensorStrategy.compute_scope (this thread)


def _zero_after(tensors):
    """A scalar zero computed from `tensors`: added to a variable's shard
    before its gather, it makes the gather wait for them. A control
    dependency would not: DTensor's passes keep control edges only between
    stateful ops (verified: gathers under `tf.control_dependencies` still ran
    at the start of the step). One scalar sum over the mesh per use."""
    floats = [t for t in tensors if t.dtype.is_floating]
    if not floats:
        return None
    return tf.stop_gradient(tf.add_n([tf.cast(tf.reduce_sum(t), tf.float32) for t in floats]) * 0.0)


def _gathered_per_layer(layer, call):
    """`layer.call`, so that under stage 3 a layer's gathered weights live only
    while the layer computes: gathered after its input exists (TensorFlow runs
    an op as soon as its inputs are ready, and a read depends on nothing, so
    every gather would otherwise run at the start of the step), dropped after
    the forward use, and gathered again for the backward pass once the
    layer's output gradient exists, by recomputing the layer there (the
    gradient of a matmul would otherwise keep its gathered operand alive from
    the forward pass to the backward one). Calls with other tensor arguments
    than one floating input run as they are: a lookup (`Embedding`) needs no
    weights for its gradient, and DTensor failed to compile the custom
    gradient of an integer input ("operand #0 does not dominate this use")."""
    @functools.wraps(call)
    def gathered_call(*args, **kwargs):
        if (_gathering.recomputing or not _gathering.active or not tf.inside_function()
                or not args or not tf.is_tensor(args[0]) or not args[0].dtype.is_floating
                or any(tf.is_tensor(a) for a in tf.nest.flatten((args[1:], kwargs)))):
            return call(*args, **kwargs)
        rest = args[1:]

        def waiting_for(tensors, run):
            before, _gathering.after = _gathering.after, _zero_after(tensors)
            try:
                return run()
            finally:
                _gathering.after = before

        def forward(x):
            y = waiting_for([x], lambda: call(x, *rest, **kwargs))

            def backward(dy, variables=None):
                x_again = tf.identity(x)
                # Gathered as in the forward pass, also where the gradient is
                # taken outside `compute_scope`.
                before = _gathering.recomputing, _gathering.active
                _gathering.recomputing = _gathering.active = True
                try:
                    with tf.GradientTape() as tape:
                        tape.watch(x_again)
                        y_again = waiting_for(tf.nest.flatten(dy),
                                              lambda: layer(x_again, *rest, **kwargs))
                finally:
                    _gathering.recomputing, _gathering.active = before
                sources = [x_again] + list(variables or [])
                grads = tape.gradient(y_again, sources, output_gradients=dy)
                dx, dvars = grads[0], grads[1:]
                # The layer below starts its backward pass once these gradients
                # are reduce-scattered, else the backward pass (fast) runs ahead
                # of the reductions (slow) and every layer's whole gradient
                # waits in memory at once.
                done = _zero_after([g for g in dvars if g is not None])
                if dx is not None and done is not None:
                    dx = dx + tf.cast(done, dx.dtype)
                return dx, dvars

            return y, backward

        return compat.graph_custom_gradient(forward, args[0])

    return gathered_call


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
                # layout already (dtensor_updates), and made whole they would cost
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

    # Under --zero_stage=3, the layout its reads take inside `compute_scope`.
    compute_layout = None

    def _read_variable_op(self, *args, **kwargs):
        value = super()._read_variable_op(*args, **kwargs)
        if self.compute_layout is not None and _gathering.active:
            # FSDP: all-gather for use; its gradient is the reduce-scatter
            # back to the stored layout. Read on every use, not kept.
            if _gathering.after is not None:
                value = value + tf.cast(_gathering.after, value.dtype)
            value = dtensor.relayout(value, self.compute_layout)
        return value

    def numpy(self):
        return _gather(self.read_value()).numpy()

    def __array__(self, dtype=None, copy=None):
        array = self.numpy()   # a fresh host array: a copy whatever `copy` asks
        return array if dtype is None else array.astype(dtype)


_runs_ended = 0   # multi-process runs ended in this process: their keys' names


class DTensorStrategy(Strategy, TensorSharding):
    name = "dtensor"
    supports_xla = False
    supports_xla_reason = ("DTensor expands its SPMD program itself, outside XLA, on CPU; "
                           "it has no per-replica step to compile")

    def __init__(self, config):
        super().__init__(config)
        self.layout_rules = sharding.LayoutRules()
        self.axes = dict(sharding.parse_mesh(config.mesh))
        self.mesh = None
        self._spec = None        # the cluster, when the mesh spans processes
        self._var_specs = {}     # model variable path -> (compute spec, stored spec)
        self._update_layouts = {}  # id(trainable variable) -> its update's layout
        self._var_layouts = {}     # id(trainable variable) -> its stored layout
        self.zero = config.zero  # the ZeRO stage (--zero_stage)
        self._predict_fns = {}   # (id(model), input structure) -> traced forward pass
        self._layer_names = set()  # the model's layers, to name one in a refusal
        self._initial_values = dtensor_init.ShardedInit(to_host=self.to_host)

    # -- lifecycle ---------------------------------------------------------
    def setup(self) -> None:
        size = self.axes[sharding.BATCH] * self.axes[sharding.MODEL]
        compat.dtensor_fsdp_lowering(self.axes, self.zero)
        self._spec = cluster.resolve(self.config.worker_hosts, self.config.task_index)
        if self._spec is not None and self._spec.num_workers > 1:
            self._setup_clients(size)
            return
        wanted = self.config.virtual_devices
        if wanted and wanted != size:
            raise UsageError(f"--mesh={self.config.mesh} needs {size} devices but "
                             f"--virtual_devices={wanted}; set --virtual_devices={size}")
        devices = cluster.local_devices(size if wanted else None)
        if len(devices) < size or (not wanted and len(devices) != size):
            raise UsageError(f"--mesh={self.config.mesh} needs {size} devices; this host has "
                             f"{len(devices)} ({', '.join(d.rsplit('/', 1)[-1] for d in devices)})")
        with logs.quiet_absl():
            self.mesh = dtensor.create_mesh(
                list(sharding.parse_mesh(self.config.mesh)), devices=devices[:size])

    def _setup_clients(self, size: int) -> None:
        """A mesh over several processes (DTensor "clients"), one per worker of
        the cluster (TF_CONFIG, --worker_hosts or tfdist-launch), each
        contributing its local devices."""
        spec, config = self._spec, self.config
        gpus = tf.config.list_physical_devices("GPU")
        local = len(gpus) if gpus else (config.virtual_devices or 1)
        if spec.num_workers * local != size:
            raise UsageError(
                f"--mesh={config.mesh} needs {size} devices but {spec.num_workers} workers x "
                f"{local} local device(s) = {spec.num_workers * local}; set --virtual_devices="
                f"{size // spec.num_workers if size % spec.num_workers == 0 else '?'} "
                "or change the mesh")
        os.environ.update({
            "DTENSOR_JOBS": ",".join(spec.cluster[t][i] for t, i in spec.tasks),
            "DTENSOR_CLIENT_ID": str(spec.worker_index),
            "DTENSOR_NUM_CLIENTS": str(spec.num_workers),
            "DTENSOR_JOB_NAME": "worker"})
        device_type = "GPU" if gpus else "CPU"
        me = spec.name(spec.worker_index)
        # Like MultiWorkerMirroredStrategy, forming the cluster waits without
        # limit for every peer: bound it, and name the peer that never came.
        with watchdog.deadline(config.collective_timeout_s,
                               f"{me}: the DTensor cluster did not form within "
                               f"--collective_timeout_s={config.collective_timeout_s:g}s",
                               multi_worker.peers(spec)), logs.quiet_absl():
            dtensor.initialize_accelerator_system(
                device_type, num_logical_cpu_devices=None if gpus else local)
        watchdog.announce_server(spec.task_type, spec.task_index, spec.address)
        with logs.quiet_absl():
            self.mesh = dtensor.create_distributed_mesh(
                list(sharding.parse_mesh(config.mesh)), device_type=device_type)
        # TensorFlow's preemption notifier may swallow SIGTERM: keep it stoppable.
        # (A peer that dies during training fails the next cross-process
        # collective at once: "Connection reset by peer", named by describe_fault.)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    @property
    def num_workers(self) -> int:
        return self._spec.num_workers if self._clients else 1

    @property
    def worker_index(self) -> int:
        return self._spec.worker_index if self._clients else 0

    @property
    def _clients(self) -> bool:
        return self._spec is not None and self._spec.num_workers > 1

    def check_config(self, config) -> None:
        if config.train.grad_agreement_every:
            raise UsageError(
                f"--grad_agreement_every={config.train.grad_agreement_every} needs per-replica "
                "gradients, which --strategy=dtensor's single SPMD program does not have; "
                "use --grad_agreement_every=0")
        if config.train.grad_compression != "none":
            raise UsageError(
                f"--grad_compression={config.train.grad_compression} does not apply to "
                "--strategy=dtensor: DTensor reduces gradients inside its SPMD program, not "
                "through an all-reduce tfdist could cast; use --grad_compression=none")
        if config.train.sync_every:
            raise UsageError(
                f"--sync_every={config.train.sync_every} does not apply to --strategy=dtensor: "
                "its one SPMD program holds one copy of the weights, with no per-replica "
                "steps to average; use --sync_every=0")

    @property
    def num_replicas(self) -> int:
        """Data-parallel width: the global batch is split over the `batch` axis."""
        return self.axes[sharding.BATCH]

    @property
    def step_copies(self) -> int:
        return 1

    def describe(self) -> str:
        where = (f"; this is {self._spec.name(self.worker_index)} of {self.num_workers} "
                 f"processes" if self._clients else "")
        return (f"dtensor: mesh batch:{self.axes['batch']} x model:{self.axes['model']} on "
                f"{', '.join(self.mesh.local_devices())}{where}")

    # -- variables on the mesh ----------------------------------------------
    def set_layout_rules(self, rules) -> None:
        self.layout_rules = rules

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
                self.usage_error = error
                raise
            if kind == "variable":
                self._var_specs[path] = spec, stored
            layout = self._layout(stored)
            if value is None and any(stored):
                # Each shard drawn alone, equal to one device's (dtensor_init).
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
        return variable

    def prepare_model(self, model) -> None:
        """Under stage 3, each layer that owns a gathered variable itself gathers
        its weights for its own computation only (`_gathered_per_layer`). Not a
        layer with non-trainable state (BatchNormalization): recomputing it in
        the backward pass would update its state twice; its weights are then
        gathered as any read is, and kept from the forward to the backward pass."""
        self._layer_names = {layer.name for layer in compat.model_layers(model)}
        self._refuse_split_filters(model)
        made_whole = self._initial_values.report()
        if made_whole and self.is_chief:
            logging.info(made_whole)
        if self.zero < 3:
            return
        for layer in compat.model_layers(model):
            own = [v for v in layer.weights if v.path.rsplit("/", 1)[0] == layer.path]
            if any(getattr(getattr(v, "value", None), "compute_layout", None) is not None
                   for v in own) and not layer.non_trainable_weights:
                layer.call = _gathered_per_layer(layer, layer.call)

    # Keras convolutions: DTensor computes them only with a replicated filter.
    _CONVOLUTIONS = tuple(getattr(keras.layers, name) for name in (
        "Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose",
        "DepthwiseConv1D", "DepthwiseConv2D", "SeparableConv1D", "SeparableConv2D"))

    def _refuse_split_filters(self, model) -> None:
        """A `UsageError` before training when a layout rule splits a
        convolution's kernel for its computation: DTensor (TF 2.21) refuses
        it at the first compile ("Filter for convolution must have fully
        replicated layout"). Split over `batch` only to be stored (ZeRO-3, a
        keras-hub map's `batch`) is fine: it is gathered for use."""
        for layer in compat.model_layers(model):
            if not isinstance(layer, self._CONVOLUTIONS):
                continue
            for variable in layer.weights:
                compute, _ = self._var_specs.get(variable.path, ((), ()))
                if "kernel" in variable.path.rsplit("/", 1)[-1] and any(compute):
                    raise UsageError(
                        f"layout rule for {variable.path!r} splits convolution layer "
                        f"{layer.name!r}'s kernel as {sharding.describe_spec(compute)}; DTensor "
                        "computes convolutions only with a replicated kernel: leave "
                        "convolution kernels out of the rules (split the dense layers)")

    @contextlib.contextmanager
    def compute_scope(self):
        """The trainer's forward and backward passes: reads of ZeRO-3 variables
        in here take their compute layout (see `MeshVariable`), and gradients
        of ops DTensor cannot lay out are taken with ops it can
        (`dtensor_ops`)."""
        before, _gathering.active = _gathering.active, True
        try:
            with dtensor_ops.shardable_gradients(), compat.custom_gradients_on_tape():
                yield
        finally:
            _gathering.active = before

    def shard_gradients(self, grads, variables) -> list:
        """ZeRO-2: each gradient relayouted to its slots' layout as it leaves
        the backward pass (a reduce-scatter: DTensor all-reduces over `batch`,
        then keeps each device's part). ZeRO-3's come back split already."""
        if self.zero != 2:
            return list(grads)
        return [dtensor_updates.split_gradient(g, self._var_layouts[id(v)],
                                               self._update_layouts[id(v)])
                if id(v) in self._update_layouts else g for g, v in zip(grads, variables)]

    @contextlib.contextmanager
    def scope(self):
        # Not inside `dtensor.default_mesh`: there, variables skip the creator.
        compat.check_keras_variable_of()   # the creator needs Keras variables' paths
        with tf.variable_creator_scope(self._creator):
            yield

    def on_optimizer_built(self, optimizer, variables) -> None:
        """Slots follow their variables (split over `batch` too under ZeRO);
        updates that are correct on DTensors, computed in the slots' layout
        under ZeRO (the gradient split to it), else in the variable's."""
        var_layouts, slot_layouts, update_layouts = [], [], []
        self._update_layouts, self._var_layouts = {}, {}
        for variable in variables:
            layout = dtensor.fetch_layout(_read(variable))
            spec = tuple(None if a == dtensor.UNSHARDED else a for a in layout.sharding_specs)
            slot = self._layout(sharding.zero_spec(spec, variable.shape, self.axes)
                                if self.zero else spec)
            # From stage 1 on, the update runs on the slots' shard and only
            # the weight update is gathered: measured (bench/zero_traffic.py)
            # 3.0 x the model's bytes per process per step on 4 processes,
            # where gathering both Adam slots for the update moved 5.6.
            update = slot if self.zero >= 1 else layout
            var_layouts.append(layout)
            slot_layouts.append(slot)
            update_layouts.append(update)
            self._update_layouts[id(variable)] = update
            self._var_layouts[id(variable)] = layout
        dtensor_updates.install(optimizer, dtensor_updates.LayoutTable(
            var_layouts, slot_layouts, update_layouts, split_gradients=self.zero == 1))

    # -- data --------------------------------------------------------------
    @property
    def num_input_pipelines(self) -> int:
        return 1   # one global-batch pipeline; DTensorDataset splits it over the mesh

    def input_iterator(self, dataset_fn):
        # DTensorDataset's iterator subclasses tf.data's OwnedIterator but
        # cannot be saved (TF 2.21: AttributeError '_dataset' in
        # `_serialize_to_tensors`): a resumed run draws a fresh permutation.
        return iter(self.distribute_dataset(dataset_fn)), None

    def distribute_dataset(self, dataset_fn):
        """Global batches from `dataset_fn`, split over the mesh's `batch` axis.

        Every process reads the same global-batch stream (one input pipeline,
        the same seed). `DTensorDataset` feeds each local data-parallel replica
        consecutive per-replica batches of its process's dataset, so each
        process keeps only the rows of its own replicas of every global batch.
        """
        dataset = dataset_fn(tf.distribute.InputContext(1, 0, 1))  # global batches
        spec = dataset.element_spec
        global_batch = tf.nest.flatten(spec)[0].shape[0]
        replicas = self.axes[sharding.BATCH]
        local = list(dict.fromkeys(loc[sharding.BATCH]
                                   for loc in self.mesh.local_device_locations()))
        if local != list(range(replicas)):
            per_replica = global_batch // replicas
            rows = tf.concat([tf.range(r * per_replica, (r + 1) * per_replica)
                              for r in local], axis=0)
            dataset = dataset.map(tf.autograph.experimental.do_not_convert(
                lambda *parts: tf.nest.map_structure(lambda t: tf.gather(t, rows), parts)))
        options = tf.data.Options()
        # Round-robin per-replica batches between local replicas (not by file).
        options.experimental_distribute.auto_shard_policy = \
            tf.data.experimental.AutoShardPolicy.DATA
        layouts = tf.nest.map_structure(
            lambda s: dtensor.Layout.batch_sharded(self.mesh, sharding.BATCH, s.shape.rank), spec)
        distributed = dtensor.DTensorDataset(dataset.unbatch().with_options(options),
                                             mesh=self.mesh, layouts=layouts,
                                             global_batch_size=global_batch,
                                             batch_dim=sharding.BATCH)
        if not (self._spec and self._spec.num_workers > 1):
            # DTensor 2.21 takes each replica to span 2 clients on a process
            # with more devices than the mesh uses and feeds every local
            # replica the same examples; in one process no replica spans clients.
            compat.dtensor_dataset_one_client_per_replica(distributed)
        return distributed

    # -- stepping ----------------------------------------------------------
    def host_function(self, fn):
        compiled = tf.function(fn, autograph=False)
        scanned = set()

        @functools.wraps(fn)
        def call(*args):
            args = [_lay_out(a, dtensor.Layout.replicated(self.mesh, a.shape.rank))
                    if isinstance(a, tf.Tensor) and not dtensor.is_dtensor(a) else a
                    for a in args]
            with dtensor.default_mesh(self.mesh):
                self._refuse_unlowerable(compiled, args, scanned)
                result = compiled(*args)
            return tf.nest.map_structure(self.to_host, result)

        return call

    def _refuse_unlowerable(self, compiled, args, scanned) -> None:
        """Before DTensor compiles a newly traced program: a `UsageError`
        naming the layer and op when it holds an op DTensor cannot lay out
        (`dtensor_ops.ops_without_rules`), rather than a compiler error
        after minutes of lowering."""
        concrete = compiled.get_concrete_function(*args)
        if concrete.name in scanned:
            return
        scanned.add(concrete.name)
        found = dtensor_ops.ops_without_rules(concrete.graph.as_graph_def())
        if found:
            op, node = found[0]
            raise dtensor_ops.Unlowerable(op, dtensor_ops.layer_of(node, self._layer_names))

    def describe_fault(self, error: Exception) -> str:
        """A DTensor compile error as one line naming the op; a peer's fault
        as `multi_worker` names it."""
        lowering = dtensor_ops.lowering_error(str(getattr(error, "message", error)))
        if lowering is not None:
            op, reason = lowering
            return (f"worker {self.worker_index}: DTensor cannot compile the step: op {op}: "
                    f"{reason}")
        if not self._clients:
            return super().describe_fault(error)
        return multi_worker.describe_peer_fault(self._spec, self.worker_index, error)

    def to_host(self, value):
        """A DTensor or mesh variable as an ordinary host tensor."""
        value = _read(value) if isinstance(value, tf.Variable) else tf.convert_to_tensor(value)
        return _gather(value) if dtensor.is_dtensor(value) else value

    def run(self, replica_fn, *args):
        return replica_fn(*args)

    def any_worker(self, flag: bool) -> bool:
        """Each process decides alone: a per-process value has no DTensor layout
        whose sum the SPMD program would take. (A preempted client that stops
        makes its peers' next collective fail, which names it.)"""
        return bool(flag)

    def _all_reduce_sum(self, tensors):
        return list(tensors)   # one SPMD program over the global batch: already global

    def check_task(self, task, y_spec, pred_spec, weight_spec) -> None:
        """Run each metric's update once on the mesh: DTensor has no SPMD rule
        for some ops Keras metrics use (AUC's ReverseV2 in 2.21), which would
        otherwise fail the first training step."""
        zeros = [tf.zeros([2, *s.shape[1:]], s.dtype) for s in (y_spec, pred_spec, weight_spec)]

        def update(layout):
            return lambda y, p, w: task.deltas_of(layout, y, p, w)

        for name, layout in zip(task.metric_names, task.metric_layouts):
            try:
                with logs.quiet_absl():
                    self.host_function(update(layout))(*zeros)
            except dtensor_ops.Unlowerable as error:
                raise UsageError(f"metric {name!r} cannot run under --strategy=dtensor: it uses "
                                 f"the TensorFlow op {error.op}, which DTensor cannot lay out; "
                                 "train it under mirrored, multi_worker or horovod, or pick "
                                 "another metric") from None
            except (tf.errors.OpError, ValueError, TypeError) as error:
                text = str(getattr(error, "message", error)).strip().splitlines()
                reason = next((line.split("error: ", 1)[-1] for line in text if "error:" in line),
                              text[0] if text else type(error).__name__)
                raise UsageError(f"metric {name!r} cannot run under --strategy=dtensor: "
                                 f"{reason[:200]}; train it under mirrored, multi_worker or "
                                 "horovod, or pick another metric") from None

    def end_of_run(self) -> None:
        """Across processes: every peer reports its end to client 0, which
        hosts the coordination service and so leaves last (a peer still in
        the final gather when it exits would fail; see
        `compat.coordination_key_value`). Client 0 waits at most
        --collective_timeout_s, then leaves with a warning naming who was
        missing."""
        global _runs_ended
        spec = self._spec
        if spec is None or spec.num_workers <= 1:
            return
        _runs_ended += 1   # every process makes its runs in the same order
        put, get = compat.coordination_key_value()
        prefix = f"tfdist/run-{_runs_ended}/ended"
        if spec.worker_index:
            put(f"{prefix}/{spec.worker_index}", "1")
            return
        timeout_ms = int(self.config.collective_timeout_s * 1000)
        for peer in range(1, spec.num_workers):
            try:
                get(f"{prefix}/{peer}", timeout_ms)
            except tf.errors.OpError:
                logging.warning("%s: %s did not report the end of the run within "
                                "--collective_timeout_s=%gs; leaving anyway",
                                spec.name(0), spec.name(peer),
                                self.config.collective_timeout_s)

    def predict_on_mesh(self, model, x, batch_size: Optional[int] = None):
        """`model`'s outputs for host inputs `x`, computed SPMD on the mesh in
        batches of `batch_size` (default 32) rounded up to a multiple of the
        `batch` axis, each split over it; ZeRO-3 variables are gathered for
        use as in training. Outputs come back to the host as NumPy."""
        from tfdist.mesh_model import padded_batches

        per = self.axes[sharding.BATCH]
        batch = -(-(batch_size or 32) // per) * per
        inputs = getattr(model, "inputs", None) or []
        dtypes = [i.dtype for i in inputs] if len(inputs) == len(tf.nest.flatten(x)) else None
        structure = tf.nest.map_structure(lambda _: 0, x)   # e.g. a dict of inputs
        key = (id(model), repr(structure))
        forward = self._predict_fns.get(key)
        if forward is None:
            @tf.function(autograph=False)
            def forward(*xs):
                with self.compute_scope():
                    return model(tf.nest.pack_sequence_as(structure, list(xs)), training=False)
            self._predict_fns[key] = forward
        outputs = []
        for chunk, real in padded_batches(x, batch):
            xs = [_lay_out(tf.convert_to_tensor(c, dtype=dtypes[i] if dtypes else None),
                           dtensor.Layout.batch_sharded(self.mesh, sharding.BATCH, c.ndim))
                  for i, c in enumerate(chunk)]
            with dtensor.default_mesh(self.mesh):
                result = forward(*xs)
            outputs.append(tf.nest.map_structure(lambda t: self.to_host(t).numpy()[:real],
                                                 result))
        return tf.nest.map_structure(lambda *parts: np.concatenate(parts), *outputs)

    def host_copy_refusal(self, model) -> Optional[str]:
        """Why a whole copy of `model` would not fit this process (None if it
        would): the copy's variables plus the gathered arrays, twice the
        model's bytes, within half of its memory limit (the rest is
        TensorFlow's and training's). From the limit alone, not from what is
        free now: every process of a mesh must decide alike, as the copy's
        gathers are collectives (a `tfdist-launch --worker_memory` cap is the
        same for all)."""
        whole = sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in model.variables)
        limit = hardware.memory_limit_bytes()
        if 2 * whole <= limit / 2:
            return None
        return (f"a whole copy of the model ({whole / 2**20:,.0f} MiB of weights, twice that "
                f"while copying) would not fit half of this process's "
                f"{limit / 2**20:,.0f} MiB memory limit")

    # -- introspection (--print_layouts, the run summary) -------------------
    def device_bytes(self, variables) -> int:
        """Bytes of `variables` held by the first device of the mesh."""
        return sum(_shard_bytes(_read(v))[0] for v in variables)

    def summary_fields(self, model, optimizer) -> dict:
        return {"mesh": f"batch:{self.axes['batch']},model:{self.axes['model']}",
                # DTensor reduces inside its SPMD program, by layout; there is no
                # per-update gradient all-reduce whose size tfdist could state.
                "bytes_reduced_per_update": None,
                "zero_stage": self.zero,
                "shard_optimizer_state": self.zero >= 1,
                "device_parameter_bytes": self.device_bytes(model.variables),
                "device_optimizer_bytes": self.device_bytes(optimizer.variables)}

    def gradient_shards(self, model) -> Optional[list]:
        """The gradients of every trainable variable, as the trainer's backward
        pass leaves them (in `compute_scope`, then `shard_gradients`), for a
        stand-in loss (the sum of the outputs) on a batch of zeros: DTensors
        whose shards can be read. None for a model without symbolic inputs."""
        inputs = getattr(model, "inputs", None)
        if not inputs:
            return None
        batch = self.axes[sharding.BATCH]
        xs = [_lay_out(tf.zeros([batch, *i.shape[1:]], i.dtype),
                       dtensor.Layout.batch_sharded(self.mesh, sharding.BATCH, len(i.shape)))
              for i in inputs]
        variables = model.trainable_variables

        @tf.function(autograph=False)
        def gradients(*xs):
            with self.compute_scope(), tf.GradientTape() as tape:
                out = model(list(xs) if len(xs) > 1 else xs[0], training=True)
                loss = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32))
                                 for o in tf.nest.flatten(out)])
            grads = tape.gradient(loss, variables,
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
            return self.shard_gradients([tf.convert_to_tensor(g) for g in grads], variables)

        with dtensor.default_mesh(self.mesh), logs.quiet_absl():
            return gradients(*xs)

    def layout_rows(self, model, optimizer, gradients: bool = True) -> list:
        """One row per variable, gradient and optimizer slot: where it lives,
        read from its shards (`dtensor.unpack`), not computed from layouts.

        Each row: kind ("variable", "gradient", "slot"), path, shape, stored
        spec, compute spec (the layout a ZeRO-3 variable is gathered to for
        use; a gradient's is its variable's), global bytes, and the largest
        shard on a local device in bytes (`whole`: that shard is the whole).
        """
        rows = []

        def row(kind, path, value, compute=None):
            spec = _spec_of(value)
            shards = _shard_bytes(value)
            global_bytes = int(np.prod(value.shape)) * value.dtype.size
            rows.append({"kind": kind, "path": path, "shape": tuple(value.shape),
                         "stored": spec, "compute": compute or spec,
                         "global_bytes": global_bytes, "device_bytes": max(shards),
                         "whole": max(shards) == global_bytes})

        computes = {}
        for variable in model.variables:
            inner = variable.value if isinstance(variable, keras.Variable) else variable
            layout = getattr(inner, "compute_layout", None)
            computes[id(variable)] = _spec_of(layout) if layout is not None else None
            row("variable", variable.path, _read(variable), computes[id(variable)])
        grads = self.gradient_shards(model) if gradients else None
        for variable, grad in zip(model.trainable_variables, grads or ()):
            row("gradient", variable.path, grad, computes[id(variable)] or
                _spec_of(_read(variable)))
        for variable in optimizer.variables:
            row("slot", variable.path, _read(variable))
        return rows

    def layout_report(self, model, optimizer) -> str:
        """A table of every variable, gradient and optimizer slot, and the
        per-device totals against one device's."""
        rows = self.layout_rows(model, optimizer)
        table = [("kind", "path", "shape", "stored", "compute", "global bytes", "bytes/device")]
        totals = {}
        for r in rows:
            total = totals.setdefault(r["kind"], [0, 0])
            total[0] += r["global_bytes"]
            total[1] += r["device_bytes"]
            table.append((r["kind"], r["path"], "x".join(map(str, r["shape"])) or "scalar",
                          sharding.describe_spec(r["stored"]), sharding.describe_spec(r["compute"]),
                          f"{r['global_bytes']:,}", f"{r['device_bytes']:,}"))
        widths = [max(len(t[i]) for t in table) for i in range(len(table[0]))]
        lines = ["  ".join(c.ljust(w) if i < 5 else c.rjust(w)
                           for i, (c, w) in enumerate(zip(t, widths))).rstrip() for t in table]
        lines.insert(1, "-" * len(lines[0]))
        stage = {0: "", 1: " (ZeRO-1: optimizer slots also split over batch)",
                 2: " (ZeRO-2: optimizer slots and gradients also split over batch)",
                 3: " (ZeRO-3: variables, gradients and optimizer slots also split over "
                    "batch; variables gathered for use)"}[self.zero]
        lines.append(f"mesh batch:{self.axes['batch']} x model:{self.axes['model']}{stage}")
        names = {"variable": "parameters", "gradient": "gradients", "slot": "optimizer"}
        for kind, (global_bytes, device) in totals.items():
            lines.append(f"{names[kind]} total: {global_bytes:,} bytes; per device {device:,} "
                         f"({device / max(global_bytes, 1):.2f}x)")
        gathered = [r for r in rows if r["kind"] == "variable" and r["compute"] != r["stored"]]
        if gathered:
            top = max(gathered, key=lambda r: r["global_bytes"] // _split(r["compute"], self.axes))
            lines.append(f"largest gathered weight: {top['path']}, "
                         f"{top['global_bytes'] // _split(top['compute'], self.axes):,} bytes "
                         f"per device while in use")
        both = [sum(t[i] for t in totals.values()) for i in (0, 1)]
        what = " + ".join(names[k] for k in totals)
        lines.append(f"{what} per device: {both[1]:,} bytes "
                     f"({both[1] / max(both[0], 1):.2f}x of {both[0]:,})")
        return "\n".join(lines)


def _spec_of(value_or_layout) -> tuple:
    layout = (value_or_layout if isinstance(value_or_layout, dtensor.Layout)
              else dtensor.fetch_layout(value_or_layout))
    return tuple(None if a == dtensor.UNSHARDED else a for a in layout.sharding_specs)


def _shard_bytes(value) -> list:
    """Bytes of each local device's shard of DTensor `value`."""
    return [int(np.prod(t.shape)) * t.dtype.size for t in dtensor.unpack(value)]


def _split(spec, axes) -> int:
    return int(np.prod([axes[a] for a in spec if a]))
