"""Probe (issue 22): can two pipeline stages, each a process on its own core,
overlap their *backward* passes when one client drives them?

    python bench/pipeline_probe.py [--modes graph,calls,gpipe,1f1b,gpipe-nostamps,
                                            1f1b-nostamps,independent] [--microbatches 8]

Two stage servers (`tf.distribute.Server`, one intra-op thread, pinned with
taskset to cores 0 and 1) and a client that connects to them
(`tf.config.experimental_connect_to_cluster`). The model is the one of
../shared/probes/pipeline_processes.py: per stage three 1024x1024 dense layers
(relu), global batch 512, a squared-output loss. Each mode times a whole
training step's gradients (no optimizer update: the same in every mode) for
M=1 (no pipelining) and M micro-batches, and prints the speed-up (ideal for
S=2, M=8: 16/9 = 1.78x):

- `graph`: the whole step in one `tf.function` (GPipe: all forwards, then all
  backwards; a tape per stage and micro-batch, the boundary gradient passed
  back with `output_gradients`): TensorFlow's dataflow executor on each task
  decides what runs when. The shared probe measured 1.02x here.
- `calls`: a schedule of small per-stage functions called from the client in
  asynchronous eager mode: `forward0(x_i) -> h_i` on task 0,
  `forward_backward1(h_i) -> dh_i` on task 1 (the last stage's forward and
  backward in one call, its gradients accumulated in place), and
  `backward0(x_i, dh_i)` on task 0 (recomputing stage 0's forward from x_i,
  as GPipe does, so no activation is kept between calls). Each task runs its
  calls in the order the client issued them, and a call waits only for its
  inputs, so stage 1's work on micro-batch i overlaps stage 0's on i+1.
  The order is 1F1B-like on task 0: forward0 of i+1 is issued before
  backward0 of i.

- `gpipe`, `1f1b`: one traced step again, but each stage's items (forward or
  backward of one micro-batch) are chained with control dependencies in the
  schedule's order, so each task runs its stage's schedule rather than
  whatever is ready. With per-item `tf.timestamp`s for the timeline; the
  `-nostamps` variants leave them out, because timestamps are stateful ops
  that tf.function's automatic control dependencies chain in build order,
  across stages (which serialises the stages by itself).
- `independent`: no pipeline at all: one traced function holding two
  independent chains of 40 matmuls, one on each task, against each chain
  alone. Measured here: 203-215 ms against 105-112 ms each (the sum: the two
  tasks never ran at the same time), while two clients driving one task each
  ran both chains at once in 105 ms each, so the cores are independent: a
  function one client runs on two remote tasks runs their parts one after
  the other. `bench/pipeline_p2p_probe.py` tries the other way (each stage
  its own client).

Each call's start and end on its task (wall time, from `tf.timestamp()` inside
the function) give the per-stage timeline and the measured bubble fraction:
1 - busy / (stages x makespan). Prints one line per mode and M.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

# Each stage's items in schedule order (also what bench/pipeline_p2p_probe.py imports).
from tfdist.pipeline.schedule import schedule

W, L, B = 1024, 3, 512


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def server(index: int, cluster: dict) -> None:
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name="worker", task_index=index,
                         protocol="grpc").join()


def client(cluster: dict, modes: list, microbatches: int, repeats: int) -> None:
    import tensorflow as tf
    tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(cluster), job_name="client")
    devs = [f"/job:worker/replica:0/task:{s}/device:CPU:0" for s in range(2)]
    ws = []
    for s in range(2):
        with tf.device(devs[s]):
            ws.append([tf.Variable(tf.random.normal([W, W], stddev=0.02, seed=s * 10 + i))
                       for i in range(L)])
    grads = []
    for s in range(2):
        with tf.device(devs[s]):
            grads.append([tf.Variable(tf.zeros([W, W])) for _ in range(L)])

    def forward(s, x):
        for w in ws[s]:
            x = tf.nn.relu(x @ w)
        return x

    # -- graph: one traced step ------------------------------------------------
    def make_graph(m):
        @tf.function
        def step(x):
            with tf.device(devs[0]):
                xs = tf.split(x, m)
            acts, tapes0, tapes1 = [], [], []
            for xb in xs:
                with tf.device(devs[0]):
                    with tf.GradientTape() as t0:
                        h = forward(0, xb)
                with tf.device(devs[1]):
                    with tf.GradientTape() as t1:
                        t1.watch(h)
                        y = forward(1, h)
                        loss = tf.reduce_mean(y * y) / m
                acts.append(h), tapes0.append(t0), tapes1.append((t1, loss))
            for i in range(m):
                t1, loss = tapes1[i]
                with tf.device(devs[1]):
                    *g1, dh = t1.gradient(loss, ws[1] + [acts[i]])
                    for acc, g in zip(grads[1], g1):
                        acc.assign_add(g)
                with tf.device(devs[0]):
                    g0 = tapes0[i].gradient(acts[i], ws[0], output_gradients=dh)
                    for acc, g in zip(grads[0], g0):
                        acc.assign_add(g)
            return tf.constant(0.0)
        return step

    # -- ordered: one traced step, each stage's work chained in schedule order ----
    def make_ordered(m, kind, stamped, labels):
        """Builds the ops of each stage's schedule in an order that respects the
        data (F0 -> F1 -> B1 -> B0 per micro-batch), each under a control
        dependency on the same stage's previous item, so each task's executor
        runs its stage's items in schedule order instead of whatever is ready
        (e.g. every micro-batch's first layer before any second layer).
        `labels` gets each item's (stage, kind, micro-batch) in build order,
        the order of the returned [start, end] rows."""
        @tf.function
        def step(x):
            with tf.device(devs[0]):
                xs = tf.split(x, m)
            plan = schedule(m, kind)
            position = [0, 0]
            last = [None, None]
            h, dh, tape0, tape1, loss1 = {}, {}, {}, {}, {}
            stamps = []

            def ready(s, k, i):
                if s == 0:
                    return k == "F" or i in dh
                return i in h if k == "F" else i in loss1

            while position[0] < len(plan[0]) or position[1] < len(plan[1]):
                progressed = False
                for s in (0, 1):
                    if position[s] >= len(plan[s]):
                        continue
                    k, i = plan[s][position[s]]
                    if not ready(s, k, i):
                        continue
                    with tf.device(devs[s]), tf.control_dependencies(
                            [last[s]] if last[s] is not None else []):
                        # tf.timestamp is stateful: tf.function's automatic
                        # control dependencies chain every timestamp in build
                        # order, across stages, which serialises the stages.
                        start = tf.timestamp() if stamped else tf.constant(0.0, tf.float64)
                        with tf.control_dependencies([start]):
                            if (s, k) == (0, "F"):
                                with tf.GradientTape() as t:
                                    out = forward(0, tf.identity(xs[i]))
                                tape0[i], h[i] = t, out
                                done = [out]
                            elif (s, k) == (1, "F"):
                                with tf.GradientTape() as t:
                                    hin = tf.identity(h[i])
                                    t.watch(hin)
                                    y = forward(1, hin)
                                    loss = tf.reduce_mean(y * y) / m
                                tape1[i], loss1[i] = (t, hin), loss
                                done = [loss]
                            elif (s, k) == (1, "B"):
                                t, hin = tape1[i]
                                *g1, dh[i] = t.gradient(loss1[i], ws[1] + [hin])
                                done = [acc.assign_add(g) for acc, g in zip(grads[1], g1)]
                                done = [dh[i]] + [d.read_value() if hasattr(d, "read_value")
                                                  else d for d in done]
                            else:
                                g0 = tape0[i].gradient(h[i], ws[0], output_gradients=dh[i])
                                done = [acc.assign_add(g) for acc, g in zip(grads[0], g0)]
                                done = [d.read_value() if hasattr(d, "read_value") else d
                                        for d in done]
                        with tf.control_dependencies(done):
                            end = tf.timestamp() if stamped else tf.constant(0.0, tf.float64)
                    stamps.append(tf.stack([start, end]))
                    labels.append((s, k, i))
                    last[s] = end if stamped else tf.group(*done)
                    position[s] += 1
                    progressed = True
                assert progressed, "schedule deadlock"
            return [tf.stack(stamps)]
        return step

    # -- calls: per-stage functions, issued asynchronously ------------------------
    def timed(body, first, *rest):
        """`body(first, *rest)` (tensors that end when its work does) and the
        wall-clock [start, end] of that work on this task."""
        start = tf.timestamp()
        with tf.control_dependencies([start]):   # the timestamp first, then the work
            first = tf.identity(first)
        outputs = body(first, *rest)
        with tf.control_dependencies(tf.nest.flatten(outputs)):
            end = tf.timestamp()
        return outputs, tf.stack([start, end])

    @tf.function
    def forward0(x):
        return timed(lambda x: forward(0, x), x)

    def _forward_backward1(h, scale):
        with tf.GradientTape() as tape:
            tape.watch(h)
            y = forward(1, h)
            loss = tf.reduce_mean(y * y) * scale
        *g1, dh = tape.gradient(loss, ws[1] + [h])
        with tf.control_dependencies([acc.assign_add(g) for acc, g in zip(grads[1], g1)]):
            return tf.identity(dh)

    @tf.function
    def forward_backward1(h, scale):
        return timed(_forward_backward1, h, scale)

    def _backward0(x, dh):
        with tf.GradientTape() as tape:
            h = forward(0, x)          # recomputed: nothing kept from forward0
        g0 = tape.gradient(h, ws[0], output_gradients=dh)
        return [acc.assign_add(g) for acc, g in zip(grads[0], g0)]

    @tf.function
    def backward0(x, dh):
        return timed(_backward0, x, dh)[1]

    def run_calls(x, m):
        with tf.device(devs[0]):
            xs = tf.split(x, m)
        scale = tf.constant(1.0 / m)
        spans = []   # (stage, kind, micro-batch, [start, end] tensor)
        hs, dhs = [None] * m, [None] * m
        # 1F1B-like issue order on task 0: forward0(i+1) before backward0(i).
        with tf.device(devs[0]):
            hs[0], span = forward0(xs[0])
        spans.append((0, "F", 0, span))
        for i in range(m):
            with tf.device(devs[1]):
                dhs[i], span = forward_backward1(hs[i], scale)
            spans.append((1, "FB", i, span))
            if i + 1 < m:
                with tf.device(devs[0]):
                    hs[i + 1], span = forward0(xs[i + 1])
                spans.append((0, "F", i + 1, span))
            with tf.device(devs[0]):
                span = backward0(xs[i], dhs[i])
            spans.append((0, "B", i, span))
        return spans

    with tf.device(devs[0]):
        x = tf.random.normal([B, W], seed=7)
    results = {}
    if "independent" in modes:
        modes = [m for m in modes if m != "independent"]

        def chains(which):
            @tf.function(autograph=False)
            def both(x):
                out = []
                for s in which:
                    with tf.device(devs[s]):
                        y = tf.identity(x[:256])
                        for _ in range(40):
                            y = tf.nn.relu(y @ ws[s][0])
                        out.append(tf.reduce_sum(y))
                return out
            return both

        for which in ([0], [1], [0, 1]):
            function = chains(which)
            [o.numpy() for o in function(x)]
            start = time.perf_counter()
            for _ in range(repeats):
                out = function(x)
            [o.numpy() for o in out]
            print(f"independent chains on tasks {which}: "
                  f"{(time.perf_counter() - start) / repeats * 1e3:.1f} ms", flush=True)
    for mode in modes:
        for m in (1, microbatches):
            if mode in ("gpipe", "1f1b", "gpipe-nostamps", "1f1b-nostamps"):
                kind, stamped = mode.split("-")[0], not mode.endswith("-nostamps")
                labels = []   # filled while the step is traced
                step = make_ordered(m, kind, stamped, labels)
                step(x)[0].numpy()
                start = time.perf_counter()
                for _ in range(repeats):
                    out = step(x)
                stamps = out[0].numpy()
                seconds = (time.perf_counter() - start) / repeats
                t0 = stamps[:, 0].min()
                makespan = stamps[:, 1].max() - t0
                busy = float((stamps[:, 1] - stamps[:, 0]).sum())
                bubble = 1 - busy / (2 * makespan) if stamped else None
                if stamped:
                    results[f"{mode} timeline M={m}"] = [
                        (s_, k, i, round(float(a - t0), 4), round(float(b - t0), 4))
                        for (s_, k, i), (a, b) in zip(labels, stamps)]
            elif mode == "graph":
                step = make_graph(m)
                step(x).numpy()
                start = time.perf_counter()
                for _ in range(repeats):
                    out = step(x)
                out.numpy()
                seconds = (time.perf_counter() - start) / repeats
                bubble = None
            else:
                with tf.experimental.async_scope():   # waits for every call at its end
                    run_calls(x, m)                     # trace and warm up
                start = time.perf_counter()
                with tf.experimental.async_scope():
                    for _ in range(repeats):
                        spans = run_calls(x, m)
                seconds = (time.perf_counter() - start) / repeats
                timeline = [(s, k, i, *span.numpy().tolist()) for s, k, i, span in spans]
                t0 = min(t[3] for t in timeline)
                makespan = max(t[4] for t in timeline) - t0
                busy = sum(t[4] - t[3] for t in timeline)
                bubble = 1 - busy / (2 * makespan)
                results[f"{mode} timeline M={m}"] = [(s, k, i, round(a - t0, 4), round(b - t0, 4))
                                                     for s, k, i, a, b in timeline]
            results[(mode, m)] = seconds
            print(f"{mode:5s} M={m}: {seconds * 1e3:7.1f} ms/step"
                  + (f", measured bubble {bubble:.2f} (GPipe formula "
                     f"{(2 - 1) / (m + 2 - 1):.2f})" if bubble is not None else ""), flush=True)
        print(f"{mode:5s} M={microbatches} vs M=1: "
              f"{results[(mode, 1)] / results[(mode, microbatches)]:.2f}x "
              f"(ideal {2 * microbatches / (microbatches + 1):.2f}x)", flush=True)
    timelines = {k: v for k, v in results.items() if isinstance(k, str)}
    if timelines:
        print(json.dumps(timelines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="graph,calls")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--role", default="main", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--cluster", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "server":
        return server(args.index, json.loads(args.cluster))
    if args.role == "client":
        return client(json.loads(args.cluster), args.modes.split(","), args.microbatches,
                      args.repeats)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tfdist.observe import hardware
    print(f"# pipeline probe on {hardware.describe()}", flush=True)
    cluster = {"worker": [f"localhost:{_free_port()}" for _ in range(2)],
               "client": [f"localhost:{_free_port()}"]}
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    me = os.path.abspath(__file__)
    servers = [subprocess.Popen(["taskset", "-c", str(i), sys.executable, me, "--role=server",
                                 f"--index={i}", f"--cluster={json.dumps(cluster)}"], env=env)
               for i in range(2)]
    try:
        subprocess.run([sys.executable, me, "--role=client", f"--cluster={json.dumps(cluster)}",
                        f"--modes={args.modes}", f"--microbatches={args.microbatches}",
                        f"--repeats={args.repeats}"], env=env, timeout=900, check=True)
    finally:
        for proc in servers:
            proc.kill()


if __name__ == "__main__":
    main()
