"""Local device topology: virtual CPU devices and the device list to replicate over.

(TF_CONFIG parsing for multi-worker clusters lives here too.)
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from tfdist.errors import UsageError


def configure_virtual_cpus(count: Optional[int]) -> None:
    """Split the first CPU into `count` logical devices on a host without GPUs.

    Must run before the TensorFlow runtime initialises; repeating the same
    request later in the process (e.g. two runs in one test) is accepted.
    """
    if not count or tf.config.list_physical_devices("GPU"):
        return
    cpu = tf.config.list_physical_devices("CPU")[0]
    wanted = [tf.config.LogicalDeviceConfiguration() for _ in range(count)]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is not None and len(current) == count:
        return
    try:
        tf.config.set_logical_device_configuration(cpu, wanted)
    except RuntimeError:
        have = len(tf.config.list_logical_devices("CPU"))
        raise UsageError(
            f"--virtual_devices={count}: TensorFlow's devices were already initialised "
            f"in this process with {have} CPU device(s); set virtual devices before any "
            "TensorFlow op, or leave --virtual_devices unset") from None


def local_devices(virtual_cpus: Optional[int]) -> list[str]:
    """All local GPUs, else all logical CPUs (after configuring virtual ones)."""
    configure_virtual_cpus(virtual_cpus)
    gpus = tf.config.list_logical_devices("GPU")
    return [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))]
