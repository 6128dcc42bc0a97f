"""tfdist-launch: run N workers of one command on this host as a TF_CONFIG cluster.

    tfdist-launch --workers=2 [--max_restarts=R] -- tfdist-train --strategy=multi_worker ...
    tfdist-launch --workers=2 --ps=1 -- tfdist-train --strategy=parameter_server ...

With `--ps=P` the cluster is a chief (the coordinator), N workers and P
parameter servers (TF_CONFIG `chief`, `worker`, `ps` tasks; output prefixed
`[chief 0] `, `[worker i] `, `[ps j] `). There the chief decides: when it exits
the rest are stopped, and a worker that dies is only reported (the chief
runs its steps on the other workers); a parameter server that dies fails
the chief's next step, so the group is stopped when the chief exits (or
--grace_s after the death at the latest).

Each worker gets its own `TF_CONFIG` (same cluster, its own task index) and
`TFDIST_LAUNCH_ATTEMPT` (0, then 1, 2, ... after restarts). Output lines are
prefixed `[worker i] `. When one worker fails the others are stopped at once:
a MultiWorkerMirroredStrategy collective would otherwise wait for the dead
peer forever. Stdlib only, so it starts instantly and never imports TensorFlow.

TensorFlow's gRPC servers listen on every interface and authenticate nothing
(any peer can run any op, file reads and writes included), so by default
(`--network=auto`) a loopback cluster runs in a private network namespace of
its own with only loopback: the launcher unshares its network (as root, or
through an unprivileged user namespace where the kernel allows one) before
it starts any process. The workers then reach no other host (their data
must be local). Each start prints every task's host:port and whether the
cluster is confined; `TFDIST_NETWORK` (private or host) tells the workers.

`--worker_memory=SIZE` caps the memory of every process of the cluster: each
runs in a memory cgroup of its own (see `MemoryCaps`), made before it starts
and removed when the cluster ends; `TFDIST_WORKER_MEMORY` (bytes) tells it
the cap, and `MALLOC_MMAP_THRESHOLD_=131072` (unless set) makes glibc return
freed blocks to the kernel. `TFDIST_CGROUP_ROOT` says where the cgroup file system is mounted
(default /sys/fs/cgroup).

The package, by job: `cli` (the command line, `main`), `cluster_spec` (roles,
ports, TF_CONFIG), `supervisor` (the processes: start, watch, stop, restart,
exit status), `network` (--network), `memory` (--worker_memory), `output`
(the launcher's lines and its workers' prefixed ones). Run it as
`tfdist-launch`, `python -m tfdist_launch`, or, with nothing installed,
`python launch/tfdist_launch` (the directory).
"""

from .cli import main, parse_args
from .cluster_spec import cluster_roles, pick_ports, ps_roles, tf_config
from .common import POLL_S, PROG, UsageError
from .memory import MemoryCaps, NoCgroup, parse_memory
from .network import NETWORKS, Refused, choose_network, describe_cluster
from .output import log
from .supervisor import Worker, run, start_group, stop_group, supervise, supervise_ps

__all__ = [
    "MemoryCaps", "NETWORKS", "NoCgroup", "POLL_S", "PROG", "Refused", "UsageError", "Worker",
    "choose_network", "cluster_roles", "describe_cluster", "log", "main", "parse_args",
    "parse_memory", "pick_ports", "ps_roles", "run", "start_group", "stop_group", "supervise",
    "supervise_ps", "tf_config",
]
