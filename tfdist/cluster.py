"""Cluster topology: TF_CONFIG validation, `--worker_hosts`, Slurm, Kubernetes
Indexed Jobs, virtual CPU devices.

TF_CONFIG is checked here, in plain Python, before TensorFlow starts: a bad
cluster description must fail in one line at once, not after a worker has
waited for peers that can never answer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from typing import Optional

from tfdist import kubernetes_job, slurm, tf_config
from tfdist.errors import UsageError

# MultiWorkerMirroredStrategy runs chief and worker tasks; parameter servers
# and evaluators belong to other strategies.
TASK_TYPES = ("chief", "worker")
# ParameterServerStrategy: one chief (the coordinator), workers, parameter servers.
PS_TASK_TYPES = ("chief", "worker", "ps")


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """A validated TF_CONFIG: every task's address and which one this is."""

    cluster: dict
    task_type: str
    task_index: int

    @property
    def tasks(self) -> list[tuple[str, int]]:
        """All (type, index) pairs, chief first, in TensorFlow's worker order."""
        return [(t, i) for t in TASK_TYPES for i in range(len(self.cluster.get(t, ())))]

    @property
    def num_workers(self) -> int:
        return len(self.tasks)

    @property
    def worker_index(self) -> int:
        return self.tasks.index((self.task_type, self.task_index))

    @property
    def is_chief(self) -> bool:
        """The chief task, or worker 0 when the cluster has no chief."""
        return self.worker_index == 0

    @property
    def address(self) -> str:
        return self.cluster[self.task_type][self.task_index]

    def name(self, worker_index: int) -> str:
        task_type, index = self.tasks[worker_index]
        return f"{task_type} {index} ({self.cluster[task_type][index]})"


def _fail(problem: str) -> None:
    raise UsageError(f"TF_CONFIG: {problem}; expected e.g. "
                     '{"cluster": {"worker": ["host1:port", "host2:port"]}, '
                     '"task": {"type": "worker", "index": 0}}')


def _address_problem(address) -> Optional[str]:
    """What is wrong with a task's host:port (None: nothing)."""
    host, _, port = str(address).rpartition(":")
    # isdigit() alone also takes non-ASCII digits such as '²', which int() rejects.
    if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        return "is not host:port with a port in 1-65535"
    if any(c.isspace() or not c.isprintable() for c in host):
        return "has whitespace or control characters in its host"
    return None


def _check_address(task_type: str, index: int, address) -> None:
    problem = _address_problem(address)
    if problem:
        _fail(f"cluster.{task_type}[{index}]={address!r} {problem}")


def _is_local(host: str) -> bool:
    """Whether this machine can listen on `host` (the task's own address)."""
    try:
        for family, kind, proto, _, sockaddr in socket.getaddrinfo(host, None):
            with socket.socket(family, kind, proto) as probe:
                probe.bind((sockaddr[0], 0))
                return True
    except (OSError, UnicodeError):   # UnicodeError: not a valid (IDNA) host name
        return False
    return False


def parse_tf_config(text: str, *, check_local: bool = True,
                    task_types: tuple = TASK_TYPES) -> ClusterSpec:
    """Validate a TF_CONFIG string. Raises `UsageError` naming the problem."""
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as error:
        _fail(f"not valid JSON ({error.msg} at character {error.pos})")
    if not isinstance(parsed, dict):
        _fail(f"a JSON {type(parsed).__name__}, not an object")
    cluster, task = parsed.get("cluster"), parsed.get("task")
    if not isinstance(cluster, dict) or not cluster:
        _fail("missing or empty 'cluster'")
    if not isinstance(task, dict):
        _fail("missing 'task'")
    for task_type, addresses in cluster.items():
        if task_type not in task_types:
            _fail(f"cluster has task type {task_type!r}; valid: {', '.join(task_types)}")
        if not isinstance(addresses, list) or not addresses:
            _fail(f"cluster.{task_type} must be a non-empty list of host:port")
        for index, address in enumerate(addresses):
            _check_address(task_type, index, address)
    if len(cluster.get("chief", ())) > 1:
        _fail(f"cluster has {len(cluster['chief'])} chiefs; at most 1 is valid")
    every = [a for addresses in cluster.values() for a in addresses]
    duplicates = sorted({a for a in every if every.count(a) > 1})
    if duplicates:
        _fail(f"address {duplicates[0]} appears more than once in the cluster")
    task_type, index = task.get("type"), task.get("index")
    if not isinstance(task_type, str) or task_type not in cluster:
        _fail(f"task.type={task_type!r} is not a task type of the cluster "
              f"({', '.join(cluster)})")
    if isinstance(index, bool) or not isinstance(index, int) or not (
            0 <= index < len(cluster[task_type])):
        _fail(f"task.index={index!r} is out of range for {len(cluster[task_type])} "
              f"{task_type} task(s) (valid: 0-{len(cluster[task_type]) - 1})")
    spec = ClusterSpec(cluster=cluster, task_type=task_type, task_index=index)
    host = spec.address.rpartition(":")[0]
    if check_local and not _is_local(host):
        _fail(f"this task's address {spec.address} ({task_type} {index}) is not an address "
              "of this machine; is task.index right for this host?")
    return spec


def tf_config_from_hosts(worker_hosts, task_index: Optional[int]) -> str:
    """TF_CONFIG for `--worker_hosts=h1:p,h2:p --task_index=i` (Model Garden style)."""
    if task_index is None:
        raise UsageError("--worker_hosts needs --task_index (this host's position in the list)")
    if not 0 <= task_index < len(worker_hosts):
        raise UsageError(f"--task_index={task_index} is out of range for "
                         f"{len(worker_hosts)} --worker_hosts (valid: 0-{len(worker_hosts) - 1})")
    for index, address in enumerate(worker_hosts):
        problem = _address_problem(address)
        if problem:
            raise UsageError(f"--worker_hosts: entry {index} {address!r} {problem}, "
                             "e.g. --worker_hosts=host1:2222,host2:2222")
    if len(set(worker_hosts)) < len(worker_hosts):
        twice = sorted({a for a in worker_hosts if list(worker_hosts).count(a) > 1})[0]
        raise UsageError(f"--worker_hosts: {twice} appears more than once; every worker "
                         "needs its own host:port")
    return tf_config.compose({"worker": worker_hosts}, "worker", task_index)


def resolve(worker_hosts=(), task_index: Optional[int] = None,
            environ=os.environ) -> Optional[ClusterSpec]:
    """This process's cluster: from --worker_hosts (written to TF_CONFIG), from
    TF_CONFIG, from the Kubernetes Indexed Job whose pod it is, or from the
    Slurm job step it runs in (those two also written to TF_CONFIG).

    None when there is none of these (a single process).
    """
    if worker_hosts:
        text = tf_config_from_hosts(worker_hosts, task_index)
        mine = worker_hosts[task_index]
        if not _is_local(mine.rpartition(":")[0]):
            raise UsageError(f"--worker_hosts entry {task_index} ({mine}) is not an address of "
                             f"this machine; is --task_index={task_index} right for this host?")
        environ["TF_CONFIG"] = text
    elif task_index is not None:
        raise UsageError(f"--task_index={task_index} needs --worker_hosts")
    text = environ.get("TF_CONFIG")
    if not text:
        return _from_indexed_job(environ) or _from_slurm(environ)
    return parse_tf_config(text)


def _from_indexed_job(environ) -> Optional[ClusterSpec]:
    """The cluster of this pod's Indexed Job (tfdist/kubernetes_job.py), once
    every worker's name resolves; None unless TFDIST_JOB_COMPLETIONS is set.
    Written to TF_CONFIG, which MultiWorkerMirroredStrategy reads."""
    task = kubernetes_job.task_from_environ(environ)
    if task is None:
        return None
    from absl import logging
    kubernetes_job.wait_for_peers(task, environ, log=logging.warning)
    host = task.address.rpartition(":")[0]
    if not _is_local(host):
        raise UsageError(f"{task.describe()}: its name {host} resolves, but not to an address "
                         f"of this pod; is {kubernetes_job.INDEX} this pod's index and "
                         f"{kubernetes_job.NAME} the Job's name?")
    environ["TF_CONFIG"] = task.tf_config()
    return parse_tf_config(environ["TF_CONFIG"], check_local=False)


def _from_slurm(environ) -> Optional[ClusterSpec]:
    """The cluster of this Slurm job step (tfdist/slurm.py says why not
    TensorFlow's SlurmClusterResolver); None outside Slurm. Written to
    TF_CONFIG, which MultiWorkerMirroredStrategy reads."""
    task = slurm.task_from_environ(environ)
    if task is None:
        return None
    host = task.address.rpartition(":")[0]
    if not _is_local(host):
        raise UsageError(f"{task.job}, rank {task.rank}: Slurm node name {host!r} is not an "
                         "address of this machine; tfdist uses the node names of "
                         "SLURM_STEP_NODELIST as host names, so they must resolve to the "
                         "nodes (or set TF_CONFIG yourself)")
    slurm.check_port_free(task)
    environ["TF_CONFIG"] = task.tf_config()
    return parse_tf_config(environ["TF_CONFIG"], check_local=False)


# -- local devices ------------------------------------------------------------
def configure_virtual_cpus(count: Optional[int]) -> None:
    """Split the first CPU into `count` logical devices on a host without GPUs.

    Must run before the TensorFlow runtime initialises. Later requests in the
    same process (e.g. several runs from the Python API or the tests) are
    accepted when at least `count` logical CPUs exist: `local_devices` then
    uses the first `count` of them.
    """
    import tensorflow as tf

    if not count or tf.config.list_physical_devices("GPU"):
        return
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is not None and len(current) >= count:
        return
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(count)])
    except RuntimeError:
        have = len(tf.config.list_logical_devices("CPU"))
        raise UsageError(
            f"--virtual_devices={count}: TensorFlow's devices were already initialised "
            f"in this process with {have} CPU device(s); set virtual devices before any "
            "TensorFlow op, or ask for at most that many") from None


def local_devices(virtual_cpus: Optional[int]) -> list[str]:
    """All local GPUs, else the logical CPUs (the first `virtual_cpus` if set)."""
    import tensorflow as tf

    configure_virtual_cpus(virtual_cpus)
    gpus = tf.config.list_logical_devices("GPU")
    if gpus:
        return [d.name for d in gpus]
    cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
    return cpus[:virtual_cpus] if virtual_cpus else cpus


# -- parameter servers ----------------------------------------------------------
def parse_ps_tf_config(text: str, *, check_local: bool = True) -> ClusterSpec:
    """A TF_CONFIG for ParameterServerStrategy: exactly one chief (the
    coordinator), at least one worker and one ps. Raises `UsageError`."""
    spec = parse_tf_config(text, check_local=False, task_types=PS_TASK_TYPES)
    counts = {t: len(spec.cluster.get(t, ())) for t in PS_TASK_TYPES}
    if counts["chief"] != 1:
        _fail("--strategy=parameter_server needs exactly one chief task (the coordinator), "
              f"the cluster has {counts['chief']}")
    for task_type, what in (("worker", "a worker"), ("ps", "a parameter server")):
        if not counts[task_type]:
            _fail(f"--strategy=parameter_server needs at least {what} ({task_type!r} "
                  "task), the cluster has none")
    if check_local:
        return parse_tf_config(text, check_local=True, task_types=PS_TASK_TYPES)
    return spec


def ps_tf_config_from_hosts(worker_hosts, ps_hosts, task_type: str,
                            task_index: Optional[int]) -> str:
    """TF_CONFIG for `--worker_hosts=chief,w1,... --ps_hosts=p0,... --task_type=T
    --task_index=i` (TensorFlow 1's convention: worker 0 is the chief)."""
    if not worker_hosts or not ps_hosts:
        raise UsageError("--strategy=parameter_server without TF_CONFIG needs --worker_hosts "
                         "(the chief first, then at least one worker) and --ps_hosts")
    if task_index is None:
        raise UsageError(f"--ps_hosts needs --task_index (this host's position in "
                         f"--{'ps' if task_type == 'ps' else 'worker'}_hosts)")
    for flag, hosts in (("--worker_hosts", worker_hosts), ("--ps_hosts", ps_hosts)):
        for index, address in enumerate(hosts):
            problem = _address_problem(address)
            if problem:
                raise UsageError(f"{flag}: entry {index} {address!r} {problem}, "
                                 f"e.g. {flag}=host1:2222,host2:2222")
    if len(worker_hosts) < 2:
        raise UsageError(f"--worker_hosts={','.join(worker_hosts)}: parameter_server needs the "
                         "chief and at least one worker (entry 0 is the chief)")
    if task_type == "chief" and task_index != 0:
        raise UsageError(f"--task_type=chief --task_index={task_index}: there is one chief, "
                         "index 0 (it is --worker_hosts entry 0)")
    hosts = ps_hosts if task_type == "ps" else worker_hosts
    if not 0 <= task_index < len(hosts):
        flag = "--ps_hosts" if task_type == "ps" else "--worker_hosts"
        raise UsageError(f"--task_index={task_index} is out of range for {len(hosts)} "
                         f"{flag} (valid: 0-{len(hosts) - 1})")
    cluster = {"chief": [worker_hosts[0]], "worker": list(worker_hosts[1:]),
               "ps": list(ps_hosts)}
    if task_type == "ps":
        return tf_config.compose(cluster, "ps", task_index)
    if task_index == 0:
        return tf_config.compose(cluster, "chief", 0)
    return tf_config.compose(cluster, "worker", task_index - 1)


def resolve_ps(worker_hosts=(), ps_hosts=(), task_type: str = "worker",
               task_index: Optional[int] = None, environ=os.environ) -> ClusterSpec:
    """This process's parameter-server cluster: from the host lists (written
    to TF_CONFIG), or TF_CONFIG. Raises `UsageError` when neither is usable."""
    if worker_hosts or ps_hosts:
        environ["TF_CONFIG"] = ps_tf_config_from_hosts(worker_hosts, ps_hosts, task_type,
                                                       task_index)
    elif task_index is not None:
        raise UsageError(f"--task_index={task_index} needs --worker_hosts and --ps_hosts")
    text = environ.get("TF_CONFIG")
    if not text:
        raise UsageError(
            "--strategy=parameter_server needs a cluster: set TF_CONFIG (chief, worker and ps "
            "tasks), pass --worker_hosts=chief:port,worker:port --ps_hosts=ps:port with "
            "--task_type and --task_index, or start one locally with "
            "`tfdist-launch --workers=N --ps=P -- tfdist-train --strategy=parameter_server ...`")
    return parse_ps_tf_config(text)


# -- checked before TensorFlow loads ------------------------------------------------
def check_workers(config, environ, *, required: bool) -> None:
    """Raise `UsageError` if `resolve` would (on a copy of `environ`), or if
    `required` and there is no cluster (multi_worker's own message). Server
    flags (--ps_hosts, --task_type) are left to the engine, which names them."""
    if config.ps_hosts or config.task_type != "worker":
        return
    if resolve(config.worker_hosts, config.task_index, environ=environ) is None and required:
        raise no_cluster(config.name)


def no_cluster(strategy: str) -> UsageError:
    """The error for an engine that needs a cluster and has none."""
    return UsageError(
        f"--strategy={strategy} needs a cluster: set TF_CONFIG, pass "
        "--worker_hosts=h1:port,h2:port with --task_index=i, start one task per "
        "worker with srun in a Slurm job (launch/slurm/tfdist.sbatch), or start "
        "local workers with `tfdist-launch --workers=N -- ...`")


def check_ps(config, environ) -> None:
    """Raise `UsageError` if `resolve_ps` would (on a copy of `environ`)."""
    resolve_ps(config.worker_hosts, config.ps_hosts, config.task_type, config.task_index,
               environ=environ)
