"""Probe (issue 22): two pipeline stages, each its own client, passing the
boundary tensors point to point.

    python bench/pipeline_p2p_probe.py [--microbatches 8] [--schedules gpipe,1f1b]
        [--inter_op 1] [--nocomm]

bench/pipeline_probe.py found that one client running a function on two
remote tasks runs their parts one after the other. Here each stage is a
process of its own (pinned with taskset to core 0 or 1, one intra-op
thread), a MultiWorkerMirroredStrategy worker of a 2-process TF_CONFIG
cluster only so that TensorFlow's collectives are set up, running its own
traced step on a GPipe (every forward, then every backward) or 1F1B
schedule (`schedule()`), its items chained in order with control
dependencies. Stage 0 sends each micro-batch's activations
to stage 1 and stage 1 sends back their gradient with
`CollectiveBcastSendV2`/`CollectiveBcastRecvV2` in a 2-member group (a point-
to-point transfer). The model is bench/pipeline_probe.py's (three 1024x1024
dense layers per stage, global batch 512). Prints each stage's ms/step for
M=1 and M micro-batches (ideal for S=2, M=8: 1.78x faster). `--nocomm`
replaces every transfer with a local tensor: each stage's own compute time.

Then each stage's items of the last step, duration in ms (each item starts
after its timestamp). Each stage's median ms/step over 9 steps.

Measured on the 2-core AMD EPYC (no AMX). With 4 inter-op threads per stage
process (its one core), nothing overlapped: M=1 96-114 ms, GPipe M=8 104-132
ms, 1F1B M=8 117-123 ms, while each stage's own compute (--nocomm) is 51-72
ms: every item ran 1.5-3x slower beside the transfers than alone. Not the
hardware (two clients running the same backward-like work on the two cores
at once ran at full speed each, 34-38 against 35 ms) nor the transfers (8 of
256 KiB take 3 ms); my reading, not verified: the idle inter-op threads'
spin-waiting takes the core from the compute while a stage waits for a
tensor. With one inter-op thread (the default here), 1F1B overlaps: M=8
83-107 ms against M=1 95-106 ms in six runs, 1.0-1.26x (ideal 1.78x); its
timeline's steady state alternates stage 1's forward (3.4 ms) and backward
(5.5 ms) with stage 0's (2.1 and 6.5 ms) at the same time. GPipe got worse
with one thread (135 ms). The gap to 1.4x is the next thing for issue 22.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipeline_probe import B, L, W, _free_port, schedule  # noqa: E402


def stage(index: int, microbatches: int, nocomm: bool, kind: str, inter_op: int,
          repeats: int = 9) -> None:
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(inter_op)
    tf.distribute.MultiWorkerMirroredStrategy()   # sets up the collectives only
    ws = [tf.Variable(tf.random.normal([W, W], stddev=0.02, seed=index * 10 + i))
          for i in range(L)]
    grads = [tf.Variable(tf.zeros([W, W])) for _ in range(L)]
    m, rows = microbatches, B // microbatches

    def forward(h):
        for w in ws:
            h = tf.nn.relu(h @ w)
        return h

    def send(t, key):
        if nocomm:
            return tf.identity(t)
        return tf.raw_ops.CollectiveBcastSendV2(input=t, group_size=2, group_key=1,
                                               instance_key=key, communication_hint="ring")

    def recv(key):
        if nocomm:
            return tf.random.normal([rows, W]) + tf.cast(key, tf.float32) * 0
        return tf.raw_ops.CollectiveBcastRecvV2(group_size=2, group_key=1, instance_key=key,
                                               shape=[rows, W], T=tf.float32,
                                               communication_hint="ring")

    order = schedule(m, kind)[index]

    @tf.function(autograph=False)
    def step(x, base):
        # Each item's [start, end] from tf.timestamp: automatic control
        # dependencies chain the timestamps in program order, which here is
        # this stage's schedule order (the other stage is another process).
        xs = tf.split(x, m)
        last, sent, tapes, ins, outs, stamps = None, [], {}, {}, {}, []
        for what, i in order:
            with tf.control_dependencies([last] if last is not None else []):
                stamps.append(tf.timestamp())
            with tf.control_dependencies([stamps[-1]]):   # the item starts after it
                if what == "F":
                    h_in = tf.identity(xs[i]) if index == 0 else recv(base * 1000 + i)
                    with tf.GradientTape() as tape:
                        tape.watch(h_in)
                        out = forward(h_in)
                        if index == 1:
                            out = tf.reduce_mean(out * out) / m
                    tapes[i], ins[i], outs[i] = tape, h_in, out
                    if index == 0:
                        sent.append(send(out, base * 1000 + i))
                    last = out
                elif index == 1:
                    *g, dh = tapes[i].gradient(outs[i], ws + [ins[i]])
                    sent.append(send(dh, base * 1000 + 500 + i))
                    last = tf.group(*[a.assign_add(gg) for a, gg in zip(grads, g)])
                else:
                    dh = recv(base * 1000 + 500 + i)
                    g = tapes[i].gradient(outs[i], ws, output_gradients=dh)
                    last = tf.group(*[a.assign_add(gg) for a, gg in zip(grads, g)])
            with tf.control_dependencies([last]):
                stamps.append(tf.timestamp())
        with tf.control_dependencies([last] + sent):
            return tf.reshape(tf.stack(stamps), [-1, 2])

    x = tf.random.normal([B, W], seed=7)
    step(x, tf.constant(0)).numpy()
    times = []
    for r in range(repeats):
        start = time.perf_counter()
        stamps = step(x, tf.constant(r + 1)).numpy()
        times.append(time.perf_counter() - start)
    times.sort()
    print(f"stage {index} {kind} M={m}{' (no transfers)' if nocomm else ''}: median "
          f"{times[len(times) // 2] * 1e3:.1f} ms/step (fastest {times[0] * 1e3:.1f})",
          flush=True)
    # The last step's items, wall-clock seconds (both processes share the clock).
    items = [f"{what}{i} {a:.4f}-{b:.4f}" for (what, i), (a, b) in zip(order, stamps)]
    print(f"timeline stage {index} {kind} M={m}: {json.dumps(items)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--nocomm", action="store_true")
    parser.add_argument("--schedules", default="gpipe,1f1b")
    parser.add_argument("--inter_op", type=int, default=1,
                        help="each stage process's inter-op threads (on its one core)")
    parser.add_argument("--stage", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage is not None:
        return stage(args.stage, args.microbatches, args.nocomm, args.schedules, args.inter_op)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tfdist.observe import hardware
    print(f"# pipeline point-to-point probe on {hardware.describe()}", flush=True)
    runs = [("gpipe", 1)] + [(kind, args.microbatches) for kind in args.schedules.split(",")]
    for kind, m in runs:   # (M=1 is the same under both schedules)
        addresses = [f"localhost:{_free_port()}" for _ in range(2)]
        procs = []
        for index in range(2):
            env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_CONFIG=json.dumps(
                {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}}))
            procs.append(subprocess.Popen(
                ["taskset", "-c", str(index), sys.executable, os.path.abspath(__file__),
                 f"--stage={index}", f"--microbatches={m}", f"--schedules={kind}",
                 f"--inter_op={args.inter_op}"]
                + (["--nocomm"] if args.nocomm else []), env=env))
        for proc in procs:
            proc.wait(timeout=300)


if __name__ == "__main__":
    main()
