"""Shared adapter for engines built on `tf.distribute` strategies."""

from __future__ import annotations

import tensorflow as tf

from tfdist import compat
from tfdist.strategies.base import Strategy, tf_variable
from tfdist.strategies.capabilities import GlobalBatchStatistics, ReplicaLocalState


class TFDistributeStrategy(Strategy, ReplicaLocalState, GlobalBatchStatistics):
    """A `tf.distribute.Strategy` behind the adapter interface.

    Subclasses implement `_create()`; replication, input distribution and
    reductions are the same for every tf.distribute engine.
    """

    _strategy: tf.distribute.Strategy
    # Replicas of this process whose batches `next_batch` slices out of one
    # stacked tf.data batch (`input_iterator`); None: a plain iterator.
    _local_replicas = None

    def setup(self) -> None:
        self._strategy = self._create()

    def _create(self) -> tf.distribute.Strategy:
        raise NotImplementedError

    def scope(self):
        return self._strategy.scope()

    @property
    def num_replicas(self) -> int:
        return self._strategy.num_replicas_in_sync

    def describe(self) -> str:
        devices = self._strategy.extended.worker_devices
        return (f"{self.name}: {self.num_replicas} replica(s) on "
                f"{', '.join(devices) or 'the default device'}")

    def distribute_dataset(self, dataset_fn):
        return self._strategy.distribute_datasets_from_function(dataset_fn)

    def input_iterator(self, dataset_fn):
        """tf.distribute's distributed iterators cannot be checkpointed (TF
        2.21), so each process reads one plain tf.data iterator, whose state
        can, of its replicas' batches (stacked [local replicas, batch, ...]
        where it has several); `next_batch` hands each replica its own.
        The replicas see exactly the batches `distribute_datasets_from_function`
        gives them (round robin over the pipeline's batches)."""
        if self.num_replicas == 1:   # the default strategy: a plain tf.data iterator
            return super().input_iterator(dataset_fn)
        local = self.num_replicas // self.num_workers
        context = tf.distribute.InputContext(
            num_input_pipelines=self.num_input_pipelines, input_pipeline_id=self.worker_index,
            num_replicas_in_sync=self.num_replicas)
        with tf.device("/cpu:0"):   # the host, like tf.distribute's input pipelines
            dataset = dataset_fn(context)
            if local > 1:
                dataset = dataset.batch(local, drop_remainder=True).prefetch(1)
            iterator = iter(dataset)
        self._local_replicas = local
        return iterator, iterator

    def next_batch(self, iterator):
        local = self._local_replicas
        if local is None:
            return next(iterator)
        batches = next(iterator)
        first = self.worker_index * local   # this process's first replica id

        def replica_batch(context):
            if local == 1:
                return batches
            index = context.replica_id_in_sync_group - first
            return tf.nest.map_structure(lambda t: t[index], batches)

        return self._strategy.experimental_distribute_values_from_function(replica_batch)

    def run(self, replica_fn, *args):
        return run_first_result(self._strategy, replica_fn, args)

    def apply_if(self, condition, update, *args):
        apply_if_merged(condition, update, args)

    def _all_reduce_sum(self, tensors):
        context = tf.distribute.get_replica_context()
        return context.all_reduce(tf.distribute.ReduceOp.SUM, tensors)

    # -- capabilities.ReplicaLocalState -------------------------------------------
    def replica_variable(self, initial_value, name):
        # Sync-on-read: each replica reads and assigns its own copy in replica
        # context (tf.distribute's per-replica metric variables).
        with self._strategy.scope():
            return tf.Variable(initial_value, trainable=False, name=name,
                               synchronization=tf.VariableSynchronization.ON_READ,
                               aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    def replica_values(self, variable):
        return list(self._strategy.experimental_local_results(tf_variable(variable)))

    def all_gather(self, tensor):
        return tf.distribute.get_replica_context().all_gather(tensor, axis=0)

    # -- capabilities.GlobalBatchStatistics -------------------------------------
    def synchronize_batch_statistics(self, layers):
        if self.num_replicas == 1:
            return "one replica: its batch is the global batch"
        for layer in layers:   # Keras all-reduces the moments through the replica context
            layer.synchronized = True
        return (f"BatchNorm statistics over the global batch ({len(layers)} layer(s): "
                f"Keras's synchronized=True, sum and sum of squares all-reduced over "
                f"{self.num_replicas} replicas)")


def run_first_result(strategy: tf.distribute.Strategy, replica_fn, args):
    """`strategy.run(replica_fn, args)`, replica 0's result (the replica
    function reduces what must agree, so every replica holds the same)."""
    per_replica = strategy.run(replica_fn, args=args)
    return tf.nest.map_structure(
        lambda v: strategy.experimental_local_results(v)[0], per_replica)


def apply_if_merged(condition, update, args) -> None:
    """`update(*args)` on every replica where `condition` holds, under the
    current tf.distribute strategy. Keras optimizers call `merge_call` under
    some strategies (MirroredStrategy over virtual CPUs), and a merge_call may
    not sit in a replica-context `tf.cond`: there the condition is taken in
    cross-replica context, as Keras's LossScaleOptimizer does."""
    if compat.strategy_supports_no_merge_call():
        def apply():
            update(*args)
            return tf.constant(True)

        tf.cond(condition, apply, lambda: tf.constant(False))
        return

    def cross_replica(distribution, condition, *args):
        condition = distribution.experimental_local_results(condition)[0]

        def apply_everywhere():
            distribution.extended.call_for_each_replica(update, args=args)
            return tf.constant(True)

        tf.cond(condition, apply_everywhere, lambda: tf.constant(False))

    tf.distribute.get_replica_context().merge_call(cross_replica, args=(condition, *args))
