"""The all-reduce alone: TensorFlow's collectives vs Horovod's Gloo, 2 processes.

    .venv/bin/python bench/allreduce.py [--sizes_mb=1,4,21] [--repeats=30]

What `bench/horovod_vs_multi_worker.py` cannot separate from the step: one
summed all-reduce of float32 gradients, 2 processes on this host, each
engine's own way, timed over --repeats calls after two warm-up calls:
  multi_worker  `tf.distribute.MultiWorkerMirroredStrategy` (tfdist-launch):
                the replica context's all_reduce of the gradient list, which
                packs it into one CollectiveReduceV2 (a ring over gRPC)
  horovod       `hvd.grouped_allreduce` of the same list (horovodrun --gloo)
The list has the shapes of the bench mlp's gradients scaled to each size
(21 MB is that mlp: 1024 wide, 3 deep, on 32x32x3 images). Prints, per size,
milliseconds per all-reduce, the algorithm bandwidth (bytes / time) and the
ratio of the two times. Without a Horovod build it prints the multi_worker
rows only. Figures: bench/results/allreduce.md and report.md.

Run time: under a minute (four process starts and a few hundred all-reduces).
"""

import argparse
import json
import math
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import HOROVODRUN, LAUNCH, REPO, Clock, finish, print_row  # noqa: E402

NAME = "allreduce"
TITLE = "The all-reduce alone: TensorFlow collectives vs Horovod (bench/allreduce.py)"
HEADER = ["MB", "multi_worker ms", "horovod ms", "multi_worker GB/s", "horovod GB/s",
          "multi_worker / horovod time"]
MLP_SHAPES = [(3072, 1024), (1024,), (1024, 1024), (1024,), (1024, 1024), (1024,), (1024, 10),
              (10,)]   # 5.26 M float32: 21.0 MB


def shapes_for(megabytes: float) -> list:
    """The mlp's gradient shapes with the first dimension of each matrix scaled
    so the list holds about `megabytes` of float32."""
    scale = megabytes * 1e6 / 4 / sum(math.prod(s) for s in MLP_SHAPES)
    return [(max(1, round(s[0] * scale)), s[1]) if len(s) == 2 else s for s in MLP_SHAPES]


def child(engine: str, sizes: list, repeats: int) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import time

    import tensorflow as tf
    if engine == "horovod":
        import horovod.tensorflow as hvd
        hvd.init()
        rank = hvd.rank()
    else:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        rank = strategy.cluster_resolver.task_id
    for megabytes in sizes:
        shapes = shapes_for(megabytes)
        if engine == "horovod":
            @tf.function
            def reduce(scale):
                return hvd.grouped_allreduce([tf.fill(s, scale) for s in shapes], op=hvd.Sum)
        else:
            @tf.function
            def reduce(scale):
                def replica():
                    return tf.distribute.get_replica_context().all_reduce(
                        tf.distribute.ReduceOp.SUM, [tf.fill(s, scale) for s in shapes])
                return strategy.experimental_local_results(strategy.run(replica))[0]
        scale = tf.constant(1.0)
        for _ in range(2):
            out = reduce(scale)
        assert float(out[0][0, 0]) == 2.0, out[0][0, 0]   # both processes' 1.0 summed
        start = time.perf_counter()
        for _ in range(repeats):
            out = reduce(scale)
        float(out[-1][0])   # the last call has finished
        seconds = (time.perf_counter() - start) / repeats
        nbytes = 4 * sum(int(tf.size(t)) for t in out)
        if rank == 0:
            print(json.dumps({"mb": nbytes / 1e6, "ms": seconds * 1e3}), flush=True)


def run(command: list, timeout: float) -> list:
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    found = []
    for line in result.stdout.splitlines():
        text = line.split("]", 1)[-1].split(">:", 1)[-1].strip()   # launcher / horovodrun prefix
        if text.startswith("{"):
            found.append(json.loads(text))
    if result.returncode != 0 or not found:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"exit {result.returncode}: {tail[:200]}")
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes_mb", default="1,4,21")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--child", choices=["multi_worker", "horovod"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [float(s) for s in args.sizes_mb.split(",")]
    if args.child:
        child(args.child, sizes, args.repeats)
        return
    me = [sys.executable, os.path.abspath(__file__), f"--sizes_mb={args.sizes_mb}",
          f"--repeats={args.repeats}"]
    clock = Clock()
    tf_rows = run([LAUNCH, "--workers=2", "--", *me, "--child=multi_worker"], args.timeout)
    horovod = os.path.exists(HOROVODRUN)
    hvd_rows = run([HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", *me,
                    "--child=horovod"], args.timeout) if horovod else [{}] * len(tf_rows)
    rows = []
    for mine, theirs in zip(tf_rows, hvd_rows):
        ms, hms = mine["ms"], theirs.get("ms")
        row = [f"{mine['mb']:.1f}", f"{ms:.1f}", f"{hms:.1f}" if hms else "not built",
               f"{mine['mb'] / ms:.2f}", f"{mine['mb'] / hms:.2f}" if hms else "-",
               f"{ms / hms:.2f}" if hms else "-"]
        rows.append(row)
        print_row(row, HEADER)
    body = ("2 processes on one host, one summed all-reduce of a float32 gradient list (the "
            "bench mlp's shapes, scaled), timed over "
            f"{args.repeats} calls after 2 warm-up calls. multi_worker: MultiWorkerMirrored"
            "Strategy's all_reduce (one packed CollectiveReduceV2, ring over gRPC); horovod: "
            "hvd.grouped_allreduce over Gloo. GB/s: bytes reduced / time.")
    if not horovod:
        body += " Horovod is not built on this machine (`make horovod` builds it)."
    finish(NAME, TITLE, body, rows, HEADER, clock)


if __name__ == "__main__":
    main()
