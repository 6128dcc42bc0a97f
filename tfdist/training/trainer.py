"""The custom training loop, shaped like Orbit.

The trainer owns the outer loop (how many steps per call, evaluation,
checkpoints, logs); each inner `tf.function` call runs `steps_per_loop`
replica steps in-graph. One replica step computes gradients over
`accum_steps` micro-batches, then makes exactly one cross-replica sum, of the
gradients and the step's metric counters together, and applies the update.
Everything engine-specific goes through the strategy adapter's hooks.
"""

from __future__ import annotations

import os
import time
from typing import Optional

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfdist.checkpointing import Checkpointer, InputPosition
from tfdist.data import inputs as inputs_lib
from tfdist.observe import flops as flops_lib
from tfdist.observe import logs
from tfdist.observe.progress import Progress
from tfdist.observe import tensorboard
from tfdist.observe.tensorboard import Profiler, TensorBoard
from tfdist.strategies.base import Strategy
from tfdist.errors import NonFiniteLoss, UsageError, WorkerFault
from tfdist.training import optimizers, xla
from tfdist.training.compression import GradientCompression
from tfdist.training.interrupts import Preempted, StopSignals
from tfdist.training.precision import Precision
from tfdist.training.task import Task, task_for

# The counters every replica step returns (summed across replicas in the
# step's one reduction): the loss numerator and divisor (`Task.loss_terms`),
# then every metric's state change (`Task.metric_deltas`); the train loop
# appends the global gradient norm at its last step.
_LOSS_NUMERATOR, _LOSS_DIVISOR, _METRICS = 0, 1, 2


def _apply_if(finite, optimizer, grads, variables) -> None:
    """`optimizer.apply(grads, variables)` only where `finite` (the same on every
    replica). Keras optimizers call `merge_call` under some tf.distribute
    strategies, which may not sit in a replica-context `tf.cond`: there the
    condition is taken in cross-replica context, as Keras's LossScaleOptimizer does."""

    def apply():
        optimizer.apply(grads, variables)
        return tf.constant(True)

    if tf.__internal__.distribute.strategy_supports_no_merge_call():
        tf.cond(finite, apply, lambda: tf.constant(False))
        return

    def cross_replica(distribution, grads, finite):
        finite = distribution.experimental_local_results(finite)[0]

        def apply_everywhere():
            distribution.extended.call_for_each_replica(
                lambda g: optimizer.apply(g, variables), args=(grads,))
            return tf.constant(True)

        tf.cond(finite, apply_everywhere, lambda: tf.constant(False))

    tf.distribute.get_replica_context().merge_call(cross_replica, args=(grads, finite))


def _dense(grads) -> list:
    return [tf.convert_to_tensor(g) for g in grads]


def _take(parts, i):
    """Micro-batch `i` of (x, y, weight) split into [k, ...] along the batch."""
    return tf.nest.map_structure(lambda t: t[i], parts)


def total_steps(train_config, spec) -> int:
    """The final global step: `train_steps`, or `epochs` over the train split."""
    if train_config.train_steps:
        return train_config.train_steps
    if not spec.train_examples:
        raise UsageError(f"--epochs={train_config.epochs} needs a dataset of known size; "
                         "set --train_steps instead")
    return train_config.epochs * max(1, spec.train_examples // train_config.global_batch_size)


class Trainer:
    """Trains `model` on `inputs` under `strategy`; see `fit()`."""

    def __init__(self, *, config, strategy: Strategy, model: keras.Model,
                 optimizer: keras.optimizers.Optimizer, inputs: inputs_lib.Inputs,
                 total_steps: int, checkpointer_factory=None, jit_level: str = xla.OFF,
                 flops_per_example: Optional[int] = None, peak_tflops: Optional[float] = None,
                 task: Optional[Task] = None):
        self.config = config
        # The loss and metrics (built against the data's specs); default: the
        # config's loss and metrics, or what `model.compile` was given.
        self.task = task or task_for(config, model, inputs)[0]
        self._counters_size = _METRICS + self.task.metric_size
        # Set while tracing the replica step: the global loss divisor when it
        # is known in advance (else the reduced gradient is rescaled), and
        # whether regularization gradients travel apart from the data's.
        self._global_divisor, self._split_regularization = None, False
        self.train_config = config.train
        self.strategy = strategy
        self.model = model
        self.optimizer = optimizer
        self.inputs = inputs
        tc = self.train_config
        self.global_batch_size = tc.global_batch_size
        self.compression = GradientCompression(tc.grad_compression)
        self.bytes_per_update = self.compression.bytes_per_update(model.trainable_variables)
        self.total_steps = total_steps
        with strategy.scope():
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step",
                                    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        self.checkpointer: Optional[Checkpointer] = None
        if checkpointer_factory is not None:
            self.checkpointer = checkpointer_factory(
                model=model, optimizer=optimizer, step=self.step)
        self.jit_level = jit_level
        self.flops_per_example, self.peak_tflops = flops_per_example, peak_tflops
        # XLA outside a whole-step compilation (`_compile_loops`): each
        # variable's optimizer update fused into one kernel.
        if jit_level == xla.OPTIMIZER or (jit_level == xla.STEP and not strategy.xla_whole_step):
            xla.fuse_optimizer_update(optimizer)
        self.tensorboard = TensorBoard(tc.model_dir, enabled=strategy.is_chief)
        profile_dir = tc.model_dir and tensorboard.directory(tc.model_dir)
        if profile_dir and not strategy.is_chief:
            profile_dir = os.path.join(profile_dir, f"worker_{strategy.worker_index}")
        self.profiler = Profiler(tc.profile_steps, profile_dir,
                                 enabled=strategy.is_chief or tc.profile_all_ranks)
        self._logs_here = strategy.is_chief or tc.log_all_ranks
        self.grad_agreement: dict = {}
        self.nonfinite_steps, self.rollbacks = 0, 0   # --on_nonfinite=skip / rollback
        self.loop_start = 0   # the step the running loop began at (for fault messages)
        self._runs = 0   # calls of `_train_to_end` (an elastic engine may repeat it)
        self._compile_loops()

    def _compile_loops(self) -> None:
        """(Re)create the traced step and loop functions. They bake in the
        number of replicas, and Horovod's ops hang when run after the group was
        re-formed, so an elastic engine's membership change needs fresh ones.
        XLA: the whole replica step where the engine's sum is no collective;
        else the gradients (and the update, fused per variable) around the sum."""
        self._step_fn, self._gradients_fn = self._replica_train_step, self._local_gradients
        if self.jit_level == xla.STEP and self.strategy.xla_whole_step:
            self._step_fn = tf.function(self._replica_train_step, jit_compile=True)
        elif self.jit_level == xla.STEP:
            self._gradients_fn = tf.function(self._local_gradients, jit_compile=True)
        self._train_loop = self.strategy.loop_function(self._train_loop_fn, self._combine_loops)
        self._eval_loop = self.strategy.function(self._eval_loop_fn)

    # -- replica steps (run on every replica inside tf.function) -----------
    def _micro_batch_gradients(self, x, y, weight):
        """Gradients of this micro-batch's share of the global loss, and its counters."""
        variables = self.model.trainable_variables
        with tf.GradientTape(persistent=True) as tape:
            y_pred = self.model(x, training=True)
            numerator, divisor, global_divisor = self.task.loss_terms(
                y, y_pred, weight, tf.ones(tf.shape(weight)[:1]))
            # Scale by the *global* divisor, so summing over replicas and
            # micro-batches gives the gradient of the global loss. When the
            # divisor depends on the data (masks, mean_with_sample_weight),
            # scale by the global batch now and by the reduced divisor later.
            self._global_divisor = global_divisor
            loss = numerator / (global_divisor or self.global_batch_size)
            regularization = None
            if self.model.losses:
                regularization = tf.add_n(self.model.losses) / (
                    self.strategy.replica_copies * self.train_config.accum_steps)
                if global_divisor:
                    loss += regularization
            # Identity unless the optimizer scales losses (mixed_float16): then
            # the gradients come out scaled and `apply` unscales them.
            scaled_loss = self.optimizer.scale_loss(loss)
            if regularization is not None and not global_divisor:
                scaled_regularization = self.optimizer.scale_loss(regularization)
        # Dense gradients: embeddings give IndexedSlices, which neither sum
        # across micro-batches nor cast for compression; the engines densify
        # them for the all-reduce anyway (Horovod's sparse_as_dense).
        grads = _dense(self.strategy.gradients(tape, scaled_loss, variables))
        self._split_regularization = regularization is not None and not global_divisor
        if self._split_regularization:  # not to be rescaled with the data's gradient
            grads += _dense(self.strategy.gradients(tape, scaled_regularization, variables))
        del tape
        counters = tf.concat([tf.stack([numerator, divisor]),
                              self.task.metric_deltas(y, y_pred, weight)], axis=0)
        return grads, counters

    def _local_gradients(self, x, y, weight):
        """This replica's gradient summed over its micro-batches, and counters."""
        k = self.train_config.accum_steps
        if k == 1:
            grads, counters = self._micro_batch_gradients(x, y, weight)
        else:
            # Sum gradients of k micro-batches locally; reduce once afterwards.
            # An in-graph loop (not k unrolled copies) keeps one micro-batch's
            # activations and gradients alive at a time.
            parts = tf.nest.map_structure(lambda t: tf.reshape(t, [k, -1, *t.shape[1:]]),
                                          (x, y, weight))
            grads, counters = self._micro_batch_gradients(*_take(parts, 0))
            for i in tf.range(1, k):
                tf.autograph.experimental.set_loop_options(parallel_iterations=1)
                more, more_counters = self._micro_batch_gradients(*_take(parts, i))
                grads = [g + m for g, m in zip(grads, more)]
                counters += more_counters
        return grads, counters

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

    def _replica_train_step(self, batch, report: bool = False,
                            measure_agreement: bool = False):
        """One update. `report` (the last step of a loop) also measures the
        global gradient norm, `measure_agreement` the per-replica gradient
        agreement: each is a full pass over the gradients (the norm cost 13%
        of the FFN mlp's step when taken at every step), so only then."""
        x, y, weight = batch
        local, counters = self._gradients_fn(x, y, weight)
        variables = self.model.trainable_variables
        reduced = self._reduce(self.compression.compress(local) + [counters])
        copies = 2 if self._split_regularization else 1
        grads = self.compression.decompress(reduced[:-1], variables * copies)
        counters = reduced[-1]
        if not self._global_divisor:  # the divisor was data-dependent: rescale by the global one
            factor = tf.math.divide_no_nan(tf.cast(self.global_batch_size, tf.float32),
                                           counters[_LOSS_DIVISOR])
            grads = [g * tf.cast(factor, g.dtype) for g in grads[:len(variables)]] + \
                grads[len(variables):]
        if self._split_regularization:
            grads = [g + r for g, r in zip(grads[:len(variables)], grads[len(variables):])]
            local = local[:len(variables)]
        norm = tf.zeros([])
        if report:  # the global gradient's norm, before clipping, without loss scaling
            norm = tf.linalg.global_norm(grads)
            scale = getattr(self.optimizer, "dynamic_scale", None)
            if scale is not None:
                norm = norm / tf.cast(scale, norm.dtype)
        agreement = (self._replica_agreement(local, grads) if measure_agreement
                     else tf.zeros([self.strategy.num_replicas]))
        if self.train_config.on_nonfinite == "stop":
            self.optimizer.apply(grads, variables)   # the run stops after this loop anyway
        else:   # skip the update of a non-finite loss; the reduced loss is the same everywhere
            _apply_if(tf.math.is_finite(counters[_LOSS_NUMERATOR]), self.optimizer, grads,
                      variables)
        return tf.concat([counters, [norm]], axis=0), agreement

    def _replica_agreement(self, local, summed):
        """Cosine similarity of this replica's gradient with the cross-replica sum
        (the mean's direction), gathered from every replica: one extra small sum,
        only at the steps measured."""
        dot = tf.add_n([tf.reduce_sum(a * b) for a, b in zip(local, summed)])
        cosine = dot / (tf.linalg.global_norm(local) * tf.linalg.global_norm(summed) + 1e-30)
        mine = tf.one_hot(self.strategy.replica_id(), self.strategy.num_replicas) * cosine
        return self.strategy.all_reduce_sum([mine])[0]

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
        return self.strategy.all_reduce_sum([tf.identity(v.value) for v in self._synced_state()])

    def _replica_eval_step(self, batch):
        x, y, weight, real = batch
        y_pred = self.model(x, training=False)
        numerator, divisor, _ = self.task.loss_terms(y, y_pred, weight, real)
        counters = tf.concat([tf.stack([numerator, divisor]),
                              self.task.metric_deltas(y, y_pred, weight)], axis=0)
        return self.strategy.all_reduce_sum([counters])[0]

    # -- in-graph loops ------------------------------------------------------
    def _train_loop_fn(self, iterator, num_steps, measure_agreement: bool):
        """`num_steps` replica steps; the last one, traced separately after the
        loop, also reports the gradient norm and, with `measure_agreement` (a
        Python bool), the gradient agreement, which adds a collective:
        collectives cannot sit in a `tf.cond` in replica context. Steps whose
        loss is not finite are counted (with the first one's offset) and left
        out of the loop's metrics."""
        totals = tf.zeros([self._counters_size + 1])
        bad, first_bad = tf.constant(0.0), tf.constant(-1.0)

        def add(step_totals, index, totals, bad, first_bad):
            # Arithmetic, not tf.where: a select on a scalar condition crashes
            # DTensor's SPMD expansion (TF 2.21, segmentation fault).
            finite = tf.cast(tf.math.is_finite(step_totals[_LOSS_NUMERATOR]), tf.float32)
            totals += tf.math.multiply_no_nan(step_totals, tf.fill(tf.shape(step_totals), finite))
            first = (1.0 - finite) * tf.cast(first_bad < 0, tf.float32)   # 1: the first bad step
            first_bad += first * (tf.cast(index, tf.float32) + 1.0)
            return totals, bad + (1.0 - finite), first_bad

        for i in tf.range(num_steps - 1):
            # Steps are sequential by nature (each reads the last update); also
            # say so to the while loop, or it may start the next step's
            # collectives early, which engines that name them (Horovod) refuse.
            tf.autograph.experimental.set_loop_options(parallel_iterations=1)
            batch = self.strategy.next_batch(iterator)
            totals, bad, first_bad = add(self.strategy.run(self._step_fn, batch)[0],
                                         i, totals, bad, first_bad)
        step_totals, agreement = self.strategy.run(
            self._step_fn, self.strategy.next_batch(iterator), True, measure_agreement)
        totals, bad, first_bad = add(step_totals, num_steps - 1, totals, bad, first_bad)
        if self.strategy.replica_copies > 1 and self._synced_state():
            summed = self.strategy.run(self._replica_sum_state)
            for variable, total in zip(self._synced_state(), summed):
                variable.assign(total / self.strategy.replica_copies)
        self.step.assign_add(tf.cast(num_steps, tf.int64))
        return tf.concat([totals, [bad, first_bad]], axis=0), agreement

    def _combine_loops(self, parts):
        """One loop's result from [(steps, (totals, agreement)), ...] of calls
        that ran its steps in pieces (`Strategy.loop_function`): counters and
        non-finite counts add up, the first non-finite step is offset by the
        steps before its piece, the gradient norm and agreement are the last piece's."""
        size, offset = self._counters_size, 0
        totals, first_bad = None, -1.0
        for steps, (piece, _) in parts:
            piece = np.asarray(piece, dtype=np.float32)
            if first_bad < 0 and piece[size + 2] >= 0:
                first_bad = offset + float(piece[size + 2])
            totals = piece.copy() if totals is None else totals + piece
            offset += steps
        totals[size] = parts[-1][1][0][size]   # the last step's gradient norm
        totals[size + 2] = first_bad
        return tf.constant(totals), tf.constant(parts[-1][1][1])

    def _eval_loop_fn(self, iterator, num_steps):
        totals = tf.zeros([self._counters_size])
        for _ in tf.range(num_steps):
            tf.autograph.experimental.set_loop_options(parallel_iterations=1)
            totals += self.strategy.run(self._replica_eval_step, next(iterator))
        return totals

    # -- outer loop ----------------------------------------------------------
    def _shuffle_buffer(self) -> int:
        # More than the split holds buys nothing (and 2**63 would not allocate).
        return min(self.config.data.shuffle_buffer,
                   self.inputs.spec.train_examples or self.config.data.shuffle_buffer)

    def _train_iterator(self, seed: int):
        """The training iterator of a pipeline shuffled by `seed`, and its
        checkpointable state (None where the engine has none)."""
        return self.strategy.input_iterator(inputs_lib.train_dataset_fn(
            self.inputs, global_batch_size=self.global_batch_size, seed=seed,
            shuffle_buffer=self._shuffle_buffer()))

    def _input_position(self) -> Optional[InputPosition]:
        if self.checkpointer is None or not self.train_config.checkpoint_input:
            return None
        strategy = self.strategy
        return InputPosition(
            self.checkpointer.directory, keep=self.checkpointer.keep,
            pipeline=strategy.worker_index, pipelines=strategy.num_input_pipelines,
            signature={"batch": self.global_batch_size, "buffer": self._shuffle_buffer(),
                       "replicas": strategy.num_replicas, "spec": repr(self.inputs.spec)})

    def _make_data(self, start_step: int):
        """The training iterator at `start_step`, and the evaluation data.

        A resumed run continues from the input position saved with its
        checkpoint, so it reads exactly the batches an uninterrupted run
        reads. Where there is none (an engine whose iterators cannot be
        checkpointed, other input settings, a missing or damaged position)
        it draws a fresh, seeded permutation instead, so it does not replay
        the batches the first steps already saw."""
        tc, strategy = self.train_config, self.strategy
        position = self._input_position()
        saved_seed = position.saved_seed(start_step) if position and start_step else None
        seed = tc.seed if saved_seed is None else saved_seed
        iterator, state = self._train_iterator(seed)
        if state is None:
            position = None
        elif position:
            position.track(state, seed)
        if start_step and not (position and position.restore(start_step)):
            why = ("--nocheckpoint_input" if not tc.checkpoint_input
                   else f"--strategy={strategy.name} cannot checkpoint its input iterator"
                   if state is None else f"no input position was saved at step {start_step}")
            logging.warning("%s: %s; reading a fresh permutation of the data",
                            strategy.describe_process(), why)
            seed = tc.seed + 7919 * start_step
            iterator, state = self._train_iterator(seed)
            if position:
                position.track(state, seed)
        if self.checkpointer is not None:
            self.checkpointer.input_position = position
        self._eval_data = None
        if self.inputs.has_eval:
            pipelines = strategy.num_input_pipelines
            self.eval_steps = inputs_lib.eval_steps(
                self.inputs, global_batch_size=self.global_batch_size, num_pipelines=pipelines)
            self._eval_data = strategy.distribute_dataset(inputs_lib.eval_dataset_fn(
                self.inputs, global_batch_size=self.global_batch_size, steps=self.eval_steps,
                replicas_per_pipeline=strategy.replica_copies // pipelines))
        return iterator

    def _results(self, totals) -> dict:
        return self.task.results(float(totals[_LOSS_NUMERATOR]), float(totals[_LOSS_DIVISOR]),
                                 totals[_METRICS:self._counters_size])

    def evaluate(self) -> dict:
        """Loss and metrics over the whole test split (exact, padding excluded)."""
        if self._eval_data is None:
            return {}
        totals = self._eval_loop(iter(self._eval_data), tf.constant(self.eval_steps)).numpy()
        return {f"test_{name}": value for name, value in self._results(totals).items()}

    def _next_stop(self, step: int) -> int:
        """The next step at which the outer loop must regain control."""
        tc = self.train_config
        stop = min(self.total_steps, step + tc.steps_per_loop)
        for every in (tc.eval_every, tc.checkpoint_every, tc.log_every,
                      tc.grad_agreement_every, self.strategy.commit_every):
            if every:
                stop = min(stop, (step // every + 1) * every)
        for boundary in self.profiler.boundaries():
            if boundary > step:
                stop = min(stop, boundary)
        return stop

    def _throughput(self, examples_per_sec: float) -> dict:
        """Model TFLOP/s and MFU for a measured examples/sec (when known)."""
        if not self.flops_per_example:
            return {}
        metrics = {"tflops": flops_lib.model_tflops(examples_per_sec, self.flops_per_example)}
        if self.peak_tflops:
            metrics["mfu"] = flops_lib.mfu(examples_per_sec, self.flops_per_example,
                                           self.peak_tflops)
        return metrics

    def _agreement_metrics(self, values) -> dict:
        cosines = [float(v) for v in values]
        metrics = {"grad_agreement_min": min(cosines),
                   "grad_agreement_mean": sum(cosines) / len(cosines)}
        metrics.update({f"grad_agreement_replica_{i}": c for i, c in enumerate(cosines)})
        return metrics

    def _on_nonfinite(self, totals, start: int) -> Optional[int]:
        """React to the non-finite steps of the loop that began at `start`:
        stop, count skipped updates, or roll back (returns the step resumed at)."""
        tc = self.train_config
        count = int(totals[self._counters_size + 1])
        first = start + int(totals[self._counters_size + 2]) + 1
        last_good = self.checkpointer.latest if self.checkpointer else None
        where = (f"the last good checkpoint is {last_good}" if last_good
                 else "no checkpoint was saved (no --model_dir)" if not self.checkpointer
                 else "no checkpoint was saved yet")
        if tc.on_nonfinite == "stop" and tc.precision == "mixed_float16":
            # fp16's dynamic loss scaling owns these: it skipped the update and
            # halved the scale, as it always has.
            self.nonfinite_steps += count
            logging.warning("%d step(s) with a non-finite loss, the first at step %d: "
                            "skipped by mixed_float16's loss scaling", count, first)
            return None
        if tc.on_nonfinite == "stop":
            raise NonFiniteLoss(
                f"{self.strategy.describe_process()}: the loss is not finite at step {first} "
                f"(--on_nonfinite=stop); {where}; --on_nonfinite=skip or rollback continue "
                "past such steps")
        self.nonfinite_steps += count
        if tc.on_nonfinite == "skip":
            logging.warning("skipped the update of %d step(s) with a non-finite loss, the "
                            "first at step %d (--on_nonfinite=skip)", count, first)
            return None
        if self.rollbacks >= tc.max_rollbacks:
            raise NonFiniteLoss(
                f"{self.strategy.describe_process()}: the loss is not finite at step {first} "
                f"after {self.rollbacks} rollback(s) (--max_rollbacks={tc.max_rollbacks}); "
                f"{where}")
        restored = self.checkpointer.restore_latest()
        if restored is None:
            raise NonFiniteLoss(
                f"{self.strategy.describe_process()}: the loss is not finite at step {first} "
                "and there is no checkpoint to roll back to yet (--on_nonfinite=rollback; "
                "lower --checkpoint_every)")
        self.strategy.broadcast_variables(
            [*self.model.variables, *self.optimizer.variables, self.step])
        self.rollbacks += 1
        step = int(self.strategy.to_host(self.step).numpy())
        logging.warning("the loss is not finite at step %d: rolled back to %s (step %d), "
                        "continuing past the offending batches (rollback %d of %d)", first,
                        restored, step, self.rollbacks, tc.max_rollbacks)
        return step

    def _check_signals(self, signals: StopSignals, step: int) -> None:
        """After a loop: Ctrl-C stops here; SIGTERM on any worker makes every
        worker save at this same step and stop (`interrupts.py`)."""
        if signals.interrupted:
            raise KeyboardInterrupt
        if step < self.total_steps and self.strategy.any_worker(signals.preempted):
            saved = self.checkpointer.save(step) if self.checkpointer else None
            if saved is None and self.checkpointer and not self.strategy.is_chief:
                saved = "(by the chief)"
            raise Preempted(step, saved)

    def fit(self) -> dict:
        """Train to `total_steps` (resuming from the latest checkpoint); return metrics."""
        tc = self.train_config
        if self.checkpointer:
            self.checkpointer.restore_latest()
        signals = StopSignals(tc.preemption_grace_s, describe=self.strategy.describe_process)
        try:
            signals.__enter__()
            # Every replica starts from the chief's state (its initial values,
            # or the checkpoint it restored), even where workers cannot see its
            # files. An elastic engine runs the loop again from its last
            # commit after workers left or joined.
            return self.strategy.run_training(
                lambda: self._train_to_end(signals),
                [*self.model.variables, *self.optimizer.variables, self.step])
        finally:
            signals.__exit__(None, None, None)
            self.profiler.stop()
            self.tensorboard.close()

    def _regrouped(self) -> None:
        """Workers left or joined (elastic): the number of replicas, this
        process's rank and who is chief may all have changed."""
        chief, tc = self.strategy.is_chief, self.train_config
        logs.configure(self.strategy, log_all_ranks=tc.log_all_ranks)   # "[rank 0/1 chief]"
        if chief:
            logging.set_verbosity(logging.INFO)
        replicas, step = self.strategy.num_replicas, int(self.strategy.to_host(self.step).numpy())
        if self.global_batch_size % (replicas * tc.accum_steps):
            raise WorkerFault(f"{self.strategy.describe_process()}: the ranks changed to "
                              f"{replicas}, which do not divide --global_batch_size="
                              f"{self.global_batch_size} (x --accum_steps={tc.accum_steps})")
        logging.warning("%s: now %d replica(s) (global batch %d = %d x %d); going on from "
                        "step %d", self.strategy.describe_process(), replicas,
                        self.global_batch_size, replicas, self.global_batch_size // replicas,
                        step)
        self._compile_loops()
        self._logs_here = chief or tc.log_all_ranks
        self.tensorboard.enabled = bool(tc.model_dir) and chief
        if self.checkpointer:
            self.checkpointer.is_chief = chief

    def _train_to_end(self, signals: StopSignals) -> dict:
        """The outer loop, from the step the state holds to `total_steps`."""
        tc = self.train_config
        if self._runs:   # run again by an elastic engine: the ranks were re-formed
            self._regrouped()
        self._runs += 1
        step = int(self.strategy.to_host(self.step).numpy())
        iterator = self._make_data(step)
        progress = Progress(self.total_steps, start=step, enabled=self._logs_here,
                            metric_names=self.task.metric_names)
        timed_examples, timed_seconds, first_loop = 0, 0.0, True
        train_metrics, eval_metrics = {}, {}
        every = tc.grad_agreement_every
        while step < self.total_steps:
            stop = self._next_stop(step)
            self.loop_start = step
            self.profiler.before_loop(step)
            started = time.perf_counter()
            totals, agreement = self._train_loop(
                iterator, tf.constant(stop - step), bool(every) and stop % every == 0)
            totals = totals.numpy()
            seconds = time.perf_counter() - started
            if totals[self._counters_size + 1]:   # non-finite losses in this loop
                rolled_back = self._on_nonfinite(totals, step)
                if rolled_back is not None:
                    step = rolled_back
                    continue
            self.profiler.after_loop(stop)
            examples = (stop - step) * self.global_batch_size
            if not first_loop:  # the first call traces and compiles the graph
                timed_examples += examples
                timed_seconds += seconds
            first_loop, step = False, stop
            train_metrics = {
                **self._results(totals),
                "examples_per_sec": examples / seconds,
                **self._throughput(examples / seconds),
                "learning_rate": optimizers.current_learning_rate(self.optimizer),
                "grad_norm": float(totals[self._counters_size])}
            loss_scale = Precision.loss_scale(self.optimizer)
            if loss_scale is not None:
                train_metrics["loss_scale"] = loss_scale
            logged = dict(train_metrics)
            if every and step % every == 0:
                self.grad_agreement = self._agreement_metrics(agreement.numpy())
                logged.update(self.grad_agreement)
            if (tc.eval_every and step % tc.eval_every == 0) or step == self.total_steps:
                eval_metrics = self.evaluate()
                logged.update(eval_metrics)
            if self.checkpointer and ((tc.checkpoint_every and step % tc.checkpoint_every == 0)
                                      or step == self.total_steps):
                self.checkpointer.save(step)
            if self.strategy.replica_copies > 1:   # an explicit all-reduce
                logged["bytes_reduced_per_update"] = self.bytes_per_update
            logged.update(self.strategy.loop_metrics())
            self.tensorboard.write(step, logged)
            progress.update(step, {**train_metrics, **eval_metrics},
                            log=not tc.log_every or step % tc.log_every == 0
                            or step == self.total_steps)
            self._check_signals(signals, step)
            self.strategy.end_of_loop(step)
        if not eval_metrics and self.inputs.has_eval:
            eval_metrics = self.evaluate()  # resumed at the final step: still report accuracy
        if timed_seconds:
            train_metrics["examples_per_sec"] = timed_examples / timed_seconds
            train_metrics.update(self._throughput(timed_examples / timed_seconds))
        return {"steps": step, **train_metrics, **eval_metrics}
