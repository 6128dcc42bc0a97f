"""A DTensor mesh over several processes (DTensor "clients"): forming it,
and leaving it in order at the end of a run."""

from __future__ import annotations

import os
import signal

from absl import logging
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist import compat, sharding
from tfdist.errors import UsageError
from tfdist.observe import logs
from tfdist.strategies import watchdog
from tfdist.strategies.multi_worker import engine as multi_worker

_ENDED = "tfdist/run-ended"


def setup_clients(spec, config, size: int):
    """The mesh over several processes (DTensor "clients"), one per worker of
    the cluster `spec` (TF_CONFIG, --worker_hosts or tfdist-launch), each
    contributing its local devices."""
    gpus = tf.config.list_physical_devices("GPU")
    local = len(gpus) if gpus else (config.virtual_devices or 1)
    if spec.num_workers * local != size:
        raise UsageError(
            f"--mesh={config.mesh} needs {size} devices but {spec.num_workers} workers x "
            f"{local} local device(s) = {spec.num_workers * local}; set --virtual_devices="
            f"{size // spec.num_workers if size % spec.num_workers == 0 else '?'} "
            "or change the mesh")
    os.environ.update({
        "DTENSOR_JOBS": ",".join(spec.cluster[t][i] for t, i in spec.tasks),
        "DTENSOR_CLIENT_ID": str(spec.worker_index),
        "DTENSOR_NUM_CLIENTS": str(spec.num_workers),
        "DTENSOR_JOB_NAME": "worker"})
    device_type = "GPU" if gpus else "CPU"
    me = spec.name(spec.worker_index)
    # Like MultiWorkerMirroredStrategy, forming the cluster waits without
    # limit for every peer: bound it, and name the peer that never came.
    with watchdog.deadline(config.collective_timeout_s,
                           f"{me}: the DTensor cluster did not form within "
                           f"--collective_timeout_s={config.collective_timeout_s:g}s",
                           multi_worker.peers(spec)), logs.quiet_absl():
        dtensor.initialize_accelerator_system(
            device_type, num_logical_cpu_devices=None if gpus else local)
    watchdog.announce_server(spec.task_type, spec.task_index, spec.address)
    with logs.quiet_absl():
        mesh = dtensor.create_distributed_mesh(
            list(sharding.parse_mesh(config.mesh)), device_type=device_type)
    # TensorFlow's preemption notifier may swallow SIGTERM: keep it stoppable.
    # (A peer that dies during training fails the next cross-process
    # collective at once: "Connection reset by peer", named by describe_fault.)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return mesh


def end_of_run(spec, config) -> None:
    """Across processes: every peer reports its end to client 0, which
    hosts the coordination service and so leaves last (a peer still in
    the final gather when it exits would fail; see
    `compat.coordination_key_value`). Client 0 waits at most
    --collective_timeout_s, then leaves with a warning naming who was
    missing."""
    if spec is None or spec.num_workers <= 1:
        return
    put, get, delete = compat.coordination_key_value()
    if spec.worker_index:
        key = f"{_ENDED}/{spec.worker_index}"
        try:
            put(key, "1")
        except tf.errors.AlreadyExistsError:   # left by a run client 0 stopped waiting for
            delete(key)
            put(key, "1")
        return
    timeout_ms = int(config.collective_timeout_s * 1000)
    for peer in range(1, spec.num_workers):
        try:
            get(f"{_ENDED}/{peer}", timeout_ms)
            delete(f"{_ENDED}/{peer}")   # the next run in these processes reports again
        except tf.errors.OpError:
            logging.warning("%s: %s did not report the end of the run within "
                            "--collective_timeout_s=%gs; leaving anyway",
                            spec.name(0), spec.name(peer), config.collective_timeout_s)
