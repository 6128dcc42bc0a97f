"""The command line: options before `--`, the worker command after it; `main`."""

import argparse
import signal
import sys

from .cluster_spec import cluster_roles
from .common import PROG, UsageError
from .memory import MemoryCaps, parse_memory
from .network import NETWORKS, choose_network
from .output import close_output, log
from .supervisor import run


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
    _cluster_options(p.add_argument_group("cluster"))
    _memory_options(p.add_argument_group("memory"))
    _fault_options(p.add_argument_group("faults"))
    return p


def _cluster_options(cluster):
    """--workers, --ps, --host, --port_base, --network."""
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


def _memory_options(memory):
    """--worker_memory."""
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


def _fault_options(faults):
    """--max_restarts, --grace_s."""
    faults.add_argument("--max_restarts", type=int, default=0, metavar="R",
                        help="restart the whole group after a failure up to R times "
                             "[default: %(default)s; an integer >= 0]")
    faults.add_argument("--grace_s", type=float, default=30.0, metavar="S",
                        help="seconds between SIGTERM and SIGKILL when stopping workers: a "
                             "tfdist-train worker saves a checkpoint and exits 143 within its "
                             "--preemption_grace_s (default 25) of SIGTERM "
                             "[default: %(default)g; a number >= 0]")


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
        close_output()
