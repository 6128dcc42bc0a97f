"""A deadline for waits that TensorFlow may block on forever.

Creating MultiWorkerMirroredStrategy connects to every peer and waits,
without limit and *holding the GIL*, for one that never starts. No Python
thread can run then, so the deadline is kept by a tiny separate process: if
the parent has not left the guarded block in time, it probes the peers,
prints one line saying which did not answer, and kills the parent (SIGKILL:
TensorFlow intercepts SIGTERM). It exits by itself when the block ends or the
parent dies (its stdin pipe closes).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

_CHILD = r"""
import json, os, select, signal, socket, sys
parent, seconds, payload = int(sys.argv[1]), float(sys.argv[2]), json.loads(sys.argv[3])
ready, _, _ = select.select([sys.stdin], [], [], seconds)
if ready:
    sys.exit(0)  # the guarded block ended (or the parent died): nothing to do
silent = []
for name, host, port in payload["peers"]:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError as error:
        silent.append(f"{name}: {error.strerror or error}")
detail = "; ".join(silent) or "every peer accepts connections but did not join"
sys.stderr.write(f"{payload['prog']}: fault: {payload['message']}; unreachable: {detail}\n")
sys.stderr.flush()
os.kill(parent, signal.SIGKILL)
"""


@contextlib.contextmanager
def deadline(seconds: float, message: str, peers=(), *, prog: str = "tfdist-train"):
    """Kill this process with `message` if the block runs longer than `seconds`.

    peers: (name, host, port) triples whose reachability the message reports.
    """
    payload = json.dumps({"message": message, "peers": list(peers), "prog": prog})
    child = subprocess.Popen([sys.executable, "-I", "-c", _CHILD, str(os.getpid()),
                              str(seconds), payload], stdin=subprocess.PIPE)
    try:
        yield
    finally:
        child.stdin.close()
        child.wait()
