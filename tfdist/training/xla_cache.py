"""XLA executables shared by this host's processes.

Each process compiles every XLA cluster it runs, so each worker of a cluster,
each restart after a preemption and each planner trial compiles the same step
again: 1.5-2 CPU-seconds for a small mlp's step, more for larger models.
TensorFlow can keep compiled executables on disk
(`TF_XLA_FLAGS=--tf_xla_persistent_cache_directory=DIR`): an entry is named by
the HLO's fingerprint, and before one is used its whole HLO is compared with
the one being compiled. Two things keep that from being shared as it is:

- TensorFlow writes an entry in place (not to a temporary file renamed into
  place), and a process that reads an entry while another is still writing it
  fails its step. So each process reads and writes a private directory
  beside the shared one, filled with hard links to the shared entries when
  its run starts (TensorFlow only writes entries it did not find, so a link
  is never written through), and a run adds what it compiled to the shared
  directory when it ends, each entry written to a temporary name and renamed
  into place. A process that ended without publishing (killed, or exited at
  once on a fault) leaves its private directory; the next run on this host
  removes it.
- An entry holds machine code for the CPU that compiled it, and its name
  says only "XLA_CPU_JIT". The shared directory is therefore one per CPU
  (model and every ISA flag), TensorFlow version and XLA flag setting:
  `$TFDIST_CACHE_DIR/xla/<key>/` (default `~/.cache/tfdist`), so a home
  directory shared by different machines never hands one another's code.

TensorFlow fails a step whose executable it cannot write, so sharing is on
only where the private directory could be made, on a disk with
`MIN_FREE_BYTES` free; a step that fails writing one later (the disk filled
during the run) ends the run with a line that says so. The shared directory
is kept under `MAX_BYTES`, the entries added longest ago removed first.
Sharing is on by default on CPUs without AVX-512 (on AVX-512 CPUs XLA logs
two false errors for every executable it loads: `enabled`);
`TFDIST_XLA_CACHE=1` turns it on anywhere, `TFDIST_XLA_CACHE=0` off; a
`--tf_xla_persistent_cache_directory` of the user's own in `TF_XLA_FLAGS` is
left as it is.

TensorFlow reads `TF_XLA_FLAGS` once, when its runtime starts: `import
tfdist` calls `configure()` before (a process whose runtime started earlier
compiles as it did); `start()` fills the private directory when a run starts.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import socket
from typing import Optional

from absl import logging

from tfdist.observe import hardware

_FLAG = "--tf_xla_persistent_cache_directory="
_PRIVATE_PREFIX = "tfdist-xla-"
MAX_BYTES = 512 * 2**20
MIN_FREE_BYTES = 2**30   # on the cache's disk, for sharing to be on


def _key() -> str:
    """What an executable depends on beyond its HLO: the CPU (its model and
    every flag /proc/cpuinfo lists), TensorFlow's version and XLA's flags."""
    model, flags = hardware.cpu_model(), hardware.cpu_flags()
    xla_flags = os.environ.get("XLA_FLAGS", "")
    tf_xla_flags = " ".join(f for f in os.environ.get("TF_XLA_FLAGS", "").split()
                            if not f.startswith(_FLAG))
    text = "|".join([model, " ".join(sorted(flags)), _tensorflow_build(), xla_flags,
                     tf_xla_flags])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _tensorflow_build() -> str:
    """TensorFlow's version, read without importing it (this runs before)."""
    for dist in ("tensorflow", "tensorflow-cpu", "tensorflow-intel", "tf-nightly"):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    spec = importlib.util.find_spec("tensorflow")
    return spec.origin if spec and spec.origin else "unknown TensorFlow"


def shared_dir() -> str:
    return os.path.join(hardware.cache_dir(), "xla", _key())


class Cache:
    """One process's private directory and the shared one it links from and
    publishes to."""

    def __init__(self, shared: str, private: str):
        self.shared, self.private = shared, private
        self._known = set()   # entries the shared directory has (linked in, or published)
        self.filled = False

    def fill(self) -> None:
        for name in _entries(self.shared):
            if _place(os.path.join(self.shared, name), os.path.join(self.private, name)):
                self._known.add(name)

    def publish(self) -> int:
        """Add the entries this process compiled since it last published to
        the shared directory (atomically each) and prune it. The number added."""
        added = 0
        for name in set(_entries(self.private)) - self._known:
            self._known.add(name)
            target = os.path.join(self.shared, name)
            if os.path.exists(target):
                continue
            temporary = os.path.join(self.shared, f".tmp-{os.getpid()}-{name}")
            if _place(os.path.join(self.private, name), temporary):
                try:
                    os.replace(temporary, target)
                    added += 1
                except OSError as error:
                    logging.warning("XLA cache: could not add %s: %s", target, error)
                    _remove(temporary)
        prune(self.shared)
        return added

    def close(self) -> None:
        self.publish()
        shutil.rmtree(self.private, ignore_errors=True)


def _place(source: str, destination: str) -> bool:
    """`destination` as a hard link to `source` (a copy where the file system
    has none); False where `source` is gone (pruned meanwhile) or the disk is
    full."""
    try:
        os.link(source, destination)
        return True
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        shutil.copyfile(source, destination)
        return True
    except OSError:
        _remove(destination)
        return False


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _entries(directory: str) -> list:
    try:
        return [n for n in os.listdir(directory) if n.endswith(".pb") and not n.startswith(".")]
    except OSError:
        return []


def prune(directory: str, max_bytes: int = MAX_BYTES) -> None:
    """Remove the entries used longest ago (modification time: `fill` copies
    do not touch it, so "added longest ago") until the rest fit `max_bytes`."""
    stats = []
    for name in _entries(directory):
        try:
            stat = os.stat(os.path.join(directory, name))
        except OSError:
            continue
        stats.append((stat.st_mtime, stat.st_size, name))
    total = sum(size for _, size, _ in stats)
    for _, size, name in sorted(stats):
        if total <= max_bytes:
            break
        try:
            os.remove(os.path.join(directory, name))
        except OSError:
            pass
        total -= size


def _private_prefix(pid: int) -> str:
    return f"{_PRIVATE_PREFIX}{socket.gethostname()}-{pid}-"


def _remove_orphans(shared: str) -> None:
    """Private directories of this host's processes that have ended."""
    host = f"{_PRIVATE_PREFIX}{socket.gethostname()}-"
    for name in os.listdir(shared) if os.path.isdir(shared) else ():
        if not name.startswith(host):
            continue
        try:
            pid = int(name[len(host):].split("-")[0])
            os.kill(pid, 0)
        except ValueError:
            continue
        except ProcessLookupError:
            shutil.rmtree(os.path.join(shared, name), ignore_errors=True)
        except PermissionError:   # alive, another user's
            pass


def enabled() -> bool:
    """Whether this process shares executables: `TFDIST_XLA_CACHE=1` or `0`
    says; unset, on except on CPUs with AVX-512. XLA (TF 2.21) compiles for
    AVX-512 with two LLVM tuning features, `+prefer-no-scatter` and
    `+prefer-no-gather`, which no host's CPU feature list contains, so each
    executable it loads from the cache logs two ERROR lines of ~2 KB ("Target
    machine feature +prefer-no-scatter is not supported on the host
    machine ... could lead to execution errors such as SIGILL"), though it
    loads and runs correctly: a cnn's warm start printed 124 of them. On
    AVX2-only CPUs, where compiling costs most, it loads silently."""
    setting = os.environ.get("TFDIST_XLA_CACHE", "")
    if setting in ("0", "1"):
        return setting == "1"
    return not any(flag.startswith("avx512") for flag in hardware.cpu_flags())


_configured = False
_cache: Optional[Cache] = None   # this process's, once configured (None: sharing off)


def configure() -> None:
    """Point this process's XLA compilations at its private directory (by
    `TF_XLA_FLAGS`, which TensorFlow reads when its runtime starts: `import
    tfdist` calls this, before). Nothing is written until `start`."""
    global _configured, _cache
    if _configured:
        return
    _configured, _cache = True, None
    flags = os.environ.get("TF_XLA_FLAGS", "").split()
    own = [f for f in flags if f.startswith(_FLAG)]
    inherited = own and os.path.basename(own[-1][len(_FLAG):].rstrip("/")).startswith(
        _PRIVATE_PREFIX)
    if own and not inherited:
        return   # the user's own persistent cache
    if inherited:   # a parent's private directory: this process gets its own
        flags = [f for f in flags if not f.startswith(_FLAG)]
        os.environ["TF_XLA_FLAGS"] = " ".join(flags)
    if enabled():
        # TensorFlow fails a step whose executable it cannot write: the
        # private directory exists, on a disk with room, or nothing is set.
        shared = shared_dir()
        private = os.path.join(shared, f"{_private_prefix(os.getpid())}{os.urandom(4).hex()}")
        try:
            os.makedirs(private)
            room = shutil.disk_usage(private).free >= MIN_FREE_BYTES
        except OSError:
            room = False
        if room:
            _cache = Cache(shared, private)
            os.environ["TF_XLA_FLAGS"] = " ".join([*flags, _FLAG + private])
            atexit.register(_cache.close)
        else:
            shutil.rmtree(private, ignore_errors=True)


def start() -> Optional[Cache]:
    """At a run's start: this process's private directory, filled with links
    to the shared entries (once per process). None where sharing is off."""
    configure()
    cache = _cache
    if cache is not None and not cache.filled:
        cache.filled = True
        _remove_orphans(cache.shared)
        cache.fill()
    return cache


def caused(error: Exception) -> Optional[str]:
    """A one-line reason where `error` (a failed step) is this process's XLA
    cache failing to write, e.g. its disk filled during the run."""
    cache = _cache
    if cache is not None and cache.private in str(error):
        return (f"TensorFlow could not write a compiled XLA executable to {cache.private} "
                f"({str(error).splitlines()[0][:200]}); free space under {cache.shared} or "
                "set TFDIST_XLA_CACHE=0")
    return None


def publish() -> None:
    """Share what this process compiled so far (at the end of each run)."""
    if _cache is not None:
        _cache.publish()
