"""`multi_worker`: MultiWorkerMirroredStrategy over a TF_CONFIG cluster.

Keras 3's `model.fit` fails under this strategy upstream ("Attempt to convert
a value (PerReplica...)"); tfdist's custom loop runs the same Keras 3 models
with `strategy.run`, so workers stay in sync step by step.

The cluster comes from TF_CONFIG (validated in `tfdist.cluster` before
TensorFlow starts), from `--worker_hosts/--task_index`, or from the Slurm job
step (`tfdist.slurm`, written to TF_CONFIG).
"""

from __future__ import annotations

import re
import signal

import tensorflow as tf

from tfdist import cluster, compat
from tfdist.errors import UsageError
from tfdist.strategies import watchdog
from tfdist.strategies.tf_distribute import TFDistributeStrategy

_IMPLEMENTATIONS = {
    "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
    "ring": tf.distribute.experimental.CommunicationImplementation.RING,
    "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
}


# Lines of a TensorFlow op error that say where, not what.
_NOISE = re.compile(r"^(Graph execution error:|Detected at node |File \"|\[\[|The error could "
                    r"be from a previous operation)")


def _reason(text: str) -> str:
    """The gist of a TensorFlow error: gRPC's own message if there is one,
    else the first lines of the message proper (no traceback, no op names)."""
    grpc = re.findall(r'grpc_message:"([^"]+)"', text)
    if grpc:
        return grpc[-1]
    lines = [line.strip() for line in text.splitlines()]
    lines = [re.sub(r"\s*\[type\.googleapis\.com/.*$", "", line) for line in lines
             if line and not _NOISE.match(line)]
    return " ".join(lines[:2])[:300] or "(no message)"


def describe_peer_fault(spec, my_index: int, error: Exception, *, probe: bool = True) -> str:
    """One line naming the peer(s) a failed collective points at.

    TensorFlow's error may name a task (".../task:N"); a cut link often names
    none (a heartbeat "Deadline Exceeded"). So, with `probe`, every peer's
    host:port is also tried with a short TCP connect and the ones that do not
    answer are listed: "...; unreachable: worker 1 (host:port): timed out".
    """
    text = str(getattr(error, "message", error))
    me = spec.name(my_index) if spec is not None else f"worker {my_index}"
    detail = _reason(text)
    silent = watchdog.unreachable(peers(spec)) if probe else []
    if silent:
        tail = "; unreachable: " + "; ".join(silent)
    elif probe and spec is not None and spec.num_workers > 1:
        tail = "; every peer accepts connections"
    else:
        tail = ""
    if spec is not None:
        for task_type, index in re.findall(r"/job:(chief|worker)/replica:\d+/task:(\d+)", text):
            if (task_type, int(index)) in spec.tasks:
                position = spec.tasks.index((task_type, int(index)))
                if position != my_index:
                    return (f"{me}: peer {spec.name(position)} failed or is unreachable: "
                            f"{detail}{tail}")
    return f"{me}: collective failed: {type(error).__name__}: {detail}{tail}"


def peers(spec) -> list:
    """(name, host, port) of every task but this one, for start-up deadlines."""
    if spec is None:
        return []
    found = []
    for index, (task_type, task_index) in enumerate(spec.tasks):
        if index != spec.worker_index:
            host, _, port = spec.cluster[task_type][task_index].rpartition(":")
            found.append((spec.name(index), host, int(port)))
    return found


class MultiWorkerStrategy(TFDistributeStrategy):
    """One process per worker; every worker replicates over its local GPUs (or one CPU)."""

    name = "multi_worker"
    _spec = None

    def _create(self):
        config = self.config
        # TF_CONFIG, --worker_hosts or the Slurm step, always as TF_CONFIG (read by
        # the strategy's default resolver): TensorFlow's SlurmClusterResolver
        # fails on CPU nodes and misnumbers tasks (tfdist/slurm.py).
        self._spec = cluster.resolve(config.worker_hosts, config.task_index)
        if self._spec is None:
            raise cluster.no_cluster(self.name)
        options = tf.distribute.experimental.CommunicationOptions(
            bytes_per_pack=config.bytes_per_pack,
            timeout_seconds=config.collective_timeout_s,
            implementation=_IMPLEMENTATIONS[config.collective])
        try:
            # Creating the strategy waits, without limit, until every peer
            # answers; bound that wait by the collective timeout.
            me = self._spec.name(self._spec.worker_index) if self._spec else "this worker"
            with watchdog.deadline(
                    config.collective_timeout_s,
                    f"{me}: the cluster did not form within --collective_timeout_s="
                    f"{config.collective_timeout_s:g}s", peers(self._spec)):
                compat.next_collective_key_base(tf.distribute.MultiWorkerMirroredStrategy)
                strategy = tf.distribute.MultiWorkerMirroredStrategy(
                    communication_options=options)
        except RuntimeError as error:
            if "initialized" in str(error) or "startup" in str(error):
                raise UsageError(
                    "--strategy=multi_worker must be created before any other TensorFlow op "
                    "in the process (tfdist.train does this first; do not run TensorFlow "
                    "code before it, e.g. create keras.metrics objects in model_fn with "
                    f"model.compile, or pass metric names): {error}") from None
            raise
        # TensorFlow's worker order: the chief (if any) first, then the workers.
        resolver = strategy.cluster_resolver
        watchdog.announce_server(resolver.task_type, resolver.task_id, resolver.cluster_spec()
                                 .task_address(resolver.task_type, resolver.task_id))
        tasks = resolver.cluster_spec().as_dict()
        self._num_workers = len(tasks.get("chief", ())) + len(tasks.get("worker", ()))
        self._worker_index = 0 if resolver.task_type == "chief" else (
            resolver.task_id + len(tasks.get("chief", ())))
        # TensorFlow's preemption notifier swallows SIGTERM; restore the
        # default so that a launcher, Kubernetes or Slurm can stop a worker.
        # (The checkpoint index is written last, so the latest complete
        # checkpoint survives.)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        return strategy

    @property
    def num_workers(self) -> int:
        return self._num_workers

    @property
    def worker_index(self) -> int:
        return self._worker_index

    @property
    def is_chief(self) -> bool:
        return self._strategy.extended.should_checkpoint

    def worker_name(self, index: int) -> str:
        if self._spec is not None:
            return self._spec.name(index)
        return f"worker {index}"

    def describe(self) -> str:
        return (f"multi_worker: {self.num_workers} worker(s), {self.num_replicas} replica(s); "
                f"this is {self.worker_name(self.worker_index)}"
                f"{' (chief)' if self.is_chief else ''}")

    def describe_fault(self, error: Exception) -> str:
        return describe_peer_fault(self._spec, self.worker_index, error)

    def broadcast_variables(self, variables) -> None:
        """Give every worker the chief's values (e.g. after the chief restored
        a checkpoint that other hosts cannot see): one sum in which only the
        chief contributes non-zero values."""
        variables = list(variables)
        chief = self.is_chief

        @tf.function(autograph=False)
        def broadcast():
            def replica_fn():
                context = tf.distribute.get_replica_context()
                first_replica = tf.equal(context.replica_id_in_sync_group, 0)
                keep = tf.logical_and(chief, first_replica)
                values = [tf.convert_to_tensor(v) for v in variables]
                return self.all_reduce_sum([tf.where(keep, v, tf.zeros_like(v)) for v in values])

            summed = self._strategy.run(replica_fn)
            for variable, total in zip(variables, summed):
                variable.assign(self._strategy.experimental_local_results(total)[0])

        if variables:
            broadcast()
