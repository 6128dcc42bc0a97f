"""The launcher's output: its own lines (`log`) and its workers' lines, each
prefixed `[role i] `, whole lines only, never interleaved."""

import re
import sys
import threading

from .common import PROG

_OUTPUT = threading.Lock()  # held per line, so lines never interleave
_closed = False             # set on exit: pumps of strays then write nothing

_STEP_LINE = re.compile(rb"step (\d+)/(\d+)")
# tfdist-train's start-up line "dataset D: global batch G = R replica(s) x P[, K micro-batches of M]; ..."
_BATCH_LINE = re.compile(rb"global batch (\d+ = \d+ replica\(s\) x \d+(?:, \d+ micro-batches of \d+)?)")


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


def pump(pipe, out, prefix, worker=None):
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


def close_output():
    """Stop all writes before exit: a daemon pump holding stdout's lock at shutdown aborts Python."""
    global _closed
    with _OUTPUT:
        _closed = True
