"""`DTensorStrategy`: the `dtensor` engine's adapter (see the package's
docstring for how a Keras 3 model runs on the mesh)."""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

from absl import logging
import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist import cluster, compat, sharding
from tfdist.errors import UsageError
from tfdist.strategies.base import Strategy
from tfdist.strategies.capabilities import GlobalBatchStatistics, TensorSharding, ZeroStages
from tfdist.observe import hardware, logs
from tfdist.strategies.multi_worker import engine as multi_worker
from tfdist.strategies.dtensor import clients
from tfdist.strategies.dtensor import init as dtensor_init
from tfdist.strategies.dtensor import ops as dtensor_ops
from tfdist.strategies.dtensor import updates as dtensor_updates
from tfdist.strategies.dtensor.gather import Gathering
from tfdist.strategies.dtensor.report import LayoutReport
from tfdist.strategies.dtensor.variables import VariableCreation, _gather, _lay_out, _read


class DTensorStrategy(VariableCreation, LayoutReport, Strategy, TensorSharding, ZeroStages,
                      GlobalBatchStatistics):
    name = "dtensor"
    statistics_collective = False   # one SPMD program: its moments are the global batch's
    supports_xla = False
    supports_xla_reason = ("DTensor expands its SPMD program itself, outside XLA, on CPU; "
                           "it has no per-replica step to compile")
    fused_kernels = False   # DTensor has no layout propagation for FusedBatchNormV3

    def __init__(self, config):
        super().__init__(config)
        self.layout_rules = sharding.LayoutRules()
        self.axes = dict(sharding.parse_mesh(config.mesh))
        self.mesh = None
        self._spec = None        # the cluster, when the mesh spans processes
        self._refused = None     # a UsageError of variable creation (see `scope`)
        self._var_specs = {}     # model variable path -> (compute spec, stored spec)
        self._update_layouts = {}  # id(trainable variable) -> its update's layout
        self._var_layouts = {}     # id(trainable variable) -> its stored layout
        self.zero = config.zero  # the ZeRO stage (--zero_stage)
        self._predict_fns = {}   # (id(model), input structure) -> traced forward pass
        self._layer_names = set()  # the model's layers, to name one in a refusal
        self._initial_values = dtensor_init.ShardedInit(to_host=self.to_host)
        self.gathering = Gathering()   # ZeRO-3: when reads gather (`compute_scope`)

    # -- lifecycle ---------------------------------------------------------
    def setup(self) -> None:
        size = self.axes[sharding.BATCH] * self.axes[sharding.MODEL]
        compat.dtensor_fsdp_lowering(self.axes, self.zero)
        self._spec = cluster.resolve(self.config.worker_hosts, self.config.task_index)
        if self._spec is not None and self._spec.num_workers > 1:
            self.mesh = clients.setup_clients(self._spec, self.config, size)
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
        # powersgd/topk and --sync_every need per-replica state: the generic
        # capability check refuses them (`capabilities.ReplicaLocalState`).
        if config.train.grad_compression in ("fp16", "bf16"):
            raise UsageError(
                f"--grad_compression={config.train.grad_compression} does not apply to "
                "--strategy=dtensor: DTensor reduces gradients inside its SPMD program, not "
                "through an all-reduce tfdist could cast; use --grad_compression=none")

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

    def synchronize_batch_statistics(self, layers) -> str:
        del layers   # the step is one program over the global batch
        return "BatchNorm statistics over the global batch already (one SPMD program)"

    # -- variables on the mesh ----------------------------------------------
    def set_layout_rules(self, rules) -> None:
        self.layout_rules = rules

    def prepare_model(self, model) -> None:
        """Under stage 3, each layer that owns a gathered variable itself gathers
        its weights for its own computation only (`Gathering.per_layer`). Not a
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
                layer.call = self.gathering.per_layer(layer, layer.call)

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
        with self.gathering.scope(), dtensor_ops.shardable_gradients(), \
                compat.custom_gradients_on_tape():
            yield

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
        self._refused = None
        try:
            with tf.variable_creator_scope(self._creator):
                yield
        except Exception:
            # Keras re-raises an error from variable creation in its own type:
            # the user's error (e.g. a bad layout rule) is the creator's.
            if self._refused is not None:
                raise self._refused from None
            raise

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
            # Grappler's memory scheduling sizes what it rewrites by the
            # global shapes, not the shards (compat's docstring).
            with dtensor.default_mesh(self.mesh), \
                    compat.dtensor_without_grappler_memory_scheduling():
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
        """Across processes, each process reports its end and client 0 leaves
        last (`clients.end_of_run`)."""
        clients.end_of_run(self._spec, self.config)

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
