"""Local SGD (`--sync_every=K`): the `Trainer`'s steps and loop where every
replica steps its own optimizer on its own gradients and the weights are
averaged every K steps (optimizer state stays per replica)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.training import nonfinite
from tfdist.training.precision import Precision
from tfdist.observe.totals import LOSS_DIVISOR


class LocalSGDSteps:
    """The local-SGD members of `Trainer` (a part of it: they read its
    strategy, model, optimizer, step functions and loop helpers)."""

    def _replica_local_step(self, batch, report: bool = False,
                            measure_agreement: bool = False) -> dict:
        """One local SGD step: this replica's optimizer on this replica's own
        gradient (its share of the loss, scaled to the mean over its own
        examples); only the counters cross replicas (a few floats), so that
        metrics and the non-finite check agree everywhere."""
        del measure_agreement   # refused with --sync_every (config)
        x, y, weight = batch
        local = self._gradients_fn(x, y, weight)
        counters = self.strategy.all_reduce_sum([local.counters])[0]
        copies = float(self.strategy.step_copies)
        if local.provisional_divisor is None:   # scaled by 1/(copies x this replica's divisor)
            data = [g * copies for g in local.data]
        else:
            factor = tf.math.divide_no_nan(local.provisional_divisor,
                                           local.counters[LOSS_DIVISOR])
            data = [g * tf.cast(factor, g.dtype) for g in local.data]
        if local.regularization:
            data = [g + r * copies for g, r in zip(data, local.regularization)]
        out = {"counters": counters, "grad_norm": tf.zeros([])}
        if report:   # this replica's gradient (replica 0's is reported)
            norm = tf.linalg.global_norm(data)
            scale = Precision.dynamic_scale(self.optimizer)
            out["grad_norm"] = norm if scale is None else norm / tf.cast(scale, tf.float32)
        variables = self.model.trainable_variables
        nonfinite.apply_unless_nonfinite(
            self.strategy, self.train_config.on_nonfinite, counters,
            lambda g: self.optimizer.apply(g, variables), data)
        return out

    def _average_weights(self) -> None:
        """Local SGD's synchronisation: every replica's weights set to their
        mean (one all-reduce of the weights; assigned in cross-replica
        context, once for every copy)."""
        variables = self.model.trainable_variables
        summed = self.strategy.run(lambda: self.strategy.all_reduce_sum(
            [tf.identity(v.value) for v in variables]))
        for variable, total in zip(variables, summed):
            variable.assign(total / tf.cast(self.strategy.step_copies, total.dtype))

    def _local_sgd_loop_fn(self, iterator, num_steps, measure_agreement: bool,
                           key=None) -> dict:
        """`_train_loop_fn` for local SGD: groups of `sync_every` local steps,
        each followed by the weights' average; the loop ends with one (the
        controller ends loops only where an average is due)."""
        del measure_agreement, key
        every = self.sync_every
        step = self._loop_step(iterator)

        def group(i, tally):
            end = tf.minimum(i + every, num_steps)
            i, tally = tf.while_loop(lambda j, _: j < end, step, (i, tally),
                                     parallel_iterations=1)
            self._average_weights()
            return i, tally

        # Whole groups, then the last group's steps, the last one traced apart
        # to report the gradient norm (as `_train_loop_fn`).
        last_group = ((num_steps - 1) // every) * every
        i, tally = tf.while_loop(lambda i, _: i < last_group, group,
                                 (tf.constant(0), nonfinite.tally(self.counters_size)),
                                 parallel_iterations=1)
        _, tally = tf.while_loop(lambda j, _: j < num_steps - 1, step, (i, tally),
                                 parallel_iterations=1)
        last = self.strategy.run(self._step_fn, self.strategy.next_batch(iterator), True)
        self._average_weights()
        return self._end_loop(tally, last, num_steps)

