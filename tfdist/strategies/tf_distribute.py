"""Shared adapter for engines built on `tf.distribute` strategies."""

from __future__ import annotations

import tensorflow as tf

from tfdist.strategies.base import Strategy


class TFDistributeStrategy(Strategy):
    """A `tf.distribute.Strategy` behind the adapter interface.

    Subclasses implement `_create()`; replication, input distribution and
    reductions are the same for every tf.distribute engine.
    """

    _strategy: tf.distribute.Strategy

    def setup(self) -> None:
        self._strategy = self._create()

    def _create(self) -> tf.distribute.Strategy:
        raise NotImplementedError

    @property
    def tf_strategy(self) -> tf.distribute.Strategy:
        return self._strategy

    def scope(self):
        return self._strategy.scope()

    @property
    def num_replicas(self) -> int:
        return self._strategy.num_replicas_in_sync

    def describe(self) -> str:
        devices = getattr(self._strategy.extended, "worker_devices", ())
        return (f"{self.name}: {self.num_replicas} replica(s) on "
                f"{', '.join(devices) or 'the default device'}")

    def distribute_dataset(self, dataset_fn):
        return self._strategy.distribute_datasets_from_function(dataset_fn)

    def run(self, replica_fn, *args):
        per_replica = self._strategy.run(replica_fn, args=args)
        return tf.nest.map_structure(
            lambda v: self._strategy.experimental_local_results(v)[0], per_replica)

    def _all_reduce_sum(self, tensors):
        context = tf.distribute.get_replica_context()
        return context.all_reduce(tf.distribute.ReduceOp.SUM, tensors)
