"""The cluster's processes: each started in a session (and, with --worker_memory,
a cgroup) of its own, watched until the group ends, stopped together, the
group restarted after a failure; the launcher's exit status."""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

from .cluster_spec import cluster_roles, pick_ports, tf_config
from .common import POLL_S, USAGE_EXIT, UsageError
from .memory import memory_events, oom_kills
from .network import describe_cluster
from .output import log, pump

DRAIN_S = 1.0         # how long to wait for a stopped worker's last output lines
SETTLE_S = 1.0        # after a failure, how long to gather near-simultaneous ones


class Worker:
    """One worker process in its own session, so a signal reaches its whole process group."""

    def __init__(self, index, cmd, env, role="worker", caps=None):
        self.index, self.role = index, role
        self.cap = caps.flag if caps else None   # --worker_memory=SIZE: its cgroup is ours
        self.cgroup_events = caps.events(role, index) if caps else None  # its OOM-kill counter
        self.oom_kills_before = oom_kills(self.cgroup_events) if caps else None
        with caps.placing(role, index) if caps else contextlib.nullcontext():
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         start_new_session=True)
        prefix = f"[{role} {index}] ".encode()
        self.last_step = None              # from its progress lines
        self.batch = None                  # from its start-up line
        self.note_cgroup()
        self.pumps = [threading.Thread(target=pump, args=(pipe, out, prefix, self), daemon=True)
                      for pipe, out in ((self.proc.stdout, sys.stdout.buffer),
                                        (self.proc.stderr, sys.stderr.buffer))]
        for t in self.pumps:
            t.start()

    def note_cgroup(self):
        """Follow the worker's memory cgroup (it may move into one after start)."""
        if self.cap or self.proc.poll() is not None:
            return
        events = memory_events(self.proc.pid)
        exiting = events in ("/sys/fs/cgroup/memory.events",
                             "/sys/fs/cgroup/memory//memory.oom_control")
        if exiting and self.cgroup_events:
            return   # a dying task is moved to the root cgroup: keep the one it lived in
        if events and events != self.cgroup_events:
            self.cgroup_events, self.oom_kills_before = events, oom_kills(events)

    def oom_killed(self):
        """Whether the kernel's OOM killer ended it (its cgroup counted a kill)."""
        if self.proc.returncode != -signal.SIGKILL or not self.cgroup_events:
            return False
        after = oom_kills(self.cgroup_events)
        return None not in (after, self.oom_kills_before) and after > self.oom_kills_before

    def signal_group(self, signum):
        """Signal the group, not just the leader: a worker's own children must stop too."""
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def group_alive(self):
        self.proc.poll()  # reap the leader; a zombie would keep the group "alive"
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def describe_exit(self):
        rc = self.proc.returncode
        if rc >= 0:
            return f"{self.role} {self.index} exited with status {rc}"
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        text = f"{self.role} {self.index} was killed by signal {name}"
        if self.oom_killed():
            where = (f" after step {self.last_step}" if self.last_step is not None
                     else " before its first progress line")
            batch = f" (global batch {self.batch})" if self.batch else ""
            cap = f" at its {self.cap} cap" if self.cap else ""
            text += (f": out of memory{where}{batch}, killed by the kernel's OOM killer{cap} (its "
                     f"memory cgroup counted the kill in {self.cgroup_events}); to use less memory: "
                     "--accum_steps (smaller micro-batches), --recompute, "
                     "--precision=mixed_bfloat16, a smaller --global_batch_size, or "
                     "--strategy=dtensor --zero_stage=3 over more processes (each holds "
                     "1/N of the model), or --strategy=pipeline over more processes (each "
                     "holds its stages)"
                     + ("; or give it more: a larger --worker_memory" if self.cap else ""))
        return text


def start_group(opts, cmd, attempt, network=(False, None), caps=None):
    """Start every process of one attempt; `network` is (private, why not) from choose_network;
    `caps` the MemoryCaps of --worker_memory, or None."""
    private, reason = network
    roles = cluster_roles(opts)
    ports = pick_ports(opts.host, len(roles), opts.port_base)
    memory = caps.environment() if caps else {}
    workers = []
    try:
        for i, (role, index) in enumerate(roles):
            env = dict(os.environ, TF_CONFIG=tf_config(opts.host, ports, roles, i),
                       TFDIST_LAUNCH_ATTEMPT=str(attempt),
                       TFDIST_NETWORK="private" if private else "host", **memory)
            workers.append(Worker(index, cmd, env, role, caps))
    except (OSError, UsageError) as e:
        stop_group(workers, signal.SIGTERM, opts.grace_s)
        if isinstance(e, UsageError):
            raise
        raise UsageError(f"cannot run {cmd[0]!r}: {e.strerror}") from None
    line = describe_cluster([(role, index, f"{opts.host}:{port}")
                             for (role, index), port in zip(roles, ports)], private, reason)
    log(f"{line}; {caps.describe()}" if caps else line)
    return workers


def stop_group(workers, signum, grace_s):
    """Signal every group, give them grace_s to exit, then SIGKILL what is left; bounded time."""
    for w in workers:
        w.signal_group(signum)
    deadline = time.monotonic() + grace_s
    while any(w.group_alive() for w in workers) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    for w in workers:
        if w.group_alive():
            log(f"{w.role} {w.index} still running {grace_s:g}s after "
                f"{signal.Signals(signum).name}; sending SIGKILL")
            w.signal_group(signal.SIGKILL)
    for w in workers:
        w.proc.wait()
    _drain(workers)


def _drain(workers):
    """Let the pumps print the last lines; a grandchild that left the group must not block us."""
    deadline = time.monotonic() + DRAIN_S
    for t in (t for w in workers for t in w.pumps):
        t.join(max(0.0, deadline - time.monotonic()))


def _root_cause(workers):
    """Log every worker that failed around the first failure; return the likely cause.

    One death makes its peers fail within moments (their collectives break),
    so failures are gathered for SETTLE_S, and a worker killed by a signal is
    preferred over peers that merely exited with an error after it.
    """
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline and any(w.proc.poll() is None for w in workers):
        time.sleep(POLL_S)
    failed = [w for w in workers if w.proc.poll() not in (None, 0)]
    for w in failed:
        log(w.describe_exit())
    killed = [w for w in failed if w.proc.returncode < 0]
    return (killed or failed)[0]


def supervise(workers, interrupts, grace_s):
    """Wait for the group: return None if all exited 0, else the failed Worker or a signal number."""
    while True:
        if interrupts:
            signum = interrupts[0]
            log(f"got {signal.Signals(signum).name}; stopping all workers")
            stop_group(workers, signum, grace_s)
            return signum
        codes = [w.proc.poll() for w in workers]
        for w in workers:
            w.note_cgroup()
        if any(rc not in (None, 0) for rc in codes):
            failed = _root_cause(workers)
            stop_group(workers, signal.SIGTERM, grace_s)
            return failed
        if all(rc == 0 for rc in codes):
            stop_group(workers, signal.SIGTERM, grace_s)  # ends strays the workers left behind
            return None
        time.sleep(POLL_S)


def supervise_ps(group, interrupts, grace_s):
    """`supervise` for a chief/worker/ps group: the chief's exit decides (see
    the package doc); the outcome is the same as `supervise`'s."""
    chief, reported, ps_died = group[0], set(), None
    while True:
        if interrupts:   # the chief first: it saves while the parameter servers still answer
            signum = interrupts[0]
            log(f"got {signal.Signals(signum).name}; stopping the chief, then the servers")
            stop_group(group[:1], signum, grace_s)
            stop_group(group[1:], signal.SIGTERM, grace_s)
            return signum
        for w in group:
            w.note_cgroup()
        if chief.proc.poll() is not None:   # nothing left to serve
            stop_group(group, signal.SIGTERM, grace_s)
            if chief.proc.returncode == 0:
                return None
            log(chief.describe_exit())
            return chief
        for w in group[1:]:
            if w.proc.poll() is not None and w not in reported:
                reported.add(w)
                if w.role == "worker":
                    log(f"{w.describe_exit()}; the chief runs its steps on the other workers")
                else:
                    log(f"{w.describe_exit()}; the chief's next step fails")
                    ps_died = ps_died or (w, time.monotonic())
        workers = [w for w in group if w.role == "worker"]
        if all(w.proc.poll() is not None for w in workers):
            log("every worker has exited; stopping the chief and the parameter servers")
            stop_group(group, signal.SIGTERM, grace_s)
            return workers[0]
        if ps_died and time.monotonic() - ps_died[1] > grace_s:
            log(f"the chief did not stop within --grace_s={grace_s:g}s of the parameter "
                "server's death; stopping all processes")
            stop_group(group, signal.SIGTERM, grace_s)
            return ps_died[0]
        time.sleep(POLL_S)


def run(opts, cmd, interrupts, network=(False, None), caps=None):
    """Start the group, restarting it after failures; return the launcher's exit status."""
    for attempt in range(opts.max_restarts + 1):
        if attempt:
            log(f"restarting all workers (restart {attempt} of {opts.max_restarts})")
        watch = supervise_ps if opts.ps else supervise
        outcome = watch(start_group(opts, cmd, attempt, network, caps), interrupts, opts.grace_s)
        if outcome is None:
            return 0
        if isinstance(outcome, int):
            log(f"interrupted by {signal.Signals(outcome).name}; all workers stopped")
            return 128 + outcome
        if interrupts:  # a Ctrl-C during the fail-fast stop means: do not restart
            return 128 + interrupts[0]
        if outcome.proc.returncode == USAGE_EXIT:   # bad input: a restart fails the same way
            log(f"failed: {outcome.describe_exit()} (bad input, as its error says; not "
                "restarted); all workers stopped")
            return USAGE_EXIT
    log(f"failed: {outcome.describe_exit()}; all workers stopped "
        f"(restarts used: {opts.max_restarts} of {opts.max_restarts})")
    return 1
