"""`parameter_server`: asynchronous training with ParameterServerStrategy.

    tfdist-launch --workers=2 --ps=1 -- tfdist-train --strategy=parameter_server ...

A cluster of one chief, N workers and P parameter servers (TF_CONFIG with
`chief`, `worker` and `ps` tasks, `--worker_hosts/--ps_hosts/--task_type/
--task_index`, or `tfdist-launch --ps=P`). Every process runs the same
`tfdist-train` command; what it does depends on its task:

- ps and worker tasks run a `tf.distribute.Server` and serve (`serve()`)
  until the chief is gone: they watch the chief's port and exit 0 once it
  stops answering, so no deployment has to stop them by hand.
- the chief (the coordinator) builds the model in this engine's scope, which
  puts every variable on the parameter servers (split into shards of at
  least `--ps_shard_bytes` by `MinSizePartitioner`), and runs the trainer.
  Each training step is the trainer's own replica step, scheduled with
  `ClusterCoordinator.schedule` as one closure on whichever worker is free:
  it reads the weights from the parameter servers, computes the gradient of
  the *global* batch on that worker's own input pipeline and applies it there
  (no all-reduce: `all_reduce_sum` is the identity). Workers do not wait for
  each other; a dead worker's closures run on the others. Checkpoints,
  summaries and evaluation (one closure over the whole test split, after the
  loop's updates have landed) are the chief's.

Keras 3 on this path needs four workarounds (BUILD_NOTES.md): gradients of
a partitioned variable are taken for its shards (a Keras variable wrapping a
`ShardedVariable` has no `.handle`), the optimizer updates partitioned
variables directly (`extended.update` refuses a `ShardedVariable`), its
slots of a partitioned variable are partitioned too (Keras would put them on
the chief, colocated with nothing), and partitioned variables checkpoint as
one whole tensor. The two that replace private upstream names are in
`tfdist.compat`.
"""

from __future__ import annotations

import collections
import contextlib
import logging as std_logging
import re
import socket
import time

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfdist import cluster, compat
from tfdist.errors import UsageError, WorkerFault
from tfdist.observe import logs
from tfdist.observe.totals import LoopTotals
from tfdist.strategies import watchdog
from tfdist.strategies.base import Strategy
from tfdist.strategies.capabilities import ScheduledSteps, ServingProcesses
from tfdist.strategies.tf_distribute import apply_if_merged, run_first_result
from tfdist.strategies.multi_worker.engine import _reason

CHIEF_POLL_S = 1.0       # how often a server checks that the chief is still there
CHIEF_GONE_PROBES = 3    # failed probes in a row that mean the chief has ended
# A loop's mean staleness from which the run warns that asynchrony costs
# accuracy with a momentum or adaptive optimizer (bench/parameter_server.py).
STALENESS_WARNING = 0.2


def _address(spec, task_type: str, index: int) -> str:
    return spec.cluster[task_type][index]


def _task_name(spec, task_type: str, index: int) -> str:
    return f"{task_type} {index} ({_address(spec, task_type, index)})"


def _tasks(spec, *task_types):
    """(name, host, port) of every task of `task_types`, for probes."""
    found = []
    for task_type in task_types:
        for index, address in enumerate(spec.cluster.get(task_type, ())):
            host, _, port = address.rpartition(":")
            found.append((_task_name(spec, task_type, index), host, int(port)))
    return found


def _answers(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=watchdog.PROBE_TIMEOUT_S).close()
        return True
    except OSError:
        return False


def _gist(error) -> str:
    """The first line of what went wrong, without gRPC's nested detail."""
    text = _reason(str(getattr(error, "message", error)))
    text = re.sub(r"\d+ root error\(s\) found\.\s*|\(\d+\) \w+:\s*", "", text)
    pieces = [p.strip(" :") for p in re.split(r"\\n|\n|Additional GRPC error", text)]
    return next((p for p in pieces if p), text)[:200]


class _OneLineClosureErrors(std_logging.Filter):
    """The coordinator logs each failed closure with its whole multi-line gRPC
    error (a dead worker or ps gives dozens); one line each is enough."""

    def filter(self, record):
        if "encountered the following error when processing closure" in str(record.msg):
            worker, error = record.args[0], record.args[1]
            record.msg, record.args = "worker %d: a step failed: %s: %s", (
                worker, type(error).__name__, _gist(error))
        elif record.pathname.endswith("cluster_coordinator.py"):
            text = record.getMessage()
            if "\n" in text:
                record.msg, record.args = "%s (%s)", (text.splitlines()[0][:200], _gist(text))
        return True


_CLOSURE_ERRORS = _OneLineClosureErrors()


def _variable_creator(next_creator, **kwargs):
    """Keras creates an optimizer slot colocated with its variable; colocated
    with a ShardedVariable, ParameterServerStrategy puts the slot, whole, on
    the chief. Without the colocation the strategy shards it over the
    parameter servers like its variable. Each partitioned variable created
    here also checkpoints as one whole tensor (`compat.checkpoint_sharded_whole`:
    Keras cannot save it otherwise), so its checkpoint restores anywhere."""
    if compat.is_sharded(kwargs.get("colocate_with")):
        kwargs.pop("colocate_with")
    variable = next_creator(**kwargs)
    if compat.is_sharded(variable):
        compat.checkpoint_sharded_whole(variable)
    return variable


def _value(variable):
    """The tf.Variable (or ShardedVariable) behind a Keras 3 variable."""
    return getattr(variable, "value", variable) if hasattr(variable, "path") else variable


class ParameterServerStrategy(Strategy, ScheduledSteps, ServingProcesses):
    """The chief coordinates; workers and parameter servers serve (see module doc)."""

    name = "parameter_server"
    process_unit = "chief"
    supports_xla = False
    supports_xla_reason = ("--strategy=parameter_server steps read and update variables on "
                           "other processes (the parameter servers), which XLA cannot compile")
    _server = None
    _strategy = None

    def setup(self) -> None:
        config = self.config
        # Validated in plain Python first: a bad cluster fails in one line
        # before any server or connection exists.
        self._spec = spec = cluster.resolve_ps(config.worker_hosts, config.ps_hosts,
                                               config.task_type, config.task_index)
        self._task = (spec.task_type, spec.task_index)
        if spec.task_type != "chief":
            try:
                self._server = tf.distribute.Server(
                    tf.train.ClusterSpec(spec.cluster), job_name=spec.task_type,
                    task_index=spec.task_index, protocol="grpc", start=True)
            except tf.errors.OpError as error:   # e.g. its port is taken
                raise UsageError(f"{_task_name(spec, *self._task)}: cannot start its server: "
                                 f"{_gist(error)}") from None
            watchdog.announce_server(*self._task, spec.address)
            return
        num_ps = len(spec.cluster["ps"])
        std_logging.getLogger("tensorflow").addFilter(_CLOSURE_ERRORS)
        partitioner = (tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=config.ps_shard_bytes, max_shards=num_ps)
            if config.ps_shard_bytes and num_ps > 1 else None)
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        with logs.quiet_absl(), watchdog.deadline(
                config.collective_timeout_s,
                f"chief: the cluster did not form within --collective_timeout_s="
                f"{config.collective_timeout_s:g}s", _tasks(spec, "worker", "ps")):
            self._strategy = tf.distribute.ParameterServerStrategy(
                resolver, variable_partitioner=partitioner)
            self._coordinator = tf.distribute.coordinator.ClusterCoordinator(self._strategy)
        watchdog.announce_server(*self._task, spec.address)   # the coordinator's server
        self._optimizer = None
        self._steps_by_worker = collections.Counter()
        self._staleness_sum, self._updates, self._staleness_max = 0, 0, 0
        self._loop = {}
        self._step_read = None       # the update counter a step read, while it is traced
        self._step_staleness = None  # and the updates since, once its gradients are computed
        self._warned = False

    # -- servers -----------------------------------------------------------
    def serve_if_server(self) -> bool:
        """A worker or ps: serve until the chief has come and gone. A chief
        that never answers within --collective_timeout_s ends this one too."""
        if self._server is None:
            return False
        spec = self._spec
        me = _task_name(spec, *self._task)
        chief = _task_name(spec, "chief", 0)
        host, _, port = _address(spec, "chief", 0).rpartition(":")
        logging.info("%s: serving until the chief %s ends", me, chief)
        deadline = time.monotonic() + self.config.collective_timeout_s
        while not _answers(host, int(port)):
            if time.monotonic() > deadline:
                raise WorkerFault(f"{me}: the chief {chief} did not start within "
                                   f"--collective_timeout_s={self.config.collective_timeout_s:g}s")
            time.sleep(CHIEF_POLL_S)
        missed = 0
        while missed < CHIEF_GONE_PROBES:
            time.sleep(CHIEF_POLL_S)
            missed = 0 if _answers(host, int(port)) else missed + 1
        logging.info("%s: the chief %s has ended; stopping", me, chief)
        return True

    # -- topology ----------------------------------------------------------
    def scope(self):
        stack = contextlib.ExitStack()
        stack.enter_context(self._strategy.scope())
        stack.enter_context(tf.variable_creator_scope(_variable_creator))
        return stack

    @property
    def num_replicas(self) -> int:
        return 1   # each step is one worker's update on the whole global batch

    @property
    def num_workers(self) -> int:
        return len(self._spec.cluster["worker"])

    @property
    def num_input_pipelines(self) -> int:
        return 1   # every worker reads the whole split, in its own order

    @property
    def is_chief(self) -> bool:
        return self._task[0] == "chief"

    def describe_process(self) -> str:
        return _task_name(self._spec, *self._task)

    def describe(self) -> str:
        ps = self._spec.cluster["ps"]
        shards = (f"variables split in shards of >= {self.config.ps_shard_bytes} bytes"
                  if self.config.ps_shard_bytes and len(ps) > 1 else "variables not split")
        return (f"parameter_server: chief + {self.num_workers} worker(s) + {len(ps)} parameter "
                f"server(s), asynchronous (each step: one worker's update on the global "
                f"batch); {shards}")

    def check_config(self, config) -> None:
        del config   # every trainer feature runs inside one worker's step

    # -- steps ---------------------------------------------------------------
    def distribute_dataset(self, dataset_fn):
        """One input pipeline per worker, each reading the whole split; its
        pipeline id (which seeds its shuffle) is the worker's index, known
        only on the worker, so the workers read in different orders."""

        def per_worker_dataset():
            worker = tf.distribute.coordinator.experimental_get_current_worker_index()
            context = tf.distribute.InputContext(
                num_input_pipelines=1, input_pipeline_id=tf.cast(worker, tf.int64),
                num_replicas_in_sync=1)
            return dataset_fn(context)

        return self._coordinator.create_per_worker_dataset(per_worker_dataset)

    def run(self, replica_fn, *args):
        return run_first_result(self._strategy, replica_fn, args)

    def apply_if(self, condition, update, *args):
        apply_if_merged(condition, update, args)

    def _all_reduce_sum(self, tensors):
        if self._step_read is not None:   # a step's gradients: its update follows them
            self._step_staleness = self._staleness_after(tensors)
        return list(tensors)   # one replica per step: nothing to add up

    def _staleness_after(self, tensors):
        """The updates of other workers that landed between the step's read
        of the weights and `tensors` (its gradients) being computed: the
        counter read after them (without the dependency TensorFlow may read
        it first thing) less the counter the step read."""
        with tf.control_dependencies(tensors):
            now = tf.convert_to_tensor(self._optimizer.iterations)
        return tf.maximum(now - self._step_read, 0)

    def replica_id(self):
        return tf.constant(0)

    def any_worker(self, flag: bool) -> bool:
        return bool(flag)   # only the chief runs the trainer

    def gradients(self, tape, target, variables) -> list:
        """Gradients for each shard of a partitioned variable, concatenated."""
        sources = [list(_value(v).variables) if compat.is_sharded(_value(v)) else [v]
                   for v in variables]
        grads = tape.gradient(target, sources, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return [parts[0] if len(parts) == 1 else
                tf.concat([tf.convert_to_tensor(p) for p in parts], axis=0) for parts in grads]

    def on_optimizer_built(self, optimizer, variables) -> None:
        self._optimizer = optimizer
        if any(compat.is_sharded(_value(v)) for v in variables):
            # The optimizer that applies the updates (a LossScaleOptimizer
            # hands them to its inner one) updates partitioned variables directly.
            applying = (optimizer.inner_optimizer
                        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
                        else optimizer)
            compat.optimizer_updates_sharded_variables(applying)

    def host_function(self, fn):
        """`fn` as one closure on a free worker; its result once it is done."""
        compiled = tf.function(fn, autograph=False)

        def call(*args):
            remote = self._coordinator.schedule(compiled, args=args)
            self._coordinator.join()
            return tf.nest.map_structure(tf.constant, remote.fetch())

        return call

    # -- scheduled steps (capabilities.ScheduledSteps) ----------------------------
    def scheduled_loop(self, loop_fn):
        """Each of the loop's steps as its own closure, all scheduled at once
        (the coordinator hands them to workers as they become free), then one
        wait for all. Each closure also reports its worker and its step's
        staleness: the updates of other workers that landed, on the parameter
        servers' update counter, between its read of the weights and the end
        of its gradient computation (`_staleness_after`)."""
        counter = lambda: tf.convert_to_tensor(self._optimizer.iterations)  # noqa: E731

        def closure(iterator, num_steps, *options):
            self._step_read, self._step_staleness = counter(), None
            try:
                with tf.control_dependencies([self._step_read]):   # before the weights
                    result = loop_fn(iterator, num_steps, *options)
                staleness = self._step_staleness
            finally:
                self._step_read, self._step_staleness = None, None
            worker = tf.distribute.coordinator.experimental_get_current_worker_index()
            return result, staleness, worker

        compiled = tf.function(closure, autograph=False)

        def call(iterator, num_steps, *options):
            one = tf.constant(1, dtype=num_steps.dtype)
            remotes = [self._coordinator.schedule(compiled, args=(iterator, one, *options))
                       for _ in range(int(num_steps))]
            self._coordinator.join()
            fetched = [remote.fetch() for remote in remotes]
            self._account([(int(staleness), int(worker)) for _, staleness, worker in fetched])
            return LoopTotals.chain([(1, LoopTotals.from_tensors(result))
                                     for result, _, _ in fetched])

        return call

    def learning_rate_factor(self):
        return self._staleness_factor if self.config.staleness_lr == "divide" else None

    def _staleness_factor(self):
        """1 / (1 + the step's staleness) inside a step, else 1."""
        if self._step_staleness is None:   # outside a step (e.g. the host logging the rate)
            return tf.constant(1.0)
        return 1.0 / (1.0 + tf.cast(self._step_staleness, tf.float32))

    def _account(self, steps) -> None:
        """Staleness and steps per worker of one loop's steps."""
        staleness = [s for s, _ in steps]   # >= 0 already (`_staleness_after`)
        for _, worker in steps:
            self._steps_by_worker[worker] += 1
        self._staleness_sum += sum(staleness)
        self._updates += len(staleness)
        self._staleness_max = max([self._staleness_max, *staleness])
        self._loop = {"staleness_mean": float(np.mean(staleness)) if staleness else 0.0,
                      "staleness_max": float(max(staleness, default=0))}
        line = staleness_warning(self._loop["staleness_mean"], self.config.staleness_lr,
                                 self._optimizer)
        if line and not self._warned:
            self._warned = True
            logging.warning("%s", line)

    def _per_worker(self) -> dict:
        return {f"steps_worker_{i}": self._steps_by_worker[i] for i in range(self.num_workers)}

    def schedule_metrics(self) -> dict:
        return {**self._loop, **self._per_worker()}

    def summary_fields(self, model, optimizer) -> dict:
        return {"parameter_servers": len(self._spec.cluster["ps"]),
                "ps_shard_bytes": self.config.ps_shard_bytes,
                "steps_per_worker": self._per_worker(),
                "staleness_mean": self._staleness_sum / self._updates if self._updates else None,
                "staleness_max": self._staleness_max if self._updates else None,
                "variable_devices": variable_devices(model)}

    # -- faults --------------------------------------------------------------
    def describe_fault(self, error: Exception) -> str:
        """Name the parameter server (or worker) a failed step points at; else
        list the tasks that do not answer a TCP connect."""
        spec, text = self._spec, str(getattr(error, "message", error))
        detail = f"{type(error).__name__}: {_gist(error)}"
        # A parameter server first: a worker's error names the ps it could not reach.
        named = sorted(set(re.findall(r"/job:(ps|worker)/replica:\d+/task:(\d+)", text)))
        for task_type, index in named:
            index = int(index)
            if index < len(spec.cluster[task_type]):
                what = "parameter server" if task_type == "ps" else "worker"
                name = _task_name(spec, task_type, index)
                host, _, port = _address(spec, task_type, index).rpartition(":")
                probe = watchdog.unreachable([(name, host, int(port))])
                state = probe[0].split(": ", 1)[1] if probe else "it accepts connections"
                return f"chief: {what} {name} failed or is unreachable ({state}): {detail}"
        silent = watchdog.unreachable(_tasks(spec, "ps", "worker"))
        tail = f"; unreachable: {'; '.join(silent)}" if silent else ""
        return f"chief: a step failed: {type(error).__name__}: {detail}{tail}"


def staleness_warning(mean: float, staleness_lr: str, optimizer) -> str | None:
    """A line when a loop's mean staleness is high enough to cost accuracy
    with momentum SGD or Adam (bench/parameter_server.py: the 512-wide mlp
    lost tens of points at 0.45; plain SGD far from its step-size limit lost
    little); None otherwise."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if mean < STALENESS_WARNING or not (isinstance(inner, keras.optimizers.Adam)
                                        or getattr(inner, "momentum", 0.0)):
        return None
    hint = ("--staleness_lr=divide scales each update's learning rate by 1 / (1 + its "
            "staleness)" if staleness_lr == "none" else
            "where accuracy matters, fewer workers or a synchronous engine (multi_worker)")
    return (f"parameter_server: mean staleness {mean:.2f} (updates of other workers landing "
            f"while a step computes its gradient): with {type(inner).__name__} that can cost "
            "accuracy (a 512-wide mlp with Adam lost 34 points at 0.45, the demo's cnn none; "
            f"docs/guides/parameter-server.md); {hint}")


def variable_devices(model) -> dict:
    """{variable path: [device of each shard]}: where the model's weights live."""
    found = {}
    for variable in model.variables:
        value = _value(variable)
        shards = value.variables if compat.is_sharded(value) else [value]
        found[variable.path] = [shard.device for shard in shards]
    return found
