"""Several tests/mw_worker.py runs, one after the other, in one process per rank.

Run by tests/integration/test_horovod.py under one horovodrun (a horovodrun is the
expensive unit: seconds of TensorFlow start-up per rank):
    horovodrun ... python tests/hvd_driver.py JOBS_JSON
JOBS_JSON is a list of [NAME, OUT_DIR, STEPS, TRAIN_OVERRIDES_JSON]; each job is
exactly `python tests/mw_worker.py OUT_DIR horovod STEPS TRAIN_OVERRIDES_JSON`
(a whole `tfdist.train`: a fresh engine, model and optimizer from
OUT_DIR/initial.npz, its weights written to OUT_DIR/weights-<rank>.npz). Each
job is bracketed by the lines `hvd_driver: begin NAME` and `hvd_driver: end
NAME` on stdout and stderr, so a test can tell each job's output apart. A job
that fails ends the process as mw_worker.py does (one `fault:` line, exit
status 1): the jobs after it do not run.

A job with a "task" imports tests/integration/test_tasks.py, which (through conftest.py)
splits the CPU into 4 virtual devices, as it does in mw_worker.py's process;
that must happen before TensorFlow's runtime starts, so the driver imports it
first when any job has a task (the Horovod engine uses the first CPU device
either way).

Horovod stays initialised from the first job to the end of the last one: the
engine's `close` (hvd.shutdown) is skipped between jobs, so the next job's
`setup` (hvd.init) finds it initialised. Shutting Horovod down and
initialising it again under one static horovodrun races in Horovod 0.28.1's
rendezvous server (a rank that finishes its rendezvous first can reset the
bookkeeping of the other's, leaving stale peer addresses for the next init):
seen as a rank aborting (exit 134) in the next job's hvd.init.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mw_worker  # noqa: E402


def _mark(text):
    for stream in (sys.stdout, sys.stderr):
        print(f"hvd_driver: {text}", file=stream, flush=True)


def main(jobs):
    jobs = json.loads(jobs)
    if any("task" in json.loads(overrides) for *_, overrides in jobs):
        import test_tasks  # noqa: F401  (before any TensorFlow op: see above)
    from tfdist.strategies.horovod.engine import HorovodStrategy
    close = HorovodStrategy.close
    HorovodStrategy.close = lambda self: None   # see above
    for index, (name, out_dir, steps, overrides) in enumerate(jobs):
        if index == len(jobs) - 1:
            HorovodStrategy.close = close   # the last job shuts Horovod down
        _mark(f"begin {name}")
        mw_worker.main(out_dir, "horovod", steps, overrides)
        _mark(f"end {name}")


if __name__ == "__main__":
    from tfdist import app, startup
    startup.load("api")   # as tfdist's own processes load TensorFlow (frozen)
    app.run(lambda argv: main(*argv[1:]))
