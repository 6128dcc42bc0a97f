"""A Slurm job step as a TF_CONFIG cluster, from Slurm's own variables.

Plain Python, no TensorFlow: like TF_CONFIG (`tfdist.cluster`), a bad Slurm
environment must fail in one line before TensorFlow starts.

Why not TensorFlow's `SlurmClusterResolver` (TF 2.21): it runs `nvidia-smi` to
count GPUs, a FileNotFoundError on every CPU-only node; `gpus_per_node=0`
fails (`range(0, 0, 0)`); when there are fewer GPU slots than tasks on a node
`zip` silently drops tasks; it sorts host names alphabetically (node10 before
node9), while Slurm numbers tasks in its own node order, so tasks take each
other's addresses; and every job uses port 8888, so two jobs on one node
collide. Here: no subprocess, no GPU count (each task uses the GPUs Slurm
gave it), ranks in Slurm's order, and ports per job step.

Ranks: Slurm places tasks with block distribution by default (srun's
`--distribution=block`): node 0 gets ranks 0..k0-1, node 1 the next k1, and
so on, in the order of the step's node list. Every task builds the same
cluster from the same variables, then checks that its own (SLURM_NODEID,
SLURM_LOCALID) is where block distribution puts its SLURM_PROCID; under
another distribution (cyclic, plane, arbitrary) the addresses would be
wrong, so that is an error.

Ports: all tasks must agree on every task's port without talking to each
other, and two jobs (or two steps of one job) on one node must not collide.
So each job step gets a window of ports derived from its SLURM_JOB_ID and
SLURM_STEP_ID, below Linux's ephemeral range (32768-60999, where outgoing
connections and tfdist-launch's OS-picked ports live), and a task takes
window start + SLURM_LOCALID. `TFDIST_SLURM_PORT_BASE=P` uses P + local id
instead. Before TensorFlow starts, each task checks that its own port is
free and names it if not.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import math
import re
import socket
from typing import Optional

from tfdist import tf_config
from tfdist.errors import UsageError

PORT_BASE_ENV = "TFDIST_SLURM_PORT_BASE"
PORT_LOW, PORT_HIGH = 20000, 32000   # [low, high): below the ephemeral range
PORT_SLOT = 16             # a window is a multiple of this many ports
STEPS_PER_JOB = 8          # windows kept apart for concurrent steps of one job
BATCH_STEP = 0xFFFFFFFB    # Slurm's step id of the batch script (SLURM_BATCH_SCRIPT)
MAX_HOSTS = 1 << 16        # no real node list expands to more

_HOSTLIST_ITEM = re.compile(r"(?:[^\[\],]+|\[[^\[\]]*\])+")
_TASKS_ITEM = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")


# -- Slurm's compact notations -------------------------------------------------
def _hostlist_error(variable: str, text: str, problem: str) -> UsageError:
    return UsageError(f"{variable}={text!r}: {problem}; expected a Slurm host list such as "
                      "node[01-04,7],gpu5")


def _split_top_level(text: str, variable: str) -> list[str]:
    """`text` split at commas outside brackets ("n[1,3],m" -> "n[1,3]", "m")."""
    items, depth, start = [], 0, 0
    for position, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:position])
            start = position + 1
        if depth not in (0, 1):
            raise _hostlist_error(variable, text, "unbalanced or nested brackets")
    if depth:
        raise _hostlist_error(variable, text, "a '[' is never closed")
    return items + [text[start:]]


def _expand_ranges(ranges: str, item: str, variable: str, text: str) -> list[str]:
    """"01-03,7" -> ["01", "02", "03", "7"]: zero padding is kept (Slurm pads
    to the width of a range's first number)."""
    values = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        high = high or low
        if not (low.isascii() and low.isdigit() and high.isascii() and high.isdigit()):
            raise _hostlist_error(variable, text, f"bad range [{ranges}] in {item!r}")
        if int(high) < int(low) or int(high) - int(low) >= MAX_HOSTS:
            raise _hostlist_error(variable, text, f"range {part} in {item!r} is empty or huge")
        values += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
        if len(values) > MAX_HOSTS:
            raise _hostlist_error(variable, text, f"[{ranges}] has more than {MAX_HOSTS} hosts")
    return values


def expand_hostlist(text: str, variable: str = "SLURM_STEP_NODELIST") -> list[str]:
    """Slurm's compact host list, expanded in Slurm's order.

    "node[9-10]" -> node9, node10; "n[01-03,7],gpu5" -> n01, n02, n03, n7,
    gpu5; "rack[1-2]-n[1-2]" -> rack1-n1, rack1-n2, rack2-n1, rack2-n2 (the
    first bracket varies slowest, as Slurm expands it).
    """
    hosts = []
    for item in _split_top_level(text.strip(), variable):
        if not _HOSTLIST_ITEM.fullmatch(item) or any(c.isspace() for c in item):
            raise _hostlist_error(variable, text, f"bad host entry {item!r}")
        parts = re.findall(r"\[[^\[\]]*\]|[^\[\]]+", item)
        choices = [_expand_ranges(p[1:-1], item, variable, text) if p.startswith("[") else [p]
                   for p in parts]
        if math.prod(len(c) for c in choices) > MAX_HOSTS:
            raise _hostlist_error(variable, text, f"{item!r} expands to too many hosts")
        hosts += ["".join(combination) for combination in itertools.product(*choices)]
        if len(hosts) > MAX_HOSTS:
            raise _hostlist_error(variable, text, f"more than {MAX_HOSTS} hosts")
    if len(set(hosts)) < len(hosts):
        twice = next(h for h in hosts if hosts.count(h) > 1)
        raise _hostlist_error(variable, text, f"node {twice} appears more than once")
    return hosts


def expand_tasks_per_node(text: str, variable: str = "SLURM_STEP_TASKS_PER_NODE") -> list[int]:
    """Slurm's tasks per node, one count per node: "2(x3),1" -> [2, 2, 2, 1]."""
    counts = []
    for item in text.strip().split(","):
        match = _TASKS_ITEM.fullmatch(item)
        if not match or int(match.group(1)) < 1 or int(match.group(2) or 1) < 1:
            raise UsageError(f"{variable}={text!r}: bad entry {item!r}; expected counts "
                             "of at least 1 such as 2(x3),1 (2 tasks on each of 3 nodes, "
                             "then 1)")
        if (len(counts) + int(match.group(2) or 1) > MAX_HOSTS
                or int(match.group(1)) > MAX_HOSTS):
            raise UsageError(f"{variable}={text!r}: more than {MAX_HOSTS} nodes, or tasks "
                             "on a node")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


# -- this task ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SlurmTask:
    """This task of a Slurm job step, and where every task of the step listens."""

    hosts: tuple             # the step's nodes, in Slurm's order
    tasks_per_node: tuple    # tasks on each of them
    rank: int                # SLURM_PROCID
    port_base: int           # task with local id L on any node listens on port_base + L
    job: str = ""            # "job J step S", for messages

    @property
    def num_tasks(self) -> int:
        return sum(self.tasks_per_node)

    @property
    def addresses(self) -> list[str]:
        """host:port of every rank, in rank order (block distribution)."""
        return [f"{host}:{self.port_base + local}"
                for host, count in zip(self.hosts, self.tasks_per_node)
                for local in range(count)]

    @property
    def address(self) -> str:
        return self.addresses[self.rank]

    def tf_config(self) -> str:
        return tf_config.compose({"worker": self.addresses}, "worker", self.rank)


def in_job(environ) -> bool:
    """Whether this process runs inside a Slurm job (a step or the batch script)."""
    return "SLURM_JOB_ID" in environ and "SLURM_PROCID" in environ


def in_step(environ) -> bool:
    """Whether this process is a task that srun started (not the batch script)."""
    return in_job(environ) and "SLURM_STEP_ID" in environ


def step_tasks(environ) -> int:
    """How many tasks this process's srun step has (1 outside a step: the batch
    script runs once, whatever the job's task count)."""
    if not in_step(environ):
        return 1
    name = _first_set(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    return _integer(environ, name, 1) if name else 1


def _first_set(environ, *names) -> Optional[str]:
    return next((name for name in names if name in environ), None)


def _integer(environ, name: str, minimum: int, *, default: Optional[int] = None) -> int:
    value = environ.get(name)
    if value is None:
        if default is not None:
            return default
        raise UsageError(f"{name} is not set, but this process runs in Slurm job "
                         f"{environ.get('SLURM_JOB_ID')}; Slurm sets it for every task of "
                         "a step started with srun")
    text = str(value).strip()
    if not (text.isascii() and text.isdigit()) or int(text) < minimum:
        raise UsageError(f"{name}={value!r} is not a whole number of at least {minimum}")
    return int(text)


def _required(environ, *names) -> tuple[str, str]:
    """(name, value) of the first of `names` that is set; UsageError if none is."""
    name = _first_set(environ, *names)
    if name is None:
        raise UsageError(f"{' or '.join(names)} is not set, but this process runs in Slurm "
                         f"job {environ.get('SLURM_JOB_ID')}; Slurm sets it for every task of "
                         "a step started with srun")
    return name, environ[name]


def task_from_environ(environ) -> Optional[SlurmTask]:
    """This task of its Slurm job step, from the SLURM_* variables; None outside Slurm.

    In a step (srun), the step's variables (SLURM_STEP_NUM_TASKS, _NODELIST,
    _TASKS_PER_NODE), else the job's. In the batch script itself (no srun)
    only a one-task job is a cluster: with more tasks the others never start.
    """
    if not in_job(environ):
        return None
    job = _integer(environ, "SLURM_JOB_ID", 0)
    if not in_step(environ):
        return _batch_script_task(environ, job)
    step = _integer(environ, "SLURM_STEP_ID", 0)
    hosts, counts, hosts_var, tasks_var = _step_layout(environ)
    rank = _integer(environ, "SLURM_PROCID", 0)
    if rank >= sum(counts):
        raise UsageError(f"SLURM_PROCID={rank} is out of range for {tasks_var}={sum(counts)} "
                         f"(valid: 0-{sum(counts) - 1})")
    _check_block_placement(environ, rank, counts, hosts_var)
    return SlurmTask(hosts=tuple(hosts), tasks_per_node=tuple(counts), rank=rank,
                     port_base=port_base(environ, job, step, max(counts)),
                     job=f"Slurm job {job} step {step}")


def _step_layout(environ) -> tuple[list, list, str, str]:
    """(nodes, tasks on each, the node list's variable, the task count's
    variable) of this step, checked against each other."""
    hosts_var, hosts_text = _required(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
    counts_var, counts_text = _required(environ, "SLURM_STEP_TASKS_PER_NODE",
                                        "SLURM_TASKS_PER_NODE")
    tasks_var = _first_set(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") or \
        "SLURM_STEP_NUM_TASKS"
    hosts = expand_hostlist(hosts_text, hosts_var)
    counts = expand_tasks_per_node(counts_text, counts_var)
    num_tasks = _integer(environ, tasks_var, 1)
    if len(counts) != len(hosts):
        raise UsageError(f"{counts_var}={counts_text!r} gives {len(counts)} node(s) but "
                         f"{hosts_var}={hosts_text!r} has {len(hosts)}; they must match")
    if sum(counts) != num_tasks:
        raise UsageError(f"{counts_var}={counts_text!r} adds up to {sum(counts)} tasks but "
                         f"{tasks_var}={num_tasks}; they must match")
    return hosts, counts, hosts_var, tasks_var


def _batch_script_task(environ, job: int) -> SlurmTask:
    """The batch script (no srun) as a one-task cluster on its own node."""
    tasks = _integer(environ, "SLURM_NTASKS", 1, default=1)
    if tasks > 1:
        raise UsageError(f"this process runs in the batch script of Slurm job {job} "
                         f"(SLURM_NTASKS={tasks}, no SLURM_STEP_ID), where the other "
                         f"{tasks - 1} task(s) never start: start it with srun, e.g. "
                         "`srun tfdist-train ...` (see launch/slurm/tfdist.sbatch)")
    hosts_var, hosts_text = _required(environ, "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    hosts = expand_hostlist(hosts_text, hosts_var)
    node = _integer(environ, "SLURM_NODEID", 0, default=0)
    if node >= len(hosts):
        raise UsageError(f"SLURM_NODEID={node} is out of range for {hosts_var}={hosts_text!r} "
                         f"(valid: 0-{len(hosts) - 1})")
    return SlurmTask(hosts=(hosts[node],), tasks_per_node=(1,), rank=0,
                     port_base=port_base(environ, job, BATCH_STEP, 1),
                     job=f"Slurm job {job} (batch script)")


def block_placement(rank: int, counts) -> tuple[int, int]:
    """(node index, local index) of `rank` under block distribution."""
    first = 0
    for node, count in enumerate(counts):
        if rank < first + count:
            return node, rank - first
        first += count
    raise ValueError(f"rank {rank} beyond {first} tasks")


def _check_block_placement(environ, rank: int, counts, hosts_var: str) -> None:
    node = _integer(environ, "SLURM_NODEID", 0)
    local = _integer(environ, "SLURM_LOCALID", 0)
    want_node, want_local = block_placement(rank, counts)
    if (node, local) == (want_node, want_local):
        return
    distribution = environ.get("SLURM_DISTRIBUTION")
    raise UsageError(
        f"SLURM_PROCID={rank} runs as SLURM_NODEID={node} SLURM_LOCALID={local}, but block "
        f"distribution puts rank {rank} at SLURM_NODEID={want_node} SLURM_LOCALID={want_local}"
        f"{f' (SLURM_DISTRIBUTION={distribution!r})' if distribution else ''}: tfdist numbers "
        f"workers in {hosts_var} order, node by node; start the step with "
        "`srun --distribution=block` (srun's default)")


def port_base(environ, job: int, step: int, width: int) -> int:
    """The first port of this job step's window; local id L listens on base + L.

    Consecutive job ids get windows STEPS_PER_JOB windows apart (room for that
    many concurrent steps of one job), so the same step of two jobs on one node
    collides only when their ids differ by a multiple of 375 (up to 16 tasks
    per node: 750 windows); the free-port check names the port then.
    """
    if environ.get(PORT_BASE_ENV, "").strip():
        base = _integer(environ, PORT_BASE_ENV, 1)
        if base + width - 1 > 65535:
            raise UsageError(f"{PORT_BASE_ENV}={base}: {width} task(s) on a node need ports "
                             f"{base}-{base + width - 1}, beyond 65535; pick at most "
                             f"{65536 - width}")
        return base
    window = PORT_SLOT * -(-width // PORT_SLOT)
    windows = (PORT_HIGH - PORT_LOW) // window
    if windows < 1:
        raise UsageError(f"{width} tasks on one node need more than the {PORT_HIGH - PORT_LOW} "
                         f"ports tfdist uses for Slurm jobs; set {PORT_BASE_ENV}=P to use "
                         "ports P, P+1, ...")
    return PORT_LOW + (job * STEPS_PER_JOB + step % STEPS_PER_JOB) % windows * window


def check_port_free(task: SlurmTask) -> None:
    """UsageError naming this task's port if something on this node listens on it.

    TensorFlow's server binds every interface with SO_REUSEADDR; so does the probe,
    so a port left in TIME_WAIT by an earlier job does not count as taken.
    """
    port = int(task.address.rpartition(":")[2])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as error:
            why = "in use" if error.errno == errno.EADDRINUSE else error.strerror
            raise UsageError(
                f"{task.job}, rank {task.rank} ({task.address}): port {port} is {why} on this "
                f"node (another job?); set {PORT_BASE_ENV}=P to use ports P, P+1, ... for "
                "this job's tasks on each node") from None
