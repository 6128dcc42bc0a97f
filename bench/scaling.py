"""Multi-worker scaling: per-worker throughput of 2 workers vs 1 worker.

    .venv/bin/python bench/scaling.py [--steps=N] [--per_worker_batch=B]

Both runs use MultiWorkerMirroredStrategy through tfdist-launch on this host,
synthetic data (so input pipelines don't blur the picture) and the same
per-worker batch. A ratio of 1.0 would be perfect weak scaling; on a 2-core
host two workers also share the cores, so the ratio mostly shows how much
the cross-worker all-reduce and the core sharing cost.
"""

import argparse

from common import LAUNCH, MODELS, TRAIN, summary, table


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--per_worker_batch", type=int, default=64)
    args = parser.parse_args()
    rows = []
    for name, model_flags in MODELS.items():
        per_worker = {}
        for workers in (1, 2):
            s = summary([LAUNCH, f"--workers={workers}", "--", TRAIN, "--strategy=multi_worker",
                         "--synthetic", f"--train_steps={args.steps}", "--steps_per_loop=50",
                         f"--global_batch_size={args.per_worker_batch * workers}",
                         *model_flags])
            per_worker[workers] = s["examples_per_sec"] / workers
        rows.append([name, f"{per_worker[1]:.0f}", f"{per_worker[2]:.0f}",
                     f"{per_worker[2] / per_worker[1]:.2f}"])
    print(f"multi_worker scaling, per-worker batch {args.per_worker_batch}, synthetic data")
    print(table(rows, ["model", "1 worker ex/s", "2 workers ex/s per worker", "ratio 2w/1w"]))


if __name__ == "__main__":
    main()
