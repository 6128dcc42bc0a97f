"""`mirrored`: synchronous data parallelism over the devices of one host."""

import tensorflow as tf

from tfdist import cluster
from tfdist.strategies.tf_distribute import TFDistributeStrategy


class MirroredStrategy(TFDistributeStrategy):
    """`tf.distribute.MirroredStrategy` over all local GPUs, or all logical CPUs.

    On a CPU-only host `virtual_devices=N` splits the CPU into N logical
    devices, so the multi-device path (per-replica batches, all-reduce,
    mirrored variables) runs for real without a GPU.
    """

    name = "mirrored"

    def _create(self):
        devices = cluster.local_devices(self.config.virtual_devices)
        return tf.distribute.MirroredStrategy(devices=devices)
