"""--network: keep a local cluster off the network (docs/guides/clusters.md,
"What a cluster exposes").

TensorFlow's gRPC servers listen on every interface and authenticate nothing,
so a loopback cluster runs in a private network namespace of its own with only
loopback, entered by the launcher itself before it starts any process.
"""

import ipaddress
import os
import socket
import struct

from .common import UsageError

NETWORKS = ("auto", "private", "host")
CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
IFREQ = "16sH22x"   # struct ifreq: interface name, flags, padding to 40 bytes


class Refused(Exception):
    """The kernel would not give us a private network; the text says which step and why."""


def _unshare(flags, what):
    if hasattr(os, "unshare"):   # Python 3.12+
        try:
            os.unshare(flags)
        except OSError as e:
            raise Refused(f"{what}: {e.strerror}") from None
        return
    import ctypes
    import ctypes.util
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.unshare(flags) != 0:
        raise Refused(f"{what}: {os.strerror(ctypes.get_errno())}")


def _write(path, text):
    """Write `text` to `path`; an OSError becomes Refused."""
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise Refused(f"writing {path}: {e.strerror}") from None

def _loopback_up():
    """`ip link set lo up` without the ip binary: SIOCGIFFLAGS, then SIOCSIFFLAGS | IFF_UP."""
    import fcntl
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            current = fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack(IFREQ, b"lo", 0))
            flags = struct.unpack(IFREQ, current)[1]
            fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack(IFREQ, b"lo", flags | IFF_UP))
    except OSError as e:
        raise Refused(f"bringing up loopback: {e.strerror}") from None


def _enter_private_network():
    """Move this process into a new network namespace whose one interface, loopback, is up.

    As root (CAP_SYS_ADMIN) that is unshare(CLONE_NEWNET). Otherwise a new user
    namespace owns it, mapping only our own uid and gid onto themselves, so files
    and processes keep their owner and the workers (exec'd as that uid) hold no
    privileges at all, only the launcher before it execs anything.
    """
    uid, gid = os.geteuid(), os.getegid()
    try:
        _unshare(CLONE_NEWNET, "unshare(CLONE_NEWNET)")
    except Refused as as_root:
        try:
            _unshare(CLONE_NEWUSER | CLONE_NEWNET, "unshare(CLONE_NEWUSER|CLONE_NEWNET)")
        except Refused as unprivileged:
            raise Refused(f"{as_root} (needs root), and the kernel refuses an unprivileged user "
                          f"namespace: {unprivileged}") from None
        _write("/proc/self/setgroups", "deny")   # required before an unprivileged gid_map
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    _loopback_up()


def _try_private_network():
    """Enter a private network (see `_enter_private_network`); None, or why it cannot be.

    A forked child tries first: a user namespace the kernel lets us create but
    not set up (seen for root with an empty capability bounding set: writing
    uid_map fails) cannot be left again, so this process only tries once the
    child has succeeded. Called while the launcher is single-threaded
    (unshare(CLONE_NEWUSER) requires that).
    """
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: report, then leave without running any cleanup
        reason = ""
        try:
            _enter_private_network()
        except BaseException as e:   # anything: the child must reach _exit
            reason = str(e) or type(e).__name__
        os.write(write, reason.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        reason = f.read().decode(errors="replace")
    os.waitpid(pid, 0)
    if reason:
        return reason
    try:
        _enter_private_network()
    except Refused as e:   # the child managed; this process may now be half-way
        raise UsageError(f"cannot confine the cluster although a trial could: {e}") from None
    return None


def _not_loopback(host):
    """The addresses `host` resolves to that are not loopback ([]: a loopback host)."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UsageError(f"--host={host}: cannot resolve it ({e.strerror})") from None
    addresses = sorted({info[4][0] for info in infos})
    return [a for a in addresses if not ipaddress.ip_address(a.split("%")[0]).is_loopback]


def choose_network(opts):
    """Confine the launcher (and so every process it starts) where --network and --host
    allow; return (private, why not) for the start-up line. --network=private that
    cannot be honoured is a usage error."""
    outside = _not_loopback(opts.host)
    if opts.network == "host":
        return False, None
    if outside:
        reason = f"--host={opts.host} is not a loopback address ({', '.join(outside)})"
    else:
        reason = _try_private_network()
    if reason and opts.network == "private":
        instead = "--host=localhost or --network=host" if outside else "--network=host"
        raise UsageError(f"--network=private: cannot confine the cluster: {reason}; "
                         f"use {instead}")
    return reason is None, reason


def describe_cluster(tasks, private, reason):
    """The start-up line: every task's address and who can reach it."""
    listing = ", ".join(f"{role} {index} {address}" for role, index, address in tasks)
    if private:
        return (f"cluster: {listing}; confined to a private network namespace (loopback only: "
                "unreachable from other hosts)")
    ports = [address.rpartition(":")[2] for _, _, address in tasks]
    exposed = (f"TensorFlow's gRPC servers listen on port{'s' if len(ports) > 1 else ''} "
               f"{', '.join(ports)} of every interface, "
               "unauthenticated (see docs/guides/clusters.md, \"What a cluster exposes\")")
    if reason is None:
        return f"cluster: {listing}; on this host's network (--network=host): {exposed}"
    return (f"warning: cluster: {listing}; reachable from the network: {exposed}; "
            f"not confined: {reason}")
