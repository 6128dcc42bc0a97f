"""The cluster's shape: which processes it has (roles), the ports they listen
on, and the TF_CONFIG each is given."""

import errno
import json
import socket

from .common import UsageError


def pick_ports(host, count, base):
    """Return `count` distinct free ports on `host`, holding each bound until all are found.

    A port counts as free if we can bind it; one in use is skipped, never waited for.
    The probes are closed before the workers start, so a port can still be taken in
    between; the worker then fails to bind and fail-fast (or a restart) handles it.
    """
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise UsageError(f"--host={host}: cannot resolve it ({e.strerror})") from None
    held, port = [], base
    try:
        while len(held) < count:
            if base is not None and port > 65535:
                raise UsageError(f"--port_base={base}: only {len(held)} free ports from {base} "
                                 f"to 65535, need {count}; pick a lower --port_base")
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.bind((addr[0], port or 0) + tuple(addr[2:]))
                held.append(sock)
            except OSError as e:
                sock.close()
                if e.errno not in (errno.EADDRINUSE, errno.EACCES) or base is None:
                    raise UsageError(f"--host={host}: cannot bind a port on it "
                                     f"({e.strerror}); use a local name such as localhost") from None
            if base is not None:
                port += 1
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def ps_roles(workers, ps):
    """(task type, index) of every process of a parameter-server cluster."""
    return ([("chief", 0)] + [("worker", i) for i in range(workers)]
            + [("ps", j) for j in range(ps)])


def cluster_roles(opts):
    """(task type, index) of every process the launcher starts."""
    return (ps_roles(opts.workers, opts.ps) if opts.ps
            else [("worker", i) for i in range(opts.workers)])


def tf_config(host, ports, roles, position):
    """TF_CONFIG of process `position` of the cluster `roles` (one port each, in order):
    `worker` tasks only, or a chief/worker/ps cluster."""
    cluster = {}
    for (role, _), port in zip(roles, ports):
        cluster.setdefault(role, []).append(f"{host}:{port}")
    role, index = roles[position]
    return json.dumps({"cluster": cluster, "task": {"type": role, "index": index}})
