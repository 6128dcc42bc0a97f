"""`pipeline`: pipeline parallelism over local devices or processes (issue 22).

The model is split into --pipeline_stages stages (`tfdist.pipeline.split`:
balanced by FLOPs over its blocks, or at --pipeline_split's layers); stage s
lives on device s (its layers' variables and their optimizer slots there) or
in worker s, and each global batch is cut into --microbatches (the same
number as --accum_steps) micro-batches that flow through the stages on a GPipe or 1F1B schedule
(`tfdist.pipeline.schedule`). One traced program holds every stage's items;
each stage's items are chained with control dependencies in its schedule's
order, so each device runs its own schedule and the stages' work overlaps
wherever the data allows. With more devices than stages (a multiple of S),
R = devices / S pipeline replicas each take 1/R of the batch, and their
gradients are summed before the one update.

Where it runs:
- in one process (no cluster): stage s on local device s: GPUs, or the
  logical CPUs of --virtual_devices. Logical CPUs share one process's
  threadpool, so they prove correctness and placement but never speed
  (README, "Pipeline parallelism").
- across processes (a TF_CONFIG cluster of N = S x R workers, e.g. from
  tfdist-launch): worker k runs stage k mod S of pipeline replica k div S,
  its own program (one client per stage: bench/pipeline_probe.py measured
  that one client driving several tasks runs their parts one after the
  other), and sends boundary tensors to its neighbours point to point
  (`CollectiveBcastSendV2`/`RecvV2` in a group of two). Each worker
  updates only its stage (`splits_update`): it sums its stage's gradients
  with the same stage of the other R - 1 pipeline replicas (a collective
  among those R workers; none for R = 1), the loss and metric counters and
  the clipping norm over all N, and applies the optimizer to its stage's
  variables. It also holds only its stage: the model is built whole (the
  split reads the built graph), then the storage of the other stages'
  weights is freed once every worker has the chief's, and their optimizer
  slots are freed as they are made (`compat.set_storage`; the variable
  objects stay, so checkpoints keep their layout). Evaluation runs through
  the stages like training (`forward`). A checkpoint or the end of training
  gathers every stage onto the chief (`gather_stages`, from each stage's
  replica 0, as FSDP's full state dict gathers on rank 0): the chief holds
  the whole model while it saves and after training (for export), the
  other workers never do. A restore writes every variable: each worker
  holds the whole model until the restored state is shared, then frees the
  others' stages again.

The update equals gradient accumulation of the same micro-batches on one
device: each micro-batch's loss is the trainer's (`MicroBatchLoss`), its
gradients flow back stage by stage (the boundary activation's gradient is the
next stage's input gradient), and each stage's are summed in micro-batch
order. BatchNorm-style state updates in each stage's forward, micro-batch by
micro-batch, as under accumulation; metrics are counted on the last stage.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import resource

import tensorflow as tf

from tfdist import cluster, compat
from tfdist.errors import UsageError, first_line
from tfdist.pipeline import schedule as schedule_lib
from tfdist.pipeline import split as split_lib
from tfdist.strategies.capabilities import PipelineStages
from tfdist.strategies.base import by_dtype
from tfdist.strategies.multi_worker import MultiWorkerStrategy


class PipelineStrategy(MultiWorkerStrategy, PipelineStages):
    """S stages (x R pipeline replicas) over the local devices, or over the
    processes of a cluster (one stage per process)."""

    name = "pipeline"
    _timeline = None   # TFDIST_PIPELINE_TIMELINE's recording (`_prepare_timeline`)
    supports_xla = False
    supports_xla_reason = ("a pipeline's stages run on different devices, and one XLA "
                           "cluster cannot span devices")

    def _create(self):
        config = self.config
        self.num_stages = stages = config.pipeline_stages
        self.stages = None          # `split.Stage`s, once placed
        self._stage_models = None
        self._stage_variables = None
        self._microbatches = None
        self._timeline = None
        self._stage_of = {}          # id(trainable variable) -> its stage
        self._released = set()       # ids of variables whose storage is freed here
        self._transfers = {}         # traced `gather_stages`/`scatter_stages`, by content
        spec = cluster.resolve(config.worker_hosts, config.task_index)
        self.processes = spec is not None and spec.num_workers > 1
        if not self.processes:
            self._spec, self._num_workers, self._worker_index = spec, 1, 0
            self.devices = cluster.local_devices(config.virtual_devices or None)
            if len(self.devices) < stages or len(self.devices) % stages:
                raise UsageError(
                    f"--pipeline_stages={stages} does not divide onto the "
                    f"{len(self.devices)} local device(s) ({', '.join(self.devices)}): use a "
                    f"divisor of {len(self.devices)}, or --virtual_devices=<a multiple of "
                    f"{stages}> on a CPU host")
            self.pipeline_replicas = len(self.devices) // stages
            self.local_stages = list(range(stages))
            return tf.distribute.get_strategy()
        if spec.num_workers % stages:
            raise UsageError(
                f"--pipeline_stages={stages} does not divide the cluster's "
                f"{spec.num_workers} workers: a cluster of S x R workers runs R pipeline "
                f"replicas of S stages, one stage per worker (e.g. tfdist-launch "
                f"--workers={stages * max(1, spec.num_workers // stages)})")
        strategy = super()._create()   # MultiWorkerMirroredStrategy: sets up the collectives
        self.pipeline_replicas = self._num_workers // stages
        self.stage = self._worker_index % stages
        self.replica = self._worker_index // stages
        self.local_stages = [self.stage]
        self.devices = list(strategy.extended.worker_devices[:1])
        return strategy

    @property
    def num_replicas(self) -> int:
        """Pipeline replicas: the global batch is split over them."""
        return self.pipeline_replicas if self.processes else 1

    @property
    def step_copies(self) -> int:
        """Across processes every worker runs the step and the trainer sums
        all N workers' results; in one process, one step."""
        return self._num_workers if self.processes else 1

    def describe(self) -> str:
        if self.processes:
            return (f"pipeline: {self.num_stages} stages x {self.pipeline_replicas} pipeline "
                    f"replica(s) over {self._num_workers} workers, "
                    f"{self.config.pipeline_schedule} schedule; this is "
                    f"{self.worker_name(self._worker_index)}: stage {self.stage} of replica "
                    f"{self.replica}{' (chief)' if self.is_chief else ''}")
        groups = [", ".join(self.devices[r * self.num_stages:(r + 1) * self.num_stages])
                  for r in range(self.pipeline_replicas)]
        return (f"pipeline: {self.num_stages} stages x {self.pipeline_replicas} pipeline "
                f"replica(s), {self.config.pipeline_schedule} schedule, on "
                + "; ".join(groups))

    def stage_device(self, stage: int, replica: int = 0) -> str:
        if self.processes:
            worker = replica * self.num_stages + stage
            return f"worker {worker}" if stage != self.stage or replica != self.replica \
                else self.devices[0]
        return self.devices[replica * self.num_stages + stage]

    def input_iterator(self, dataset_fn):
        """Across processes, the S workers of a pipeline replica read the same
        batches (stage 0 uses the inputs, the last stage the labels): R input
        pipelines, each replica's its own."""
        if not self.processes:
            return super().input_iterator(dataset_fn)
        iterator = iter(self.distribute_dataset(dataset_fn))
        return iterator, iterator

    # -- checks ------------------------------------------------------------------
    def check_config(self, config) -> None:
        tc = config.train
        self._microbatches = tc.accum_steps
        parts = self.pipeline_replicas * tc.accum_steps
        if tc.global_batch_size % parts:
            raise UsageError(
                f"--global_batch_size={tc.global_batch_size} must be divisible by pipeline "
                f"replicas ({self.pipeline_replicas}) x --microbatches ({tc.accum_steps}) "
                f"= {parts}; e.g. {max(parts, tc.global_batch_size // parts * parts)}")
        if tc.grad_compression in ("powersgd", "topk") or tc.sync_every:
            what = (f"--sync_every={tc.sync_every}" if tc.sync_every
                    else f"--grad_compression={tc.grad_compression}")
            raise UsageError(f"{what}: --strategy=pipeline reduces each stage's gradients "
                             "among that stage's replicas in its own step; it has no "
                             "per-replica compression or local SGD (fp16/bf16 casts work)")
        if tc.reduce_bucket_mb:
            raise UsageError(f"--reduce_bucket_mb={tc.reduce_bucket_mb}: --strategy=pipeline "
                             "makes one reduction per update; use --reduce_bucket_mb=0")
        if self.processes and tc.precision == "mixed_float16":
            raise UsageError("--precision=mixed_float16: across processes each pipeline "
                             "worker applies its own stage's update, and fp16 loss scaling "
                             "would skip steps stage by stage; use mixed_bfloat16 or float32")
        if self.processes and tc.grad_agreement_every:
            raise UsageError(f"--grad_agreement_every={tc.grad_agreement_every}: across "
                             "processes a pipeline worker holds one stage's gradients, not a "
                             "replica's; use --grad_agreement_every=0")

    # -- the model ---------------------------------------------------------------
    def place_model(self, model, input_signature=None) -> None:
        """Split `model` into its stages, balanced by FLOPs for inputs like
        `input_signature` (one example of the data, batch 1), and place them."""
        names = list(self.config.pipeline_split) or None
        self.stages = split_lib.split(model, self.num_stages, names=names,
                                      input_signature=input_signature)
        self._stage_models = split_lib.stage_models(model, self.stages)
        self._stage_variables = [m.trainable_variables for m in self._stage_models]
        self._stage_of = {id(v): s for s, variables in enumerate(self._stage_variables)
                          for v in variables}
        self._held = set()
        for s in self.local_stages:
            for variable in self._stage_models[s].variables:
                self._held.add(id(variable))
                if not self.processes:
                    compat.move_variable(variable, self.stage_device(s))
        self._prepare_timeline()
        if self.processes:
            for s in range(self.num_stages - 1):
                shape = self._stage_models[s].output.shape
                if any(d is None for d in shape[1:]):
                    raise UsageError(
                        f"pipeline stages across processes: the tensor between stage {s} and "
                        f"{s + 1} has shape {tuple(shape)}; its dimensions after the batch "
                        "must be fixed (e.g. --sequence_length) to be sent between workers")

    def _prepare_timeline(self) -> None:
        """With TFDIST_PIPELINE_TIMELINE=PREFIX (bench/pipeline.py), a worker
        of a cross-process pipeline records, for each of its items in the last
        step of every loop, the wall-clock time it started, the time its
        inputs were there (received, or read) and the time it ended, and
        `close` writes them to PREFIX-<worker>.json: the per-stage timeline
        and bubble (an item's busy time runs from its inputs to its end)."""
        self._timeline = None
        prefix = os.environ.get("TFDIST_PIPELINE_TIMELINE")
        if prefix and self.processes:
            m = self._microbatches or 1
            self._timeline_prefix = prefix
            self._timeline_items = schedule_lib.schedule(
                m, self.config.pipeline_schedule, self.num_stages)[self.stage]
            self._timeline = tf.Variable(tf.zeros([len(self._timeline_items), 3], tf.float64),
                                         trainable=False)

    def close(self) -> None:
        if self._timeline is not None:
            stamps = self._timeline.numpy().tolist()
            with open(f"{self._timeline_prefix}-{self._worker_index}.json", "w") as f:
                json.dump({"stage": self.stage, "replica": self.replica,
                           "schedule": self.config.pipeline_schedule,
                           "microbatches": self._microbatches,
                           # this process's peak resident memory (Linux: KiB)
                           "peak_rss_bytes": resource.getrusage(
                               resource.RUSAGE_SELF).ru_maxrss * 1024,
                           # [kind, micro-batch, started, inputs there, ended]
                           "items": [[kind, i, *times] for (kind, i), times
                                     in zip(self._timeline_items, stamps)]}, f)
            self._timeline = None
        super().close()

    # -- the update, across processes: each worker its stage's ---------------------
    @property
    def splits_update(self) -> bool:
        return self.processes

    def updated_variables(self, variables) -> list:
        if not self.processes:
            return list(variables)
        return [v for v in variables if id(v) in self._held]

    def reduce_update(self, grads, counters):
        """The stage's gradients summed over its R pipeline replicas (one
        collective per dtype among those R workers; none for R = 1), the
        counters over all N workers (the loss and metrics are counted on the
        last stage, zeros elsewhere)."""
        counters = self.all_reduce_sum([counters])[0]
        if self.pipeline_replicas == 1:
            return list(grads), counters
        return _StageGroup(self).all_reduce_sum(grads), counters

    def global_norm(self, grads):
        """Each stage's squared norm from its replica 0, summed over all workers."""
        squares = tf.add_n([tf.reduce_sum(tf.square(tf.cast(g, tf.float32))) for g in grads]
                           or [tf.zeros([])])
        if self.replica:
            squares = tf.zeros_like(squares)
        return tf.sqrt(self.all_reduce_sum([squares])[0])

    # -- holding one stage, across processes ------------------------------------
    def _components(self, variable) -> tuple:
        """The tf.Variables behind Keras variable `variable` (one per local device)."""
        return self._strategy.experimental_local_results(variable.value)

    def _set_storage(self, variable, value) -> None:
        for component in self._components(variable):
            compat.set_storage(component, value)

    def build_optimizer(self, optimizer, variables) -> None:
        """Across processes, each optimizer slot of another stage's variable is
        freed as soon as Keras makes it (Keras makes every slot through the
        public `add_variable_from_reference`), so the slots of the whole
        model are never held at once."""
        if not self.processes:
            optimizer.build(variables)
            return
        if self._worker_index:   # the chief keeps them until it has sent them (`scatter_stages`)
            for variable in variables:
                if id(variable) not in self._held:
                    self._release(variable)
        make = optimizer.add_variable_from_reference

        def add_variable_from_reference(reference, *args, **kwargs):
            slot = make(reference, *args, **kwargs)
            if id(reference) not in self._held:
                self._release(slot)
            return slot

        optimizer.add_variable_from_reference = add_variable_from_reference
        try:
            optimizer.build(variables)
        finally:
            del optimizer.add_variable_from_reference   # the class's again
        for variable, slots in zip(variables, compat.optimizer_slots(optimizer, variables)):
            missed = [slot.path for slot in slots
                      if id(variable) not in self._held and id(slot) not in self._released]
            if missed:
                raise RuntimeError(
                    f"optimizer {type(optimizer).__name__} made slot(s) {missed} without "
                    "add_variable_from_reference: the pipeline cannot free another stage's "
                    "slots (verified on keras 3.15.1)")

    def _release(self, variable) -> None:
        if id(variable) not in self._released:
            self._set_storage(variable, tf.zeros([0], variable.dtype))
            self._released.add(id(variable))

    def release_others(self, pairs) -> None:
        if not self.processes:
            return
        for variable, owner in pairs:
            if id(owner) not in self._held:
                self._release(variable)

    def materialize(self, pairs) -> None:
        for variable, _ in pairs:
            if id(variable) in self._released:
                self._set_storage(variable, tf.zeros(variable.shape, variable.dtype))
                self._released.discard(id(variable))

    def holds_whole_model(self) -> bool:
        return not self._released

    def gather_stages(self, pairs) -> None:
        """Each stage's replica-0 worker (worker s, for stage s) sends every
        variable and slot of its stage to the chief (worker 0, stage 0), one
        point-to-point transfer each, in a group of those two workers; the
        chief's storage of them is refilled. The other workers keep theirs."""
        if not self.processes or self.num_stages == 1:
            return
        self._traced("gather", pairs)()
        if self._worker_index == 0:
            self._released.clear()

    def scatter_stages(self, pairs) -> None:
        """The reverse of `gather_stages`: the chief sends each of `pairs` to
        every other worker of its stage (one point-to-point transfer each),
        which stores it. Unlike a broadcast (a sum over every worker of a
        whole-model tensor, with zeros from all but the chief) no worker ever
        holds more than its stage and one transfer."""
        if self.processes:
            self._traced("scatter", pairs)()

    def _traced(self, kind: str, pairs):
        """The traced transfers of `pairs` (kept per kind and content)."""
        pairs = list(pairs)
        key = (kind, tuple(id(v) for v, _ in pairs))
        if key not in self._transfers:
            self._transfers[key] = tf.function(lambda: self._transfer_fn(kind, pairs),
                                               autograph=False)
        return self._transfers[key]

    def _transfer_fn(self, kind: str, pairs):
        """Gather: stage s's variables from worker s to worker 0. Scatter: from
        worker 0 to every worker of their stage. One transfer at a time: a
        send holds copies of its tensor until it is received (serialised for
        the wire), and all at once had grown a 130M-parameter mlp's stage-1
        process by 1 GB."""
        me, done = self._worker_index, []
        for k, (variable, owner) in enumerate(pairs):
            stage = self._stage_of[id(owner)]
            if kind == "gather":
                moves = [(stage, 0, _Transfer.GATHER_GROUP_BASE + stage)] if stage else []
            else:
                moves = [(0, worker, _Transfer.SCATTER_GROUP_BASE + worker)
                         for worker in range(stage, self._num_workers, self.num_stages) if worker]
            for sender, receiver, group in moves:
                if me in (sender, receiver):
                    with tf.control_dependencies(done[-1:]):
                        done += self._move(variable, group, _Transfer.GATHER_INSTANCE_BASE + k,
                                           sending=me == sender)
        with tf.control_dependencies(done):   # (a send's output is used nowhere else)
            return tf.constant(0)

    def _move(self, variable, group_key: int, instance_key: int, sending: bool) -> list:
        """Send `variable`, or receive it into its storage: the ops to chain on."""
        wire = tf.float32 if variable.dtype == "bfloat16" else tf.as_dtype(variable.dtype)
        keys = dict(group_size=2, group_key=group_key, instance_key=instance_key,
                    communication_hint="auto",
                    timeout_seconds=float(self.config.collective_timeout_s))
        if sending:
            return [tf.raw_ops.CollectiveBcastSendV2(
                input=tf.cast(tf.convert_to_tensor(variable), wire), **keys)]
        value = tf.raw_ops.CollectiveBcastRecvV2(
            shape=tf.constant([int(d) for d in variable.shape], tf.int32), T=wire, **keys)
        return [compat.set_storage(component, value) for component in self._components(variable)]

    def forward(self, x, y):
        """This worker's stage of the evaluation forward pass of one batch:
        (the model's output, []) on the last stage, else (None, [the send to
        the next stage]). Stage 0 reads `x`, the others receive their
        neighbour's output; `y` gives the batch's rows."""
        stage, last = self.stage, self.num_stages - 1
        transfer = _Transfer(self, self.replica, tf.shape(tf.nest.flatten(y)[0])[0],
                             instance_base=_Transfer.EVAL_INSTANCE_BASE)
        with tf.name_scope(f"stage{stage}_E0"):
            source = x if stage == 0 else transfer.receive_activation(stage, 0)
            out = self._stage_models[stage](source, training=False)
            if stage == last:
                return out, []
            return None, [transfer.send_activation(stage, 0, out)]

    def distribute_dataset(self, dataset_fn):
        """Across processes (training, through `input_iterator`, and
        evaluation), the S workers of a pipeline replica read the same
        batches: R input pipelines, one per pipeline replica."""
        if not self.processes:
            return super().distribute_dataset(dataset_fn)
        context = tf.distribute.InputContext(
            num_input_pipelines=self.pipeline_replicas, input_pipeline_id=self.replica,
            num_replicas_in_sync=self.pipeline_replicas)
        with tf.device("/cpu:0"):
            return dataset_fn(context)

    def state_share(self, variable, value):
        """Across processes, the R workers of `variable`'s stage hold its
        state (BatchNorm statistics): each contributes S x its value and the
        others zeros, so the trainer's sum over all N = S x R workers divided
        by N is the mean over the R pipeline replicas."""
        if not self.processes:
            return value
        if id(variable) in self._held:
            return value * tf.cast(self.num_stages, value.dtype)
        return tf.zeros_like(value)

    def stage_report(self, model) -> str:
        if self.stages is None:
            self.place_model(model)
        m = self._microbatches or 1
        in_flight = schedule_lib.peak_in_flight(
            schedule_lib.schedule(m, self.config.pipeline_schedule, self.num_stages))
        lines = [self.describe(), split_lib.table(self.stages)]
        lines += [f"stage {s} on {self.stage_device(s)}: at most {in_flight[s]} of {m} "
                  f"micro-batches' activations held at once ({self.config.pipeline_schedule})"
                  for s in range(self.num_stages)]
        lines.append(f"ideal bubble (S-1)/(M+S-1) = {schedule_lib.bubble(self.num_stages, m):.0%}")
        return "\n".join(lines)

    def summary_fields(self, model, optimizer) -> dict:
        fields = {"pipeline_stages": self.num_stages,
                  "pipeline_replicas": self.pipeline_replicas,
                  "pipeline_schedule": self.config.pipeline_schedule,
                  "microbatches": self._microbatches,
                  "stage_layers": [list(s.layers) for s in self.stages or ()],
                  "stage_param_bytes": [s.param_bytes for s in self.stages or ()]}
        if self.processes:
            fields["stage"], fields["pipeline_replica"] = self.stage, self.replica
        return fields

    def describe_fault(self, error: Exception) -> str:
        """Names the stage (and its device or worker) whose item failed: every
        item's ops sit in a name scope `stage<s>_<F|B><micro-batch>`; across
        processes a neighbour's failure shows as this worker's transfer
        failing, which multi_worker's description traces to the peer."""
        text = str(getattr(error, "message", error))
        if self.processes:
            found = re.search(r"stage(\d+)_([FB])(\d+)", text)
            line = super().describe_fault(error)
            if found and "peer" not in line and "unreachable" not in line:
                kind = "forward" if found.group(2) == "F" else "backward"
                return (f"pipeline stage {self.stage} of replica {self.replica} "
                        f"({self.worker_name(self._worker_index)}, {kind} of micro-batch "
                        f"{found.group(3)}): {type(error).__name__}: {first_line(error)}")
            return re.sub(r"\bworker (\d+)\b", lambda w: f"worker {w.group(1)} (stage "
                          f"{int(w.group(1)) % self.num_stages})", line)
        found = re.search(r"stage(\d+)_([FB])(\d+)", text)
        if found and self.stages is not None:
            s = int(found.group(1))
            kind = "forward" if found.group(2) == "F" else "backward"
            return (f"pipeline stage {s} on {self.stage_device(s)} ({kind} of micro-batch "
                    f"{found.group(3)}): {type(error).__name__}: {first_line(error)}")
        return f"pipeline: {type(error).__name__}: {first_line(error)}"

    # -- the step ----------------------------------------------------------------
    def local_gradients(self, losses, x, y, weight):
        """This process's stages' gradients, in the order of
        `updated_variables(losses.variables)`; in one process, every stage's,
        summed over its pipeline replicas."""
        from tfdist.training.trainer import LocalGradients
        m = losses.micro_batches
        replicas = 1 if self.processes else self.pipeline_replicas
        parts = tf.nest.map_structure(
            lambda t: tf.reshape(t, [replicas, m, -1, *t.shape[1:]]), (x, y, weight))
        grads, separate, counters = {}, {}, None
        for r in range(replicas):
            replica = self.replica if self.processes else r
            more_grads, more_counters, more_separate = self._pipeline(
                losses, tf.nest.map_structure(lambda t: t[r], parts), replica, replicas)
            counters = more_counters if counters is None else counters + more_counters
            for into, more in ((grads, more_grads), (separate, more_separate)):
                for key, value in more.items():
                    into[key] = value if key not in into else into[key] + value
        def in_order(by_variable):
            return [by_variable[id(v)] for v in self.updated_variables(losses.variables)]

        return LocalGradients(in_order(grads), in_order(separate) if separate else [],
                              counters, losses.provisional_divisor())

    def _pipeline(self, losses, parts, replica, in_process_replicas):
        """One pipeline replica's items of this process's stages: ({id(variable):
        summed gradient}, summed counters (zeros where the last stage is
        elsewhere), {id(variable): regularization gradient kept apart})."""
        stages, m = self.num_stages, losses.micro_batches
        last_stage = stages - 1
        here = set(self.local_stages)
        plan = schedule_lib.schedule(m, self.config.pipeline_schedule, stages)
        rows = tf.shape(tf.nest.flatten(tf.nest.map_structure(lambda t: t[0], parts[1]))[0])[0]
        transfer = _Transfer(self, replica, rows) if self.processes else None
        outputs, inputs, tapes, regularization, input_grads = {}, {}, {}, {}, {}
        grads, separate = {}, {}
        counters = None
        last_item = {}
        sends, stamps = [], []
        apart = None
        timed = self._timeline is not None

        def mark(value):
            """`value`, after the timeline's stamp of when it was there (an
            item's inputs: received, or read from the batch)."""
            if not timed:
                return value
            with tf.control_dependencies(tf.nest.flatten(value)):
                stamps.append(tf.timestamp())
            with tf.control_dependencies([stamps[-1]]):
                return tf.nest.map_structure(tf.identity, value)
     # regularization gradients kept apart from the data's
        if last_stage not in here:
            # The loss is computed elsewhere; this worker still needs to know
            # whether its share is final (see `MicroBatchLoss.loss`) and the
            # counters' shape: the loss of a stand-in output, never run.
            x_0, y_0, w_0 = tf.nest.map_structure(lambda t: t[0], parts)
            rows = tf.shape(tf.nest.flatten(y_0)[0])[0]
            stand_in = tf.nest.map_structure(
                lambda t: tf.zeros(tf.concat([[rows], t.shape[1:]], 0), t.dtype),
                self._stage_models[last_stage].output)
            _, shape_of, _ = losses.loss(y_0, stand_in, w_0)
            counters = tf.zeros_like(shape_of)
        for s, kind, i in schedule_lib.build_order(plan):
            if s not in here:
                continue
            stage_model = self._stage_models[s]
            variables = self._stage_variables[s]
            after = [last_item[s]] if s in last_item else []
            place = contextlib.nullcontext() if self.processes else \
                tf.device(self.stage_device(s, replica))
            if timed:
                with tf.control_dependencies(after):
                    after = [tf.timestamp()]
                stamps.append(after[0])
            with place, tf.control_dependencies(after), tf.name_scope(f"stage{s}_{kind}{i}"):
                x_i, y_i, w_i = tf.nest.map_structure(lambda t: t[i], parts)
                if kind == "F":
                    if s == 0:
                        source = x_i
                    elif s - 1 in here:   # arrives on this stage's device
                        source = tf.nest.map_structure(tf.identity, outputs[(s - 1, i)])
                    else:
                        source = transfer.receive_activation(s, i)
                    source = mark(source)
                    with tf.GradientTape(persistent=True) as tape:
                        if s > 0:
                            tape.watch(source)
                        out = stage_model(source, training=True)
                        reg = None
                        if stage_model.losses:
                            # The trainer's share is per step copy and micro-batch;
                            # here R of the N = S x R workers (or, in one process,
                            # R pipelines in turn) add this stage's.
                            reg = losses.regularization(stage_model.losses) * (
                                self.num_stages if self.processes else 1 / in_process_replicas)
                        if s == last_stage:
                            loss, micro_counters, known = losses.loss(y_i, out, w_i)
                            apart = reg is not None and not known
                            if reg is not None and known:
                                loss += reg
                            out = losses.scale(loss)
                            counters = micro_counters if counters is None else \
                                counters + micro_counters
                    inputs[(s, i)], outputs[(s, i)], tapes[(s, i)] = source, out, tape
                    regularization[(s, i)] = reg
                    done = tf.nest.flatten(out)
                    if s < last_stage and s + 1 not in here:
                        # Not in the chain: a transfer completes only when the
                        # neighbour receives, which may come after this
                        # stage's next items (1F1B: its next forward's send
                        # waits for the neighbour's backward).
                        sends.append(transfer.send_activation(s, i, out))
                else:
                    tape = tapes.pop((s, i))
                    reg = regularization.pop((s, i))
                    out = outputs.pop((s, i))
                    source = inputs.pop((s, i))
                    sources = list(variables) + ([source] if s > 0 else [])
                    zero = tf.UnconnectedGradients.ZERO
                    if s == last_stage:
                        if timed:   # its input, the loss, is there from the start
                            stamps.append(stamps[-1])
                        got = tape.gradient(out, sources, unconnected_gradients=zero)
                    else:
                        seed = mark(input_grads.pop((s + 1, i)) if s + 1 in here else
                                    transfer.receive_gradient(s, i))
                        targets, seeds = [out], [seed]
                        if reg is not None and not apart:
                            targets.append(losses.scale(reg))
                            seeds.append(tf.ones_like(targets[-1]))
                        got = tape.gradient(targets, sources, output_gradients=seeds,
                                            unconnected_gradients=zero)
                    got = [tf.convert_to_tensor(g) for g in got]
                    for variable, g in zip(variables, got):
                        key = id(variable)
                        grads[key] = g if key not in grads else grads[key] + g
                    done = [grads[id(v)] for v in variables]
                    if s > 0:
                        if s - 1 in here:
                            input_grads[(s, i)] = got[-1]
                        else:
                            sends.append(transfer.send_gradient(s, i, got[-1]))
                        done.append(got[-1])
                    if reg is not None and apart:
                        extra = tape.gradient(losses.scale(reg), variables,
                                              unconnected_gradients=zero)
                        for variable, g in zip(variables, extra):
                            key = id(variable)
                            g = tf.convert_to_tensor(g)
                            separate[key] = g if key not in separate else separate[key] + g
                    del tape
                last_item[s] = tf.group(*done)
            if timed:
                with tf.control_dependencies([last_item[s]]):
                    stamps.append(tf.timestamp())
                last_item[s] = stamps[-1]
        if stamps:
            with tf.control_dependencies([self._timeline.assign(
                    tf.reshape(tf.stack(stamps), [-1, 3]))]):
                sends = sends + [tf.constant(0)]
        if sends:   # every transfer has run before the gradients are used
            with tf.control_dependencies(sends):
                grads = {key: tf.identity(g) for key, g in grads.items()}
        if apart is False or not separate:
            separate = {}
        return grads, counters, separate


class _Transfer:
    """Boundary tensors between the stages of one pipeline replica across
    processes: one point-to-point group (a 2-member collective group) per
    pair of neighbouring stages, one instance per micro-batch and direction.
    The shapes come from the stage models' outputs (fixed after the batch),
    the micro-batch's rows from the labels every worker reads."""

    GROUP_BASE = 1 << 20      # far above MultiWorkerMirroredStrategy's own keys
    INSTANCE_BASE = 1 << 20
    EVAL_INSTANCE_BASE = INSTANCE_BASE + (1 << 15)   # `PipelineStrategy.forward`'s
    # `gather_stages`: a group of worker 0 and worker s (stage s's owner)
    GATHER_GROUP_BASE = GROUP_BASE + (1 << 17)
    GATHER_INSTANCE_BASE = INSTANCE_BASE + (1 << 17)
    # `scatter_stages`: a group of worker 0 and worker w
    SCATTER_GROUP_BASE = GROUP_BASE + (1 << 18)

    def __init__(self, strategy: PipelineStrategy, replica: int, rows,
                 instance_base: int = INSTANCE_BASE):
        self._strategy = strategy
        self._replica = replica
        self._timeout = float(strategy.config.collective_timeout_s)
        self._rows = rows   # the batch's (or micro-batch's) rows
        self._instance_base = instance_base

    def _group(self, first: int) -> int:
        """The group of stages `first` and `first` + 1 of this replica."""
        return self.GROUP_BASE + self._replica * self._strategy.num_stages + first

    def _dtype(self, first: int):
        return tf.as_dtype(self._strategy._stage_models[first].output.dtype)

    def _wire(self, first: int):
        """The dtype a boundary tensor travels in: TensorFlow's collectives
        take no bfloat16 (TF 2.21), so bfloat16 goes as float32 (exactly:
        every bfloat16 is a float32) and is cast back on arrival."""
        dtype = self._dtype(first)
        return tf.float32 if dtype == tf.bfloat16 else dtype

    def _send(self, value, first: int, instance: int):
        return tf.raw_ops.CollectiveBcastSendV2(
            input=tf.cast(value, self._wire(first)), group_size=2, group_key=self._group(first),
            instance_key=self._instance_base + instance, communication_hint="auto",
            timeout_seconds=self._timeout)

    def _receive(self, first: int, instance: int):
        boundary = self._strategy._stage_models[first].output
        # Outside the stage's chain: every receive is posted when the step
        # starts, so the neighbour's send completes as soon as it runs and a
        # transfer's latency hides behind this stage's other items.
        with tf.control_dependencies(None):
            shape = tf.concat([[self._rows], tf.constant(boundary.shape[1:], tf.int32)], 0)
            received = tf.raw_ops.CollectiveBcastRecvV2(
                group_size=2, group_key=self._group(first),
                instance_key=self._instance_base + instance, shape=shape, T=self._wire(first),
                communication_hint="auto", timeout_seconds=self._timeout)
        return tf.cast(received, self._dtype(first))

    def send_activation(self, stage: int, i: int, value):
        return self._send(value, stage, 2 * i)

    def receive_activation(self, stage: int, i: int):
        return self._receive(stage - 1, 2 * i)

    def send_gradient(self, stage: int, i: int, value):
        return self._send(value, stage - 1, 2 * i + 1)

    def receive_gradient(self, stage: int, i: int):
        return self._receive(stage, 2 * i + 1)


class _StageGroup:
    """The R workers that run one stage (one per pipeline replica), as a
    collective group: their gradients summed, one collective per dtype."""

    GROUP_BASE = _Transfer.GROUP_BASE + (1 << 16)   # beside the stage pairs' groups
    INSTANCE_BASE = _Transfer.INSTANCE_BASE + (1 << 16)

    def __init__(self, strategy: PipelineStrategy):
        self._strategy = strategy

    def all_reduce_sum(self, tensors) -> list:
        instances = itertools.count(self.INSTANCE_BASE)   # one per dtype
        return by_dtype(tensors, lambda same: self._sum(same, next(instances)))

    def _sum(self, tensors, instance_key: int) -> list:
        """One collective for `tensors` (one dtype), packed into one vector."""
        dtype = tensors[0].dtype
        # bfloat16 (--grad_compression=bf16) goes as float32, as boundaries do.
        wire = tf.float32 if dtype == tf.bfloat16 else dtype
        flat = tf.concat([tf.reshape(tf.cast(t, wire), [-1]) for t in tensors], 0)
        summed = tf.raw_ops.CollectiveReduceV2(
            input=flat, group_size=self._strategy.pipeline_replicas,
            group_key=self.GROUP_BASE + self._strategy.stage, instance_key=instance_key,
            ordering_token=[], merge_op="Add", final_op="Id", communication_hint="auto",
            timeout_seconds=float(self._strategy.config.collective_timeout_s))
        parts = tf.split(summed, [t.shape.num_elements() for t in tensors])
        return [tf.cast(tf.reshape(part, t.shape), dtype) for part, t in zip(parts, tensors)]
