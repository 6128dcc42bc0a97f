"""`default`: one device, no replication (TensorFlow's default strategy)."""

import tensorflow as tf

from tfdist.strategies.tf_distribute import TFDistributeStrategy


class DefaultStrategy(TFDistributeStrategy):
    """Single-device training; the reference the other engines must match.

    Uses TensorFlow's default strategy so the trainer's code path (input
    contexts, replica context, reductions) is the same as under the
    multi-device engines; its all-reduce is the identity.
    """

    name = "default"
    xla_whole_step = True   # its cross-replica sum is the identity

    def _create(self):
        return tf.distribute.get_strategy()

    def describe(self) -> str:
        return "default: 1 replica on the default device"
