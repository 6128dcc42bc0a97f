"""A pipeline's stages across processes: each worker updating and holding
only its own stage (`StagesAcrossProcesses`; under ZeRO-1 its share of the
stage's optimizer slots), over the collectives of `collectives`."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import tensorflow as tf
from absl import logging

from tfdist import compat
from tfdist.errors import UsageError
from tfdist.strategies.pipeline.collectives import SharedGroup, StageGroup, Transfer

if TYPE_CHECKING:
    from tfdist.strategies.pipeline.engine import PipelineStrategy


class StagesAcrossProcesses:
    """The members of `PipelineStrategy` for a worker that runs one place of
    a pipeline replica across processes (`splits_update`): its stage, or
    its v chunks' stages under --pipeline_chunks. A part of
    `PipelineStrategy`, whose state they read (`processes`, `local_stages`,
    `replica`, `_held`, `_released`, `_stage_models`, ...). In one process
    each is the identity or does as without stages."""

    _gathered_at = None   # the step the chief last gathered every stage at
    _updated = ()         # `updated_variables`, in order (across processes)
    _deferred = None      # (variables built without storage, values the build assigned)
    by_stage = False      # whether each process built only its stages' weights
    _making = None        # `compat.created_without_broadcast`'s choice, while making one
    zero_stages = (1,)    # ZeRO-1: a stage's optimizer slots split over its replicas
    _slots_here = frozenset()   # ids of the variables whose slots this worker holds
    _slot_replica = None  # under ZeRO-1: {(stage, id(variable)): the replica holding its slots}
    _gathered_weights = False   # the chief took every stage's weights at the end

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

    # -- ZeRO-1 within a stage's pipeline replicas ------------------------------
    def check_zero(self, config) -> None:
        super().check_zero(config)
        if not self.processes or self.pipeline_replicas < 2:
            where = (f"this cluster runs {self.pipeline_replicas} replica of each stage"
                     if self.processes else "in one process every slot has one copy")
            raise UsageError(
                f"--zero_stage={config.strategy.zero}: --strategy=pipeline splits each "
                f"stage's optimizer slots over the stage's pipeline replicas across processes, "
                f"and {where}; run S x R workers with R >= 2 (e.g. tfdist-launch "
                f"--workers={2 * config.strategy.pipeline_stages}), or --zero_stage=0")

    @property
    def zero1(self) -> bool:
        """Whether each stage's optimizer slots are split over its replicas."""
        return bool(self.processes and self.config.zero)

    def _split_slots(self) -> None:
        """Which trainable variables' optimizer slots this worker holds (and
        which it applies the optimizer to): all of its stages', or under
        ZeRO-1 its share of them. Each stage's variables are dealt to its R
        replicas whole, largest first, each to the replica holding the fewest
        elements so far (ties: the lower replica), the same on every worker."""
        if not self.zero1:
            self._slots_here = frozenset(self._held)
            return
        replicas, self._slot_replica = self.pipeline_replicas, {}
        for s, stage_model in enumerate(self._stage_models):
            variables = list({id(v): v for v in stage_model.trainable_variables}.values())
            if len(variables) < replicas:
                raise UsageError(
                    f"--zero_stage=1: pipeline stage {s} has {len(variables)} trainable "
                    f"variable(s), fewer than its {replicas} pipeline replicas, and each "
                    "replica must hold some of its slots; use fewer workers per stage, other "
                    "--pipeline_split points, or --zero_stage=0")
            loads = [0] * replicas
            for k in sorted(range(len(variables)),
                            key=lambda k: (-math.prod(variables[k].shape), k)):
                r = min(range(replicas), key=lambda r: (loads[r], r))
                self._slot_replica[(s, id(variables[k]))] = r
                loads[r] += math.prod(variables[k].shape)
        self._slots_here = frozenset(key for (s, key), r in self._slot_replica.items()
                                     if s in self.local_stages and r == self.replica)

    def _keeps(self, variable, owner) -> bool:
        """Whether this worker holds `variable` (of `owner`'s stage: `owner`
        itself, or one of its optimizer slots)."""
        return id(owner) in (self._held if variable is owner else self._slots_here)

    def _holders(self, variable, owner, stage: int) -> list:
        """The workers of `stage` (a stage holding `owner`) that hold
        `variable`: every replica's for a variable, under ZeRO-1 one for a slot."""
        if variable is owner or not self.zero1:
            return [self.worker_of(stage, r) for r in range(self.pipeline_replicas)]
        return [self.worker_of(stage, self._slot_replica[(stage, id(owner))])]

    def applied_update(self, grads, variables) -> tuple:
        if not self.zero1:
            return list(grads), list(variables)
        mine = [k for k, v in enumerate(variables) if id(v) in self._slots_here]
        return [grads[k] for k in mine], [variables[k] for k in mine]

    def share_update(self, variables) -> None:
        """Under ZeRO-1, after each replica of a stage updated its share of
        the stage's variables: each updated variable summed over the stage's
        replicas (its value from its replica, zeros from the others) into
        the others' copies, one variable at a time (a whole stage's at once
        would hold several copies of its weights)."""
        if not self.zero1:
            return
        group, done = StageGroup(self), []
        for k, variable in enumerate(variables):
            mine = id(variable) in self._slots_here
            with tf.control_dependencies(done[-1:]):
                value = group.share(variable, k, mine)
                done += [value] if mine else [component.assign(value)
                                              for component in self._components(variable)]

    def checkpoint_parts(self, checkpoint, state):
        """Across processes, checkpoints written and read in parts: each
        stage's variables and slots by the worker that holds them (the one
        `gather_stages` would take them from), the rest by the chief."""
        if not self.processes:
            return None
        from tfdist.checkpoint_parts import CheckpointParts

        def writer(variable, owner) -> int:
            return self._holders(variable, owner, self._stages_of[id(owner)][0])[0]

        parts = CheckpointParts(self, checkpoint, pairs=state.owned, writer=writer,
                                keeps=self._keeps)
        return parts if parts.prepare() else None

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

    def gather_model(self, state) -> None:
        """At the end of training the chief takes every stage's weights (not
        their slots: the last checkpoint holds those) from their owners, for
        `RunResult.model` and the export; not with --nopipeline_gather, nor
        where they would not fit the chief's memory limit (it says so)."""
        if not self.processes or not self.config.pipeline_gather:
            return
        if self._gathered_at is not None:   # the last checkpoint's gather left it all here
            return
        weights = [(v, owner) for v, owner in state.owned() if v is owner]
        refusal = self._gather_refusal(weights) if self.is_chief else None
        if self.any_worker(refusal is not None):
            if refusal:
                logging.warning("the chief does not gather the trained model: %s. "
                                "RunResult.model holds its stages only; export the last "
                                "checkpoint with tfdist-export on a machine with the memory",
                                refusal)
            return
        self.gather_stages(weights)
        self._gathered_weights = True

    def chief_holds_model(self) -> bool:
        """Whether the chief holds every weight of the trained model (it
        gathered them at the end, or at the last checkpoint); the same answer
        on every worker."""
        return self._gathered_at is not None or self._gathered_weights

    def _gather_refusal(self, weights):
        """Why the chief cannot take the other stages' `weights`, or None:
        they and one transfer's copy would not fit under its memory limit."""
        from tfdist.observe import hardware
        sizes = [math.prod(v.shape) * tf.as_dtype(v.dtype).size
                 for v, _ in weights if id(v) in self._released]
        need = sum(sizes) + max(sizes, default=0)
        room = max(0, hardware.memory_limit_bytes() - hardware.resident_bytes())
        if need <= room:
            return None
        return (f"the other stages' weights need {need / 2**20:.1f} MiB and its memory "
                f"limit leaves {room / 2**20:.1f} MiB")

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
        layer's over every worker of the stages holding it (`SharedGroup`),
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
            group = SharedGroup(self, stages) if stages else StageGroup(self)
            if group.size == 1:   # one replica, or every sharing stage on this worker
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
               if self._stages_of[id(v)][0] in self.local_stages]
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
            held = id(reference) in self._slots_here
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
                      if id(variable) not in self._slots_here and id(slot) not in self._released]
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
            if not self._keeps(variable, owner):
                self._release(variable)

    def materialize(self, pairs) -> None:
        for variable, _ in pairs:
            if id(variable) in self._released:
                self._set_storage(variable, tf.zeros(variable.shape, variable.dtype))
                self._released.discard(id(variable))

    def holds_whole_model(self) -> bool:
        """Whether every weight of the model has its storage here (its
        optimizer slots may not: the end of training gathers weights only)."""
        return not self._released & set(self._stages_of)

    def gather_stages(self, pairs) -> None:
        """Each stage's replica-0 worker (worker s mod S, for stage s) sends
        every variable and slot of its stage to the chief (worker 0), one
        point-to-point transfer each, in a group of those two workers; the
        chief's storage of them is refilled. The other workers keep theirs."""
        if not self.processes or self.positions == 1:
            return
        self._traced("gather", pairs)()
        if self._worker_index == 0:
            self._released -= {id(v) for v, _ in pairs}

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
        """Gather: stage s's variables from worker s mod S to worker 0.
        Scatter: from worker 0 to every worker of their stage. One transfer at a time: a
        send holds copies of its tensor until it is received (serialised for
        the wire), and all at once had grown a 130M-parameter mlp's stage-1
        process by 1 GB."""
        me, done = self._worker_index, []
        for k, (variable, owner) in enumerate(pairs):
            stage = self._stages_of[id(owner)][0]
            if kind == "gather":   # from its owning stage's first worker holding it
                source = self._holders(variable, owner, stage)[0]
                moves = [(source, 0, Transfer.GATHER_GROUP_BASE + source)] if source else []
            else:   # to every worker of every stage holding it, from the chief or,
                # where each process built only its stages, from the owning stage's replica 0
                source = self.worker_of(stage, 0) if self.by_stage else 0
                moves = [(source, worker,
                          Transfer.SCATTER_GROUP_BASE + source * self._num_workers + worker)
                         for held_by in self._stages_of[id(owner)]
                         for worker in self._holders(variable, owner, held_by)
                         if worker != source]
            for sender, receiver, group in moves:
                if me in (sender, receiver):
                    with tf.control_dependencies(done[-1:]):
                        done += self._move(variable, group, Transfer.GATHER_INSTANCE_BASE + k,
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

    def state_share(self, variable, value):
        """Across processes, the R workers of `variable`'s stage hold its
        state (BatchNorm statistics): each contributes S x its value and the
        others zeros, so the trainer's sum over all N = S x R workers divided
        by N is the mean over the R pipeline replicas."""
        if not self.processes:
            return value
        if id(variable) in self._held:
            return value * tf.cast(self.positions, value.dtype)
        return tf.zeros_like(value)
