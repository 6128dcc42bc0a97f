"""Trials: candidates run for real in child processes (`trial.py`), started
as their engine's processes start (one process; `tfdist-launch --workers=N`
for a TF_CONFIG cluster; `horovodrun -np N` for Horovod's ranks), bounded in
time and, when asked, in memory (`tfdist-launch --worker_memory`), their
examples/s and each process's peak read back. A trial that fails, is
OOM-killed or runs out of time is a result with a one-line reason."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

from tfdist import strategies
from tfdist.errors import UsageError
from tfdist.strategies import records


# The bound of the longest process the planner starts, besides calibration's
# (half the search's seconds): a probe (the slowest, the 24-layer mlp at
# ZeRO-3 in 8 micro-batches, took 97 s alone on 2 cores); a trial's is lower.
LONGEST_S = 300.0


@dataclasses.dataclass
class TrialResult:
    ok: bool
    reason: str                       # "" when ok, else one line
    seconds: float
    runs: list                        # per run of the chief: its record (trial.py)
    peaks: list                       # per process: its peak bytes (last run; trial.py)

    @property
    def examples_per_sec(self) -> Optional[float]:
        return self.runs[-1].get("examples_per_sec") if self.runs else None


def _launcher() -> str:
    return records.executable("tfdist-launch",
                              "reinstall tfdist (make install) to run multi-process trials")


def _launch_of(flags: list) -> str:
    """How the engine a run's flags name starts its processes."""
    name = next((f.split("=", 1)[1] for f in flags if f.startswith("--strategy=")),
                strategies.REFERENCE)
    return strategies.engine(name).launch


def command(runs: list, processes: int, cap: Optional[int], spec: str, out: str) -> list:
    """The trial's command: trial.py alone, or under the launcher its engine
    needs for `processes` (or a cap). Horovod's ranks cannot be capped one
    by one (horovodrun starts them): a UsageError."""
    cmd = [sys.executable, "-m", "tfdist.planner.trial", spec, out]
    if processes > 1 and _launch_of(runs[0]) == records.HOROVODRUN:
        if cap:
            raise UsageError("a memory cap per process needs tfdist-launch's processes; "
                             "horovodrun starts Horovod's ranks itself")
        tool, *words = records.local_launcher(records.HOROVODRUN, processes)
        return [records.executable(tool, "build Horovod with `make horovod`"), *words, *cmd]
    if processes > 1 or cap:
        return [_launcher(), f"--workers={processes}",
                *([f"--worker_memory={cap}"] if cap else []), "--", *cmd]
    return cmd


def run(runs: list, *, processes: int = 1, functions: Optional[dict] = None,
        cap: Optional[int] = None, timeout: float = 120.0,
        work_dir: Optional[str] = None) -> TrialResult:
    """Start one trial: `runs` (lists of tfdist-train flags) in order in each
    of `processes` processes; wait at most `timeout` seconds."""
    out = tempfile.mkdtemp(prefix="trial-", dir=work_dir)
    spec = os.path.join(out, "spec.json")
    with open(spec, "w") as f:
        json.dump({"runs": runs, **(functions or {})}, f)
    try:
        cmd = command(runs, processes, cap, spec, out)
    except UsageError as error:
        return TrialResult(ok=False, reason=str(error), seconds=0.0, runs=[], peaks=[])
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    log_path = os.path.join(out, "log")
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
            late = False
        except subprocess.TimeoutExpired:
            _stop(proc)
            rc, late = proc.returncode, True
    seconds = time.monotonic() - start
    runs = [_read(p) for p in sorted(glob.glob(os.path.join(out, "run-0-*.json")),
                                     key=lambda p: int(p.rsplit("-", 1)[1].split(".")[0]))]
    peaks = []
    for task in range(processes):
        mine = sorted(glob.glob(os.path.join(out, f"run-{task}-*.json")))
        if mine:
            record = _read(mine[-1])
            peaks.append(record["peak_bytes"])
    ok = rc == 0 and not late and len(runs) == len(_expected(out))
    reason = "" if ok else (f"did not finish in {timeout:.0f} s" if late
                            else _reason(log_path, rc))
    return TrialResult(ok=ok, reason=reason, seconds=seconds, runs=runs, peaks=peaks)


def _expected(out: str) -> list:
    with open(os.path.join(out, "spec.json")) as f:
        return json.load(f)["runs"]


def _read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _stop(proc: subprocess.Popen) -> None:
    """The trial's whole process group: SIGTERM, then SIGKILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _reason(log_path: str, rc: int) -> str:
    """The one line that says why a trial failed: the launcher's, an error
    line, else the last line, else the exit status."""
    with open(log_path, errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    for prefix in ("tfdist-launch:", "error:", "tfdist-train:", "trial.py:"):
        found = [line for line in lines if line.startswith(prefix)]
        if found:
            return found[-1]
    if rc < 0:
        return f"killed by signal {-rc}"
    return lines[-1][:300] if lines else f"exit status {rc}"
