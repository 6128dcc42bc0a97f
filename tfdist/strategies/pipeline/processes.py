"""A pipeline's stages across processes: the boundary tensors between
neighbouring stages' workers (`_Transfer`), the sum of one stage's gradients
over its pipeline replicas (`_StageGroup`), and each worker updating and
holding only its own stage (`StagesAcrossProcesses`)."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import tensorflow as tf
from absl import logging

from tfdist import compat
from tfdist.strategies.base import by_dtype

if TYPE_CHECKING:
    from tfdist.strategies.pipeline.engine import PipelineStrategy


class StagesAcrossProcesses:
    """The members of `PipelineStrategy` for a worker that runs one stage of
    a pipeline replica across processes (`splits_update`): a part of
    `PipelineStrategy`, whose state they read (`processes`, `stage`,
    `replica`, `_held`, `_released`, `_stage_models`, ...). In one process
    each is the identity or does as without stages."""

    _gathered_at = None   # the step the chief last gathered every stage at
    _updated = ()         # `updated_variables`, in order (across processes)
    _deferred = None      # (variables built without storage, values the build assigned)
    by_stage = False      # whether each process built only its stages' weights
    _making = None        # `compat.created_without_broadcast`'s choice, while making one

    # -- building only this process's stages ------------------------------------
    def scope(self):
        """The engine's scope; across processes, one in which the variables
        `_give_storage` and `build_optimizer` make skip the strategy's
        broadcast of the chief's initial values."""
        if not self.processes:
            return super().scope()
        return compat.created_without_broadcast(super().scope(), lambda: self._making)

    def build_model(self, build):
        """Across processes, `build()` with no variable given storage yet:
        `place_model` then gives storage to this process's stages only. A
        model whose build fails while no variable has storage is built again,
        whole, as in one process, and each process frees the other stages'
        weights once it has the chief's."""
        if not self.processes:
            return build()
        try:
            model, made, assigned = compat.build_without_storage(build)
        except compat.UpstreamChanged:
            raise
        except Exception as error:   # noqa: BLE001  (the build runs again, whole)
            if self.is_chief:
                logging.info("pipeline: each process builds the whole model, then frees the "
                             "other stages' weights: it cannot be built without storage (%s)",
                             " ".join(str(error).split())[:300])
            return build()
        self._deferred = (made, assigned)
        return model

    def _give_storage(self) -> None:
        """After `build_model` without storage: storage, with this process's
        own initial values, for its stages' trainable variables and for every
        other variable (non-trainable state every process keeps); none for
        the other stages' trainable variables. In the build's order, the same
        in every process."""
        made, assigned = self._deferred
        self._deferred = None
        self.by_stage = True
        for variable in made:
            held = id(variable) in self._held or not variable.trainable or \
                id(variable) not in self._stages_of
            self._making = compat.LOCAL if held else (compat.EMPTY, variable.shape)
            try:
                compat.give_storage(variable, assigned.get(id(variable)) if held else None)
            finally:
                self._making = None
            if not held:
                self._released.add(id(variable))
        for stage_model in self._stage_models:   # any made from a value, with storage
            for variable in stage_model.trainable_variables:
                if id(variable) not in self._held:
                    self._release(variable)

    # -- lifecycle hooks (`Strategy`): the stages onto the chief and back ----------
    def gather_state(self, state) -> None:
        """The chief takes every variable and optimizer slot from its stage's
        owner, so it holds the whole trained model; the other processes keep
        their stages only. Once per step: it moves the whole model and slots."""
        if not self.processes:
            return
        step = int(self.to_host(state.step).numpy())
        if self._gathered_at != step:
            self.gather_stages(state.owned())
            self._gathered_at = step

    def release_state(self, state) -> None:
        """After a checkpoint: the chief frees the other stages again."""
        if self.processes:
            self.release_others(state.owned())
            self._gathered_at = None

    def hold_state(self, state) -> None:
        if self.processes:
            self.materialize(state.owned())
            self._gathered_at = None

    def broadcast_state(self, state, restored: bool) -> None:
        """Each process takes only its stages' weights, point to point, from
        the chief or, where each process built only its own stages, from the
        owning stage's first worker (and their optimizer slots after a
        restore; a fresh run's are the same initial values everywhere), then
        frees the other stages; the rest (BatchNorm statistics, counters, the
        step) is broadcast as usual.
        A broadcast of the whole model would hold several whole-model tensors
        in every process at once (a 130M-parameter mlp's stage processes
        peaked at 1.5x a whole-model process's memory)."""
        if not self.processes:
            super().broadcast_state(state, restored)
            return
        owned = state.owned()
        staged = {id(v) for v, _ in owned}
        if not self.any_worker(restored):
            owned = [(v, owner) for v, owner in owned if v is owner]
        self.scatter_stages(owned)
        self.broadcast_variables([v for v in state.variables if id(v) not in staged])
        self.release_state(state)

    # -- the update, across processes: each worker its stage's ---------------------
    @property
    def splits_update(self) -> bool:
        return self.processes

    def updated_variables(self, variables) -> list:
        if not self.processes:
            return list(variables)
        self._updated = [v for v in variables if id(v) in self._held]
        return list(self._updated)

    def reduce_update(self, grads, counters):
        """The stage's gradients summed over its R pipeline replicas (one
        collective per dtype among those R workers; none for R = 1), a shared
        layer's over every worker of the stages holding it (`_SharedGroup`),
        the counters over all N workers (the loss and metrics are counted on
        the last stage, zeros elsewhere). `grads` follow `updated_variables`
        (twice over where regularization's gradients are kept apart)."""
        counters = self.all_reduce_sum([counters])[0]
        grads = list(grads)
        variables = self._variables_of(grads)
        shared = self.shared_variables()
        groups = {}   # the stages holding a variable -> positions in grads
        for k, variable in enumerate(variables):
            groups.setdefault(shared.get(id(variable), ()), []).append(k)
        summed = list(grads)
        for stages, positions in groups.items():
            if stages:
                group = _SharedGroup(self, stages)
            elif self.pipeline_replicas > 1:
                group = _StageGroup(self)
            else:
                continue
            for k, value in zip(positions, group.all_reduce_sum([grads[k] for k in positions])):
                summed[k] = value
        return summed, counters

    def _variables_of(self, grads) -> list:
        """The variable of each of `grads` (`updated_variables`' order, twice
        over where regularization's gradients are kept apart)."""
        return self._updated * (len(grads) // max(1, len(self._updated)))

    def global_norm(self, grads):
        """Each stage's squared norm from its replica 0, summed over all
        workers; a shared layer's gradients counted on its first stage only."""
        own = [g for g, v in zip(grads, self._variables_of(grads))
               if self._stages_of[id(v)][0] == self.stage]
        squares = tf.add_n([tf.reduce_sum(tf.square(tf.cast(g, tf.float32))) for g in own]
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
            held = id(reference) in self._held
            if not self.by_stage:
                slot = make(reference, *args, **kwargs)
                if not held:
                    self._release(slot)
                return slot
            self._making = compat.LOCAL if held else (compat.EMPTY, reference.shape)
            try:
                slot = make(reference, *args, **kwargs)
            finally:
                self._making = None
            if not held:
                self._released.add(id(slot))
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
        """The reverse of `gather_stages`: the chief (or, where each process
        built only its stages, the owning stage's first worker) sends each of
        `pairs` to every other worker of its stages (one point-to-point transfer each),
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
            stage = self._stages_of[id(owner)][0]
            if kind == "gather":
                moves = [(stage, 0, _Transfer.GATHER_GROUP_BASE + stage)] if stage else []
            else:   # to every worker of every stage holding it, from the chief or,
                # where each process built only its stages, from the owning stage's replica 0
                source = stage if self.by_stage else 0
                moves = [(source, worker,
                          _Transfer.SCATTER_GROUP_BASE + source * self._num_workers + worker)
                         for held_by in self._stages_of[id(owner)]
                         for worker in range(held_by, self._num_workers, self.num_stages)
                         if worker != source]
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
            out = self._stage_models[stage](None if stage == 0 else source, x,
                                            training=False)
            if stage == last:
                return out, []
            return None, [transfer.send_activation(stage, 0, out)]

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
        return tf.as_dtype(self._strategy._stage_outputs[first].dtype)

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
        boundary = self._strategy._stage_outputs[first].shape[1:]
        # Outside the stage's chain: every receive is posted when the step
        # starts, so the neighbour's send completes as soon as it runs and a
        # transfer's latency hides behind this stage's other items.
        with tf.control_dependencies(None):
            shape = tf.concat([[self._rows], tf.constant(boundary, tf.int32)], 0)
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
        self.size = strategy.pipeline_replicas
        self.key = self.GROUP_BASE + strategy.stage

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
            input=flat, group_size=self.size, group_key=self.key, instance_key=instance_key,
            ordering_token=[], merge_op="Add", final_op="Id", communication_hint="auto",
            timeout_seconds=float(self._strategy.config.collective_timeout_s))
        parts = tf.split(summed, [t.shape.num_elements() for t in tensors])
        return [tf.cast(tf.reshape(part, t.shape), dtype) for part, t in zip(parts, tensors)]


class _SharedGroup(_StageGroup):
    """Every worker of the stages that hold a shared layer (tied embeddings:
    stage 0 and the last), across all pipeline replicas: the layer's
    gradients summed among them, so each stage's copy takes the same update.
    One group per set of stages, its key the set's place among the model's
    sets (the same on every worker: the split is)."""

    GROUP_BASE = _StageGroup.GROUP_BASE + (1 << 15)
    INSTANCE_BASE = _StageGroup.INSTANCE_BASE + (1 << 15)

    def __init__(self, strategy: PipelineStrategy, stages: tuple):
        super().__init__(strategy)
        self.size = len(stages) * strategy.pipeline_replicas
        self.key = self.GROUP_BASE + sorted(set(strategy.shared_variables().values())).index(
            stages)
