"""Network namespaces for the tests and benchmarks that need a second "host":
`ip`, the check whether this machine can make namespaces and veth pairs, two
namespaces joined by a veth pair (`Link`), its shaping with `tc` (a `tbf`
rate limit, a `netem` delay where the kernel has it) and byte counters, and
the two `tfdist-train --strategy=multi_worker` processes that train across
it (`Workers`). Used by tests/integration/test_netns.py, tests/integration/test_exposure.py,
tests/integration/test_slow_link.py and bench/slow_link.py; only the standard library
(it imports no TensorFlow)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(os.path.dirname(sys.executable), "tfdist-train")


def ip(*args, check=True):
    """Run iproute2's `ip ARGS`; CompletedProcess with text output."""
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def tc(*args, check=True):
    """Run iproute2's `tc ARGS`; CompletedProcess with text output."""
    return subprocess.run(["tc", *args], capture_output=True, text=True, check=check)


def why_not(prefix: str):
    """Why this machine cannot run namespace tests (None: it can). `prefix`
    names the probe namespace and veth pair (<= 12 characters)."""
    if os.geteuid() != 0:
        return "network namespaces and veth links need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    name = f"{prefix}probe"
    made = ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    try:
        veth = ip("-n", name, "link", "add", f"{prefix}p0", "type", "veth",
                  "peer", "name", f"{prefix}p1", check=False)
        if veth.returncode != 0:
            return f"cannot create a veth pair: {veth.stderr.strip()}"
    finally:
        ip("netns", "del", name, check=False)   # takes the veth pair with it
    return None


def why_no_qdisc(prefix: str, *qdisc: str):
    """Why the qdisc `tc qdisc add dev lo root QDISC...` cannot be had here
    (None: it can): a real add in a scratch namespace, as kernels differ in
    the qdiscs they carry (`netem` is often missing, `tbf` rarely)."""
    if shutil.which("tc") is None:
        return "iproute2's `tc` is not installed"
    name = f"{prefix}qd"
    made = ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    try:
        added = tc("-n", name, "qdisc", "add", "dev", "lo", "root", *qdisc, check=False)
        if added.returncode != 0:
            return f"`tc qdisc add ... {qdisc[0]}` is refused: {added.stderr.strip()}"
    finally:
        ip("netns", "del", name, check=False)
    return None


def burst_bytes(rate: str) -> int:
    """A tbf bucket for `rate` (e.g. 100mbit): 10 ms of it, at least 64 KiB
    so a whole TSO segment (up to 64 KiB on veth) fits."""
    return max(64 * 1024, rate_bits(rate) // 8 // 100)


def rate_bits(rate: str) -> int:
    """Bits per second of a tc rate such as 1gbit or 100mbit."""
    units = {"gbit": 10**9, "mbit": 10**6, "kbit": 10**3, "bit": 1}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return int(float(rate[:-len(unit)]) * scale)
    raise ValueError(f"unknown rate {rate!r}: expected e.g. 1gbit, 100mbit")


class Link:
    """Namespaces `namespaces[0]`/`[1]` joined by a veth pair whose ends
    `ends[0]` (in namespace 0, addresses[0]) and `ends[1]` (namespace 1) are
    named after `prefix` (<= 12 characters)."""

    def __init__(self, prefix: str, addresses=("10.231.0.1", "10.231.0.2")):
        self.addresses = tuple(addresses)
        self.namespaces = (f"{prefix}ns0", f"{prefix}ns1")
        self.ends = (f"{prefix}v0", f"{prefix}v1")

    def create(self):
        for ns in self.namespaces:
            ip("netns", "add", ns)
        # Both ends are created inside their namespaces: nothing in the host's.
        ip("-n", self.namespaces[0], "link", "add", self.ends[0], "type", "veth",
           "peer", "name", self.ends[1], "netns", self.namespaces[1])
        for ns, end, address in zip(self.namespaces, self.ends, self.addresses):
            ip("-n", ns, "addr", "add", f"{address}/24", "dev", end)
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", end, "up")

    def set(self, index, state):
        ip("-n", self.namespaces[index], "link", "set", self.ends[index], state)

    def delete(self):
        for ns in self.namespaces:
            ip("netns", "del", ns, check=False)   # takes the veth end in it along

    def shape(self, rate: str, *, latency: str = "100ms", delay: str | None = None):
        """Limit both directions to `rate` (e.g. 100mbit): a tbf qdisc on each
        end's egress (`tc qdisc replace ... root tbf`), with a queue of
        `latency` of traffic. With `delay` (e.g. 1ms; needs `netem`, see
        `why_no_qdisc`), a root netem delays each packet and the tbf is its
        child (tc-netem(8)'s recipe)."""
        tbf = ["tbf", "rate", rate, "burst", str(burst_bytes(rate)), "latency", latency]
        for ns, end in zip(self.namespaces, self.ends):
            if not delay:
                tc("-n", ns, "qdisc", "replace", "dev", end, "root", *tbf)
                continue
            tc("-n", ns, "qdisc", "del", "dev", end, "root", check=False)
            tc("-n", ns, "qdisc", "add", "dev", end, "root", "handle", "1:", "netem",
               "delay", delay)
            tc("-n", ns, "qdisc", "add", "dev", end, "parent", "1:1", "handle", "10:", *tbf)

    def unshape(self):
        """Back to the veth's own speed: the root qdiscs removed."""
        for ns, end in zip(self.namespaces, self.ends):
            tc("-n", ns, "qdisc", "del", "dev", end, "root", check=False)

    def qdiscs(self, index) -> list:
        """`tc -s qdisc show` of end `index`: one dict per qdisc (kind,
        options, bytes and packets sent, drops, ...)."""
        shown = tc("-n", self.namespaces[index], "-s", "-j", "qdisc", "show", "dev",
                   self.ends[index])
        return json.loads(shown.stdout)

    def tx_bytes(self) -> int:
        """Bytes both ends have sent (their interface counters, so every
        header and retransmission): all the traffic over the link."""
        total = 0
        for ns, end in zip(self.namespaces, self.ends):
            shown = ip("-n", ns, "-s", "-j", "link", "show", "dev", end)
            total += json.loads(shown.stdout)[0]["stats64"]["tx"]["bytes"]
        return total


class Workers:
    """The two `tfdist-train --strategy=multi_worker` processes of one run,
    worker i in `link.namespaces[i]` at `link.addresses[i]:port`, with
    `flags` (and their output in files in `directory`)."""

    def __init__(self, link: Link, directory: str, flags: list, port: int = 23456):
        self.link, self.directory, self.flags, self.port = link, directory, list(flags), port
        self.procs = []

    def command(self, index):
        hosts = ",".join(f"{address}:{self.port}" for address in self.link.addresses)
        return ["ip", "netns", "exec", self.link.namespaces[index], TRAIN,
                "--strategy=multi_worker", f"--worker_hosts={hosts}", f"--task_index={index}",
                *self.flags]

    def start(self, run):
        env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        env["TF_CPP_MIN_LOG_LEVEL"] = "2"
        self.run = run
        # `ip netns exec` execs the command: each pid is the worker's own.
        self.procs = []
        for index in (0, 1):
            with open(self.path(index, "out"), "w") as out, \
                    open(self.path(index, "err"), "w") as err:
                self.procs.append(subprocess.Popen(self.command(index), cwd=REPO, env=env,
                                                   stdout=out, stderr=err))

    def wait(self, timeout: float) -> list:
        """Wait for both (at most `timeout` s in all, then kill them); their
        return codes (None: killed at the timeout)."""
        deadline = time.monotonic() + timeout
        try:
            for proc in self.procs:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        codes = [proc.poll() for proc in self.procs]
        self.kill()
        return codes

    def summary(self) -> dict:
        """The chief's run summary (the last JSON line of worker 0's stdout)."""
        for line in reversed(self.text(0, "out").splitlines()):
            if line.startswith("{"):
                return json.loads(line)
        raise ValueError("no run summary in worker 0's output\n" + self.tails())

    def path(self, index, stream):
        return os.path.join(self.directory, f"{self.run}-w{index}.{stream}")

    def text(self, index, stream):
        with open(self.path(index, stream)) as f:
            return f.read()

    def tails(self):
        return "\n".join(f"--- worker {i} stderr:\n{self.text(i, 'err')[-2500:]}" for i in (0, 1))

    def kill(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
