"""`pipeline`: pipeline parallelism over the devices of one process (issue 22).

The model is split into --pipeline_stages stages (`tfdist.pipeline.split`:
balanced by FLOPs over its blocks, or at --pipeline_split's layers); stage s
lives on device s (its layers' variables and their optimizer slots there),
and each global batch is cut into --accum_steps (alias --microbatches)
micro-batches that flow through the stages on a GPipe or 1F1B schedule
(`tfdist.pipeline.schedule`). One traced program holds every stage's items;
each stage's items are chained with control dependencies in its schedule's
order, so each device runs its own schedule and the stages' work overlaps
wherever the data allows. With more devices than stages (a multiple of S),
R = devices / S pipeline replicas each take 1/R of the batch, and their
gradients are summed before the one update.

Where it runs: local GPUs, or the logical CPUs of --virtual_devices. Logical
CPUs share one process's threadpool, so they prove correctness and placement
but never speed (measured: ../shared/probes/pipeline_overlap.py, and the
README's pipeline section); the speed of real CPU stages needs a process per
stage (bench/pipeline_p2p_probe.py).

The update equals gradient accumulation of the same micro-batches on one
device: each micro-batch's loss is the trainer's (`MicroBatchLoss`), its
gradients flow back stage by stage (the boundary activation's gradient is the
next stage's input gradient), and each stage's are summed in micro-batch
order. BatchNorm-style state updates in each stage's forward, micro-batch by
micro-batch, as under accumulation; metrics are counted on the last stage.
"""

from __future__ import annotations

import tensorflow as tf

from tfdist import cluster, compat
from tfdist.errors import UsageError, first_line
from tfdist.pipeline import schedule as schedule_lib
from tfdist.pipeline import split as split_lib
from tfdist.strategies.capabilities import PipelineStages
from tfdist.strategies.tf_distribute import TFDistributeStrategy


class PipelineStrategy(TFDistributeStrategy, PipelineStages):
    """S stages (x R pipeline replicas) over the local devices."""

    name = "pipeline"
    supports_xla = False
    supports_xla_reason = ("a pipeline's stages run on different devices, and one XLA "
                           "cluster cannot span devices")

    def _create(self):
        config = self.config
        self.num_stages = config.pipeline_stages
        self.devices = cluster.local_devices(config.virtual_devices or None)
        if len(self.devices) < self.num_stages or len(self.devices) % self.num_stages:
            raise UsageError(
                f"--pipeline_stages={self.num_stages} does not divide onto the "
                f"{len(self.devices)} local device(s) ({', '.join(self.devices)}): use a "
                f"divisor of {len(self.devices)}, or --virtual_devices=<a multiple of "
                f"{self.num_stages}> on a CPU host")
        self.pipeline_replicas = len(self.devices) // self.num_stages
        self.stages = None          # `split.Stage`s, once placed
        self._stage_models = None
        self._stage_variables = None
        self._microbatches = None
        return tf.distribute.get_strategy()

    def describe(self) -> str:
        groups = [", ".join(self.devices[r * self.num_stages:(r + 1) * self.num_stages])
                  for r in range(self.pipeline_replicas)]
        return (f"pipeline: {self.num_stages} stages x {self.pipeline_replicas} pipeline "
                f"replica(s), {self.config.pipeline_schedule} schedule, on "
                + "; ".join(groups))

    def stage_device(self, stage: int, replica: int = 0) -> str:
        return self.devices[replica * self.num_stages + stage]

    # -- checks ------------------------------------------------------------------
    def check_config(self, config) -> None:
        tc = config.train
        parts = self.pipeline_replicas * tc.accum_steps
        if tc.global_batch_size % parts:
            raise UsageError(
                f"--global_batch_size={tc.global_batch_size} must be divisible by pipeline "
                f"replicas ({self.pipeline_replicas}) x --microbatches ({tc.accum_steps}) "
                f"= {parts}; e.g. {max(parts, tc.global_batch_size // parts * parts)}")
        self._microbatches = tc.accum_steps
        if tc.reduce_bucket_mb:
            raise UsageError(f"--reduce_bucket_mb={tc.reduce_bucket_mb}: --strategy=pipeline "
                             "reduces nothing across processes; use --reduce_bucket_mb=0")

    # -- the model ---------------------------------------------------------------
    def place_model(self, model) -> None:
        names = list(self.config.pipeline_split) or None
        self.stages = split_lib.split(model, self.num_stages, names=names)
        self._stage_models = split_lib.stage_models(model, self.stages)
        self._stage_variables = []
        for s, stage_model in enumerate(self._stage_models):
            for variable in stage_model.variables:
                compat.move_variable(variable, self.stage_device(s))
            self._stage_variables.append(stage_model.trainable_variables)

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
        return {"pipeline_stages": self.num_stages,
                "pipeline_replicas": self.pipeline_replicas,
                "pipeline_schedule": self.config.pipeline_schedule,
                "microbatches": self._microbatches,
                "stage_layers": [list(s.layers) for s in self.stages or ()],
                "stage_param_bytes": [s.param_bytes for s in self.stages or ()]}

    def describe_fault(self, error: Exception) -> str:
        """Names the stage (and its device) whose item failed: every item's ops
        sit in a name scope `stage<s>_<F|B><micro-batch>`."""
        import re
        text = str(getattr(error, "message", error))
        found = re.search(r"stage(\d+)_([FB])(\d+)", text)
        if found and self.stages is not None:
            s = int(found.group(1))
            kind = "forward" if found.group(2) == "F" else "backward"
            return (f"pipeline stage {s} on {self.stage_device(s)} ({kind} of micro-batch "
                    f"{found.group(3)}): {type(error).__name__}: {first_line(error)}")
        return super().describe_fault(error)

    # -- the step ----------------------------------------------------------------
    def local_gradients(self, losses, x, y, weight):
        from tfdist.training.trainer import LocalGradients
        m = losses.micro_batches
        r_count = self.pipeline_replicas
        parts = tf.nest.map_structure(
            lambda t: tf.reshape(t, [r_count, m, -1, *t.shape[1:]]), (x, y, weight))
        results = [self._pipeline(losses, tf.nest.map_structure(lambda t: t[r], parts), r)
                   for r in range(r_count)]
        stage_grads = results[0][0]
        counters = results[0][1]
        separate = results[0][2]
        for more_grads, more_counters, more_separate in results[1:]:
            stage_grads = [[a + b for a, b in zip(mine, theirs)]
                           for mine, theirs in zip(stage_grads, more_grads)]
            separate = [[a + b for a, b in zip(mine, theirs)]
                        for mine, theirs in zip(separate, more_separate)] if separate else []
            counters = counters + more_counters
        by_ref = {}
        for variables, grads in zip(self._stage_variables, stage_grads):
            for variable, grad in zip(variables, grads):
                by_ref[id(variable)] = grad
        order = losses.variables
        data = [by_ref[id(v)] for v in order]
        regularization = []
        if separate:
            by_ref = {}
            for variables, grads in zip(self._stage_variables, separate):
                for variable, grad in zip(variables, grads):
                    by_ref[id(variable)] = grad
            regularization = [by_ref[id(v)] for v in order]
        return LocalGradients(data, regularization, counters, losses.provisional_divisor())

    def _pipeline(self, losses, parts, replica):
        """One pipeline replica's summed (per-stage gradients, counters,
        per-stage regularization gradients kept apart) over its micro-batches."""
        stages, m = self.num_stages, losses.micro_batches
        last_stage = stages - 1
        plan = schedule_lib.schedule(m, self.config.pipeline_schedule, stages)
        inputs = {}      # (s, i): stage s's input for micro-batch i
        outputs = {}     # (s, i): stage s's output (the last stage: its scaled loss)
        tapes = {}
        regularization = {}
        input_grads = {}  # (s, i): the gradient of stage s's input
        grads = [None] * stages
        separate = [None] * stages
        counters = None
        last_item = [None] * stages
        apart = None     # regularization gradients kept apart from the data's
        for s, kind, i in schedule_lib.build_order(plan):
            device = self.stage_device(s, replica)
            after = [last_item[s]] if last_item[s] is not None else []
            with tf.device(device), tf.control_dependencies(after), \
                    tf.name_scope(f"stage{s}_{kind}{i}"):
                x_i, y_i, w_i = tf.nest.map_structure(lambda t: t[i], parts)
                if kind == "F":
                    source = x_i if s == 0 else outputs[(s - 1, i)]
                    # The boundary tensor arrives on this stage's device.
                    source = tf.nest.map_structure(tf.identity, source)
                    with tf.GradientTape(persistent=True) as tape:
                        if s > 0:
                            tape.watch(source)
                        out = self._stage_models[s](source, training=True)
                        stage_losses = self._stage_models[s].losses
                        reg = losses.regularization(stage_losses) if stage_losses else None
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
                else:
                    tape = tapes.pop((s, i))
                    variables = self._stage_variables[s]
                    reg = regularization.pop((s, i))
                    targets, seeds = [outputs[(s, i)]], [None]
                    if s < last_stage:
                        seeds = [input_grads.pop((s + 1, i))]
                        if reg is not None and not apart:
                            targets.append(losses.scale(reg))
                            seeds.append(tf.ones_like(targets[-1]))
                    sources = list(variables) + ([inputs[(s, i)]] if s > 0 else [])
                    if s < last_stage:
                        got = tape.gradient(targets, sources, output_gradients=seeds,
                                            unconnected_gradients=tf.UnconnectedGradients.ZERO)
                    else:
                        got = tape.gradient(targets[0], sources,
                                            unconnected_gradients=tf.UnconnectedGradients.ZERO)
                    got = [tf.convert_to_tensor(g) for g in got]
                    stage_grads = got[:len(variables)]
                    if s > 0:
                        input_grads[(s, i)] = got[-1]
                    grads[s] = stage_grads if grads[s] is None else \
                        [a + b for a, b in zip(grads[s], stage_grads)]
                    if apart and reg is not None:
                        extra = [tf.convert_to_tensor(g) for g in tape.gradient(
                            losses.scale(reg), variables,
                            unconnected_gradients=tf.UnconnectedGradients.ZERO)]
                        separate[s] = extra if separate[s] is None else \
                            [a + b for a, b in zip(separate[s], extra)]
                    del tape
                    inputs.pop((s, i))
                    outputs.pop((s, i))
                    done = list(grads[s]) + ([input_grads[(s, i)]] if s > 0 else [])
                last_item[s] = tf.group(*done)
        if apart:
            separate = [sep if sep is not None else
                        [tf.zeros_like(g) for g in grads[s]] for s, sep in enumerate(separate)]
        else:
            separate = []
        return grads, counters, separate
