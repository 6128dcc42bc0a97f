"""The traced items of one pipeline replica: the forward ("F") and backward
("B") pass of each micro-batch on each of this process's stages, in the
schedule's order, each stage's items chained with control dependencies (see
the package's docstring)."""

from __future__ import annotations

import contextlib

import tensorflow as tf

from tfdist.pipeline import schedule as schedule_lib
from tfdist.strategies.pipeline.collectives import Transfer


def replica_items(strategy, losses, parts, replica, in_process_replicas):
    """One pipeline replica's items of this process's stages: ({id(variable):
    summed gradient}, summed counters (zeros where the last stage is
    elsewhere), {id(variable): regularization gradient kept apart})."""
    return _ReplicaItems(strategy, losses, parts, replica, in_process_replicas).run()


class _ReplicaItems:
    """What `replica_items` holds while it traces: each item's tape, input
    and output until its backward pass, the gradients summed so far, the
    transfers to other processes and the timeline's stamps."""

    def __init__(self, strategy, losses, parts, replica, in_process_replicas):
        self.strategy, self.losses, self.parts = strategy, losses, parts
        self.replica, self.in_process_replicas = replica, in_process_replicas
        self.last_stage = strategy.num_stages - 1
        self.here = set(strategy.local_stages)
        rows = tf.shape(tf.nest.flatten(tf.nest.map_structure(lambda t: t[0], parts[1]))[0])[0]
        self.transfer = Transfer(strategy, replica, rows) if strategy.processes else None
        self.outputs, self.inputs, self.tapes = {}, {}, {}
        self.regularization, self.input_grads = {}, {}
        self.grads, self.separate = {}, {}
        self.counters = None
        self.last_item = {}
        self.sends, self.stamps = [], []
        self.apart = None   # regularization gradients kept apart from the data's
        self.timed = strategy._timeline is not None

    def run(self):
        """Every item of this process's stages, in the schedule's build
        order; (grads, counters, separate) as `replica_items` returns them."""
        strategy = self.strategy
        plan = strategy.plan(self.losses.micro_batches)
        if self.last_stage not in self.here:
            self.counters = self._stand_in_counters()
        for s, kind, i in schedule_lib.build_order(plan):
            if s in self.here:
                self._item(s, kind, i)
        return self._finish()

    def _mark(self, value):
        """`value`, after the timeline's stamp of when it was there (an
        item's inputs: received, or read from the batch)."""
        if not self.timed:
            return value
        with tf.control_dependencies(tf.nest.flatten(value)):
            self.stamps.append(tf.timestamp())
        with tf.control_dependencies([self.stamps[-1]]):
            return tf.nest.map_structure(tf.identity, value)

    def _stand_in_counters(self):
        """The loss is computed elsewhere; this worker still needs to know
        whether its share is final (see `MicroBatchLoss.loss`) and the
        counters' shape: the loss of a stand-in output, never run."""
        x_0, y_0, w_0 = tf.nest.map_structure(lambda t: t[0], self.parts)
        rows = tf.shape(tf.nest.flatten(y_0)[0])[0]
        stand_in = tf.nest.map_structure(
            lambda t: tf.zeros(tf.concat([[rows], t.shape[1:]], 0), t.dtype),
            self.strategy._stage_outputs[self.last_stage])
        _, shape_of, _ = self.losses.loss(y_0, stand_in, w_0)
        return tf.zeros_like(shape_of)

    def _item(self, s: int, kind: str, i: int) -> None:
        """Stage `s`'s item `kind` of micro-batch `i`, after its device's
        previous item (of any of the device's stages), on the stage's device
        (in one process)."""
        strategy = self.strategy
        d = s % strategy.positions
        after = [self.last_item[d]] if d in self.last_item else []
        place = contextlib.nullcontext() if strategy.processes else \
            tf.device(strategy.stage_device(s, self.replica))
        if self.timed:
            with tf.control_dependencies(after):
                after = [tf.timestamp()]
            self.stamps.append(after[0])
        with place, tf.control_dependencies(after), tf.name_scope(f"stage{s}_{kind}{i}"):
            x_i, y_i, w_i = tf.nest.map_structure(lambda t: t[i], self.parts)
            if kind == "F":
                done = self._forward(s, i, x_i, y_i, w_i)
            else:
                done = self._backward(s, i)
            self.last_item[d] = tf.group(*done)
        if self.timed:
            with tf.control_dependencies([self.last_item[d]]):
                self.stamps.append(tf.timestamp())
            self.last_item[d] = self.stamps[-1]

    def _forward(self, s: int, i: int, x_i, y_i, w_i) -> list:
        """Stage `s`'s forward pass of micro-batch `i`, recorded on a tape
        (on the last stage: the loss and counters): the tensors it makes."""
        strategy, losses = self.strategy, self.losses
        stage_model = strategy._stage_models[s]
        if s == 0:
            source = x_i
        elif s - 1 in self.here:   # arrives on this stage's device
            source = tf.nest.map_structure(tf.identity, self.outputs[(s - 1, i)])
        else:
            source = self.transfer.receive_activation(s, i)
        source = self._mark(source)
        with tf.GradientTape(persistent=True) as tape:
            if s > 0:
                tape.watch(source)
            out = stage_model(source if s > 0 else None, x_i, training=True)
            reg = None
            if stage_model.losses:
                # The trainer's share is per step copy and micro-batch;
                # here R of the N = S x R workers (or, in one process,
                # R pipelines in turn) add this stage's.
                reg = losses.regularization(stage_model.losses) * (
                    strategy.positions if strategy.processes else 1 / self.in_process_replicas)
            if s == self.last_stage:
                loss, micro_counters, known = losses.loss(y_i, out, w_i)
                self.apart = reg is not None and not known
                if reg is not None and known:
                    loss += reg
                out = losses.scale(loss)
                self.counters = micro_counters if self.counters is None else \
                    self.counters + micro_counters
        self.inputs[(s, i)], self.outputs[(s, i)], self.tapes[(s, i)] = source, out, tape
        self.regularization[(s, i)] = reg
        if s < self.last_stage and s + 1 not in self.here:
            # Not in the chain: a transfer completes only when the
            # neighbour receives, which may come after this
            # stage's next items (1F1B: its next forward's send
            # waits for the neighbour's backward).
            self.sends.append(self.transfer.send_activation(s, i, out))
        return tf.nest.flatten(out)

    def _backward(self, s: int, i: int) -> list:
        """Stage `s`'s backward pass of micro-batch `i`: its variables'
        gradients added to the sums, its input's gradient passed on; the
        tensors it makes."""
        variables = self.strategy._stage_variables[s]
        tape = self.tapes.pop((s, i))
        reg = self.regularization.pop((s, i))
        out = self.outputs.pop((s, i))
        source = self.inputs.pop((s, i))
        sources = list(variables) + ([source] if s > 0 else [])
        if s == self.last_stage:
            if self.timed:   # its input, the loss, is there from the start
                self.stamps.append(self.stamps[-1])
            got = tape.gradient(out, sources)
        else:
            seed = self._mark(self.input_grads.pop((s + 1, i)) if s + 1 in self.here else
                              self.transfer.receive_gradient(s, i))
            targets, seeds = [out], [seed]
            if reg is not None and not self.apart:
                targets.append(self.losses.scale(reg))
                seeds.append(tf.ones_like(targets[-1]))
            got = tape.gradient(targets, sources, output_gradients=seeds)
        got = _dense(got, sources)
        _add(self.grads, variables, got)
        done = [self.grads[id(v)] for v in variables]
        if s > 0:
            if s - 1 in self.here:
                self.input_grads[(s, i)] = got[-1]
            else:
                self.sends.append(self.transfer.send_gradient(s, i, got[-1]))
            done.append(got[-1])
        if reg is not None and self.apart:
            extra = tape.gradient(self.losses.scale(reg), variables)
            _add(self.separate, variables, _dense(extra, variables))
        del tape
        return done

    def _finish(self):
        """(grads, counters, separate), the gradients once every transfer
        (and the timeline's record) has run."""
        grads, separate, sends = self.grads, self.separate, self.sends
        if self.stamps:
            with tf.control_dependencies([self.strategy._timeline.assign(
                    tf.reshape(tf.stack(self.stamps), [-1, 3]))]):
                sends = sends + [tf.constant(0)]
        if sends:   # every transfer has run before the gradients are used
            with tf.control_dependencies(sends):
                grads = {key: tf.identity(g) for key, g in grads.items()}
        if self.apart is False or not separate:
            separate = {}
        return grads, self.counters, separate


def _dense(grads, sources) -> list:
    """`grads` as dense tensors, zeros where a source is not connected (a
    shared layer's variable this stage's calls do not read: an untied
    embedding's reverse projection on stage 0). Not TensorFlow's
    `UnconnectedGradients.ZERO`, which cannot make zeros for a Keras variable
    (its dtype is a string)."""
    return [tf.zeros(source.shape, tf.as_dtype(source.dtype)) if g is None else
            tf.convert_to_tensor(g) for g, source in zip(grads, sources)]


def _add(sums: dict, variables, grads) -> None:
    """Each of `grads` added to its variable's sum in `sums` (by id)."""
    for variable, g in zip(variables, grads):
        key = id(variable)
        sums[key] = g if key not in sums else sums[key] + g
