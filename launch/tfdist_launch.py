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
"""

import argparse
import contextlib
import errno
import ipaddress
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

PROG = "tfdist-launch"
POLL_S = 0.1          # how often worker exits are checked; no busy loop
DRAIN_S = 1.0         # how long to wait for a stopped worker's last output lines
SETTLE_S = 1.0        # after a failure, how long to gather near-simultaneous ones
_OUTPUT = threading.Lock()  # held per line, so lines never interleave
_closed = False             # set on exit: pumps of strays then write nothing


class UsageError(Exception):
    """A mistake in the command line; reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def _parser():
    """Options grouped by concern, each help saying its default and valid values
    (the style of tfdist-train --help)."""
    p = _Parser(prog=PROG, allow_abbrev=False,
                usage=f"{PROG} --workers=N [options] -- CMD [ARGS...]",
                formatter_class=argparse.RawDescriptionHelpFormatter,
                description="Start N local workers of CMD as a TF_CONFIG cluster; stop them all "
                            "when one fails,\noptionally restart the group. Everything after "
                            "'--' is the worker command:\n\n"
                            f"    {PROG} --workers=2 -- tfdist-train --strategy=multi_worker\n"
                            f"    {PROG} --workers=2 --ps=1 -- tfdist-train "
                            "--strategy=parameter_server",
                epilog="Exit status: 0 when every worker exited 0; 1 after a failure (restarts "
                       "used up);\n128+N when stopped by signal N; 2 for a bad command line.")
    cluster = p.add_argument_group("cluster")
    cluster.add_argument("--workers", type=int, required=True, metavar="N",
                         help="number of worker processes [required; an integer >= 1]")
    cluster.add_argument("--ps", type=int, default=0, metavar="P",
                         help="parameter servers: start a chief, N workers and P parameter "
                              "servers (--strategy=parameter_server); 0: N workers, no chief "
                              "[default: %(default)s; an integer >= 0]")
    cluster.add_argument("--host", default="localhost",
                         help="host name or address written into TF_CONFIG; a non-loopback "
                              "one makes the cluster reachable from the network (see --network) "
                              "[default: %(default)s]")
    cluster.add_argument("--port_base", type=int, default=None, metavar="P",
                         help="use free ports P, P+1, ... (ports in use are skipped) "
                              "[default: ports picked by the OS; a TCP port, 1 to 65535]")
    cluster.add_argument("--network", default="auto", choices=NETWORKS,
                         help="private: the cluster in a network namespace of its own with only "
                              "loopback, unreachable from other hosts; the workers reach no "
                              "network either (data must be local); needs root or unprivileged "
                              "user namespaces, and a loopback --host. host: this host's network, "
                              "where TensorFlow's gRPC servers listen unauthenticated on every "
                              "interface. auto: private when possible, else host with a warning "
                              "[default: %(default)s]")
    memory = p.add_argument_group("memory")
    memory.add_argument("--worker_memory", default=None, metavar="SIZE",
                        help="cap the memory of each process of the cluster (every worker; with "
                             "--ps also the chief and each parameter server) at SIZE, with "
                             "no swap: an integer number of bytes with an optional K, M or G "
                             "suffix, powers of 1024 (2G = 2147483648 bytes; 1500M; at least "
                             "1M). Each process runs in a memory cgroup of its own (cgroup v2 "
                             "memory.max with memory.swap.max 0, or cgroup v1 "
                             "memory.limit_in_bytes), made under (cgroup v2: if need be "
                             "beside) the launcher's cgroup before "
                             "the process starts and removed when the cluster ends. A process "
                             "over its cap is killed by the kernel's out-of-memory killer; the "
                             "launcher names it and the cap and stops the rest of the cluster. "
                             "Each process finds the cap in bytes in TFDIST_WORKER_MEMORY, and "
                             "MALLOC_MMAP_THRESHOLD_=131072 (unless set) so that glibc returns "
                             "freed blocks to the kernel. Needs "
                             "root (or a delegated cgroup): where the cgroups cannot be made the "
                             "launcher exits 2 before starting anything [default: no cap]")
    faults = p.add_argument_group("faults")
    faults.add_argument("--max_restarts", type=int, default=0, metavar="R",
                        help="restart the whole group after a failure up to R times "
                             "[default: %(default)s; an integer >= 0]")
    faults.add_argument("--grace_s", type=float, default=30.0, metavar="S",
                        help="seconds between SIGTERM and SIGKILL when stopping workers: a "
                             "tfdist-train worker saves a checkpoint and exits 143 within its "
                             "--preemption_grace_s (default 25) of SIGTERM "
                             "[default: %(default)g; a number >= 0]")
    return p


def parse_args(argv):
    """Options before `--`, the worker command after it; argparse would eat the command's flags."""
    cut = argv.index("--") if "--" in argv else len(argv)
    opts, stray = _parser().parse_known_args(argv[:cut])
    cmd = argv[cut + 1:]
    if stray and stray[0].startswith("-"):
        raise UsageError(f"unrecognized arguments: {' '.join(stray)}")
    if stray or not cmd:
        raise UsageError(f"missing the worker command: put it after '--', "
                         f"e.g. {PROG} --workers=2 -- tfdist-train --strategy=multi_worker")
    if opts.workers < 1:
        raise UsageError(f"--workers={opts.workers} must be at least 1")
    if opts.ps < 0:
        raise UsageError(f"--ps={opts.ps} must be 0 or more")
    if opts.max_restarts < 0:
        raise UsageError(f"--max_restarts={opts.max_restarts} must be 0 or more")
    if opts.port_base is not None and not 1 <= opts.port_base <= 65535:
        raise UsageError(f"--port_base={opts.port_base} must be a TCP port, 1..65535 "
                         f"(omit it to let the OS pick free ports)")
    if opts.grace_s < 0:
        raise UsageError(f"--grace_s={opts.grace_s:g} must be 0 or more")
    opts.memory_limit = (parse_memory(opts.worker_memory) if opts.worker_memory is not None
                         else None)
    return opts, cmd


def _emit(stream, data):
    """Write bytes and flush under the output lock; a closed stream must not kill the launcher."""
    with _OUTPUT:
        if _closed:
            return
        try:
            stream.write(data)
            stream.flush()
        except (OSError, ValueError):
            pass


def log(message):
    _emit(sys.stderr.buffer, f"{PROG}: {message}\n".encode())


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


# -- network: keep a local cluster off the network (README "Security") ------------
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


def _write(path, text, error=None):
    """Write `text` to `path`; an OSError becomes `error` (default Refused)."""
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        if error is not None:
            raise error(f"writing {text!r} to {path}: {e.strerror}") from None
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
               "unauthenticated (see README \"Security\")")
    if reason is None:
        return f"cluster: {listing}; on this host's network (--network=host): {exposed}"
    return (f"warning: cluster: {listing}; reachable from the network: {exposed}; "
            f"not confined: {reason}")


# -- --worker_memory: each process of the cluster in a memory cgroup of its own ---
CGROUP_ROOT = "/sys/fs/cgroup"   # TFDIST_CGROUP_ROOT overrides it
MIN_MEMORY = 1 << 20
_SIZE = re.compile(r"([0-9]+)([KMG]?)", re.IGNORECASE)
REMOVE_S = 5.0   # how long a cgroup's strays may take to die before we give up removing it


def parse_memory(text):
    """--worker_memory's SIZE in bytes: an integer, optionally K, M or G (powers of 1024)."""
    found = _SIZE.fullmatch(text.strip())
    if not found:
        raise UsageError(f"--worker_memory={text} is not a size: use an integer number of bytes "
                         "with an optional K, M or G suffix (powers of 1024), e.g. "
                         "--worker_memory=2G or --worker_memory=1500M")
    size = int(found[1]) << 10 * "_KMG".index(found[2].upper() or "_")
    if size < MIN_MEMORY:
        meant = f" (did you mean {text}M?)" if size and not found[2] else ""
        raise UsageError(f"--worker_memory={text} is {size} bytes, too little to run a process; "
                         f"give at least 1M{meant}")
    if size >= 1 << 62:
        raise UsageError(f"--worker_memory={text} is more than any kernel can cap; give less, "
                         "or omit the flag for no cap")
    return size


class NoCgroup(Exception):
    """The memory cgroups cannot be made here; the text says which step and why."""


def _read(path):
    with open(path) as f:
        return f.read()


def _cgroup_write(path, text):
    _write(path, text, error=NoCgroup)


def _remove_cgroup(path):
    """rmdir a cgroup; processes still in it (strays that left their worker's
    process group) are SIGKILLed first. Gives up, with a warning, after REMOVE_S."""
    deadline = time.monotonic() + REMOVE_S
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                log(f"warning: cannot remove the cgroup {path}: {e.strerror}")
                return
        try:
            strays = [int(pid) for pid in _read(f"{path}/cgroup.procs").split()]
        except OSError:
            strays = []
        for pid in strays:
            if pid != os.getpid():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        time.sleep(POLL_S)


def _own_cgroups():
    """{controller, or "" for the cgroup v2 hierarchy: path} of this process."""
    own = {}
    for line in _read("/proc/self/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            own[controller] = path
    return own


class MemoryCaps:
    """--worker_memory: a memory cgroup per process of the cluster, each capped,
    made before any process starts and removed (`remove`) when the cluster ends.

    The groups are `tfdist-launch-PID/ROLE-INDEX`. cgroup v2 caps a group by
    memory.max (and memory.swap.max 0), but only once its parent enables the
    memory controller for its children (cgroup.subtree_control), and a group
    that does may hold no processes itself ("no internal processes"). So
    `tfdist-launch-PID` is made under the launcher's own cgroup when the
    launcher is alone there (it first moves itself into a leaf beside it,
    `tfdist-launcher-PID`) or when its cgroup already enables memory for its
    children (the root), else beside the launcher's cgroup when that cgroup's
    parent already delegates memory. cgroup v1 (a memory hierarchy of
    its own, as in hybrid set-ups) has no such rule: the groups are made under
    the launcher's memory cgroup, capped by memory.limit_in_bytes and
    memory.memsw.limit_in_bytes (memory plus swap: no swap).

    A process joins its group at its first instruction: the launcher moves
    itself into the group, forks it, and moves back (`placing`). A preexec_fn
    writing the child's pid would run Python between fork and exec, which can
    deadlock while the output threads run; a wrapper would hide an unrunnable
    command behind a shell's exit status.
    """

    def __init__(self, limit, spelling, roles):
        self.limit, self.flag = limit, f"--worker_memory={spelling}"
        self.root = os.path.normpath(os.environ.get("TFDIST_CGROUP_ROOT") or CGROUP_ROOT)
        self._undo = []        # what to do to remove everything made, in order made
        self.leaves = {}       # (role, index) -> its cgroup directory
        self.home = None       # the cgroup.procs of the launcher's own cgroup
        self.no_swap = False   # a swap limit was written
        try:
            self._make(roles)
        except (NoCgroup, OSError) as e:
            self.remove()
            why = f"reading {e.filename}: {e.strerror}" if isinstance(e, OSError) else e
            raise UsageError(f"{self.flag}: cannot cap each process's memory: {why}") from None

    def _make(self, roles):
        try:
            own = _own_cgroups()
        except OSError as e:
            raise NoCgroup(f"reading /proc/self/cgroup: {e.strerror}") from None
        v2 = "" in own and os.path.exists(f"{self._at(own[''])}/cgroup.controllers")
        if v2:
            group = self._v2_group(self._at(own[""]))
            self.events_file = "memory.events"
            limit, swap = ("memory.max", self.limit), ("memory.swap.max", 0)
        elif "memory" in own and os.path.isdir(self._at(own["memory"], "memory")):
            here = self._at(own["memory"], "memory")
            self.home = f"{here}/cgroup.procs"
            group = self._mkdir(f"{here}/tfdist-launch-{os.getpid()}")
            self.events_file = "memory.oom_control"
            # memsw caps memory plus swap (so must come second, never below the first)
            limit, swap = (("memory.limit_in_bytes", self.limit),
                           ("memory.memsw.limit_in_bytes", self.limit))
        else:
            raise NoCgroup(f"no cgroup v2 hierarchy and no cgroup v1 memory hierarchy holding "
                           f"this process under {self.root} (TFDIST_CGROUP_ROOT)")
        for role, index in roles:
            leaf = self._mkdir(f"{group}/{role}-{index}")
            _cgroup_write(f"{leaf}/{limit[0]}", str(limit[1]))
            self.no_swap = os.path.exists(f"{leaf}/{swap[0]}")   # without swap accounting: none
            if self.no_swap:
                _cgroup_write(f"{leaf}/{swap[0]}", str(swap[1]))
            self.leaves[role, index] = leaf

    def _at(self, path, hierarchy=""):
        return os.path.normpath(os.path.join(self.root, hierarchy, path.lstrip("/")))

    def _v2_group(self, here):
        """Make tfdist-launch-PID with the memory controller for its children (see the class)."""
        offered = _read(f"{here}/cgroup.controllers").split()
        if "memory" not in offered:
            raise NoCgroup(f"the memory controller is not available in the launcher's cgroup "
                           f"{here} (it offers: {' '.join(offered) or 'none'})")
        self.home = f"{here}/cgroup.procs"
        parent = here
        if "memory" not in _read(f"{here}/cgroup.subtree_control").split():
            if _read(self.home).split() == [str(os.getpid())]:   # alone: step into a leaf
                leaf = self._mkdir(f"{here}/tfdist-launcher-{os.getpid()}")
                self._move(f"{leaf}/cgroup.procs")
                self._undo.append(lambda: self._move(f"{here}/cgroup.procs"))
                self.home = f"{leaf}/cgroup.procs"
                self._enable_memory(here)
            elif (here != self.root and "memory" in
                  _read(f"{os.path.dirname(here)}/cgroup.subtree_control").split()):
                parent = os.path.dirname(here)
            else:
                raise NoCgroup(f"the launcher's cgroup {here} holds other processes (cgroup v2 "
                               "gives no controller to the children of a group with processes) "
                               "and its parent does not delegate the memory controller; start "
                               "the launcher in a cgroup of its own (e.g. systemd-run --scope)")
        group = self._mkdir(f"{parent}/tfdist-launch-{os.getpid()}")
        self._enable_memory(group)
        return group

    def _enable_memory(self, path):
        _cgroup_write(f"{path}/cgroup.subtree_control", "+memory")
        self._undo.append(lambda: _cgroup_write(f"{path}/cgroup.subtree_control", "-memory"))

    def _mkdir(self, path):
        try:
            os.mkdir(path)
        except OSError as e:
            raise NoCgroup(f"making the cgroup {path}: {e.strerror}") from None
        self._undo.append(lambda: _remove_cgroup(path))
        return path

    def _move(self, procs):
        """Move the launcher (every thread of it) into the cgroup of `procs`."""
        _cgroup_write(procs, str(os.getpid()))

    @contextlib.contextmanager
    def placing(self, role, index):
        """The launcher in `role index`'s cgroup while it starts that process (see the class)."""
        try:
            self._move(f"{self.leaves[role, index]}/cgroup.procs")
            try:
                yield
            finally:
                self._move(self.home)
        except NoCgroup as e:
            raise UsageError(f"{self.flag}: cannot start {role} {index} in its cgroup: {e}") \
                from None

    def events(self, role, index):
        """The file counting OOM kills in `role index`'s cgroup."""
        return f"{self.leaves[role, index]}/{self.events_file}"

    def describe(self):
        swap = " (no swap)" if self.no_swap else ""
        return (f"{self.flag}: each process in a memory cgroup of its own, capped at "
                f"{self.limit} bytes{swap}")

    def remove(self):
        """Undo everything made, newest first: the processes' cgroups (killing any
        process left in one), their parent, and the launcher's own move. Bounded."""
        while self._undo:
            try:
                self._undo.pop()()
            except NoCgroup as e:
                log(f"warning: {self.flag}: while removing its cgroups: {e}")


def tf_config(host, ports, index):
    cluster = {"worker": [f"{host}:{p}" for p in ports]}
    return json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})


def ps_roles(workers, ps):
    """(task type, index) of every process of a parameter-server cluster."""
    return ([("chief", 0)] + [("worker", i) for i in range(workers)]
            + [("ps", j) for j in range(ps)])


def ps_tf_config(host, ports, roles, position):
    """TF_CONFIG of process `position` of a chief/worker/ps cluster (one port each)."""
    cluster = {}
    for (role, _), port in zip(roles, ports):
        cluster.setdefault(role, []).append(f"{host}:{port}")
    role, index = roles[position]
    return json.dumps({"cluster": cluster, "task": {"type": role, "index": index}})


_STEP_LINE = re.compile(rb"step (\d+)/(\d+)")
# tfdist-train's start-up line "dataset D: global batch G = R replica(s) x P[, K micro-batches of M]; ..."
_BATCH_LINE = re.compile(rb"global batch (\d+ = \d+ replica\(s\) x \d+(?:, \d+ micro-batches of \d+)?)")


def _pump(pipe, out, prefix, worker=None):
    """Copy a worker's output to ours line by line, prefixed; bytes, so any garbage
    passes. Remembers the last training step the worker reported."""
    with pipe:
        for line in iter(lambda: pipe.readline(1 << 16), b""):
            if worker is not None:
                found = _STEP_LINE.search(line)
                if found:
                    worker.last_step = int(found[1])
                found = _BATCH_LINE.search(line)
                if found:
                    worker.batch = found[1].decode(errors="replace")
            _emit(out, prefix + (line if line.endswith(b"\n") else line + b"\n"))


def _memory_events(pid):
    """The file counting OOM kills of `pid`'s memory cgroup (v2 memory.events or
    v1 memory.oom_control), or None."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            candidate = f"/sys/fs/cgroup{path}/memory.events"
        elif "memory" in controllers.split(","):
            candidate = f"/sys/fs/cgroup/memory{path}/memory.oom_control"
        else:
            continue
        if os.path.exists(candidate):
            return candidate
    return None


def _oom_kills(path):
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


class Worker:
    """One worker process in its own session, so a signal reaches its whole process group."""

    def __init__(self, index, cmd, env, role="worker", caps=None):
        self.index, self.role = index, role
        self.cap = caps.flag if caps else None   # --worker_memory=SIZE: its cgroup is ours
        self.cgroup_events = caps.events(role, index) if caps else None  # its OOM-kill counter
        self.oom_kills_before = _oom_kills(self.cgroup_events) if caps else None
        with caps.placing(role, index) if caps else contextlib.nullcontext():
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         start_new_session=True)
        prefix = f"[{role} {index}] ".encode()
        self.last_step = None              # from its progress lines
        self.batch = None                  # from its start-up line
        self.note_cgroup()
        self.pumps = [threading.Thread(target=_pump, args=(pipe, out, prefix, self), daemon=True)
                      for pipe, out in ((self.proc.stdout, sys.stdout.buffer),
                                        (self.proc.stderr, sys.stderr.buffer))]
        for t in self.pumps:
            t.start()

    def note_cgroup(self):
        """Follow the worker's memory cgroup (it may move into one after start)."""
        if self.cap or self.proc.poll() is not None:
            return
        events = _memory_events(self.proc.pid)
        exiting = events in ("/sys/fs/cgroup/memory.events",
                             "/sys/fs/cgroup/memory//memory.oom_control")
        if exiting and self.cgroup_events:
            return   # a dying task is moved to the root cgroup: keep the one it lived in
        if events and events != self.cgroup_events:
            self.cgroup_events, self.oom_kills_before = events, _oom_kills(events)

    def oom_killed(self):
        """Whether the kernel's OOM killer ended it (its cgroup counted a kill)."""
        if self.proc.returncode != -signal.SIGKILL or not self.cgroup_events:
            return False
        after = _oom_kills(self.cgroup_events)
        return None not in (after, self.oom_kills_before) and after > self.oom_kills_before

    def signal_group(self, signum):
        """Signal the group, not just the leader: a worker's own children must stop too."""
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def group_alive(self):
        self.proc.poll()  # reap the leader; a zombie would keep the group "alive"
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def describe_exit(self):
        rc = self.proc.returncode
        if rc >= 0:
            return f"{self.role} {self.index} exited with status {rc}"
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        text = f"{self.role} {self.index} was killed by signal {name}"
        if self.oom_killed():
            where = (f" after step {self.last_step}" if self.last_step is not None
                     else " before its first progress line")
            batch = f" (global batch {self.batch})" if self.batch else ""
            cap = f" at its {self.cap} cap" if self.cap else ""
            text += (f": out of memory{where}{batch}, killed by the kernel's OOM killer{cap} (its "
                     f"memory cgroup counted the kill in {self.cgroup_events}); to use less memory: "
                     "--accum_steps (smaller micro-batches), --recompute, "
                     "--precision=mixed_bfloat16, a smaller --global_batch_size, or "
                     "--strategy=dtensor --zero_stage=3 over more processes (each holds "
                     "1/N of the model)"
                     + ("; or give it more: a larger --worker_memory" if self.cap else ""))
        return text


def cluster_roles(opts):
    """(task type, index) of every process the launcher starts."""
    return (ps_roles(opts.workers, opts.ps) if opts.ps
            else [("worker", i) for i in range(opts.workers)])


def start_group(opts, cmd, attempt, network=(False, None), caps=None):
    """Start every process of one attempt; `network` is (private, why not) from choose_network;
    `caps` the MemoryCaps of --worker_memory, or None."""
    private, reason = network
    roles = cluster_roles(opts)
    ports = pick_ports(opts.host, len(roles), opts.port_base)
    memory = {}
    if caps:
        # Under a cap, freed memory must go back to the kernel: glibc keeps a
        # freed block under its mmap threshold (which grows to 32 MiB as large
        # blocks are freed) in a per-thread arena, where the cgroup still
        # counts it. Measured: a 135M-parameter mlp under ZeRO-3 on 4 workers
        # peaked at 1.94-1.99 GiB per process, 1.52-1.67 GiB with blocks of
        # 128 KiB and more mapped and unmapped (BUILD_NOTES). A value the
        # user set is kept.
        memory = {"TFDIST_WORKER_MEMORY": str(caps.limit),
                  "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", "131072")}
    workers = []
    try:
        for i, (role, index) in enumerate(roles):
            config = (ps_tf_config(opts.host, ports, roles, i) if opts.ps
                      else tf_config(opts.host, ports, i))
            env = dict(os.environ, TF_CONFIG=config, TFDIST_LAUNCH_ATTEMPT=str(attempt),
                       TFDIST_NETWORK="private" if private else "host", **memory)
            workers.append(Worker(index, cmd, env, role, caps))
    except (OSError, UsageError) as e:
        stop_group(workers, signal.SIGTERM, opts.grace_s)
        if isinstance(e, UsageError):
            raise
        raise UsageError(f"cannot run {cmd[0]!r}: {e.strerror}") from None
    line = describe_cluster([(role, index, f"{opts.host}:{port}")
                             for (role, index), port in zip(roles, ports)], private, reason)
    log(f"{line}; {caps.describe()}" if caps else line)
    return workers


def stop_group(workers, signum, grace_s):
    """Signal every group, give them grace_s to exit, then SIGKILL what is left; bounded time."""
    for w in workers:
        w.signal_group(signum)
    deadline = time.monotonic() + grace_s
    while any(w.group_alive() for w in workers) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    for w in workers:
        if w.group_alive():
            log(f"{w.role} {w.index} still running {grace_s:g}s after "
                f"{signal.Signals(signum).name}; sending SIGKILL")
            w.signal_group(signal.SIGKILL)
    for w in workers:
        w.proc.wait()
    _drain(workers)


def _drain(workers):
    """Let the pumps print the last lines; a grandchild that left the group must not block us."""
    deadline = time.monotonic() + DRAIN_S
    for t in (t for w in workers for t in w.pumps):
        t.join(max(0.0, deadline - time.monotonic()))


def _root_cause(workers):
    """Log every worker that failed around the first failure; return the likely cause.

    One death makes its peers fail within moments (their collectives break),
    so failures are gathered for SETTLE_S, and a worker killed by a signal is
    preferred over peers that merely exited with an error after it.
    """
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline and any(w.proc.poll() is None for w in workers):
        time.sleep(POLL_S)
    failed = [w for w in workers if w.proc.poll() not in (None, 0)]
    for w in failed:
        log(w.describe_exit())
    killed = [w for w in failed if w.proc.returncode < 0]
    return (killed or failed)[0]


def supervise(workers, interrupts, grace_s):
    """Wait for the group: return None if all exited 0, else the failed Worker or a signal number."""
    while True:
        if interrupts:
            signum = interrupts[0]
            log(f"got {signal.Signals(signum).name}; stopping all workers")
            stop_group(workers, signum, grace_s)
            return signum
        codes = [w.proc.poll() for w in workers]
        for w in workers:
            w.note_cgroup()
        if any(rc not in (None, 0) for rc in codes):
            failed = _root_cause(workers)
            stop_group(workers, signal.SIGTERM, grace_s)
            return failed
        if all(rc == 0 for rc in codes):
            stop_group(workers, signal.SIGTERM, grace_s)  # ends strays the workers left behind
            return None
        time.sleep(POLL_S)


def supervise_ps(group, interrupts, grace_s):
    """`supervise` for a chief/worker/ps group: the chief's exit decides (see
    the module doc); the outcome is the same as `supervise`'s."""
    chief, reported, ps_died = group[0], set(), None
    while True:
        if interrupts:   # the chief first: it saves while the parameter servers still answer
            signum = interrupts[0]
            log(f"got {signal.Signals(signum).name}; stopping the chief, then the servers")
            stop_group(group[:1], signum, grace_s)
            stop_group(group[1:], signal.SIGTERM, grace_s)
            return signum
        for w in group:
            w.note_cgroup()
        if chief.proc.poll() is not None:   # nothing left to serve
            stop_group(group, signal.SIGTERM, grace_s)
            if chief.proc.returncode == 0:
                return None
            log(chief.describe_exit())
            return chief
        for w in group[1:]:
            if w.proc.poll() is not None and w not in reported:
                reported.add(w)
                if w.role == "worker":
                    log(f"{w.describe_exit()}; the chief runs its steps on the other workers")
                else:
                    log(f"{w.describe_exit()}; the chief's next step fails")
                    ps_died = ps_died or (w, time.monotonic())
        workers = [w for w in group if w.role == "worker"]
        if all(w.proc.poll() is not None for w in workers):
            log("every worker has exited; stopping the chief and the parameter servers")
            stop_group(group, signal.SIGTERM, grace_s)
            return workers[0]
        if ps_died and time.monotonic() - ps_died[1] > grace_s:
            log(f"the chief did not stop within --grace_s={grace_s:g}s of the parameter "
                "server's death; stopping all processes")
            stop_group(group, signal.SIGTERM, grace_s)
            return ps_died[0]
        time.sleep(POLL_S)


def run(opts, cmd, interrupts, network=(False, None), caps=None):
    """Start the group, restarting it after failures; return the launcher's exit status."""
    for attempt in range(opts.max_restarts + 1):
        if attempt:
            log(f"restarting all workers (restart {attempt} of {opts.max_restarts})")
        watch = supervise_ps if opts.ps else supervise
        outcome = watch(start_group(opts, cmd, attempt, network, caps), interrupts, opts.grace_s)
        if outcome is None:
            return 0
        if isinstance(outcome, int):
            log(f"interrupted by {signal.Signals(outcome).name}; all workers stopped")
            return 128 + outcome
        if interrupts:  # a Ctrl-C during the fail-fast stop means: do not restart
            return 128 + interrupts[0]
    log(f"failed: {outcome.describe_exit()}; all workers stopped "
        f"(restarts used: {opts.max_restarts} of {opts.max_restarts})")
    return 1


def _close_output():
    """Stop all writes before exit: a daemon pump holding stdout's lock at shutdown aborts Python."""
    global _closed
    with _OUTPUT:
        _closed = True


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    interrupts = []  # signal handlers only record; the poll loop acts within POLL_S
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda s, _frame: interrupts.append(s))
    caps = None
    try:
        opts, cmd = parse_args(argv)
        if opts.memory_limit is not None:   # before any process: each starts in its cgroup
            caps = MemoryCaps(opts.memory_limit, opts.worker_memory, cluster_roles(opts))
        network = choose_network(opts)   # before any thread or process is started
        return run(opts, cmd, interrupts, network, caps)
    except UsageError as e:
        log(f"error: {e}")
        return 2
    finally:
        if caps:
            caps.remove()
        _close_output()


if __name__ == "__main__":
    sys.exit(main())
