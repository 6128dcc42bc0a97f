"""A deadline for waits that TensorFlow may block on forever, and peer probes.

Creating MultiWorkerMirroredStrategy connects to every peer and waits,
without limit and *holding the GIL*, for one that never starts. No Python
thread can run then, so the deadline is kept by a tiny separate process (this
file run as a script, standard library only): if the parent has not left the
guarded block in time, it probes the peers, prints one line saying which did
not answer, and kills the parent (SIGKILL: TensorFlow intercepts SIGTERM). It
exits by itself when the block ends or the parent dies (its stdin pipe closes).

`unreachable` is the same probe for a fault during training: a collective
that failed says little about *which* peer is gone (a cut link shows up as a
coordination-service heartbeat "Deadline Exceeded"), a TCP connect to each
peer's host:port does: "Connection refused" (the process is gone, the host
answers), "Network is unreachable" (this host's link is down), "No route to
host" or "timed out" (no answer: the peer's link or host is down).

`announce_server` prints, from every process that starts TensorFlow's gRPC
server, the port it listens on and who can reach it: the server binds every
interface and authenticates nothing (docs/guides/clusters.md, "What a cluster
exposes"), unless tfdist-launch confined the cluster to a private network
namespace with only loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading

PROBE_TIMEOUT_S = 2.0


def unreachable(peers, timeout: float = PROBE_TIMEOUT_S) -> list:
    """"name: reason" for each (name, host, port) in `peers` that does not
    accept a TCP connection within `timeout` seconds (probed in parallel, so
    this takes at most about `timeout`, a hanging name lookup included);
    [] if every peer answers."""
    peers = list(peers)
    reasons = [None] * len(peers)

    def probe(index, host, port):
        try:
            socket.create_connection((host, port), timeout=timeout).close()
        except OSError as error:
            reasons[index] = error.strerror or str(error) or type(error).__name__

    threads = [threading.Thread(target=probe, args=(i, host, port), daemon=True)
               for i, (_, host, port) in enumerate(peers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 1.0)
    return [f"{name}: {reason}" for (name, _, _), reason in zip(peers, reasons)
            if reason is not None]


def _interfaces() -> list:
    """This process's network interfaces (its network namespace's), or [] if unknown."""
    try:
        with open("/proc/self/net/dev") as f:
            return [line.split(":")[0].strip() for line in f.read().splitlines()[2:]]
    except OSError:
        return []


def announce_server(task_type: str, task_index: int, address: str, *,
                    prog: str = "tfdist-train") -> str:
    """Print (and return) one line: this task's server at `address` listens on its
    port of every interface, reachable from the network, unless this process's
    network namespace has only loopback (as under tfdist-launch --network=private)."""
    port = address.rpartition(":")[2]
    if _interfaces() == ["lo"]:
        whose = ("tfdist-launch's private network namespace"
                 if os.environ.get("TFDIST_NETWORK") == "private" else "a network namespace")
        reach = f"only inside {whose} (loopback only: unreachable from other hosts)"
    else:
        reach = ("of every interface (unauthenticated; see docs/guides/clusters.md, "
                 "\"What a cluster exposes\")")
    line = (f"{prog}: {task_type} {task_index} ({address}): TensorFlow's gRPC server "
            f"listens on port {port} {reach}")
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    return line


def _watch(parent: int, seconds: float, payload: dict) -> None:
    """The deadline process: wait for stdin to close or `seconds` to pass.

    SIGTERM or SIGINT to the process group (a launcher, Kubernetes or Slurm
    stopping the job, Ctrl-C) reach this process too, while the parent cannot
    take them (TensorFlow swallows SIGTERM and holds the GIL in the wait): it
    kills the parent at once, with one line. Before, the signal ended only
    this process, and the parent went on waiting with no deadline at all."""
    import select
    import signal

    def stop(signum, _frame):
        sys.stderr.write(f"{payload['prog']}: stopped by {signal.Signals(signum).name} while "
                         "TensorFlow waited for the cluster (it takes no signal then)\n")
        sys.stderr.flush()
        os.kill(parent, signal.SIGKILL)
        os._exit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)
    sys.stdout.write("ready\n")   # the parent waits for this before it blocks
    sys.stdout.flush()
    ready, _, _ = select.select([sys.stdin], [], [], seconds)
    if ready:
        return  # the guarded block ended (or the parent died): nothing to do
    detail = "; ".join(unreachable(payload["peers"])) or \
        "every peer accepts connections but did not join"
    sys.stderr.write(f"{payload['prog']}: fault: {payload['message']}; unreachable: {detail}\n")
    sys.stderr.flush()
    os.kill(parent, signal.SIGKILL)


@contextlib.contextmanager
def deadline(seconds: float, message: str, peers=(), *, prog: str = "tfdist-train"):
    """Kill this process with `message` if the block runs longer than `seconds`.

    peers: (name, host, port) triples whose reachability the message reports.
    """
    payload = json.dumps({"message": message, "peers": list(peers), "prog": prog})
    # -I: only the standard library (this file imports nothing else).
    child = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__),
                              str(os.getpid()), str(seconds), payload], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
    # Its signal handlers are in place before TensorFlow may swallow ours
    # (an empty line: it died, e.g. signalled already; the wait is unguarded then).
    child.stdout.readline()
    try:
        yield
    finally:
        child.stdin.close()
        child.wait()


if __name__ == "__main__":
    _watch(int(sys.argv[1]), float(sys.argv[2]), json.loads(sys.argv[3]))
