"""Pipeline parallelism across processes: S=2 stages, each a process.

    .venv/bin/python bench/pipeline.py [--microbatches 8] [--steps 25] [--width 1024]
        [--depth 6] [--global_batch 512] [--interop 2] [--pin/--nopin] [--png PATH]
        [--chunks 2]

`--stages S` runs S stage processes (default 2; more than the cores measures
memory, not speed). `--zero1` instead runs S x 2 workers (two pipeline replicas
of each stage) without and with `--zero_stage=1`, then the same model as
`multi_worker` over S x 2 processes, and prints each worker's peak memory
beside its stage's Adam slots (ZeRO-1 keeps half of them per worker). Runs, one after the other, on the bundled mlp (synthetic tfdist_shapes images,
Adam, float32, no XLA: the pipeline cannot use it):

- `default`: plain `--strategy=default`, one process using both cores (the
  baseline a CPU user has; XLA as --jit_compile=auto picks);
- `pipeline M=1`: the same model split into the two stages `--print_stages`
  shows, each stage a process (a 2-worker TF_CONFIG cluster) pinned to a core
  of its own (`--pin`), one intra-op and `--interop` (default 2) inter-op threads
  (TF_NUM_INTRAOP_THREADS / TF_NUM_INTEROP_THREADS), no micro-batching;
- `pipeline M=<M> 1f1b` and `gpipe`: the same with M micro-batches;
- `pipeline M=<M> interleaved 1f1b, v=<V>`: the model in S x V stages, each
  process running V of them (`--pipeline_chunks`, `--chunks`, default 2).

Prints examples/sec of each, their ratios to M=1 (ideal for S=2, M=8: 16/9 =
1.78x; interleaved with v=2: 32/17 = 1.88x) and to `default`, and, from each pipelined run's
timeline of its last step (each worker records when each of its items' inputs
were there and when it ended: TFDIST_PIPELINE_TIMELINE), the measured bubble
1 - busy / (S x span) against the ideal (S-1)/(vM+S-1), and each stage
process's peak resident memory (1F1B holds at most S micro-batches'
activations, GPipe M: visible once the activations outweigh TensorFlow's own
memory, e.g. `--width 2048 --global_batch 4096`). `--png` draws the
timelines (one row per stage process, forwards light, backwards dark; an
interleaved run's second chunk in green, its items labelled F<micro-batch>.<stage>).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import REPO, TRAIN, hardware_header, summary, table  # noqa: E402

from tfdist.pipeline import schedule  # noqa: E402  (no TensorFlow)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pipeline_run(args, microbatches: int, kind: str, timeline: str, replicas: int = 1,
                 extra: tuple = (), chunks: int = 1) -> dict:
    """S x `replicas` stage processes; worker 0's (the chief's) run summary."""
    command = [TRAIN, "--strategy=pipeline", f"--pipeline_stages={args.stages}",
               f"--microbatches={microbatches}", f"--pipeline_schedule={kind}",
               f"--pipeline_chunks={chunks}", *model_flags(args), *extra]
    return run_cluster(args, command, args.stages * replicas,
                       {"TFDIST_PIPELINE_TIMELINE": timeline})[0]


def run_cluster(args, command: list, workers: int, env: dict = None,
                check: bool = True) -> tuple:
    """`workers` processes of `command` in one TF_CONFIG cluster, process k
    pinned to core k mod the cores (--pin), one intra-op and --interop
    inter-op threads each: (the chief's run summary, each process's peak
    resident bytes, from the kernel's accounting when it is reaped, each
    process's exit status). With `check`, a failed process ends the
    benchmark; without, the summary is None where the run failed."""
    ports = [_free_port() for _ in range(workers)]
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    procs, logs = [], []
    for k in range(workers):
        environ = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {}),
                   "TF_CONFIG": json.dumps({"cluster": cluster,
                                            "task": {"type": "worker", "index": k}}),
                   "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": str(args.interop)}
        pin = ["taskset", "-c", str(k % os.cpu_count())] if args.pin else []
        logs.append((tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")))
        procs.append(subprocess.Popen([*pin, *command], cwd=REPO, env=environ, text=True,
                                      stdout=logs[-1][0], stderr=logs[-1][1]))
    codes, peaks = [None] * workers, [0] * workers
    deadline = time.monotonic() + args.timeout
    try:
        while None in codes:   # poll each process; wait4 gives its peak
            for k, proc in enumerate(procs):
                if codes[k] is None:
                    pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                    if pid:
                        codes[k] = proc.returncode = os.waitstatus_to_exitcode(status)
                        peaks[k] = usage.ru_maxrss * 1024
            if time.monotonic() > deadline:
                sys.exit(f"the cluster ran past --timeout={args.timeout}")
            time.sleep(0.2)
    finally:
        for proc, code in zip(procs, codes):
            if code is None:
                proc.kill()
    texts = []
    for out, err in logs:
        out.seek(0)
        err.seek(0)
        texts.append((out.read(), err.read()))
    for code, (_, err) in zip(codes, texts):
        if code and check:
            sys.exit(f"a cluster process failed:\n{err[-3000:]}")
    for line in reversed(texts[0][0].splitlines()):
        if line.startswith("{") and not any(codes):
            return json.loads(line), peaks, codes
    if check:
        sys.exit("no run summary from the chief")
    return None, peaks, codes


def zero1_rows(args, scratch: str) -> list:
    """S x 2 workers (2 pipeline replicas of each stage), without and with
    --zero_stage=1: each worker's peak resident memory, and the Adam slots
    (2 x the stage's float32 parameter bytes) it holds in each."""
    runs = {}
    for zero in (0, 1):
        prefix = os.path.join(scratch, f"zero{zero}")
        run = pipeline_run(args, args.microbatches, "1f1b", prefix, replicas=2,
                           extra=(f"--zero_stage={zero}",))
        runs[zero] = (run, read_timeline(prefix, 2 * args.stages)[1])
    # the same model and batch as plain data parallelism over as many processes
    _, data_parallel, codes = run_cluster(
        args, [TRAIN, "--strategy=multi_worker", "--jit_compile=off", *model_flags(args)],
        2 * args.stages, check=False)
    ended = [f" (killed by signal {-c})" if c < 0 else f" (exit {c})" if c else ""
             for c in codes]
    rows = []
    for k in range(2 * args.stages):
        stage = k % args.stages
        slots = 2 * runs[0][0]["stage_param_bytes"][stage]
        plain, zero = runs[0][1][k] / 2**20, runs[1][1][k] / 2**20
        rows.append([f"worker {k}: stage {stage}, replica {k // args.stages}",
                     f"{slots / 2**20:.0f}", f"{plain:.0f}", f"{zero:.0f}",
                     f"{plain - zero:.0f}", f"{data_parallel[k] / 2**20:.0f}{ended[k]}",
                     f"{runs[0][0]['examples_per_sec']:.0f} / {runs[1][0]['examples_per_sec']:.0f}"
                     if k == 0 else ""])
    return rows


def model_flags(args) -> list:
    return ["--model=mlp", f"--model_width={args.width}", f"--model_depth={args.depth}",
            "--dataset=tfdist_shapes", "--synthetic", f"--global_batch_size={args.global_batch}",
            f"--train_steps={args.steps}", f"--steps_per_loop={max(1, args.steps // 5)}",
            "--optimizer=adam"]


def read_timeline(prefix: str, stages: int) -> tuple:
    """([(process's place in the pipeline, stage, kind, micro-batch, inputs
    there, end)] of the last step, every worker; each stage process's peak
    resident memory in bytes)."""
    rows, peaks = [], []
    for k in range(stages):
        with open(f"{prefix}-{k}.json") as f:
            data = json.load(f)
        rows += [(data["position"], s, kind, i, ready, end)
                 for s, kind, i, _start, ready, end in data["items"]]
        peaks.append(data["peak_rss_bytes"])
    return rows, peaks


def bubble(rows: list, stages: int = 2) -> tuple:
    """(measured bubble, span in ms): 1 - busy / (stages x span), busy being
    each item's time from its inputs being there to its end."""
    start = min(r[4] for r in rows)
    span = max(r[5] for r in rows) - start
    busy = sum(r[5] - r[4] for r in rows)
    return 1 - busy / (stages * span), span * 1e3


def draw(timelines: dict, path: str, stages: int = 2) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(timelines), 1, figsize=(10, 1.6 * len(timelines)),
                             squeeze=False)
    for axis, (name, rows) in zip(axes[:, 0], timelines.items()):
        start = min(r[4] for r in rows)
        chunked = len({r[1] for r in rows}) > stages
        for position, stage, kind, i, ready, end in rows:
            light, dark = (("#a1d99b", "#31a354") if chunked and stage >= stages
                           else ("#9ecae1", "#3182bd"))
            axis.barh(position, (end - ready) * 1e3, left=(ready - start) * 1e3,
                      color=light if kind == "F" else dark, edgecolor="black", linewidth=0.4)
            label = f"{kind}{i}" if not chunked else f"{kind}{i}.{stage}"
            axis.text((ready - start) * 1e3 + (end - ready) * 5e2, position, label,
                      ha="center", va="center", fontsize=5 if chunked else 6)
        axis.set_yticks(range(stages), [f"process {s}" for s in range(stages)])
        axis.invert_yaxis()
        axis.set_title(name, fontsize=9)
        axis.set_xlabel("ms into the step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2,
                        help="stage processes (more than the cores: for memory, not speed)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=2,
                        help="the interleaved 1F1B row's chunks per stage process "
                             "(--pipeline_chunks; 1: no such row)")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--global_batch", type=int, default=512)
    parser.add_argument("--interop", type=int, default=2,
                        help="inter-op threads per stage process: with 1, a finished item's "
                             "send waits behind the stage's next items (TensorFlow runs one "
                             "ready op inline and queues the rest on the inter-op pool), so "
                             "GPipe's forwards did not overlap; 2 is TensorFlow's default on "
                             "2 cores (bench/pipeline_p2p_probe.py found 4 slower)")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                        help="pin stage process k to core k (taskset)")
    parser.add_argument("--png", default=None, help="draw the timelines into this PNG")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--zero1", action="store_true",
                        help="instead: S x 2 workers without and with --zero_stage=1 (each "
                             "stage's Adam slots split over its 2 replicas), and the same "
                             "model as multi_worker over S x 2 processes: each process's "
                             "peak memory (on 2 cores this measures memory, not speed)")
    args = parser.parse_args()
    print(hardware_header(), flush=True)
    if args.zero1:
        with tempfile.TemporaryDirectory() as scratch:
            rows = zero1_rows(args, scratch)
        print(table(rows, ["worker", "its stage's Adam slots MiB", "peak MiB, ZeRO-1 off",
                           "on", "saved MiB", f"{2 * args.stages}-way multi_worker MiB",
                           "ex/s off / on"]))
        return
    m = args.microbatches
    rows, timelines = [], {}
    base = summary([TRAIN, "--strategy=default", *model_flags(args)], timeout=args.timeout)
    rows.append(["default (1 process, both cores)", "",
                 f"{base['peak_rss_bytes'] / 2**20:.0f}", f"{base['examples_per_sec']:.0f}"])
    print(rows[-1], flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        runs = [(1, "1f1b", 1), (m, "1f1b", 1), (m, "gpipe", 1)]
        runs += [(m, "1f1b", args.chunks)] if args.chunks > 1 else []
        results = {}
        for microbatches, kind, chunks in runs:
            prefix = os.path.join(scratch, f"timeline-{microbatches}-{kind}-{chunks}")
            run = pipeline_run(args, microbatches, kind, prefix, chunks=chunks)
            name = f"pipeline M={microbatches}" + (f" {kind}" if microbatches > 1 else "")
            if chunks > 1:
                name = f"pipeline M={microbatches} interleaved {kind}, v={chunks}"
            results[name] = run
            timeline, peaks = read_timeline(prefix, args.stages)
            measured, span = bubble(timeline, args.stages)
            if microbatches > 1:
                timelines[name] = timeline
                if chunks > 1:
                    print(f"{name}: stages {run.get('stage_layers')}", flush=True)
            ideal = schedule.bubble(args.stages, microbatches, chunks)
            rows.append([name, f"{measured:.0%} (ideal {ideal:.0%}; step {span:.0f} ms)",
                         " / ".join(f"{p / 2**20:.0f}" for p in peaks),
                         f"{run['examples_per_sec']:.0f}"])
            print(rows[-1], flush=True)
        single = results["pipeline M=1"]["examples_per_sec"]
        for row in rows:
            speed = float(row[3])
            row += [f"{speed / single:.2f}x", f"{speed / base['examples_per_sec']:.2f}x"]
    print(f"stages: {results['pipeline M=1'].get('stage_layers')}")
    print(table(rows, ["run", "bubble (last step)",
                       f"peak RSS MiB (stage {' / '.join(map(str, range(args.stages)))})", "ex/s",
                       "vs M=1", "vs default"]))
    if args.png:
        draw(timelines, args.png, args.stages)
        print(f"timelines: {args.png}")


if __name__ == "__main__":
    main()
