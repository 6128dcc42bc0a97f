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
        cross_device_ops = None  # TensorFlow's choice (NCCL) for GPUs
        if "GPU" not in devices[0].upper():
            # On logical CPUs TF picks collective ops, whose keys restart at the
            # same values in every MirroredStrategy: a second strategy in one
            # process (two runs from the Python API) then collides with the
            # first's cached collectives. Reducing on one device has no keys, and
            # costs nothing extra between logical CPUs that share memory.
            cross_device_ops = tf.distribute.ReductionToOneDevice(reduce_to_device=devices[0])
            self.shared_cpu_replicas = len(devices) if len(devices) > 1 else 0
        return tf.distribute.MirroredStrategy(devices=devices, cross_device_ops=cross_device_ops)
