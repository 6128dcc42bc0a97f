"""Multi-worker scaling: per-worker throughput of 2 workers vs 1 worker.

    .venv/bin/python bench/scaling.py [--seconds=S] [--steps=N] [--per_worker_batch=B]
        [--models=mlp,transformer] [--timeout=T]

Every variant uses MultiWorkerMirroredStrategy through tfdist-launch on this
host, synthetic data (so input pipelines don't blur the picture) and the same
per-worker batch. A ratio of 1.0 would be perfect weak scaling; on a 2-core
host two workers also share the cores, so the ratio mostly shows how much
the cross-worker all-reduce and the core sharing cost.

Runs are sized by time: per model, a short probe of the first variant
(PROBE_STEPS steps) gives its step time, and every variant of that model then
trains the same number of steps, about --seconds of timed loops for the first
(the first loop of each run compiles and is not timed). --steps=N trains
exactly N steps (N/4 per loop) instead. A run still going after --timeout
seconds is stopped and its row says `timed out`. Each row is printed when
measured; the table also goes to bench/results/scaling.md and report.md.

To compare another setting, add a variant to VARIANTS: (label, workers,
extra tfdist-train flags); its ratio is against the first variant.

Run time: about 2.5 minutes on this 2-core Xeon (AVX-512) at the defaults,
estimated from tiny runs (~15 s to start a 1-worker run, ~25 s a 2-worker one).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    LAUNCH, MODELS, TRAIN, Clock, finish, print_row, run_sizing, run_summary, RunFailed)

# (label, workers, extra tfdist-train flags); ratios are against the first.
VARIANTS = [
    ("1 worker", 1, []),
    ("2 workers", 2, []),
    ("2 workers, 4 MB buckets", 2, ["--reduce_bucket_mb=4"]),
]
HEADER = ["model", "variant", "workers", "steps", "ex/s", "ex/s per worker",
          "per worker vs 1st"]


def command(model_flags, workers, extra, per_worker_batch, train_steps, per_loop):
    return [LAUNCH, f"--workers={workers}", "--", TRAIN, "--strategy=multi_worker",
            "--synthetic", f"--train_steps={train_steps}", f"--steps_per_loop={per_loop}",
            f"--global_batch_size={per_worker_batch * workers}", *model_flags, *extra]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0,
                        help="timed seconds per run of the first variant (after its compiling "
                             "loop); the others train as many steps")
    parser.add_argument("--steps", type=int, default=None,
                        help="train exactly this many steps per run instead (N/4 per loop)")
    parser.add_argument("--per_worker_batch", type=int, default=64)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--timeout", type=float, default=180,
                        help="seconds after which one run is stopped and reported as timed out")
    args = parser.parse_args()
    clock, rows = Clock(), []
    for name in args.models.split(","):
        model_flags = MODELS[name]
        label, workers, extra = VARIANTS[0]
        sizing = run_sizing(args, lambda steps, loop: command(
            model_flags, workers, extra, args.per_worker_batch, steps, loop), f"{name} ({label})")
        first = None   # the first variant's examples/sec per worker
        for index, (label, workers, extra) in enumerate(VARIANTS):
            try:
                if isinstance(sizing, RunFailed):
                    raise RunFailed(f"probe {sizing}")
                s = run_summary(command(model_flags, workers, extra, args.per_worker_batch,
                                        *sizing), args.timeout)
                per_worker = s["examples_per_sec"] / workers
                first = per_worker if index == 0 else first
                cells = [f"{s['examples_per_sec']:.0f}", f"{per_worker:.0f}",
                         f"{per_worker / first:.2f}" if first else "-"]
            except RunFailed as failure:
                cells = [str(failure), "-", "-"]
            row = [name, label, workers,
                   sizing[0] if not isinstance(sizing, RunFailed) else "-", *cells]
            rows.append(row)
            print_row(row, HEADER)
    how = (f"{args.steps} steps per run" if args.steps else
           f"steps per model sized by a probe for about {args.seconds:g} s of timed loops in "
           f"the first variant")
    body = (f"MultiWorkerMirroredStrategy via tfdist-launch on one host, synthetic data, "
            f"per-worker batch {args.per_worker_batch} (global = per-worker x workers); "
            f"{how}, the first loop (compiling) not timed. `per worker vs 1st`: per-worker "
            "examples/sec against the first variant (1.0 = perfect weak scaling; workers "
            "share this host's cores).")
    finish("scaling", "Multi-worker scaling (bench/scaling.py)", body, rows, HEADER, clock)


if __name__ == "__main__":
    main()
