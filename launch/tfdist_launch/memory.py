"""--worker_memory: each process of the cluster in a memory cgroup of its own
(`MemoryCaps`), and what the kernel's cgroups say about a process's OOM kills."""

import contextlib
import errno
import os
import re
import signal
import time

from .common import POLL_S, UsageError
from .output import log

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
    """Write `text` to `path`; an OSError becomes NoCgroup."""
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise NoCgroup(f"writing {text!r} to {path}: {e.strerror}") from None


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

    def environment(self):
        """What each capped process is told: its cap, and glibc's mmap threshold."""
        # Under a cap, freed memory must go back to the kernel: glibc keeps a
        # freed block under its mmap threshold (which grows to 32 MiB as large
        # blocks are freed) in a per-thread arena, where the cgroup still
        # counts it. Measured: a 135M-parameter mlp under ZeRO-3 on 4 workers
        # peaked at 1.94-1.99 GiB per process, 1.52-1.67 GiB with blocks of
        # 128 KiB and more mapped and unmapped (BUILD_NOTES). A value the
        # user set is kept.
        return {"TFDIST_WORKER_MEMORY": str(self.limit),
                "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", "131072")}

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


def memory_events(pid):
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


def oom_kills(path):
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        pass
    return None
