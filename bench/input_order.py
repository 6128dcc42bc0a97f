"""What the one global order costs the input pipeline: `--autoshard=global`
(every worker reads every record and shuffles the stored bytes, and decodes
only its own rows of each global batch) against `--autoshard=data` (each
worker reads and decodes its own examples), on the bundled image dataset
(`tfdist_shapes`, 32x32x3 PNGs), side by side in one process.

For N workers, pipeline 0 of N is timed alone (what one worker's input
pipeline delivers; on real hosts the N run in parallel): global batches per
second it keeps up with, for each mode, interleaved over repeats (median).
Then the resume: the time to the first batch of a run restored at the last
batch of an epoch (the global order re-reads up to its position).

    python bench/input_order.py [--batches=N] [--repeats=N]
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402
from tfdist.data import inputs as inputs_lib  # noqa: E402
from tfdist.data import tfds_inputs  # noqa: E402

GLOBAL_BATCH = 128
WORKERS = (1, 2, 4)


def pipeline(inputs, mode, workers, start_example=0):
    fn = inputs_lib.train_dataset_fn(inputs, global_batch_size=GLOBAL_BATCH, seed=42,
                                     shuffle_buffer=10_000, global_order=mode == "global",
                                     start_example=start_example)
    return fn(tf.distribute.InputContext(workers, 0, workers))


def batches_per_second(inputs, mode, workers, batches):
    iterator = iter(pipeline(inputs, mode, workers))
    next(iterator)   # the shuffle buffer's first fill is not a steady state
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    clock = common.Clock()
    print(common.hardware_header(), flush=True)
    data = tfdist.DataConfig(dataset="tfdist_shapes")
    inputs = tfds_inputs.load(data)
    examples = inputs.split_size("train", 1, 0)
    header = ["workers", "global: batches/s per worker", "data: batches/s per worker",
              "global / data"]
    rows = []
    for workers in WORKERS:
        found = {"global": [], "data": []}
        for _ in range(args.repeats):
            for mode in found:
                found[mode].append(batches_per_second(inputs, mode, workers, args.batches))
        g, d = statistics.median(found["global"]), statistics.median(found["data"])
        rows.append([workers, f"{g:.1f}", f"{d:.1f}", f"{g / d:.2f}"])
        common.print_row(rows[-1], header)
    # The resume: the first batch at the last full batch of the first epoch.
    last = (examples // GLOBAL_BATCH - 1) * GLOBAL_BATCH
    start = time.perf_counter()
    next(iter(pipeline(inputs, "global", 2, start_example=last)))
    restore = time.perf_counter() - start
    start = time.perf_counter()
    next(iter(pipeline(inputs, "global", 2)))
    fresh = time.perf_counter() - start
    description = (
        f"The training input of one worker of N, global batch {GLOBAL_BATCH}, shuffle buffer "
        f"10000, `tfdist_shapes` ({examples} training images; the global order decodes only a worker's own rows), "
        f"{args.batches} batches per measurement, the median of {args.repeats} interleaved "
        "repeats. Under the global order every worker reads the whole stream, so its input "
        "rate in global batches per second stays that of one worker, while per-worker "
        "sharding divides the work by N. First batch of a run resumed at example "
        f"{last} (the last batch of epoch 0, 2 workers): {restore:.2f} s, against "
        f"{fresh:.2f} s for a fresh start.")
    common.finish("input_order", "The one global order: input cost per worker", description,
                  rows, header, clock)


if __name__ == "__main__":
    main()
