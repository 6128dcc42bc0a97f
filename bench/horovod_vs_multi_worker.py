"""Horovod vs MultiWorkerMirroredStrategy, 2 processes each, same model and batch.

    .venv/bin/python bench/horovod_vs_multi_worker.py [--seconds=S] [--steps=N]
        [--global_batch=B] [--models=mlp,transformer] [--timeout=T]

Both engines run the same tfdist trainer on synthetic data; only the
collective layer differs (Horovod's Gloo grouped all-reduce vs TensorFlow's
collective ops). Prints examples/sec of each and the ratio horovod /
multi_worker. Without a Horovod build (no .venv/bin/horovodrun; `make horovod`
builds it) it prints one line, writes a section saying so and exits 0.

Runs are sized by time: per model, a short multi_worker probe (PROBE_STEPS
steps) gives the step time, and both engines then train the same number of
steps, about --seconds of timed loops (the first loop of each run compiles
and is not timed). --steps=N trains exactly N steps (N/4 per loop) instead.
A run still going after --timeout seconds is stopped and its row says
`timed out`. Each row is printed when measured; the table also goes to
bench/results/horovod_vs_multi_worker.md and report.md.

Run time: about 3 minutes on this 2-core Xeon (AVX-512) at the defaults,
estimated from tiny runs (~25-30 s to start a 2-process run of either engine).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    HOROVODRUN, LAUNCH, MODELS, REPO, TRAIN, Clock, finish, print_row, run_sizing, run_summary,
    RunFailed, write_section)

NAME = "horovod_vs_multi_worker"
TITLE = "Horovod vs multi_worker (bench/horovod_vs_multi_worker.py)"
# (engine, launcher + trainer command); ratios are against the first.
ENGINES = [
    ("multi_worker", [LAUNCH, "--workers=2", "--", TRAIN, "--strategy=multi_worker"]),
    ("horovod", [HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", TRAIN,
                 "--strategy=horovod"]),
    # Bucketed reductions (--reduce_bucket_mb): collectives issued during the
    # backward pass instead of one after it.
    ("multi_worker, 4 MB buckets", [LAUNCH, "--workers=2", "--", TRAIN,
                                    "--strategy=multi_worker", "--reduce_bucket_mb=4"]),
    ("horovod, 4 MB buckets", [HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", TRAIN,
                               "--strategy=horovod", "--reduce_bucket_mb=4"]),
]
HEADER = ["model", "engine", "steps", "ex/s", "vs multi_worker"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0,
                        help="timed seconds per run (after its compiling loop), sized on "
                             "multi_worker; horovod trains as many steps")
    parser.add_argument("--steps", type=int, default=None,
                        help="train exactly this many steps per run instead (N/4 per loop)")
    parser.add_argument("--global_batch", type=int, default=128)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--timeout", type=float, default=180,
                        help="seconds after which one run is stopped and reported as timed out")
    args = parser.parse_args()
    if not os.path.exists(HOROVODRUN):
        print(f"{NAME}: skipped: Horovod is not built ({os.path.relpath(HOROVODRUN, REPO)} is "
              "missing; `make horovod` builds it)", flush=True)
        write_section(NAME, TITLE, "Not measured: Horovod is not built on this machine "
                      "(`make horovod` builds it).")
        return
    clock, rows = Clock(), []
    for name in args.models.split(","):
        def command(engine, train_steps, per_loop):
            return [*engine, "--synthetic", f"--train_steps={train_steps}",
                    f"--steps_per_loop={per_loop}", f"--global_batch_size={args.global_batch}",
                    *MODELS[name]]

        sizing = run_sizing(args, lambda steps, loop: command(ENGINES[0][1], steps, loop),
                            f"{name} ({ENGINES[0][0]})")
        first = None   # the first engine's examples/sec
        for index, (engine, launch) in enumerate(ENGINES):
            try:
                if isinstance(sizing, RunFailed):
                    raise RunFailed(f"probe {sizing}")
                eps = run_summary(command(launch, *sizing), args.timeout)["examples_per_sec"]
                first = eps if index == 0 else first
                cells = [f"{eps:.0f}", f"{eps / first:.2f}" if first else "-"]
            except RunFailed as failure:
                cells = [str(failure), "-"]
            row = [name, engine, "-" if isinstance(sizing, RunFailed) else sizing[0], *cells]
            rows.append(row)
            print_row(row, HEADER)
    how = (f"{args.steps} steps per run" if args.steps else
           f"steps per model sized by a multi_worker probe for about {args.seconds:g} s of "
           "timed loops")
    body = (f"2 processes on one host (tfdist-launch for multi_worker, `horovodrun --gloo` for "
            f"horovod), synthetic data, global batch {args.global_batch}; {how}, the first "
            "loop (compiling) not timed.")
    finish(NAME, TITLE, body, rows, HEADER, clock)


if __name__ == "__main__":
    main()
