"""`PipelineStrategy`: the `pipeline` engine's adapter (see the package's
docstring): its stages and their placement, the checks, the reports and the
step's gradients; the members for stages across processes are in
`processes`, the traced items of one pipeline replica in `step`."""

from __future__ import annotations

import json
import os
import re
import resource

import tensorflow as tf

from tfdist import cluster, compat
from tfdist.errors import UsageError, first_line
from tfdist.pipeline import schedule as schedule_lib
from tfdist.pipeline import split as split_lib
from tfdist.pipeline import stages as stages_lib
from tfdist.strategies.capabilities import LocalGradients, PipelineStages, ZeroStages
from tfdist.strategies.multi_worker.engine import MultiWorkerStrategy
from tfdist.strategies.pipeline import step
from tfdist.strategies.pipeline.inference import StagesInference
from tfdist.strategies.pipeline.processes import StagesAcrossProcesses


class PipelineStrategy(StagesAcrossProcesses, StagesInference, MultiWorkerStrategy,
                       PipelineStages, ZeroStages):
    """S stages (x R pipeline replicas) over the local devices, or over the
    processes of a cluster (one stage per process); with --pipeline_chunks=v,
    S x v stages, v of them on each device or process."""

    name = "pipeline"
    # Each stage's gradients are reduced among its replicas in the stage's own
    # step: no per-replica compression or local SGD (fp16/bf16 casts work).
    replica_local_state = False
    # A stage sees micro-batches: its statistics cannot be the global batch's.
    global_batch_statistics = False
    _timeline = None   # TFDIST_PIPELINE_TIMELINE's recording (`_prepare_timeline`)
    chunks = 1         # --pipeline_chunks: the stages each device (process) runs
    supports_xla = False
    supports_xla_reason = ("a pipeline's stages run on different devices, and one XLA "
                           "cluster cannot span devices")

    def _create(self):
        config = self.config
        # S devices (processes) per pipeline replica, each running v chunks:
        # the model's S x v stages, stage s on device s mod S.
        self.positions = positions = config.pipeline_stages
        self.chunks = config.pipeline_chunks
        self.num_stages = positions * self.chunks
        self.stages = None          # `split.Stage`s, once placed
        self._stage_models = None
        self._stage_outputs = None   # across processes: each stage's output for the data
        self._stage_variables = None
        self._microbatches = None
        self._timeline = None
        self._stages_of = {}         # id(variable) -> the stages holding it (first: its owner)
        self._released = set()       # ids of variables whose storage is freed here
        self._predict_steps = {}     # `predict_through_stages`' traced batch, by batch size
        self._transfers = {}         # traced `gather_stages`/`scatter_stages`, by content
        spec = cluster.resolve(config.worker_hosts, config.task_index)
        self.processes = spec is not None and spec.num_workers > 1
        if not self.processes:
            self._spec, self._num_workers, self._worker_index = spec, 1, 0
            self.devices = cluster.local_devices(config.virtual_devices or None)
            if len(self.devices) < positions or len(self.devices) % positions:
                raise UsageError(
                    f"--pipeline_stages={positions} does not divide onto the "
                    f"{len(self.devices)} local device(s) ({', '.join(self.devices)}): use a "
                    f"divisor of {len(self.devices)}, or --virtual_devices=<a multiple of "
                    f"{positions}> on a CPU host")
            self.pipeline_replicas = len(self.devices) // positions
            self.local_stages = list(range(self.num_stages))
            return tf.distribute.get_strategy()
        if spec.num_workers % positions:
            raise UsageError(
                f"--pipeline_stages={positions} does not divide the cluster's "
                f"{spec.num_workers} workers: a cluster of S x R workers runs R pipeline "
                f"replicas of S stages, one stage per worker (e.g. tfdist-launch "
                f"--workers={positions * max(1, spec.num_workers // positions)})")
        strategy = super()._create()   # MultiWorkerMirroredStrategy: sets up the collectives
        self.pipeline_replicas = self._num_workers // positions
        self.position = self._worker_index % positions
        self.replica = self._worker_index // positions
        self.local_stages = self.stages_on(self.position)
        self.devices = list(strategy.extended.worker_devices[:1])
        return strategy

    def stages_on(self, position: int) -> list:
        """The stages a pipeline replica's device (process) `position` runs:
        position, position + S, ... (one unless --pipeline_chunks)."""
        return list(range(position, self.num_stages, self.positions))

    def worker_of(self, stage: int, replica: int) -> int:
        """Across processes, the worker running `stage` of pipeline replica
        `replica`; in one process, the index of its device."""
        return replica * self.positions + stage % self.positions

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
            zero = ", ZeRO-1 over each stage's replicas" if self.zero1 else ""
            return (f"pipeline: {self._shape()} x {self.pipeline_replicas} pipeline "
                    f"replica(s) over {self._num_workers} workers, {self._schedule()} "
                    f"schedule{zero}; this is {self.worker_name(self._worker_index)}: "
                    f"{self._stages_of_worker(self._worker_index)} of replica "
                    f"{self.replica}{' (chief)' if self.is_chief else ''}")
        groups = [", ".join(self.devices[r * self.positions:(r + 1) * self.positions])
                  for r in range(self.pipeline_replicas)]
        return (f"pipeline: {self._shape()} x {self.pipeline_replicas} pipeline "
                f"replica(s), {self._schedule()} schedule, on " + "; ".join(groups))

    def _shape(self) -> str:
        if self.chunks == 1:
            return f"{self.num_stages} stages"
        return (f"{self.num_stages} stages ({self.positions} per pipeline x {self.chunks} "
                "chunks each)")

    def _schedule(self) -> str:
        kind = self.config.pipeline_schedule
        return f"interleaved {kind}" if self.chunks > 1 and kind == "1f1b" else kind

    def stage_device(self, stage: int, replica: int = 0) -> str:
        worker = self.worker_of(stage, replica)
        if self.processes:
            return f"worker {worker}" if worker != self._worker_index else self.devices[0]
        return self.devices[worker]

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
        if self.chunks > 1 and self.config.pipeline_schedule == "1f1b" and \
                tc.accum_steps % self.positions:
            raise UsageError(
                f"--microbatches={tc.accum_steps}: interleaved 1F1B (--pipeline_chunks="
                f"{self.chunks}) runs micro-batches in groups of --pipeline_stages="
                f"{self.positions}; use a multiple of {self.positions}, e.g. "
                f"{-(-tc.accum_steps // self.positions) * self.positions}")
        if tc.reduce_bucket_mb:
            raise UsageError(f"--reduce_bucket_mb={tc.reduce_bucket_mb}: --strategy=pipeline "
                             "makes one reduction per update; use --reduce_bucket_mb=0")
        if self.processes and tc.precision == "mixed_float16":
            raise UsageError("--precision=mixed_float16: across processes each pipeline "
                             "worker applies its own stage's update, and fp16 loss scaling "
                             "would skip steps stage by stage; use mixed_bfloat16 or float32")
        if self.processes and tc.export_dir and not self.config.pipeline_gather:
            raise UsageError(f"--export_dir={tc.export_dir}: with --nopipeline_gather no "
                             "process holds the whole trained model to export; export the "
                             "last checkpoint with tfdist-export --model_dir=... on a machine "
                             "with the memory, or drop --nopipeline_gather")
        if self.processes and tc.grad_agreement_every:
            raise UsageError(f"--grad_agreement_every={tc.grad_agreement_every}: across "
                             "processes a pipeline worker holds one stage's gradients, not a "
                             "replica's; use --grad_agreement_every=0")

    # -- the model ---------------------------------------------------------------
    def place_model(self, model, input_signature=None) -> None:
        """Split `model` into its stages, balanced by FLOPs for inputs like
        `input_signature` (one example of the data, batch 1), and place them."""
        names = list(self.config.pipeline_split) or None
        flag = f"--pipeline_stages={self.positions}" + (
            f" x --pipeline_chunks={self.chunks}" if self.chunks > 1 else "")
        self.stages = split_lib.split(model, self.num_stages, names=names,
                                      input_signature=input_signature, flag=flag)
        self._stage_models = stages_lib.stage_models(model, self.stages)
        self._stage_variables = [m.trainable_variables for m in self._stage_models]
        # A variable on several stages (a layer they share) is owned by the
        # first: it is kept there in one process, gathered from it and
        # counted once in norms; every stage holding it sums its gradients.
        self._stages_of = {}
        for s, stage_model in enumerate(self._stage_models):
            for variable in stage_model.variables:
                stages = self._stages_of.setdefault(id(variable), [])
                if s not in stages:
                    stages.append(s)
        self._check_shared()
        self._held = set()
        for s in self.local_stages:
            for variable in self._stage_models[s].variables:
                self._held.add(id(variable))
                if not self.processes and self._stages_of[id(variable)][0] == s:
                    compat.move_variable(variable, self.stage_device(s))
        self._split_slots()
        self._prepare_timeline()
        if self.processes:
            # What crosses between workers: shapes fixed after the batch (a
            # length the model leaves open is the data's).
            self._stage_outputs = stages_lib.data_outputs(model, self._stage_models,
                                                         input_signature)
            for s in range(self.num_stages):
                for output in tf.nest.flatten(self._stage_outputs[s]):
                    if any(d is None for d in output.shape[1:]):
                        raise UsageError(
                            f"pipeline stages across processes: stage {s} makes a tensor of "
                            f"shape {tuple(output.shape)} even for the data's examples; its "
                            "dimensions after the batch must be fixed (e.g. "
                            "--sequence_length) to be sent between workers")
            if self._deferred:   # built without storage: this process's stages get theirs
                self._give_storage()

    def _check_shared(self) -> None:
        """Across processes each stage's workers hold their own copy of a
        shared layer's variables: trainable ones stay equal (their gradients
        are summed among those workers), but state a layer updates itself
        (BatchNorm's statistics) would drift apart, so it is refused."""
        if not self.processes:
            return
        for stage_model in self._stage_models:
            for variable in stage_model.variables:
                stages = self._stages_of[id(variable)]
                if len(stages) > 1 and not variable.trainable:
                    raise UsageError(
                        f"pipeline stages across processes: variable {variable.path!r} is "
                        f"used on stages {', '.join(map(str, stages))} and is not trainable "
                        "(state its layer updates itself); across processes each stage "
                        "would update its own copy: give each stage its own layer, or run "
                        "the stages in one process (--virtual_devices)")

    def shared_variables(self) -> dict:
        """{id(variable): the stages holding it} for variables on more than
        one stage (a layer the stages share)."""
        return {key: tuple(stages) for key, stages in self._stages_of.items()
                if len(stages) > 1}

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
            self._timeline_items = self.plan(m)[self.position]
            self._timeline = tf.Variable(tf.zeros([len(self._timeline_items), 3], tf.float64),
                                         trainable=False)

    def close(self) -> None:
        if self._timeline is not None:
            stamps = self._timeline.numpy().tolist()
            with open(f"{self._timeline_prefix}-{self._worker_index}.json", "w") as f:
                json.dump({"position": self.position, "stages": self.local_stages,
                           "replica": self.replica, "positions": self.positions,
                           "chunks": self.chunks, "schedule": self.config.pipeline_schedule,
                           "microbatches": self._microbatches,
                           # this process's peak resident memory (Linux: KiB)
                           "peak_rss_bytes": resource.getrusage(
                               resource.RUSAGE_SELF).ru_maxrss * 1024,
                           # [stage, kind, micro-batch, started, inputs there, ended]
                           "items": [[s, kind, i, *times] for (s, kind, i), times
                                     in zip(self._timeline_items, stamps)]}, f)
            self._timeline = None
        super().close()


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

    def plan(self, m: int) -> list:
        """Each device's (process's) items of one pipeline replica, in order."""
        return schedule_lib.schedule(m, self.config.pipeline_schedule, self.positions,
                                     self.chunks)

    def stage_report(self, model) -> str:
        if self.stages is None:
            self.place_model(model)
        m = self._microbatches or 1
        plan = self.plan(m)
        in_flight = schedule_lib.peak_in_flight(plan)
        lines = [self.describe(), split_lib.table(self.stages)]
        for d in range(self.positions):
            if self.chunks == 1:
                lines.append(f"stage {d} on {self.stage_device(d)}: at most {in_flight[d]} of "
                             f"{m} micro-batches' activations held at once ({self._schedule()})")
                continue
            lines.append(f"stages {', '.join(map(str, self.stages_on(d)))}"
                         f" on {self.stage_device(d)}: at most {in_flight[d]} of "
                         f"{m * self.chunks} (stage, micro-batch) activations held at once "
                         f"({self._schedule()})")
        formula = "(S-1)/(M+S-1)" if self.chunks == 1 else "(S-1)/(vM+S-1)"
        lines.append(f"ideal bubble {formula} = "
                     f"{schedule_lib.bubble(self.positions, m, self.chunks):.0%}")
        return "\n".join(lines)

    def summary_fields(self, model, optimizer) -> dict:
        fields = {"pipeline_stages": self.positions, "pipeline_chunks": self.chunks,
                  "pipeline_replicas": self.pipeline_replicas,
                  "pipeline_schedule": self.config.pipeline_schedule,
                  "microbatches": self._microbatches,
                  "stage_layers": [list(s.layers) for s in self.stages or ()],
                  "stage_param_bytes": [s.param_bytes for s in self.stages or ()]}
        if self.processes:
            fields["stages"], fields["pipeline_replica"] = self.local_stages, self.replica
            fields["zero_stage"] = self.config.zero
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
                return (f"pipeline stage {found.group(1)} of replica {self.replica} "
                        f"({self.worker_name(self._worker_index)}, {kind} of micro-batch "
                        f"{found.group(3)}): {type(error).__name__}: {first_line(error)}")
            return re.sub(r"\bworker (\d+)\b", lambda w: f"worker {w.group(1)} ("
                          f"{self._stages_of_worker(int(w.group(1)))})", line)
        found = re.search(r"stage(\d+)_([FB])(\d+)", text)
        if found and self.stages is not None:
            s = int(found.group(1))
            kind = "forward" if found.group(2) == "F" else "backward"
            return (f"pipeline stage {s} on {self.stage_device(s)} ({kind} of micro-batch "
                    f"{found.group(3)}): {type(error).__name__}: {first_line(error)}")
        return f"pipeline: {type(error).__name__}: {first_line(error)}"

    def _stages_of_worker(self, worker: int) -> str:
        """ "stage 1", or "stages 1, 3" with chunks: what `worker` runs."""
        stages = self.stages_on(worker % self.positions)
        return f"stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))}"

    # -- the step ----------------------------------------------------------------
    def local_gradients(self, losses, x, y, weight):
        """This process's stages' gradients, in the order of
        `updated_variables(losses.variables)`; in one process, every stage's,
        summed over its pipeline replicas."""
        m = losses.micro_batches
        replicas = 1 if self.processes else self.pipeline_replicas
        parts = tf.nest.map_structure(
            lambda t: tf.reshape(t, [replicas, m, -1, *t.shape[1:]]), (x, y, weight))
        grads, separate, counters = {}, {}, None
        for r in range(replicas):
            replica = self.replica if self.processes else r
            more_grads, more_counters, more_separate = step.replica_items(
                self, losses, tf.nest.map_structure(lambda t: t[r], parts), replica, replicas)
            counters = more_counters if counters is None else counters + more_counters
            for into, more in ((grads, more_grads), (separate, more_separate)):
                for key, value in more.items():
                    into[key] = value if key not in into else into[key] + value
        def in_order(by_variable):
            return [by_variable[id(v)] for v in self.updated_variables(losses.variables)]

        return LocalGradients(in_order(grads), in_order(separate) if separate else [],
                              counters, losses.provisional_divisor())

