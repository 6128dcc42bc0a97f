"""The strategy adapter interface the trainer and controller talk to.

An adapter owns everything specific to one scale-out engine: creating it,
the variable scope, turning a dataset function into per-replica batches,
running a replica step, the cross-replica sum, broadcasting initial state,
and who is chief. These core hooks are what every engine has; what only some
engines do (tensor sharding, elastic membership, scheduled steps, serving
processes) are opt-in interfaces in `capabilities.py`. The trainer only
calls these hooks, so adding an engine is one file plus one registry line
(see `tfdist/strategies/__init__.py`; `tests/integration/test_new_engine.py` adds one).
"""

from __future__ import annotations

import abc
import contextlib
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

from tfdist.errors import UsageError, first_line
from tfdist.strategies.capabilities import ElasticMembership, ServingProcesses

if TYPE_CHECKING:   # tfdist.config imports the engines' option declarations
    from tfdist.config import StrategyConfig


def by_dtype(tensors: Sequence, reduce: Callable) -> list:
    """`reduce` (a list of tensors of one dtype -> as many results) applied
    to each dtype's tensors of `tensors` in turn, in order of first
    appearance; the results in `tensors`' order."""
    tensors = list(tensors)
    positions_of = {}
    for position, tensor in enumerate(tensors):
        positions_of.setdefault(tensor.dtype, []).append(position)
    reduced = [None] * len(tensors)
    for positions in positions_of.values():
        for position, value in zip(positions, reduce([tensors[p] for p in positions])):
            reduced[position] = value
    return reduced


def runs_within(items: Sequence, sizes: Sequence[int], limit: int) -> list:
    """`items` in order, cut into consecutive runs of at most `limit` in
    total of `sizes` (an item larger than `limit` alone): how a large state
    moves or is summed a bounded piece at a time."""
    runs, run, total = [], [], 0
    for item, size in zip(items, sizes):
        if run and total + size > limit:
            runs.append(run)
            run, total = [], 0
        run.append(item)
        total += size
    return runs + [run] if run else runs


def tf_variable(variable):
    """The `tf.Variable` behind `variable` (a Keras variable holds one)."""
    import keras
    return variable.value if isinstance(variable, keras.Variable) else variable


class TrainingState(NamedTuple):
    """What a run trains and keeps, as the lifecycle hooks see it."""

    variables: list              # the weights, the optimizer's variables, the step
    owned: Callable[[], list]    # (variable, the trainable variable whose holder owns it),
    #                              for every trainable variable and optimizer slot
    step: Any                    # the global step variable


class Strategy(abc.ABC):
    """Base class of every strategy adapter: the core hooks.

    Lifecycle: `__init__` only stores the config; `setup()` creates the
    engine and must run before any other TensorFlow op (MultiWorkerMirrored
    requires that; virtual CPU devices must be configured before the runtime
    starts), then everything else may be called.

    A new engine must implement `setup`, `num_replicas`, `distribute_dataset`,
    `run` and `_all_reduce_sum`; the rest have defaults for one process
    (sections below: lifecycle, topology, the model and its optimizer, data,
    stepping, agreement and faults). What only some engines do is not here:
    see `capabilities.py` (TensorSharding, ElasticMembership, ScheduledSteps,
    ServingProcesses).
    """

    name: str = ""
    # What a process is called in log lines ("[worker 0/2 chief]").
    process_unit: str = "worker"
    # XLA (--jit_compile): whether the replica step may be compiled, why not,
    # and whether all of it (gradients, sum, update) fits in one XLA cluster
    # (only where the cross-replica sum is no real collective).
    supports_xla: bool = True
    supports_xla_reason: str = ""
    xla_whole_step: bool = False
    # Whether the step may use the fused kernels tfdist puts in place of Keras's
    # composite ops (--fused_batchnorm): an engine that lays out every op
    # itself needs a rule for each.
    fused_kernels: bool = True
    # Replicas of this process that are logical devices of one CPU, sharing
    # its cores (mirrored over --virtual_devices): a test vehicle, not a
    # speed-up (docs/guides/default-and-mirrored.md).
    shared_cpu_replicas: int = 0

    def __init__(self, config: StrategyConfig):
        if (config.ps_hosts or config.task_type != "worker") and \
                not isinstance(self, ServingProcesses):
            raise UsageError(f"--ps_hosts and --task_type name server tasks, which "
                             f"--strategy={config.name} does not have "
                             "(--strategy=parameter_server has)")
        if config.elastic and not isinstance(self, ElasticMembership):
            raise UsageError(f"--elastic: --strategy={config.name} cannot change its number "
                             "of workers during a run; --strategy=horovod under an elastic "
                             "horovodrun (--min-np/--max-np) can")
        self.config = config
        # Counts cross-replica reductions traced into step functions; tests use
        # it to prove one reduction per update (accumulation must not add more).
        self.reductions_traced = 0
        self._any_worker_fn = None   # traced on first use (see `any_worker`)

    # -- lifecycle ---------------------------------------------------------
    @abc.abstractmethod
    def setup(self) -> None:
        """Create the engine. Raises `UsageError` for bad user input."""

    def scope(self) -> contextlib.AbstractContextManager:
        """Context in which models, optimizers and state variables are made."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Release engine resources (idempotent)."""

    # -- topology ----------------------------------------------------------
    @property
    @abc.abstractmethod
    def num_replicas(self) -> int:
        """Replicas across all workers; the global batch is split over them."""

    @property
    def step_copies(self) -> int:
        """Copies of the replica step that run per update, whose results
        `all_reduce_sum` adds up.

        `num_replicas` for replica-based engines (each replica runs the step
        on its share of the batch); 1 for SPMD engines (DTensor), where one
        program computes over the whole global batch and reductions are
        implicit. Loss terms added once per copy (regularization) and state
        averaged over copies (BatchNorm statistics) use this.
        """
        return self.num_replicas

    @property
    def num_workers(self) -> int:
        return 1

    @property
    def worker_index(self) -> int:
        return 0

    @property
    def num_input_pipelines(self) -> int:
        """Input pipelines the data is sharded over (one per worker process)."""
        return self.num_workers

    @property
    def is_chief(self) -> bool:
        """Only the chief writes checkpoints, summaries and the run summary."""
        return self.worker_index == 0

    def describe_process(self) -> str:
        """This process in messages, e.g. "worker 1" or "rank 0"."""
        return f"{self.process_unit} {self.worker_index}"

    def describe(self) -> str:
        """One line naming the engine and its devices, for the start-up log."""
        return f"{self.name}: {self.num_replicas} replica(s)"

    # -- the model, its optimizer, the run summary ---------------------------
    def on_optimizer_built(self, optimizer, variables) -> None:
        """Called once the optimizer is built on `variables` (its slots exist):
        an engine whose variables are split may replace its update steps."""

    def to_host(self, value):
        """`value` (a tensor or variable the engine made) as a host tensor."""
        import tensorflow as tf
        return tf.convert_to_tensor(value)

    def summary_fields(self, model, optimizer) -> dict:
        """Engine-specific entries of the run summary."""
        return {}

    def check_config(self, config) -> None:
        """Raise `UsageError` for a `RunConfig` this engine cannot run."""

    def check_task(self, task, y_spec, pred_spec, weight_spec) -> None:
        """Raise `UsageError` for a loss or metric this engine cannot compute
        (`task` has been built and traced on plain tensors already)."""

    # -- compiling and differentiating --------------------------------------
    def host_function(self, fn: Callable) -> Callable:
        """`fn` compiled for this engine, callable from the host.

        Called with host values (an iterator, a step count, Python options);
        returns host-readable tensors (`.numpy()`) in `fn`'s structure.
        """
        import tensorflow as tf
        return tf.function(fn, autograph=False)

    def gradients(self, tape, target, variables) -> list:
        """Gradients of `target` for `variables` (unconnected ones are zeros);
        engines whose variables are split into shards override this."""
        import tensorflow as tf
        return tape.gradient(target, variables,
                             unconnected_gradients=tf.UnconnectedGradients.ZERO)

    # -- data --------------------------------------------------------------
    @abc.abstractmethod
    def distribute_dataset(self, dataset_fn: Callable) -> Any:
        """Per-replica batches from `dataset_fn(input_context) -> tf.data.Dataset`.

        `dataset_fn` returns this input pipeline's dataset already batched by
        the per-replica batch size (`input_context.get_per_replica_batch_size`).
        """

    def input_iterator(self, dataset_fn: Callable):
        """The training iterator over `dataset_fn`'s batches, and the tf.data
        iterator whose state is this process's input position (None where the
        engine's iterator cannot be checkpointed: a resumed run then draws a
        fresh permutation). Batches are taken with `next_batch` in the loop."""
        import tensorflow as tf
        iterator = iter(self.distribute_dataset(dataset_fn))
        return iterator, (iterator if isinstance(iterator, tf.data.Iterator) else None)

    def next_batch(self, iterator):
        """The next per-replica batch from `input_iterator`'s iterator (in a tf.function)."""
        return next(iterator)

    # -- stepping ----------------------------------------------------------
    @abc.abstractmethod
    def run(self, replica_fn: Callable, *args) -> Any:
        """Run `replica_fn(*args)` on every replica; return replica 0's result.

        Called inside a `tf.function`. The replica function reduces whatever
        must agree across replicas with `all_reduce_sum`, so after it returns
        every replica holds the same values and replica 0's copy is taken.
        """

    @abc.abstractmethod
    def _all_reduce_sum(self, tensors: Sequence) -> list:
        """Engine-specific cross-replica sum of a list of tensors of one dtype."""

    def all_reduce_sum(self, tensors: Sequence) -> list:
        """Sum `tensors` over all replicas (called in replica context).

        One call is one reduction (the engines pack the list into as few
        collectives as they can, one per dtype, since packing concatenates);
        the trainer makes exactly one per update, gradients and metrics together.
        """
        self.reductions_traced += 1
        return by_dtype(tensors, self._all_reduce_sum)

    def apply_if(self, condition, update: Callable, *args) -> None:
        """`update(*args)` where `condition` (a boolean tensor that is the same
        on every replica) holds; called in replica context."""
        import tensorflow as tf

        def apply():
            update(*args)
            return tf.constant(True)

        tf.cond(condition, apply, lambda: tf.constant(False))

    # -- agreement between workers, faults ------------------------------------
    def any_worker(self, flag: bool) -> bool:
        """Whether `flag` is set on any worker (all workers call this together,
        between loops): one small collective where there are several processes."""
        import tensorflow as tf
        if self.num_workers == 1:
            return bool(flag)
        if self._any_worker_fn is None:
            def agree(value):
                # tf.identity: a replica's own copy (MultiWorkerMirroredStrategy
                # cannot all-reduce a host input: "destinations can not be empty").
                return self.run(lambda v: self.all_reduce_sum([tf.identity(v)])[0], value)
            self._any_worker_fn = self.host_function(agree)
        total = self._any_worker_fn(tf.constant(1.0 if flag else 0.0))
        return float(self.to_host(total).numpy()) > 0

    def replica_id(self):
        """This replica's index in [0, num_replicas) (called in replica context)."""
        import tensorflow as tf
        return tf.distribute.get_replica_context().replica_id_in_sync_group

    def describe_fault(self, error: Exception) -> str:
        """One line naming what failed, for an engine error during training."""
        return f"worker {self.worker_index}: {type(error).__name__}: {first_line(error)}"

    # -- lifecycle hooks: where the training state lives between steps --------
    # The controller calls them (through the trainer) around checkpoints,
    # restores and the start and end of training. An engine that splits the
    # state across processes (pipeline stages) moves it here; the defaults
    # suit every engine whose chief holds the whole state.
    def gather_state(self, state: TrainingState) -> None:
        """Before a checkpoint and at the end of training: the chief must hold
        all of `state`. Default: it does."""

    def release_state(self, state: TrainingState) -> None:
        """After a checkpoint is written: undo `gather_state`."""

    def gather_model(self, state: TrainingState) -> None:
        """At the end of training: the chief holds what `RunResult.model` and
        the export need. Default: `gather_state`."""
        self.gather_state(state)

    def hold_state(self, state: TrainingState) -> None:
        """Before a restore, which writes every variable: storage for all of
        `state` in this process, without a collective."""

    def broadcast_state(self, state: TrainingState, restored: bool) -> None:
        """Every replica starts from the chief's `state` (`restored`: whether
        this process restored a checkpoint)."""
        self.broadcast_variables(state.variables)

    def broadcast_variables(self, variables) -> None:
        """Make every replica start from the chief's values (no-op where the
        engine already mirrors variables)."""
