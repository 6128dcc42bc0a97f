"""Who can reach a running local cluster (docs/guides/clusters.md, "What a cluster exposes").

TensorFlow's gRPC servers listen on every interface and authenticate nothing,
so tfdist-launch runs a loopback cluster in a private network namespace with
only loopback. Here an "outside" network namespace, joined to this host's by
a veth pair (10.233.0.1/24 on this host, 10.233.0.2/24 outside), stands for
another machine on the network: it routes to a non-loopback address of this
host. For each engine that starts servers (multi_worker, parameter_server,
dtensor across processes) a --network=private cluster trains, and the
outside must reach none of its ports. Its ports are held bound (not
listening) in this host's namespace meanwhile, so nothing else can answer
there in its place. The positive control is one --network=host multi_worker
cluster, probed the same way: the outside reaches every port. (One control,
not one per engine: the confinement is the launcher's namespace, the same for
every engine, and a host cluster of each engine only showed again that
TensorFlow's servers listen on every interface, at 9 CPU-seconds a process.)

Each cluster is probed as soon as its launcher's namespace shows every port
listening, and must show them again just after the probe; every cluster must
still finish training (exit 0). The four start at once (each is mostly
TensorFlow start-up, so they overlap well).

Needs root and iproute2 (`ip netns`); skipped otherwise. The namespace and
the link are named after this process and deleted however the tests end.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

import netns
from conftest import BIN, REPO

LAUNCH = os.path.join(BIN, "tfdist-launch")
TRAIN = os.path.join(BIN, "tfdist-train")
HOST_END, OUTSIDE_END = "10.233.0.1", "10.233.0.2"
PREFIX = f"tfx{os.getpid()}"   # <= 15-character interface names: tfx<pid>h
# One loop of 10 steps; no XLA compile (2 s of CPU a process here). A generous
# --collective_timeout_s: 14 processes start at once on 2 cores.
TINY = ["--model=mlp", "--model_width=16", "--model_depth=1", "--global_batch_size=16",
        "--train_steps=10", "--steps_per_loop=10", "--jit_compile=off",
        "--collective_timeout_s=120"]
ENGINES = {   # launcher options, tfdist-train options
    "multi_worker": (["--workers=2"], ["--strategy=multi_worker"]),
    "parameter_server": (["--workers=1", "--ps=1"], ["--strategy=parameter_server"]),
    "dtensor": (["--workers=2"], ["--strategy=dtensor", "--mesh=batch:2,model:1",
                                  "--virtual_devices=1"]),
}
CONTROL = "multi_worker"   # the engine of the one --network=host cluster
CLUSTER_LINE = re.compile(r"^tfdist-launch: (?:warning: )?cluster: (.*?); ", re.M)
START_S = 200   # four clusters' start-up and training on a loaded 2-core machine, with a margin
PRIVATE_PORTS = 3   # the most tasks of a cluster (parameter_server: chief, worker, ps)
CONNECT_S = 3   # a connect that neither succeeds nor is refused in this long: unreachable


_ip = netns.ip


_WHY = netns.why_not(PREFIX)
# make slow (~65 CPU-s); make test: test_launcher.py's
# test_network_confines_the_cluster_or_shares_this_hosts (the namespace that confines).
pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(_WHY is not None, reason=str(_WHY))]


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
        this host's HOST_END:port, all ports at once (a refused port answers
        at once; an unreachable one takes CONNECT_S)."""
        code = ("import concurrent.futures, json, socket, sys\n"
                "def reach(port):\n"
                "    try:\n"
                "        socket.create_connection((sys.argv[1], port), timeout=float(sys.argv[2]))"
                ".close()\n        return 'connected'\n"
                "    except OSError as e:\n        return e.strerror or str(e)\n"
                "ports = [int(p) for p in sys.argv[3:]]\n"
                "with concurrent.futures.ThreadPoolExecutor(len(ports)) as pool:\n"
                "    print(json.dumps(dict(zip(ports, pool.map(reach, ports)))))")
        result = subprocess.run(["ip", "netns", "exec", self.namespace, sys.executable, "-I",
                                 "-c", code, HOST_END, str(CONNECT_S), *map(str, ports)],
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
        first = socket.socket()   # IPv4: what the outside connects to
        first.bind(("0.0.0.0", 0))
        base, held = first.getsockname()[1], [first]
        try:
            for port in range(base + 1, base + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("0.0.0.0", port))
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

    def ports(self):
        """{task name: port} from the launcher's start-up line (None: not yet)."""
        found = CLUSTER_LINE.search(self.text())
        if not found:
            assert self.proc.poll() is None, f"the launcher ended at start-up\n{self.tail()}"
            return None
        tasks = [task.rpartition(" ") for task in found[1].split(", ")]
        return {name: int(address.rpartition(":")[2]) for name, _, address in tasks}

    def probe_when_listening(self, outside):
        """Once every port listens in the launcher's network namespace, connect
        to each from the outside: (ports, outcomes, listening before, after);
        None while not all listen yet."""
        ports = self.ports()
        if ports is None or not set(ports.values()) <= listening(self.proc.pid):
            assert self.proc.poll() is None, \
                f"the cluster ended before all of {ports} listened\n{self.tail()}"
            return None
        before = listening(self.proc.pid)
        reached = outside.connect(ports.values())
        return ports, reached, before, listening(self.proc.pid)

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
def runs(outside, prepared_data_dir, tmp_path_factory):
    """Every engine's private cluster and the host control, started at once and each probed
    as soon as all its servers listen: {(engine, network): (Cluster, probe, exit status)}.
    The private ones share a port base (each has a namespace of its own)."""
    directory = str(tmp_path_factory.mktemp("exposure"))
    base, held = held_block(PRIVATE_PORTS)
    clusters = {}
    try:
        for engine in ENGINES:
            clusters[engine, "private"] = Cluster(engine, "private", directory, prepared_data_dir,
                                                  launcher=[f"--port_base={base}"])
        clusters[CONTROL, "host"] = Cluster(CONTROL, "host", directory, prepared_data_dir)
        deadline = time.monotonic() + START_S
        # One watcher per cluster, so a slow probe of one (a loaded machine's
        # `ip netns exec`, or CONNECT_S of an unreachable port) cannot make
        # another's whole listening window pass unseen (a CI run saw that).
        with concurrent.futures.ThreadPoolExecutor(len(clusters)) as pool:
            watched = {key: pool.submit(_probe_when_all_listen, cluster, outside, deadline)
                       for key, cluster in clusters.items()}
            probes = {key: future.result() for key, future in watched.items()}
        codes = {key: cluster.finish(max(1.0, deadline - time.monotonic()))
                 for key, cluster in clusters.items()}
    finally:
        for cluster in clusters.values():
            cluster.kill()
        for sock in held:
            sock.close()
    return {key: (cluster, probes[key], codes[key]) for key, cluster in clusters.items()}, base


def _probe_when_all_listen(cluster, outside, deadline):
    """Poll `cluster` until every port listens, then probe it (see Cluster)."""
    while not (probe := cluster.probe_when_listening(outside)):
        assert time.monotonic() < deadline, \
            f"not every port listened within {START_S}s\n{cluster.tail()}"
        time.sleep(0.05)
    return probe


def _assert_announced(cluster, ports, reach):
    """Every server said where it listens (and who can reach it)."""
    text = cluster.text()
    for name, port in ports.items():
        line = (f"[{name}] tfdist-train: {name} (localhost:{port}): TensorFlow's gRPC server "
                f"listens on port {port} {reach}")
        assert line in text, f"{line!r} missing\n{cluster.tail()}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine", list(ENGINES))
def test_the_outside_reaches_no_port_of_a_private_cluster(engine, runs):
    found, base = runs
    cluster, (ports, reached, before, after), code = found[engine, "private"]
    print(json.dumps({"private": [ports, reached]}))
    assert code == 0, cluster.tail()
    assert sorted(ports.values()) == list(range(base, base + len(ports))), (ports, base)
    assert set(ports.values()) <= before and set(ports.values()) <= after, (ports, before, after)
    assert all(why != "connected" for why in reached.values()), (reached, cluster.tail())
    _assert_announced(cluster, ports, "only inside tfdist-launch's private network namespace")
    assert "; confined to a private network namespace (loopback only" in cluster.text()


@pytest.mark.timeout(300)
def test_the_outside_reaches_every_port_of_a_host_cluster(runs):
    """The control: the same probe reaches a cluster on this host's network."""
    found, _ = runs
    cluster, (ports, reached, before, after), code = found[CONTROL, "host"]
    print(json.dumps({"host": [ports, reached]}))
    assert code == 0, cluster.tail()
    assert set(ports.values()) <= before and set(ports.values()) <= after, (ports, before, after)
    assert all(why == "connected" for why in reached.values()), (reached, cluster.tail())
    _assert_announced(cluster, ports, "of every interface")
    assert "; on this host's network (--network=host): TensorFlow's gRPC servers listen on " \
           "ports" in cluster.text()
