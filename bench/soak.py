"""Soak run of fault handling: a 2-worker training run with random crashes and preemptions.

    .venv/bin/python bench/soak.py [--minutes=M] [--seed=S] [--mean_interval_s=T]
        [--max_restarts=R] [--model_dir=D] [--global_batch_size=B] [--timeout_s=T]

One `tfdist-launch --workers=2 --max_restarts=R -- tfdist-train
--strategy=multi_worker --model_dir=D ...` run (a small cnn on the
tfdist_shapes dataset, real data so the loss after a resume shows whether the
weights came back), sized by a short probe run to train for about --minutes
without faults. For --minutes after the start, a worker is stopped at random:
once the group trains (a progress line of worker 0 since its (re)start), a
fault is drawn from --seed: a wait (exponential, mean --mean_interval_s), a
worker (0 or 1) and a signal, SIGKILL (a crash: the launcher restarts the
group, training resumes from the last periodic checkpoint and retrains the
steps since) or SIGTERM (a preemption: every worker saves at the same step and
exits 143, then the launcher restarts the group). After the window the run
trains to its end without faults.

While it runs, the checkpoint steps of the model dir are polled
(`tfdist.checkpointing.saved_steps`, --keep_checkpoints large so none is
pruned): a latest saved step that goes backwards, or a saved step that
disappears, is a failure. At every restart the launcher logs, the last saved
step is read; the step worker 0 restores (its `restored .../ckpt-N` line, 0
without one) must be at or after it. Steps recomputed: for a SIGKILL, the
last `step S/N` progress line of worker 0 before the kill minus the step
resumed from (an estimate: steps of the unfinished loop are not counted);
for a SIGTERM, the preempted step minus the step resumed from (0: it saved
there). Restart time: from the signal to worker 0's first progress line
after the restart, split into stopping the old group (signal -> the
launcher's restart line), starting the new one (-> worker 0's `restored`
line: processes, TensorFlow, cluster, restore) and its first loop (->
first progress line: tracing, compiling, 10 steps).

Printed: the plan (probe speed, steps), one line per fault as it resolves,
then a summary table and a per-fault table, also written to
bench/results/soak.md and the shared bench/results/report.md. The launcher's
full output goes to a log file (its path is printed). The launcher and every
worker are stopped in all cases (hard timeout --timeout_s, Ctrl-C, errors).
Exit status: 0 if the run finished and every check held, 1 otherwise, 130
when interrupted.

Run time: --minutes of faults, then the rest of the training (restarts make
it longer than --minutes), plus ~1 min of probe: ~5-8 min at --minutes=3.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import (  # noqa: E402
    LAUNCH, REPO, TRAIN, Clock, RunFailed, markdown_table, print_row, run_summary,
    step_seconds, table, write_section)

NAME, TITLE = "soak", "Fault soak: random SIGKILL / SIGTERM (bench/soak.py)"

WORKERS = 2
STEPS_PER_LOOP = 10
CHECKPOINT_EVERY = 20
KEEP_CHECKPOINTS = 1_000_000           # never prune: the whole history stays visible
MODEL = ["--model=cnn", "--model_width=16", "--model_depth=1", "--dataset=tfdist_shapes"]
PROBE_STEPS = 3 * STEPS_PER_LOOP       # the first loop compiles; 2 timed loops
POLL_S = 0.25                          # checkpoint polling and event handling
NO_FAULT_TAIL = 2 * STEPS_PER_LOOP     # no fault this close to the final step
LAUNCH_GRACE_S = 30                    # tfdist-launch --grace_s (SIGTERM -> SIGKILL)

# Lines of the launcher's output (worker lines come prefixed `[worker i] `).
PROGRESS = re.compile(r"^\[worker 0\] .*\bstep (\d+)/(\d+)\b(.*)$")
LOSS = re.compile(r"\bloss=([-+\w.]+)")
RESTORED = re.compile(r"^\[worker 0\] .*\brestored \S*ckpt-(\d+)\s*$")
PREEMPTED = re.compile(r"^\[worker (\d+)\] tfdist-train: preempted \(SIGTERM\) at step (\d+)")
EXITED = re.compile(r"^tfdist-launch: worker (\d+) (?:exited with status (-?\d+)|"
                    r"was killed by signal (\w+))")
RESTART = re.compile(r"^tfdist-launch: restarting all workers \(restart (\d+) of (\d+)\)")
LAUNCH_FAILED = re.compile(r"^tfdist-launch: failed: (.*)")
SUMMARY = re.compile(r"^\[worker 0\] (\{.*\})\s*$")
FAULT_LINE = re.compile(r"^\[worker (\d+)\] tfdist-train: fault: (.*)")
# Lines that mean something went worse than the design says.
ANOMALIES = {
    "preemption grace exceeded": re.compile(r"not stopped within --preemption_grace_s"),
    "launcher had to SIGKILL a worker": re.compile(r"^tfdist-launch: .*sending SIGKILL"),
    "traceback": re.compile(r"Traceback \(most recent call last\)"),
    "checkpoint write failed": re.compile(r"cannot save the checkpoint|cannot update the "
                                          r"checkpoint index"),
    "damaged checkpoint skipped at restore": re.compile(r"checkpoint \S+ cannot be read|"
                                                        r"checkpoint index in \S+ is damaged"),
}


def train_command(train_steps, model_dir, args, max_restarts=0):
    cmd = [LAUNCH, f"--workers={WORKERS}", f"--max_restarts={max_restarts}",
           f"--grace_s={LAUNCH_GRACE_S}", "--",
           TRAIN, "--strategy=multi_worker", *MODEL,
           f"--global_batch_size={args.global_batch_size}", f"--train_steps={train_steps}",
           f"--steps_per_loop={STEPS_PER_LOOP}"]
    if model_dir:
        cmd += [f"--model_dir={model_dir}", f"--checkpoint_every={CHECKPOINT_EVERY}",
                f"--keep_checkpoints={KEEP_CHECKPOINTS}"]
    return cmd


def _worker_index(pid):
    """A worker's task index from its TF_CONFIG (None if unreadable)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        return json.loads(env[b"TF_CONFIG"])["task"]["index"]
    except (OSError, KeyError, ValueError):
        return None


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _children(pid):
    """Direct children of `pid` (the launcher's workers)."""
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [int(p) for p in out.split()]


class Fault:
    def __init__(self, number, t, signame, worker, pid, step, loss, saved):
        self.number, self.t, self.signame, self.worker, self.pid = number, t, signame, worker, pid
        self.step_at_fault, self.loss_before, self.saved_at_fault = step, loss, saved
        self.preempted_steps: dict[int, int] = {}     # worker -> step of its preemption line
        self.exits: list[str] = []                   # the launcher's exit lines
        self.exit_codes: list[int] = []
        self.restarts: list[int] = []                # restart numbers it took
        self.saved_at_restart = None                 # latest saved step when it restarted
        self.resumed_from = None                     # the step worker 0 restored
        self.first_step = None                       # its first progress step after
        self.loss_after = None
        self.restart_s = None                        # signal -> first progress line
        self.t_restart = self.t_restored = None      # its restart line, restored line

    @property
    def stop_step(self):
        """The last step trained before the stop: the preemption step for a
        SIGTERM (every worker finished that loop), else the last progress line."""
        if self.preempted_steps:
            return max(self.preempted_steps.values())
        return self.step_at_fault

    @property
    def recomputed(self):
        if self.resumed_from is None:
            return None
        return max(0, self.stop_step - self.resumed_from)

    @property
    def resumed_ok(self):
        if self.resumed_from is None or self.saved_at_restart is None:
            return None
        return self.resumed_from >= self.saved_at_restart


class Soak:
    """One soak run: the launcher, its output, the fault schedule, the checks."""

    def __init__(self, args, model_dir, train_steps, log_path, saved_steps):
        self.args, self.model_dir, self.train_steps = args, model_dir, train_steps
        self.saved_steps = saved_steps
        self.rng = random.Random(args.seed)
        self.log = open(log_path, "w", buffering=1, errors="replace")
        self.events: queue.Queue = queue.Queue()
        self.process = None
        self.worker_pids: set[int] = set()
        self.t0 = None
        # Progress of worker 0.
        self.last_step, self.last_loss = 0, None
        self.training = False          # a progress line since the group's last start
        self.group_started = None      # time of the launcher's last (re)start
        self.restored = None           # step restored by the current group (None: none yet)
        # Faults.
        self.faults: list[Fault] = []
        self.pending: Fault | None = None     # injected, training not yet resumed
        self.next_fault = None                # (time, signame, worker)
        # Checkpoint history.
        self.saved_history: list[tuple[float, list[int]]] = []
        self.seen_saved: set[int] = set()
        self.max_saved = 0
        self.went_backwards: list[str] = []
        self.vanished: list[str] = []
        self.read_errors = 0
        # Everything else.
        self.restart_lines = 0
        self.restarts_resumed = 0             # restarts after which training went on
        self.unexpected: list[str] = []       # restarts or exits nobody caused
        self.anomalies: dict[str, list[str]] = {}
        self.summary = None
        self.launch_failed = None
        self.returncode = None
        self.timed_out = False
        self.load = (os.getloadavg()[0], None)

    # -- the launcher's output -------------------------------------------------
    def _reader(self, stream, name):
        for raw in iter(stream.readline, b""):
            self.events.put((time.monotonic(), name, raw.decode(errors="replace").rstrip("\n")))
        self.events.put((time.monotonic(), name, None))

    def now(self):
        return time.monotonic() - self.t0

    def _handle(self, t, line):
        self.log.write(f"{t - self.t0:9.2f} {line}\n")
        for what, pattern in ANOMALIES.items():
            if pattern.search(line):
                self.anomalies.setdefault(what, []).append(f"t={t - self.t0:.0f}s: {line[:200]}")
        if m := PROGRESS.match(line):
            step = int(m.group(1))
            loss = LOSS.search(m.group(3))
            self.last_step, self.last_loss = step, loss and loss.group(1)
            fault = self.pending
            if fault is not None and not fault.restarts:
                # A loop the old group finished as the signal came: trained too.
                fault.step_at_fault = max(fault.step_at_fault, step)
            if not self.training:
                self.training = True
                if self.restart_lines:
                    self.restarts_resumed += 1
                if self.restored is not None and step <= self.restored:
                    self.anomalies.setdefault("first step not after the restored one", []).append(
                        f"t={t - self.t0:.0f}s: restored {self.restored}, then step {step}")
                fault = self.pending
                if fault is not None and fault.restarts:
                    fault.resumed_from = self.restored or 0
                    fault.first_step, fault.loss_after = step, self.last_loss
                    fault.restart_s = t - self.t0 - fault.t
                    self.pending = None
                    self._report_fault(fault)
        elif m := RESTORED.match(line):
            self.restored = int(m.group(1))
            if self.pending is not None and self.pending.restarts:
                self.pending.t_restored = t - self.t0
        elif m := PREEMPTED.match(line):
            if self.pending is not None:
                self.pending.preempted_steps[int(m.group(1))] = int(m.group(2))
            else:
                self.unexpected.append(f"t={t - self.t0:.0f}s: {line}")
        elif m := EXITED.match(line):
            text = line.split(": ", 1)[1]
            if self.pending is not None and not self.pending.restarts:
                self.pending.exits.append(text)
                if m.group(2) is not None:
                    self.pending.exit_codes.append(int(m.group(2)))
            else:
                self.unexpected.append(f"t={t - self.t0:.0f}s: {text}")
        elif m := RESTART.match(line):
            self.restart_lines += 1
            # The old group is gone (the launcher waited for it), the new one
            # has not started: the latest saved step now is what it must resume at.
            saved = self._poll_saved(t)
            self.training, self.restored, self.group_started = False, None, t
            if self.pending is not None:
                self.pending.restarts.append(int(m.group(1)))
                if self.pending.t_restart is None:
                    self.pending.t_restart = t - self.t0
                if self.pending.saved_at_restart is None:
                    self.pending.saved_at_restart = max(saved, default=0)
            else:
                self.unexpected.append(f"t={t - self.t0:.0f}s: {line}")
        elif m := LAUNCH_FAILED.match(line):
            self.launch_failed = m.group(1)
        elif m := SUMMARY.match(line):
            try:
                self.summary = json.loads(m.group(1))
            except ValueError:
                pass

    def _report_fault(self, f):
        print(f"fault {f.number}: t={f.t:.0f}s {f.signame} worker {f.worker} at step "
              f"{f.stop_step} (last saved {f.saved_at_fault}); exits: "
              f"{'; '.join(f.exits) or '-'}; resumed from {f.resumed_from} "
              f"(saved at restart {f.saved_at_restart}); recomputed {f.recomputed}; "
              f"restart {f.restart_s:.1f}s (stop / start+restore / 1st loop: {_phases(f)}); "
              f"loss {f.loss_before} -> {f.loss_after}", flush=True)

    # -- checkpoints -----------------------------------------------------------
    def _poll_saved(self, t=None):
        t = time.monotonic() if t is None else t
        try:
            steps = self.saved_steps(self.model_dir)
        except Exception:   # noqa: BLE001  (a half-written index must not end the soak)
            self.read_errors += 1
            return sorted(self.seen_saved)
        if not self.saved_history or self.saved_history[-1][1] != steps:
            self.saved_history.append((t - self.t0, steps))
        latest = max(steps, default=0)
        if latest < self.max_saved:
            self.went_backwards.append(f"t={t - self.t0:.0f}s: latest {self.max_saved} -> {latest}")
        gone = self.seen_saved - set(steps)
        if gone:
            self.vanished.append(f"t={t - self.t0:.0f}s: {sorted(gone)} no longer listed")
        self.seen_saved |= set(steps)
        self.max_saved = max(self.max_saved, latest)
        return steps

    # -- faults ----------------------------------------------------------------
    def _schedule(self):
        interval = self.rng.expovariate(1.0 / self.args.mean_interval_s)
        signame = self.rng.choice(("SIGKILL", "SIGTERM"))
        worker = self.rng.randrange(WORKERS)
        self.next_fault = (self.now() + interval, signame, worker)

    def _inject(self):
        _, signame, worker = self.next_fault
        pids = {}
        for pid in _children(self.process.pid):
            self.worker_pids.add(pid)
            pids[_worker_index(pid)] = pid
        pid = pids.get(worker)
        if pid is None:
            return False   # not there (any more): try again at the next poll
        saved = self._poll_saved()
        fault = Fault(len(self.faults) + 1, self.now(), signame, worker, pid, self.last_step,
                      self.last_loss, max(saved, default=0))
        try:
            os.kill(pid, getattr(signal, signame))
        except ProcessLookupError:
            return False
        self.log.write(f"{fault.t:9.2f} soak: sent {signame} to worker {worker} (pid {pid}) "
                       f"at step {self.last_step}\n")
        self.faults.append(fault)
        self.pending, self.next_fault = fault, None
        return True

    def _maybe_fault(self):
        if (self.now() >= self.args.minutes * 60 or self.pending is not None
                or not self.training or self.last_step >= self.train_steps - NO_FAULT_TAIL):
            return
        if self.next_fault is None:
            self._schedule()
        if self.now() >= self.next_fault[0]:
            self._inject()

    # -- the run ---------------------------------------------------------------
    def run(self):
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
        command = train_command(self.train_steps, self.model_dir, self.args,
                                self.args.max_restarts)
        self.t0 = self.group_started = time.monotonic()
        self.log.write(f"{0:9.2f} soak: {' '.join(command)}\n")
        self.process = subprocess.Popen(command, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        start_new_session=True)
        readers = [threading.Thread(target=self._reader, args=(stream, name), daemon=True)
                   for stream, name in ((self.process.stdout, "out"),
                                        (self.process.stderr, "err"))]
        for r in readers:
            r.start()
        deadline, open_streams = self.t0 + self.args.timeout_s, 2
        next_poll = next_children = 0.0
        while open_streams or self.process.poll() is None:
            if time.monotonic() > deadline:
                self.timed_out = True
                print(f"soak: timed out after {self.args.timeout_s:.0f}s; stopping the run",
                      flush=True)
                return
            try:
                t, _, line = self.events.get(timeout=POLL_S)
                if line is None:
                    open_streams -= 1
                else:
                    self._handle(t, line)
            except queue.Empty:
                pass
            if time.monotonic() >= next_poll:
                next_poll = time.monotonic() + POLL_S
                self._poll_saved()
                if time.monotonic() >= next_children and self.process.poll() is None:
                    next_children = time.monotonic() + 1.0   # for the cleanup
                    self.worker_pids.update(_children(self.process.pid))
                self._maybe_fault()
            if not open_streams and self.process.poll() is None:
                time.sleep(POLL_S)   # streams closed, the launcher about to exit
        self.returncode = self.process.wait()
        self._poll_saved()
        self.load = (self.load[0], os.getloadavg()[0])

    def cleanup(self):
        """Stop the launcher (it stops its workers) and anything of ours left;
        bounded (the launcher's grace, then SIGKILL) and safe to call twice."""
        if self.process is not None and self.process.poll() is None:
            for pid in _children(self.process.pid):
                self.worker_pids.add(pid)
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=LAUNCH_GRACE_S + 10)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                pass
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()
        # Workers run in sessions of their own (the launcher's design), so the
        # launcher's group does not include them: kill what is left of ours.
        marker = f"--model_dir={self.model_dir}"
        for pid in sorted(self.worker_pids):
            if marker in _cmdline(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        if not self.log.closed:
            self.log.close()


def _phases(f):
    """Where a restart's time went: signal -> the launcher's restart line (the
    old group stopped), -> worker 0's `restored` line (processes, TensorFlow,
    cluster, restore), -> its first progress line (tracing, compiling, a loop)."""
    if f.restart_s is None or f.t_restart is None or f.t_restored is None:
        return "-"
    first_progress = f.t + f.restart_s
    return (f"{f.t_restart - f.t:.1f} / {f.t_restored - f.t_restart:.1f} / "
            f"{first_progress - f.t_restored:.1f}")


def _stats(values, unit="s"):
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.1f} {unit}"
    return (f"median {statistics.median(values):.1f} {unit} (min {min(values):.1f}, "
            f"max {max(values):.1f}; n={len(values)})")


def report(soak, args, step_s, clock, log_path, wall_s):
    from tfdist.observe import hardware

    faults = soak.faults
    kills = [f for f in faults if f.signame == "SIGKILL"]
    terms = [f for f in faults if f.signame == "SIGTERM"]
    resolved = [f for f in faults if f.resumed_from is not None]
    final = soak.summary.get("steps") if soak.summary else None
    term_codes = [c for f in terms for c in f.exit_codes]
    codes_text = ", ".join(f"{c} x{term_codes.count(c)}" for c in sorted(set(term_codes))) or "-"
    resumed = [f.resumed_ok for f in resolved]
    if soak.timed_out:
        outcome = f"timed out after {args.timeout_s:.0f} s (stopped)"
    elif soak.returncode == 0:
        outcome = "finished (exit 0)"
    else:
        outcome = f"failed (tfdist-launch exit {soak.returncode}): {soak.launch_failed or '-'}"
    fault_free_s = soak.train_steps * step_s
    rows = [
        ["hardware", hardware.describe()],
        ["soak window (faults injected)", f"{args.minutes:g} min, seed {args.seed}, "
                                          f"mean interval {args.mean_interval_s:g} s"],
        ["wall time of the run", f"{wall_s / 60:.1f} min (fault-free estimate "
                                 f"{fault_free_s / 60:.1f} min of steps + start-up)"],
        ["outcome", outcome],
        ["steps requested / final", f"{soak.train_steps} / {final if final is not None else '-'}"],
        ["probe speed", f"{step_s:.3f} s/step (global batch {args.global_batch_size})"],
        ["host load (1-min load average, start / end)",
         f"{soak.load[0]:.1f} / {soak.load[1] or os.getloadavg()[0]:.1f} on "
         f"{os.cpu_count()} CPUs"],
        ["faults injected", f"SIGKILL {len(kills)}, SIGTERM {len(terms)}"],
        ["restarts survived", f"{soak.restarts_resumed} of {soak.restart_lines} (training went "
                              f"on after it; max_restarts {args.max_restarts})"],
        ["steps recomputed", f"{sum(f.recomputed or 0 for f in resolved)} "
                             f"(SIGKILL {sum(f.recomputed or 0 for f in kills)}, "
                             f"SIGTERM {sum(f.recomputed or 0 for f in terms)})"],
        ["checkpoint steps went backwards",
         "yes: " + "; ".join(soak.went_backwards[:3]) if soak.went_backwards else "no"],
        ["checkpoint steps vanished",
         "yes: " + "; ".join(soak.vanished[:3]) if soak.vanished else "no"],
        ["restarts resumed at/after last saved step",
         ("yes" if all(resumed) else
          "NO: " + "; ".join(f"fault {f.number}: resumed {f.resumed_from} < saved "
                             f"{f.saved_at_restart}" for f in resolved if not f.resumed_ok))
         if resumed else "-"],
        ["preemption (SIGTERM) exit statuses", codes_text],
        ["restart wall time (signal -> first progress)",
         _stats([f.restart_s for f in resolved])],
        ["  after SIGKILL", _stats([f.restart_s for f in kills if f.restart_s is not None])],
        ["  after SIGTERM", _stats([f.restart_s for f in terms if f.restart_s is not None])],
        ["checkpoints kept at the end", f"{len(soak.seen_saved)} (every {CHECKPOINT_EVERY} "
                                        f"steps, polled every {POLL_S:g} s)"],
        ["anomalies", "; ".join(f"{k}: {len(v)}" for k, v in soak.anomalies.items()) or "none"],
        ["unexplained exits/restarts", len(soak.unexpected)],
    ]
    header = ["measure", "value"]
    fault_header = ["#", "t (s)", "signal", "worker", "step at fault", "last saved",
                    "saved at restart", "resumed from", "recomputed", "exits", "restart (s)",
                    "stop / start+restore / 1st loop (s)", "loss before -> after"]
    fault_rows = [[f.number, f"{f.t:.0f}", f.signame, f.worker, f.stop_step, f.saved_at_fault,
                   f.saved_at_restart if f.saved_at_restart is not None else "-",
                   f.resumed_from if f.resumed_from is not None else "-",
                   f.recomputed if f.recomputed is not None else "-",
                   "; ".join(f.exits) or "-",
                   f"{f.restart_s:.1f}" if f.restart_s is not None else "-",
                   _phases(f),
                   f"{f.loss_before} -> {f.loss_after}"] for f in faults]
    print()
    print(table(rows, header))
    print()
    if fault_rows:
        print(table(fault_rows, fault_header))
        print()
    for name, lines in (("unexplained", soak.unexpected), *soak.anomalies.items()):
        for line in lines[:5]:
            print(f"{name}: {line}")
    description = (
        f"One `tfdist-launch --workers={WORKERS} --max_restarts={args.max_restarts} -- "
        f"tfdist-train --strategy=multi_worker {' '.join(MODEL)} "
        f"--global_batch_size={args.global_batch_size} --steps_per_loop={STEPS_PER_LOOP} "
        f"--checkpoint_every={CHECKPOINT_EVERY}` run (keep all checkpoints), sized by a "
        f"probe to train about {args.minutes:g} min without faults. During the first "
        f"{args.minutes:g} min a random worker got SIGKILL (crash: the group restarts from the "
        f"last periodic checkpoint) or SIGTERM (preemption: all save at one step, exit 143, "
        f"the group restarts), at exponential intervals (mean {args.mean_interval_s:g} s, "
        f"counted from the resume of training). Steps recomputed: the last progress step "
        f"before a SIGKILL (an estimate) or the preempted step, minus the step resumed from. "
        f"The steps of the loop in flight at a SIGKILL are lost too and not counted (up to "
        f"{STEPS_PER_LOOP}). Restart time: signal -> worker 0's first progress line after the "
        f"restart, split into: signal -> the launcher's restart line (old group stopped) / -> "
        f"worker 0's `restored` line (new processes, TensorFlow, cluster, restore) / -> first "
        f"progress (tracing, compiling, one {STEPS_PER_LOOP}-step loop); it grows with the "
        f"machine's load (see the load row).")
    body = f"{description}\n\n{markdown_table(rows, header)}"
    if fault_rows:
        body += f"\n\nFaults:\n\n{markdown_table(fault_rows, fault_header)}"
    section = write_section(NAME, TITLE, body)
    print(section)
    print(f"launcher output: {log_path}")
    print(f"{NAME}: {clock.minutes()}")


def _quiet_import_saved_steps():
    """`tfdist.checkpointing.saved_steps`; TensorFlow's C++ start-up lines
    (printed whatever TF_CPP_MIN_LOG_LEVEL says) go to /dev/null."""
    sys.stderr.flush()
    saved_fd = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            from tfdist.checkpointing import saved_steps
    finally:
        os.dup2(saved_fd, 2)
        os.close(saved_fd)
    return saved_steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5.0,
                        help="how long faults are injected; the run is sized to train about "
                             "this long without faults (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    parser.add_argument("--max_restarts", type=int, default=100,
                        help="tfdist-launch --max_restarts (default 100)")
    parser.add_argument("--mean_interval_s", type=float, default=40.0,
                        help="mean seconds of training between faults (default 40)")
    parser.add_argument("--model_dir", default=None,
                        help="model dir of the run (must hold no checkpoints); default: a "
                             "temporary dir, deleted at the end")
    parser.add_argument("--global_batch_size", type=int, default=512)
    parser.add_argument("--timeout_s", type=float, default=None,
                        help="hard limit for the soak run (default 3 x --minutes + 5 min)")
    args = parser.parse_args()
    if args.minutes <= 0 or args.mean_interval_s <= 0 or args.max_restarts < 0:
        parser.error("--minutes and --mean_interval_s must be > 0, --max_restarts >= 0")
    if args.timeout_s is None:
        args.timeout_s = 3 * args.minutes * 60 + 300

    clock = Clock()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, REPO)
    saved_steps = _quiet_import_saved_steps()

    temporary = args.model_dir is None
    model_dir = tempfile.mkdtemp(prefix="tfdist-soak-") if temporary else \
        os.path.abspath(args.model_dir)
    if not temporary and saved_steps(model_dir):
        parser.error(f"--model_dir={model_dir} already holds checkpoints; the soak needs a "
                     "fresh one")
    log_path = model_dir.rstrip("/") + ".log"

    # Ctrl-C and SIGTERM both end the soak through `finally` (which stops the run).
    def interrupt(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupt)

    # Probe: steps/s of the same run, fault-free, without checkpoints.
    try:
        step_s = step_seconds(run_summary(
            train_command(PROBE_STEPS, None, args), timeout=300 + 10 * PROBE_STEPS))
    except RunFailed as failure:
        sys.exit(f"soak: the probe run {failure}")
    per_ckpt = CHECKPOINT_EVERY
    train_steps = max(4 * per_ckpt, per_ckpt * round(args.minutes * 60 / step_s / per_ckpt))
    print(f"probe: {step_s:.3f} s/step -> {train_steps} steps (~{args.minutes:g} min "
          f"without faults); model dir {model_dir}; launcher output {log_path}", flush=True)
    print_row([args.minutes, args.seed, args.mean_interval_s, args.max_restarts],
              ["minutes", "seed", "mean_interval_s", "max_restarts"])

    soak = Soak(args, model_dir, train_steps, log_path, saved_steps)
    started = time.monotonic()
    try:
        soak.run()
    except KeyboardInterrupt:
        print("soak: interrupted; stopping the run", flush=True)
        soak.cleanup()
        if temporary:
            shutil.rmtree(model_dir, ignore_errors=True)
        sys.exit(130)
    finally:
        soak.cleanup()   # idempotent
    wall_s = time.monotonic() - started
    try:
        report(soak, args, step_s, clock, log_path, wall_s)
    finally:
        if temporary:
            shutil.rmtree(model_dir, ignore_errors=True)
    ok = (soak.returncode == 0 and not soak.went_backwards and not soak.vanished
          and all(f.resumed_ok for f in soak.faults if f.resumed_ok is not None))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
