"""Who can reach a running local cluster (README "Security").

TensorFlow's gRPC servers listen on every interface and authenticate nothing,
so tfdist-launch runs a loopback cluster in a private network namespace with
only loopback. Here an "outside" network namespace, joined to this host's by
a veth pair (10.233.0.1/24 on this host, 10.233.0.2/24 outside), stands for
another machine on the network: it routes to a non-loopback address of this
host. For each engine that starts servers (multi_worker, parameter_server,
dtensor across processes) two clusters train side by side (each is mostly
TensorFlow start-up, so they overlap well):

- --network=host, the positive control: the outside reaches every port;
- --network=private: it reaches none, while the launcher's namespace shows
  every port listening just before and just after the probe. Its ports are
  held bound (not listening) in this host's namespace meanwhile, so nothing
  else can answer there in its place.

Both clusters must still finish training (exit 0).

Needs root and iproute2 (`ip netns`); skipped otherwise. The namespace and
the link are named after this process and deleted however the tests end.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

from tfdist.config import DataConfig
from tfdist.data import tfds_inputs

from conftest import BIN, REPO

LAUNCH = os.path.join(BIN, "tfdist-launch")
TRAIN = os.path.join(BIN, "tfdist-train")
HOST_END, OUTSIDE_END = "10.233.0.1", "10.233.0.2"
PREFIX = f"tfx{os.getpid()}"   # <= 15-character interface names: tfx<pid>h
TINY = ["--model=mlp", "--model_width=16", "--model_depth=1", "--global_batch_size=16",
        "--train_steps=20", "--steps_per_loop=10"]
ENGINES = {   # launcher options, tfdist-train options
    "multi_worker": (["--workers=2"], ["--strategy=multi_worker"]),
    "parameter_server": (["--workers=1", "--ps=1"], ["--strategy=parameter_server"]),
    "dtensor": (["--workers=2"], ["--strategy=dtensor", "--mesh=batch:2,model:1",
                                  "--virtual_devices=1"]),
}
CLUSTER_LINE = re.compile(r"^tfdist-launch: (?:warning: )?cluster: (.*?); ", re.M)
START_S = 180   # a cluster's start-up on a loaded 2-core machine, with a margin


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _why_not():
    """Why this machine cannot run the tests (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces and a veth link into this host's namespace need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    name = f"{PREFIX}probe"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    try:
        veth = _ip("-n", name, "link", "add", f"{PREFIX}p0", "type", "veth",
                   "peer", "name", f"{PREFIX}p1", check=False)
        if veth.returncode != 0:
            return f"cannot create a veth pair: {veth.stderr.strip()}"
    finally:
        _ip("netns", "del", name, check=False)   # takes the veth pair with it
    return None


_WHY = _why_not()
pytestmark = [pytest.mark.integration, pytest.mark.skipif(_WHY is not None, reason=str(_WHY))]


class Outside:
    """Namespace NS, linked to this host's: veth end H here (HOST_END), O in NS."""

    def __init__(self):
        self.namespace, self.host_end = f"{PREFIX}ns", f"{PREFIX}h"

    def create(self):
        _ip("netns", "add", self.namespace)
        _ip("link", "add", self.host_end, "type", "veth", "peer", "name", f"{PREFIX}o",
            "netns", self.namespace)
        _ip("addr", "add", f"{HOST_END}/24", "dev", self.host_end)
        _ip("link", "set", self.host_end, "up")
        _ip("-n", self.namespace, "addr", "add", f"{OUTSIDE_END}/24", "dev", f"{PREFIX}o")
        _ip("-n", self.namespace, "link", "set", f"{PREFIX}o", "up")
        _ip("-n", self.namespace, "link", "set", "lo", "up")

    def connect(self, ports):
        """{port: "connected" or why not} for a TCP connect from the outside to
        this host's HOST_END:port, each port at once."""
        code = ("import json, socket, sys\nfound = {}\nfor port in sys.argv[2:]:\n"
                "    try:\n        socket.create_connection((sys.argv[1], int(port)), timeout=3)"
                ".close()\n        found[port] = 'connected'\n"
                "    except OSError as e:\n        found[port] = e.strerror or str(e)\n"
                "print(json.dumps(found))")
        result = subprocess.run(["ip", "netns", "exec", self.namespace, sys.executable, "-I",
                                 "-c", code, HOST_END, *map(str, ports)],
                                capture_output=True, text=True, timeout=60, check=True)
        return {int(port): why for port, why in json.loads(result.stdout).items()}

    def delete(self):
        _ip("netns", "del", self.namespace, check=False)   # takes both veth ends with it
        _ip("link", "del", self.host_end, check=False)


def listening(pid):
    """TCP ports in LISTEN state in the network namespace of process `pid`."""
    ports = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:   # the process has ended
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            if state == "0A":
                ports.add(int(local.rpartition(":")[2], 16))
    return ports


def held_block(count):
    """`count` consecutive ports free in this namespace, held bound (not listening)
    so nothing here can answer on them: (first port, sockets to close)."""
    for _ in range(50):
        first = socket.socket(socket.AF_INET6)
        first.bind(("::", 0))
        base, held = first.getsockname()[1], [first]
        try:
            for port in range(base + 1, base + count):
                sock = socket.socket(socket.AF_INET6)
                held.append(sock)
                sock.bind(("::", port))
            return base, held
        except OSError:
            for sock in held:
                sock.close()
    raise AssertionError(f"no {count} consecutive free ports found")


class Cluster:
    """One `tfdist-launch ... -- tfdist-train ...`, its output in files."""

    def __init__(self, engine, network, directory, data_dir, launcher=()):
        self.network = network
        self.paths = {s: os.path.join(directory, f"{engine}-{network}.{s}") for s in ("out", "err")}
        options, train = ENGINES[engine]
        command = [LAUNCH, *options, f"--network={network}", "--grace_s=10", *launcher, "--",
                   TRAIN, *TINY, *train, f"--data_dir={data_dir}"]
        with open(self.paths["out"], "w") as out, open(self.paths["err"], "w") as err:
            self.proc = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=err,
                                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})

    def text(self, stream="err"):
        with open(self.paths[stream]) as f:
            return f.read()

    def tail(self):
        return f"--- {self.network} cluster's stderr:\n{self.text()[-3000:]}"

    def ports(self, deadline):
        """{task name: port} from the launcher's start-up line (waited for)."""
        while not (found := CLUSTER_LINE.search(self.text())):
            assert self.proc.poll() is None, f"the launcher ended at start-up\n{self.tail()}"
            assert time.monotonic() < deadline, f"no cluster line\n{self.tail()}"
            time.sleep(0.05)
        tasks = [task.rpartition(" ") for task in found[1].split(", ")]
        return {name: int(address.rpartition(":")[2]) for name, _, address in tasks}

    def wait_listening(self, ports, deadline):
        """Until every port listens in the launcher's network namespace."""
        while not set(ports) <= listening(self.proc.pid):
            assert self.proc.poll() is None, \
                f"the cluster ended before all of {ports} listened\n{self.tail()}"
            assert time.monotonic() < deadline, f"{ports} never all listened\n{self.tail()}"
            time.sleep(0.05)

    def finish(self, timeout):
        self.proc.wait(timeout=timeout)
        return self.proc.returncode

    def kill(self):
        """The launcher's own session: its workers have theirs (it stops them on SIGTERM)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def outside():
    made = Outside()
    try:
        made.create()
        yield made
    finally:
        made.delete()


@pytest.fixture(scope="module")
def prepared_data_dir(data_dir):
    """The session's data_dir with the bundled dataset generated, once, here:
    the clusters only read it (they have no network in a private namespace)."""
    tfds_inputs.load(DataConfig(data_dir=data_dir))
    return data_dir


@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine", list(ENGINES))
def test_the_outside_reaches_a_host_cluster_and_not_a_private_one(engine, outside,
                                                                   prepared_data_dir, tmp_path):
    count = {"multi_worker": 2, "parameter_server": 3, "dtensor": 2}[engine]
    base, held = held_block(count)
    try:
        private = Cluster(engine, "private", str(tmp_path), prepared_data_dir,
                          launcher=[f"--port_base={base}"])
        host = Cluster(engine, "host", str(tmp_path), prepared_data_dir)
        clusters = (private, host)
        try:
            deadline = time.monotonic() + START_S
            found = {}
            for cluster in clusters:
                ports = cluster.ports(deadline)
                cluster.wait_listening(ports.values(), deadline)
                before = listening(cluster.proc.pid)
                reached = outside.connect(ports.values())
                after = listening(cluster.proc.pid)
                found[cluster.network] = ports, reached, before, after
            codes = [cluster.finish(START_S) for cluster in clusters]
        finally:
            for cluster in clusters:
                cluster.kill()
    finally:
        for sock in held:
            sock.close()
    tails = "\n".join(cluster.tail() for cluster in clusters)
    print(json.dumps({network: [ports, reached] for network, (ports, reached, _, _)
                      in found.items()}))
    assert codes == [0, 0], tails
    ports, reached, before, after = found["private"]
    assert sorted(ports.values()) == list(range(base, base + count)), (ports, base)
    assert set(ports.values()) <= before and set(ports.values()) <= after, (ports, before, after)
    assert all(why != "connected" for why in reached.values()), (reached, tails)
    ports, reached, before, after = found["host"]
    assert set(ports.values()) <= before and set(ports.values()) <= after, (ports, before, after)
    assert all(why == "connected" for why in reached.values()), (reached, tails)
    # Every server said where it listens, and the launcher said who can reach the cluster.
    for cluster in clusters:
        text = cluster.text()
        ports = found[cluster.network][0]
        for name, port in ports.items():
            reach = ("only inside tfdist-launch's private network namespace"
                     if cluster.network == "private" else "of every interface")
            line = (f"[{name}] tfdist-train: {name} (localhost:{port}): TensorFlow's gRPC server "
                    f"listens on port {port} {reach}")
            assert line in text, f"{line!r} missing\n{cluster.tail()}"
    assert "; confined to a private network namespace (loopback only" in private.text()
    assert "; on this host's network (--network=host): TensorFlow's gRPC servers listen on " \
           "ports" in host.text()
