"""How a loop of training steps runs in the graph (Orbit's `StandardTrainer`).

`Trainer.train_loop(iterator, num_steps)` runs `num_steps` replica steps in
one engine call and returns their `LoopTotals`; `evaluate` runs the test
split. One replica step computes gradients over `accum_steps` micro-batches,
then makes exactly one cross-replica sum, of the gradients and the step's
metric counters together (or, under --grad_compression=powersgd|topk, the
exchange's own collectives, once per update), and applies the update. Under
local SGD (--sync_every) a step applies the replica's own gradient and the
loop averages the weights every K steps. When and how often loops
run (intervals, checkpoints, signals, rollback) is the `Controller`'s.
Everything engine-specific goes through the strategy adapter's hooks.
"""

from __future__ import annotations

import contextlib
import keras
import tensorflow as tf

from tfdist import compat
from tfdist.errors import UsageError, first_line
from tfdist.strategies.base import Strategy, TrainingState
from tfdist.strategies.capabilities import (LocalGradients, PipelineStages, ReplicaLocalState,
                                            ScheduledSteps, TensorSharding, capability)
from tfdist.training import compression, micro_batches, nonfinite, xla
from tfdist.training.local_sgd import LocalSGDSteps
from tfdist.training.micro_batches import MicroBatchLoss
from tfdist.training.precision import Precision
from tfdist.training.task import Task
from tfdist.observe.totals import LOSS_DIVISOR, LOSS_NUMERATOR, METRICS, LoopTotals


def _dense(grads) -> list:
    # Embeddings give IndexedSlices, which neither sum across micro-batches nor
    # cast for compression; the engines densify them for the all-reduce anyway.
    return [tf.convert_to_tensor(g) for g in grads]


@contextlib.contextmanager
def _traced_without_autograph():
    """A model whose `call` branches on a tensor in Python is a `UsageError`:
    tfdist traces without AutoGraph, as Keras 3's `fit` does (BUILD_NOTES)."""
    try:
        yield
    except tf.errors.OperatorNotAllowedInGraphError as error:
        raise UsageError(
            f"the model uses a tensor's value in Python control flow ({first_line(error)}); "
            "tfdist traces the step without AutoGraph, as Keras 3's fit does: write "
            "keras.ops.cond, tf.cond or tf.while_loop instead of `if`/`for` on a tensor"
        ) from None


def total_steps(train_config, spec) -> int:
    """The final global step: `train_steps`, or `epochs` over the train split."""
    if train_config.train_steps:
        return train_config.train_steps
    if not spec.train_examples:
        raise UsageError(f"--epochs={train_config.epochs} needs a dataset of known size; "
                         "set --train_steps instead")
    return train_config.epochs * max(1, spec.train_examples // train_config.global_batch_size)


class Trainer(LocalSGDSteps):
    """The in-graph part of training `model` under `strategy` (see module doc)."""

    def __init__(self, *, config, strategy: Strategy, model: keras.Model,
                 optimizer: keras.optimizers.Optimizer, task: Task, jit_level: str = xla.OFF):
        self.config, self.train_config = config, config.train
        self.strategy, self.model, self.optimizer, self.task = strategy, model, optimizer, task
        self.global_batch_size = config.train.global_batch_size
        self.counters_size = METRICS + task.metric_size
        self.compression = compression.create(config.train, model.trainable_variables,
                                              optimizer)
        # Local SGD (--sync_every=K): replicas step on their own gradients,
        # and the weights are averaged every K steps (`_local_sgd_loop_fn`).
        self.sync_every = config.train.sync_every
        self.local_state = capability(strategy, ReplicaLocalState)
        if self.compression.stateful:
            self.compression.build(self.local_state)
        self.bytes_per_update = (
            sum(compression.bytes_of(v) for v in model.trainable_variables) / self.sync_every
            if self.sync_every else self.compression.bytes_per_update(model.trainable_variables))
        self.jit_level = jit_level
        self.sharded = capability(strategy, TensorSharding)
        self.pipeline = capability(strategy, PipelineStages)
        # Across processes a pipeline worker updates only its stages' variables
        # (`PipelineStages.splits_update`): it reduces, clips and applies those,
        # and holds only those; the chief gathers the rest for a checkpoint (`gather_state`).
        self.split_update = bool(self.pipeline and self.pipeline.splits_update)
        self.updated_variables = (self.pipeline.updated_variables(model.trainable_variables)
                                  if self.split_update else model.trainable_variables)
        with strategy.scope():
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step",
                                    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        # XLA outside a whole-step compilation: each variable's optimizer
        # update fused into one kernel.
        if jit_level == xla.OPTIMIZER or (jit_level == xla.STEP and (
                not strategy.xla_whole_step or self._micro_batches_compiled)):
            xla.fuse_optimizer_update(optimizer)
        self.compile_loops()

    @property
    def state_variables(self) -> list:
        """Everything a replica must share with the chief: weights, optimizer, step."""
        return [*self.model.variables, *self.optimizer.variables, self.step]

    @property
    def replica_state_variables(self) -> list:
        """State each replica holds for itself and every process saves beside
        a checkpoint (`checkpointing.ReplicaState`): the compression's error
        feedback (and PowerSGD's Q); under local SGD, the optimizer's state,
        which is not averaged."""
        variables = list(self.compression.state_variables)
        if self.sync_every:
            variables += list(self.optimizer.variables)
        return variables

    def current_step(self) -> int:
        return int(self.strategy.to_host(self.step).numpy())

    def compile_loops(self) -> None:
        """(Re)create the traced step and loop functions. They bake in the
        number of replicas (an elastic engine's membership change needs fresh
        ones). XLA: the whole replica step where the engine's sum is no
        collective; else the gradients (and the update, fused per variable)
        around the sum; with micro-batches, each micro-batch's gradients
        (their loop stays in TensorFlow: `xla`)."""
        self._step_fn, self._gradients_fn = self._replica_train_step, self._local_gradients
        self._micro_fn = self._micro_batch_gradients
        if self._micro_batches_compiled:
            self._micro_fn = tf.function(self._micro_batch_gradients, jit_compile=True,
                                         autograph=False)
        elif self.jit_level == xla.STEP and self.strategy.xla_whole_step:
            self._step_fn = tf.function(self._replica_train_step, jit_compile=True,
                                        autograph=False)
        elif self.jit_level == xla.STEP:
            self._gradients_fn = tf.function(self._local_gradients, jit_compile=True,
                                             autograph=False)
        loop_fn = self._local_sgd_loop_fn if self.sync_every else self._train_loop_fn
        if self.sync_every:
            self._step_fn = self._replica_local_step
        if isinstance(self.strategy, ScheduledSteps):
            self._train_loop = self.strategy.scheduled_loop(loop_fn)
        else:
            self._train_loop = self.strategy.host_function(loop_fn)
        self._eval_loop = self.strategy.host_function(self._eval_loop_fn)

    @property
    def _micro_batches_compiled(self) -> bool:
        """Whether XLA compiles each micro-batch (not the step around their loop)."""
        return (self.jit_level == xla.STEP and self.train_config.accum_steps > 1
                and not self.sharded and not self.pipeline)

    # -- the host's calls ------------------------------------------------------
    def train_loop(self, iterator, num_steps: int, measure_agreement: bool) -> LoopTotals:
        """`num_steps` steps from `iterator` (a `Strategy.input_iterator`).
        `measure_agreement` (a full extra pass and a small collective) also
        measures the per-replica gradient agreement at the last step."""
        # The exchange may change between loops (top-k's warm-up): a trace per key.
        key = self.compression.loop_key(self.current_step()) if self.compression.boundaries() \
            else None
        with _traced_without_autograph():
            result = self._train_loop(iterator, tf.constant(num_steps), measure_agreement, key)
        return result if isinstance(result, LoopTotals) else LoopTotals.from_tensors(result)

    @property
    def training_state(self) -> TrainingState:
        """What this run trains and keeps, for the engine's lifecycle hooks."""
        return TrainingState(self.state_variables, self._owned_state, self.step)

    def gather_state(self) -> None:
        """Before a checkpoint and at the end of training: the chief holds the
        whole state (`Strategy.gather_state`; engines that split it across
        processes move it, only then: it moves the whole model and its slots)."""
        self.strategy.gather_state(self.training_state)

    def release_state(self) -> None:
        """After a checkpoint is written: undo `gather_state`."""
        self.strategy.release_state(self.training_state)

    def gather_model(self) -> None:
        """At the end of training: the trained model on the chief (`Strategy.gather_model`)."""
        self.strategy.gather_model(self.training_state)

    def hold_state(self) -> None:
        """Before a restore (which writes every variable): storage for all of
        it in this process (no collective)."""
        self.strategy.hold_state(self.training_state)

    def broadcast_state(self, restored: bool) -> None:
        """Every replica starts from the chief's state (`restored`: whether this
        process restored a checkpoint)."""
        self.strategy.broadcast_state(self.training_state, restored)

    def evaluate_counters(self, iterator, num_steps: int):
        """Summed loss and metric counters over `num_steps` evaluation batches."""
        with _traced_without_autograph():
            return self._eval_loop(iterator, tf.constant(num_steps)).numpy()

    def results(self, counters) -> dict:
        """Loss and metrics from summed counters."""
        return self.task.results(float(counters[LOSS_NUMERATOR]), float(counters[LOSS_DIVISOR]),
                                 counters[METRICS:self.counters_size])

    # -- gradients (on every replica, inside tf.function) ----------------------
    def _micro_batch_gradients(self, x, y, weight) -> LocalGradients:
        """Gradients of this micro-batch's share of the global loss, and its counters."""
        variables = self.model.trainable_variables
        with self._compute_scope():
            return self._micro_batch_gradients_in_scope(x, y, weight, variables)

    def _compute_scope(self):
        return self.sharded.compute_scope() if self.sharded else contextlib.nullcontext()

    def _loss_and_counters(self, y, y_pred, weight):
        """(this micro-batch's share of the global data loss, its counters, the
        global divisor or None where it depends on the data)."""
        numerator, divisor, global_divisor = self.task.loss_terms(
            y, y_pred, weight, tf.ones(tf.shape(weight)[:1]))
        # Scale by the *global* divisor, so summing over replicas and
        # micro-batches gives the gradient of the global loss (or, when it
        # depends on the data, by the global batch and rescale later).
        loss = numerator / (global_divisor or self.global_batch_size)
        counters = tf.concat([tf.stack([numerator, divisor]),
                              self.task.metric_deltas(y, y_pred, weight)], axis=0)
        return loss, counters, global_divisor

    def _regularization_share(self, losses):
        """One copy's and micro-batch's share of the regularization `losses`."""
        return tf.add_n(losses) / (self.strategy.step_copies * self.train_config.accum_steps)

    def _micro_batch_gradients_in_scope(self, x, y, weight, variables) -> LocalGradients:
        with tf.GradientTape(persistent=True) as tape:
            y_pred = self.model(x, training=True)
            loss, counters, global_divisor = self._loss_and_counters(y, y_pred, weight)
            regularization = None
            if self.model.losses:
                regularization = self._regularization_share(self.model.losses)
                if global_divisor:
                    loss += regularization
            # Identity unless the optimizer scales losses (mixed_float16): then
            # the gradients come out scaled and `apply` unscales them.
            scaled_loss = self.optimizer.scale_loss(loss)
            apart = regularization is not None and not global_divisor
            if apart:
                scaled_regularization = self.optimizer.scale_loss(regularization)
        grads = _dense(self.strategy.gradients(tape, scaled_loss, variables))
        separate = (_dense(self.strategy.gradients(tape, scaled_regularization, variables))
                    if apart else [])
        del tape
        if self.sharded:
            grads = self.sharded.shard_gradients(grads, variables)
            separate = self.sharded.shard_gradients(separate, variables) if separate else []
        provisional = None if global_divisor else tf.constant(
            float(self.global_batch_size), tf.float32)
        return LocalGradients(grads, separate, counters, provisional)

    def _local_gradients(self, x, y, weight) -> LocalGradients:
        """This replica's gradients summed over its micro-batches."""
        if self.pipeline:   # micro-batches through the stages, on the engine's schedule
            with self._compute_scope():
                return self.pipeline.local_gradients(MicroBatchLoss(self), x, y, weight)
        k = self.train_config.accum_steps
        if k == 1:
            return self._micro_batch_gradients(x, y, weight)
        # Summed locally; reduced once afterwards.
        return micro_batches.summed(self._micro_fn, (x, y, weight), k,
                                    unrolled=bool(self.sharded))

    def _reduce(self, tensors):
        """Sum `tensors` (gradients in variable order, then the counters) over
        replicas: one reduction, or buckets of ~`reduce_bucket_mb` from the last
        variable backwards, each an independent collective that can start as
        soon as the backward pass has produced its gradients."""
        limit = self.train_config.reduce_bucket_mb * 1e6
        if not limit or self.train_config.accum_steps > 1:
            return self.strategy.all_reduce_sum(tensors)
        buckets, bucket, size = [], [], 0
        *grads, counters = range(len(tensors))
        for index in reversed(grads):
            bucket.append(index)
            size += tensors[index].shape.num_elements() * tensors[index].dtype.size
            if size >= limit:
                buckets.append(bucket)
                bucket, size = [], 0
        if bucket or not buckets:
            buckets.append(bucket)
        buckets[-1].append(counters)   # with the first layers' gradients, which come last
        reduced = [None] * len(tensors)
        for bucket in buckets:
            for index, value in zip(bucket, self.strategy.all_reduce_sum(
                    [tensors[i] for i in bucket])):
                reduced[index] = value
        return reduced

    def _global_gradients(self, local: LocalGradients):
        """(the global gradient of `updated_variables`, the reduced counters):
        one cross-replica sum, or the stateful exchange's collectives
        (`compression.StatefulExchange`: PowerSGD's two all-reduces, top-k's
        all-reduce and all-gather)."""
        variables = self.updated_variables
        if self.compression.stateful:
            data, separate, counters = self.compression.exchange(
                local.data, local.regularization, local.counters,
                replicas=self.strategy.num_replicas, reduce=self.strategy.all_reduce_sum,
                gather=self.local_state.all_gather)
            return self._rescaled(data, separate, counters, local.provisional_divisor)
        sent = self.compression.compress(local.data + local.regularization)
        if self.split_update:
            summed, counters = self.pipeline.reduce_update(sent, local.counters)
            reduced = [*summed, counters]
        else:
            reduced = self._reduce(sent + [local.counters])
        grads = self.compression.decompress(
            reduced[:-1], variables * (2 if local.regularization else 1))
        data, separate = grads[:len(variables)], grads[len(variables):]
        return self._rescaled(data, separate, reduced[-1], local.provisional_divisor)

    @staticmethod
    def _rescaled(data, separate, counters, provisional_divisor):
        """(the gradient, `counters`): `data` rescaled by the divisor in
        `counters` where it was provisional (`LocalGradients`), plus `separate`."""
        if provisional_divisor is not None:   # rescale by the reduced global divisor
            factor = tf.math.divide_no_nan(provisional_divisor, counters[LOSS_DIVISOR])
            data = [g * tf.cast(factor, g.dtype) for g in data]
        if separate:
            data = [g + r for g, r in zip(data, separate)]
        return data, counters

    # -- the replica step -------------------------------------------------------
    def _replica_train_step(self, batch, report: bool = False,
                            measure_agreement: bool = False) -> dict:
        """One update. `report` (the last step of a loop) also measures the
        global gradient norm, `measure_agreement` the per-replica gradient
        agreement: each is a full pass over the gradients (the norm cost 13%
        of the FFN mlp's step when taken at every step), so only then."""
        x, y, weight = batch
        local = self._gradients_fn(x, y, weight)
        grads, counters = self._global_gradients(local)
        out = {"counters": counters, "grad_norm": tf.zeros([])}
        norm = None
        clip = self.optimizer.global_clipnorm if self.split_update else None
        if report or clip:
            norm = (self.pipeline.global_norm(grads) if self.split_update
                    else tf.linalg.global_norm(grads))
        if clip:
            # Keras's `global_clipnorm` would clip this process's stages by
            # their own norm: clip by the whole model's, as Keras does
            # (scale = clip * min(1/norm, 1/clip)); Keras's own clip of the
            # result then scales by 1 (within an ulp).
            scale = clip * tf.minimum(1.0 / norm, 1.0 / clip)
            grads = [g * tf.cast(scale, g.dtype) for g in grads]
        if report:  # the global gradient's norm, before clipping, without loss scaling
            out["grad_norm"] = norm
            scale = Precision.dynamic_scale(self.optimizer)
            if scale is not None:
                out["grad_norm"] = out["grad_norm"] / tf.cast(scale, tf.float32)
        if measure_agreement:
            out["agreement"] = self._replica_agreement(local.data, grads)
        variables = self.updated_variables
        if self.split_update:
            grads, variables = self.pipeline.applied_update(grads, variables)
        nonfinite.apply_unless_nonfinite(
            self.strategy, self.train_config.on_nonfinite, counters,
            lambda g: self.optimizer.apply(g, variables), grads)
        if self.split_update:
            self.pipeline.share_update(self.updated_variables)
        return out

    def _replica_agreement(self, local, summed):
        """Cosine similarity of this replica's gradient with the cross-replica sum
        (the mean's direction), gathered from every replica: one extra small sum,
        only at the steps measured."""
        dot = tf.add_n([tf.reduce_sum(a * b) for a, b in zip(local, summed)])
        cosine = dot / (tf.linalg.global_norm(local) * tf.linalg.global_norm(summed) + 1e-30)
        mine = tf.one_hot(self.strategy.replica_id(), self.strategy.num_replicas) * cosine
        return self.strategy.all_reduce_sum([mine])[0]

    def _owned_state(self) -> list:
        """(variable, the trainable variable whose owner holds it) for every
        trainable variable and optimizer slot, where `split_update`."""
        trainable = self.model.trainable_variables
        pairs = [(v, v) for v in trainable]
        for variable, slots in zip(trainable, compat.optimizer_slots(self.optimizer, trainable)):
            pairs += [(slot, variable) for slot in slots]
        return pairs

    def _synced_state(self):
        return [v for v in self.model.non_trainable_variables if "float" in v.dtype]

    def _replica_sum_state(self):
        """Sum non-trainable float state (BatchNorm moving statistics) over replicas.

        Keras 3 creates these with aggregation "none", so under tf.distribute
        each replica keeps its own moving averages of its own batches. They
        are averaged once per loop, before anything reads them (evaluation,
        checkpoints); as they are exponential moving averages, which are
        linear, this equals averaging every update. The variables are read
        into tensors first: MultiWorkerMirroredStrategy cannot all-reduce a
        variable itself ("destinations can not be empty"); the average is
        assigned outside replica context (`_train_loop_fn`), once for every copy.
        """
        values = [tf.identity(v.value) for v in self._synced_state()]
        if self.pipeline:   # a stage's state counts only where the stage runs
            values = [self.pipeline.state_share(v, value)
                      for v, value in zip(self._synced_state(), values)]
        return self.strategy.all_reduce_sum(values)

    def _replica_eval_step(self, batch):
        x, y, weight, real = batch
        if self.split_update:   # through the stages; counted on the last
            with self._compute_scope():
                y_pred, sends = self.pipeline.forward(x, y)
            if y_pred is None:
                with tf.control_dependencies(sends):
                    counters = tf.zeros([self.counters_size])
                return self.strategy.all_reduce_sum([counters])[0]
        else:
            with self._compute_scope():
                y_pred = self.model(x, training=False)
        numerator, divisor, _ = self.task.loss_terms(y, y_pred, weight, real)
        counters = tf.concat([tf.stack([numerator, divisor]),
                              self.task.metric_deltas(y, y_pred, weight)], axis=0)
        return self.strategy.all_reduce_sum([counters])[0]

    # -- in-graph loops -----------------------------------------------------------
    def _train_loop_fn(self, iterator, num_steps, measure_agreement: bool, key=None) -> dict:
        """`num_steps` replica steps, as `LoopTotals.fields`. The last step, traced
        separately after the loop, also reports the gradient norm and, with
        `measure_agreement` (a Python bool), the agreement, which adds a
        collective: collectives cannot sit in a `tf.cond` in replica context.
        `key` (the exchange's `loop_key`) only makes a trace per value."""
        step = self._loop_step(iterator)
        # Steps are sequential by nature (each reads the last update); also say
        # so to the while loop, or it may start the next step's collectives
        # early, which engines that name them (Horovod) refuse.
        _, tally = tf.while_loop(lambda i, _: i < num_steps - 1, step,
                                 (tf.constant(0), nonfinite.tally(self.counters_size)),
                                 parallel_iterations=1)
        last = self.strategy.run(self._step_fn, self.strategy.next_batch(iterator), True,
                                 measure_agreement)
        result = self._end_loop(tally, last, num_steps)
        if measure_agreement:
            result["agreement"] = last["agreement"]
        return result

    def _loop_step(self, iterator):
        """The while-loop body of one replica step: (i, tally) -> (i + 1, tally)."""
        def step(i, tally):
            out = self.strategy.run(self._step_fn, self.strategy.next_batch(iterator))
            return i + 1, nonfinite.tally_add(tally, out["counters"], i)
        return step

    def _end_loop(self, tally, last, num_steps) -> dict:
        """After a loop's steps (`last`: its last step's result): the tally
        completed, BatchNorm statistics averaged over the copies, the global
        step advanced; `LoopTotals.fields` but the agreement."""
        tally = nonfinite.tally_add(tally, last["counters"], num_steps - 1)
        if self.strategy.step_copies > 1 and self._synced_state():
            summed = self.strategy.run(self._replica_sum_state)
            for variable, total in zip(self._synced_state(), summed):
                variable.assign(total / self.strategy.step_copies)
        self.step.assign_add(tf.cast(num_steps, tf.int64))
        counters, bad, first_bad = tally
        return {"counters": counters, "grad_norm": last["grad_norm"], "nonfinite": bad,
                "first_nonfinite": first_bad}

    def _eval_loop_fn(self, iterator, num_steps):
        def step(i, totals):
            return i + 1, totals + self.strategy.run(self._replica_eval_step, next(iterator))

        return tf.while_loop(lambda i, _: i < num_steps, step,
                             (tf.constant(0), tf.zeros([self.counters_size])),
                             parallel_iterations=1)[1]
