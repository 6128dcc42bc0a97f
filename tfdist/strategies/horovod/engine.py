"""`horovod`: Horovod ranks (one process each), started by `horovodrun`.

    horovodrun -np 2 -H localhost:2 --gloo tfdist-train --strategy=horovod ...

Without horovodrun the process runs as a single rank; several srun tasks
without horovodrun would each be one (a usage error, see
`_check_not_split_by_srun`). Horovod 0.28.1 does not
build against current TensorFlow as published; `make horovod` builds it
(launch/build_horovod.sh, see BUILD_NOTES.md). Its `DistributedGradientTape`
calls `.ref()` on its sources, which Keras 3 variables lack, so this adapter
all-reduces gradient tensors directly (`grouped_allreduce`), which is also
what lets accumulation reduce once per update.

`--elastic` (under `horovodrun --min-np/--max-np --host-discovery-script`):
the model, optimizer and step variables live in a Horovod elastic state
(`horovod.common.elastic`), committed every `--elastic_commit_every` steps.
When a rank dies, the others' next collective fails: they roll back to the
last commit, re-form the group (`shutdown`, `init`), re-broadcast rank 0's
state and the trainer runs its loop again with the new number of replicas
(same global batch, re-sharded data, re-traced functions). A rank that joins
gets the state in the same broadcast. See BUILD_NOTES.md for what of
Horovod's own elastic TensorFlow helpers does not work with Keras 3.
"""

from __future__ import annotations

import os

import tensorflow as tf
from absl import logging

from tfdist import compat, slurm
from tfdist.errors import UsageError
from tfdist.strategies.base import Strategy, tf_variable
from tfdist.strategies.capabilities import (ElasticMembership, GlobalBatchStatistics,
                                            ReplicaLocalState)

ELASTIC_GLOO_TIMEOUT_S = 120
BUILD_HINT = "build it with `make horovod` (launch/build_horovod.sh; see BUILD_NOTES.md)"


def _import_horovod():
    try:
        import horovod.tensorflow as hvd
    except ImportError as error:
        raise UsageError(f"--strategy=horovod: Horovod is not installed here ({error}); "
                         f"{BUILD_HINT}") from None
    except Exception as error:  # e.g. built against another TensorFlow: undefined symbols
        raise UsageError(f"--strategy=horovod: Horovod cannot be loaded "
                         f"({str(error).splitlines()[0]}); rebuild it with `make horovod`") from None
    return hvd  # the import loads Horovod's TensorFlow ops library: it was built with TF


# horovodrun sets some of these in every rank it starts (fixed or elastic, Gloo).
# An MPI launch (e.g. srun's PMI) is judged by the rank count MPI finds.
HOROVODRUN_VARIABLES = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_HOSTNAME",
                        "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_ELASTIC")


def _check_not_split_by_srun(hvd, environ, *, initialised: bool) -> None:
    """A UsageError for `srun -n N tfdist-train --strategy=horovod` that would
    make N one-rank jobs.

    Without horovodrun, a Horovod built without MPI (Gloo only, as `make
    horovod` builds it) runs each srun task as a one-rank job that believes it
    is the chief: N copies train alone and all write the same --model_dir.
    Checked before `hvd.init` when Horovod has no MPI, and after it when MPI
    still found one rank (srun without a working PMI, e.g. `--mpi=none`).
    """
    tasks = slurm.step_tasks(environ)
    if tasks < 2 or any(name in environ for name in HOROVODRUN_VARIABLES):
        return
    if initialised and hvd.size() > 1:
        return
    if not initialised and hvd.mpi_built():
        return   # MPI may find the step's ranks through srun's PMI: see after init
    if initialised:
        hvd.shutdown()
    why = "sees 1 rank" if initialised else "was built without MPI"
    raise UsageError(
        f"--strategy=horovod under srun with {tasks} tasks (SLURM_STEP_NUM_TASKS={tasks}), "
        f"not started by horovodrun, and Horovod {why}: each task would train alone as "
        "its own chief, all writing --model_dir; run horovodrun in one srun task, e.g. "
        f"`srun --ntasks=1 horovodrun -np {tasks} -H {_horovod_hosts(environ, tasks)} "
        "--gloo tfdist-train --strategy=horovod ...`, or use --strategy=multi_worker "
        "(one srun task per worker)")


def _horovod_hosts(environ, tasks: int) -> str:
    """horovodrun's -H for this step ("node9:2,node10:2"), or a sketch of it."""
    try:
        task = slurm.task_from_environ(environ)
    except UsageError:
        task = None
    if task is None:
        return f"host1:{tasks}"
    return ",".join(f"{host}:{count}" for host, count in zip(task.hosts, task.tasks_per_node))


class HorovodStrategy(Strategy, ElasticMembership, ReplicaLocalState, GlobalBatchStatistics):
    """Data parallelism over Horovod ranks; rank 0 is the chief. Elastic
    (ranks may leave and join) with --elastic."""

    name = "horovod"
    process_unit = "rank"
    _hvd = None   # horovod.tensorflow, once `setup` has initialised it

    def setup(self) -> None:
        hvd = _import_horovod()
        launched_elastic = os.environ.get("HOROVOD_ELASTIC") == "1"
        if self.config.elastic and "HOROVOD_RANK" in os.environ and not launched_elastic:
            raise UsageError("--elastic needs an elastic horovodrun (--min-np/--max-np with "
                             "--host-discovery-script); this one has a fixed -np")
        if self.config.elastic:
            # Ranks re-forming the group wait in hvd.init for a joining rank,
            # which first has to import TensorFlow (10-20 s on a loaded host);
            # past Gloo's timeout (30 s) they abort (gloo::IoException).
            os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", str(ELASTIC_GLOO_TIMEOUT_S))
        _check_not_split_by_srun(hvd, os.environ, initialised=False)
        hvd.init()
        _check_not_split_by_srun(hvd, os.environ, initialised=True)
        if launched_elastic and not self.config.elastic and hvd.rank() == 0:
            logging.warning("an elastic horovodrun without --elastic: a rank that fails still "
                            "ends the run")
        gpus = tf.config.list_physical_devices("GPU")
        if gpus:  # one GPU per local rank
            tf.config.set_visible_devices(gpus[hvd.local_rank() % len(gpus)], "GPU")
        self._hvd = hvd
        self._reforms = 0   # --elastic: times the group was re-formed

    def close(self) -> None:
        """Shut Horovod's background thread down cleanly at the end of a run."""
        if self._hvd is not None and self._hvd.is_initialized():
            self._hvd.shutdown()

    @property
    def num_replicas(self) -> int:
        return self._hvd.size()

    @property
    def num_workers(self) -> int:
        return self._hvd.size()

    @property
    def worker_index(self) -> int:
        return self._hvd.rank()

    def describe(self) -> str:
        elastic = ""
        if self.config.elastic:
            every = self.config.elastic_commit_every
            elastic = (f", elastic (commit every {every} steps)" if every
                       else ", elastic (commit every loop)")
        return (f"horovod: {self.num_replicas} rank(s); this is rank {self.worker_index} "
                f"(local rank {self._hvd.local_rank()}){elastic}")

    # -- elastic (capabilities.ElasticMembership) -------------------------------
    @property
    def elastic_enabled(self) -> bool:
        return self.config.elastic

    @property
    def commit_interval(self) -> int:
        return self.config.elastic_commit_every

    def train_elastic(self, train, state_variables):
        from horovod.common.elastic import run_fn
        from horovod.common.exceptions import HorovodInternalError

        self._elastic_state = _elastic_state(self, list(state_variables))

        def attempt(state):
            try:
                return train()
            except tf.errors.OpError as error:
                # A collective failed because a rank died (Horovod shut down):
                # roll back and re-form. hvd.elastic.run recognises only some
                # op names (not HorovodGroupedAllreduce) and returns None for
                # any other UnknownError, so tfdist translates errors itself.
                lines = [line.strip() for line in str(error.message).splitlines()
                         if "Horovod" in line]
                if not lines:
                    raise
                why = [line for line in lines if not line.startswith("Detected at node")]
                logging.warning("%s: a collective failed (%s); rolling back to the last "
                                "commit and re-forming the ranks", self.describe_process(),
                                (why or lines)[0][:300])
                raise HorovodInternalError(error) from None

        return run_fn(attempt, self._reform)(self._elastic_state)

    def _reform(self) -> None:
        """Re-form the group after ranks left or joined (Horovod's elastic reset)."""
        before = self._hvd.size()
        self._hvd.shutdown()
        self._hvd.init()
        self._reforms += 1
        self._any_worker_fn = None   # traced for the old group: Horovod ops would hang
        logging.warning("%s: ranks re-formed: %d -> %d rank(s); training goes on from the "
                        "last commit", self.describe_process(), before, self._hvd.size())

    def summary_fields(self, model, optimizer) -> dict:
        if not self.config.elastic:
            return {}
        return {"elastic_reforms": self._reforms}   # as the final chief saw them

    def commit_if_due(self, step: int) -> None:
        every = self.config.elastic_commit_every
        if not every or step % every == 0:
            # Copies the state to host memory, then (one small broadcast) raises
            # HostsUpdatedInterrupt on every rank if ranks are to join or leave.
            self._elastic_state.commit()

    def distribute_dataset(self, dataset_fn):
        context = tf.distribute.InputContext(
            num_input_pipelines=self.num_workers, input_pipeline_id=self.worker_index,
            num_replicas_in_sync=self.num_replicas)
        return dataset_fn(context)

    def run(self, replica_fn, *args):
        return replica_fn(*args)

    def replica_id(self):
        return self._hvd.rank()

    def _all_reduce_sum(self, tensors):
        if self.num_replicas == 1:
            return list(tensors)
        return self._hvd.grouped_allreduce(list(tensors), op=self._hvd.Sum)

    # -- capabilities.ReplicaLocalState (one replica per rank) --------------------
    def replica_variable(self, initial_value, name):
        return tf.Variable(initial_value, trainable=False, name=name)

    def replica_values(self, variable):
        return [tf_variable(variable)]

    def all_gather(self, tensor):
        if self.num_replicas == 1:
            return tensor
        return self._hvd.allgather(tensor)

    # -- capabilities.GlobalBatchStatistics -------------------------------------
    def synchronize_batch_statistics(self, layers):
        if self.num_replicas == 1:
            return "one rank: its batch is the global batch"
        for layer in layers:
            compat.replace_batchnorm_moments(layer, _moments_over_ranks(layer, self._hvd))
        return (f"BatchNorm statistics over the global batch ({len(layers)} layer(s): sum, "
                f"sum of squares and count all-reduced over {self.num_replicas} Horovod ranks)")

    def broadcast_variables(self, variables) -> None:
        """Rank 0's values everywhere (its initial weights, or its checkpoint)."""
        if self.num_replicas == 1:
            return
        for index, variable in enumerate(variables):
            variable.assign(self._hvd.broadcast(tf.convert_to_tensor(variable), root_rank=0,
                                                name=f"tfdist_broadcast_{index}"))

    def describe_fault(self, error: Exception) -> str:
        text = str(getattr(error, "message", error)).strip().splitlines()
        return (f"rank {self.worker_index}: Horovod collective failed (a peer rank died or "
                f"timed out): {text[0] if text else type(error).__name__}")


def _moments_over_ranks(layer, hvd):
    """`layer`'s moments over every rank's batch: the sums of x, x^2 and the
    count over the normalised axes, one grouped all-reduce (its gradient is
    the all-reduce of theirs), then E[x], E[x^2] - E[x]^2 (Keras's
    synchronized formula)."""
    def moments(inputs, mask):
        rank = len(inputs.shape)
        axes = [i for i in range(rank) if i != layer.axis % rank]
        weight = (tf.ones_like(inputs) if mask is None else tf.broadcast_to(
            tf.cast(tf.expand_dims(mask, -1), inputs.dtype), tf.shape(inputs)))
        total, squares, count = hvd.grouped_allreduce(
            [tf.reduce_sum(inputs * weight, axes), tf.reduce_sum(tf.square(inputs) * weight, axes),
             tf.reduce_sum(weight, axes)], op=hvd.Sum)
        mean = total / count
        return mean, tf.maximum(squares / count - tf.square(mean), 0.0)
    return moments


def _elastic_state(strategy, variables):
    """A Horovod elastic state of `variables` (Keras 3 variables or tf.Variables).

    Horovod's own helpers do not fit Keras 3 (BUILD_NOTES.md): its
    `TensorFlowKerasState` calls `optimizer.variables()` (a list in Keras 3);
    its `TensorFlowState` fails on Keras 3 variables, and in eager TF2 it
    broadcasts only when constructed (its `sync` needs a TF1 session), so a
    rank that joins would keep its own initial weights. This one copies the
    values to host memory on commit and broadcasts rank 0's in `sync` with
    the adapter's own broadcast.
    """
    from horovod.common.elastic import ObjectState

    class VariablesState(ObjectState):
        def __init__(self):
            self._save_variables()
            super().__init__(bcast_object=strategy._hvd.broadcast_object,
                             get_rank=strategy._hvd.rank)

        def _save_variables(self):
            self._values = [variable.numpy() for variable in variables]

        def save(self):
            self._save_variables()
            super().save()

        def restore(self):
            for variable, value in zip(variables, self._values):
                variable.assign(value)
            super().restore()

        def sync(self):
            strategy.broadcast_variables(variables)
            self._save_variables()
            super().sync()

    return VariablesState()
