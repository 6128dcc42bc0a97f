"""Does a slow link move the planner's choice, and is the moved choice faster
on that link? (`tfdist.plan` for two hosts, `bench/slow_link.py`'s shaped link)

    sudo .venv/bin/python bench/planner_link.py [--rate 100mbit] [--fast_rate 10gbit]

1. Two network namespaces joined by a veth pair, each direction limited by a
   `tbf` qdisc at --rate (tests/netns.py `Link`, as bench/slow_link.py).
2. The link measured: a TCP stream from one namespace to the other (--probe_mb
   megabytes, after a 1 MB warm-up): its bytes per second each way.
3. The planner for 2 processes over 2 hosts, lossy choices allowed, twice:
   at the measured rate, and at --fast_rate (a flag value, as a user planning
   ahead gives it). Its trials run both processes on this host; the links'
   terms are predicted for the rate given.
4. On the shaped link, each plan's pick and plain multi_worker (gradients
   all-reduced whole in float32), one worker per namespace: examples/s of
   the chief's summary, and the ratio.

The model is bench/slow_link.py's: the transformer (width 256, depth 2) on
tfdist_tokens, global batch 64. Ratios in one run; 2 shared cores.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.join(os.path.dirname(HERE), "tests"))

import common  # noqa: E402
import netns  # noqa: E402

PREFIX = "plnk"
ADDRESSES = ("10.236.0.1", "10.236.0.2")
PORT = 23457
PROBE_PORT = 23999
HEADER = ["link", "planned for", "pick", "pick ex/s", "multi_worker ex/s", "pick / multi_worker",
          "runner-up"]
# The cluster flags each worker is given on its own command line.
CLUSTER = ("--worker_hosts", "--task_index")

SINK = """
import socket, sys
server = socket.socket(); server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((sys.argv[1], int(sys.argv[2]))); server.listen(1)
connection, _ = server.accept()
while connection.recv(1 << 20):
    pass
"""


def measure_link(link: netns.Link, megabytes: int) -> float:
    """Bytes per second of a TCP stream from namespace 0 to namespace 1."""
    sink = subprocess.Popen(["ip", "netns", "exec", link.namespaces[1], sys.executable, "-c",
                             SINK, link.addresses[1], str(PROBE_PORT)])
    try:
        source = (
            "import socket, sys, time\n"
            "for _ in range(100):\n"
            "    try:\n"
            f"        s = socket.create_connection(('{link.addresses[1]}', {PROBE_PORT}))\n"
            "        break\n"
            "    except OSError:\n"
            "        time.sleep(0.1)\n"
            "chunk = b'x' * (1 << 20)\n"
            "s.sendall(chunk)\n"
            "start = time.perf_counter()\n"
            f"for _ in range({megabytes}):\n"
            "    s.sendall(chunk)\n"
            "s.shutdown(socket.SHUT_WR)\n"
            "s.recv(1)\n"
            "print(time.perf_counter() - start)\n")
        out = subprocess.run(["ip", "netns", "exec", link.namespaces[0], sys.executable, "-c",
                              source], capture_output=True, text=True, timeout=600, check=True)
        return megabytes * (1 << 20) / float(out.stdout.strip().splitlines()[-1])
    finally:
        sink.kill()
        sink.wait()


def run_on_link(link, directory, name, flags, timeout) -> float:
    # netns.Workers puts --strategy=multi_worker first: a pick's own engine,
    # later on the command line, overrides it (absl keeps a flag's last value).
    workers = netns.Workers(link, directory, flags, port=PORT)
    workers.start(name)
    codes = workers.wait(timeout)
    if codes != [0, 0]:
        raise RuntimeError(f"{name}: exit {codes}\n{workers.tails()}")
    return workers.summary()["examples_per_sec"]


def config_of(args):
    import tfdist
    return tfdist.RunConfig(
        model=tfdist.ModelConfig(name="transformer", width=256, depth=2),
        data=tfdist.DataConfig(dataset="tfdist_tokens"),
        optimizer=tfdist.OptimizerConfig(learning_rate=0.003),
        train=tfdist.TrainConfig(global_batch_size=64, train_steps=args.steps,
                                 steps_per_loop=8))


def flags_of(config) -> list:
    from tfdist import config as config_lib
    return [f for f in config_lib.as_flags(config) if f.split("=", 1)[0] not in CLUSTER]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="100mbit", help="the shaped link's tbf rate")
    parser.add_argument("--fast_rate", default="10gbit",
                        help="the second plan's --link_bandwidth (not shaped: planned ahead)")
    parser.add_argument("--probe_mb", type=int, default=48)
    parser.add_argument("--steps", type=int, default=48,
                        help="--train_steps of each run on the link (8 per loop)")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    why = netns.why_not(PREFIX)
    if why:
        print(f"planner_link.py: skipped: {why}")
        return
    print(common.hardware_header(), flush=True)
    import tfdist
    from tfdist.planner import parse_rate
    clock = common.Clock()
    link = netns.Link(PREFIX, ADDRESSES)
    link.delete()   # left-overs of an interrupted run
    rows = []
    try:
        link.create()
        link.shape(args.rate)
        measured = measure_link(link, args.probe_mb)
        print(f"the link shaped at {args.rate}: measured {measured * 8 / 1e6:.1f} Mbit/s",
              flush=True)
        config = config_of(args)
        with tempfile.TemporaryDirectory(prefix="bench-planner-link-") as directory:
            plain = [*flags_of(config), "--strategy=multi_worker", "--virtual_devices=1"]
            baseline = run_on_link(link, directory, "multi_worker", plain, args.timeout)
            print(f"multi_worker on the link: {baseline:.1f} examples/s", flush=True)
            for label, rate in ((f"measured {measured * 8 / 1e6:.0f} Mbit/s", measured),
                                (f"--link_bandwidth={args.fast_rate}",
                                 parse_rate(args.fast_rate, "--fast_rate"))):
                plan = tfdist.plan(config, processes=2, hosts=2, link_bandwidth=rate,
                                   allow_lossy=True, work_dir=directory,
                                   log=lambda line: print(f"  [{label}] {line}", flush=True))
                print(plan.table(), flush=True)
                pick = plan.winner_config()
                rate_on_link = run_on_link(link, directory, f"pick-{len(rows)}",
                                           flags_of(pick), args.timeout)
                row = [args.rate, label, plan.winner.describe(), f"{rate_on_link:.1f}",
                       f"{baseline:.1f}", f"{rate_on_link / baseline:.2f}",
                       plan.runner_up.describe() if plan.runner_up else "-"]
                common.print_row(row, HEADER)
                rows.append(row)
    finally:
        link.delete()
    description = (
        f"The planner (`tfdist.plan`, 2 processes over 2 hosts, `allow_lossy=True`, its "
        f"default trials) for the transformer of bench/slow_link.py (width 256, depth 2, "
        f"batch 64), planned at the link's measured rate (a TCP stream across a veth pair "
        f"shaped with tbf at {args.rate}) and at {args.fast_rate}; each pick then trained "
        f"on the shaped link, one worker per namespace, against plain multi_worker there "
        f"({args.steps} steps, 8 per loop; examples/s of the chief's summary).")
    common.finish("planner_link", "The planner on a slow link", description, rows, HEADER,
                  clock)


if __name__ == "__main__":
    main()
