"""One planner trial process: `python -m tfdist.planner.trial SPEC OUT_DIR`.

SPEC (JSON) holds the runs to make in this process, in order, each a list of
tfdist-train flags, and where the user's `model_fn` / `dataset_fn` are
(`functions.reference`), if any. After each run the process writes
OUT_DIR/run-<task>-<i>.json: its examples/s, loss, step time and this
process's peak memory so far (runs are ordered so that a later run's peak is
its own: a larger batch after a smaller one). Started by `trials.run` alone,
under `tfdist-launch` (one per worker, TF_CONFIG set) or under `horovodrun`
(one per rank).

A process's peak is what its memory cgroup is charged at most: its memory
cgroup's peak where it has one of its own (`tfdist-launch --worker_memory`),
else its anonymous peak (peak resident set less the file pages mapped at the
end: TensorFlow's libraries, about 0.4 GiB, which every process on the host
shares from the page cache, which a cgroup does not charge again once
another process has read them, and which the kernel can drop under a limit).
Measured on one run: peak resident set 721 MiB, cgroup peak 315 MiB,
anonymous 310 MiB.
"""

from __future__ import annotations

import json
import os
import resource
import sys


def _task_index() -> int:
    """This process's place among the trial's: its TF_CONFIG task, or its
    rank under horovodrun."""
    if os.environ.get("HOROVOD_RANK", "").isdigit():
        return int(os.environ["HOROVOD_RANK"])
    try:
        return int(json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0))
    except (ValueError, AttributeError):
        return 0


def _cgroup_peak(own: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """This process's memory cgroup peak when it has a cgroup of its own
    (`tfdist-launch --worker_memory`): cgroup v2's memory.peak, or v1's
    memory.max_usage_in_bytes in its memory hierarchy; else None."""
    if not os.environ.get("TFDIST_WORKER_MEMORY"):
        return None
    try:
        with open(own) as f:
            groups = dict(line.strip().split(":", 2)[1:] for line in f if line.count(":") >= 2)
    except (OSError, ValueError):
        return None
    for hierarchy, path, name in (("memory", f"{root}/memory", "memory.max_usage_in_bytes"),
                                  ("", root, "memory.peak")):
        if hierarchy in groups:
            try:
                with open(f"{path}{groups[hierarchy]}/{name}") as f:
                    return int(f.read())
            except (OSError, ValueError):
                continue
    return None


def _anonymous_peak(status: str = "/proc/self/status") -> int | None:
    """Peak resident bytes less the file-backed and shared resident bytes now
    (Linux's VmHWM - RssFile - RssShmem), else None."""
    try:
        with open(status) as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        kib = {name: int(fields[name].split()[0]) for name in ("VmHWM", "RssFile", "RssShmem")}
    except (OSError, KeyError, ValueError, IndexError):
        return None
    return (kib["VmHWM"] - kib["RssFile"] - kib["RssShmem"]) * 1024


def peak() -> tuple:
    """(this process's peak bytes, how it was measured): see the module's doc."""
    found = _cgroup_peak()
    if found is not None:
        return found, "cgroup"
    found = _anonymous_peak()
    if found is not None:
        return found, "anonymous"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "resident"


def main(argv: list[str]) -> int:
    spec_path, out = argv[1], argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    from tfdist import flags as tfdist_flags   # defines tfdist's flags
    from tfdist.planner import functions
    from tfdist import startup
    user = functions.resolved(spec)
    api = startup.load("api")   # TensorFlow and Keras, frozen (tfdist/startup.py)
    task = _task_index()
    for index, run in enumerate(spec["runs"]):
        config = tfdist_flags.run_config_of(run)
        result = api.train(config, **user)
        summary = result.summary or {}
        peak_bytes, measured_as = peak()
        record = {"examples_per_sec": summary.get("examples_per_sec"),
                  "loss": summary.get("loss"), "peak_bytes": peak_bytes,
                  "peak_measured_as": measured_as,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        with open(os.path.join(out, f"run-{task}-{index}.json"), "w") as f:
            json.dump(record, f)
    return 0


if __name__ == "__main__":
    from tfdist import app
    app.run(main)
