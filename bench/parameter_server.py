"""parameter_server (asynchronous) vs multi_worker (synchronous), 2 workers each.

    .venv/bin/python bench/parameter_server.py [--steps=N] [--model=cnn|mlp]
        [--global_batch=B] [--stopped=F] [--period=S] [--timeout=T]

Both engines train the same model on the bundled tfdist_shapes data with the
same global batch for the same number of steps (so the same number of
examples): multi_worker as 2 processes of tfdist-launch (each step one
all-reduce over 2 replicas of half the batch), parameter_server as a chief,
2 workers and 1 parameter server (each step one worker's update on the whole
batch, the workers not waiting for each other). Reported: examples/sec (timed
loops, the compiling first loop left out), test accuracy at the end, and for
parameter_server the steps each worker ran and the mean staleness.

Then the same with worker 1 slowed down: a straggler, made by stopping its
process (SIGSTOP) for a fraction --stopped of every --period seconds and
letting it run (SIGCONT) the rest, which slows that worker alone whatever the
engine (a sleep in its input pipeline would need a code path per engine: a
parameter-server worker's pipeline is traced on the chief). Synchronous
training waits for the straggler at every all-reduce; asynchronous training
should keep most of its throughput, the straggler running fewer steps.

Ratios: parameter_server / multi_worker per condition, and slowed / normal
per engine. Run time: about 6 minutes on this 2-core machine at the defaults.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    LAUNCH, REPO, TRAIN, Clock, RunFailed, _error_line, _stop_group, finish, hardware_header,
    print_row)

NAME = "parameter_server"
TITLE = "parameter_server vs multi_worker, with and without a straggler (bench/parameter_server.py)"
MODELS = {
    "cnn": ["--model=cnn", "--model_width=16", "--learning_rate=0.003"],
    "mlp": ["--model=mlp", "--model_width=256", "--learning_rate=0.001"],
}
ENGINES = [
    ("multi_worker", [LAUNCH, "--workers=2", "--"], ["--strategy=multi_worker"]),
    ("parameter_server", [LAUNCH, "--workers=2", "--ps=1", "--"],
     ["--strategy=parameter_server"]),
]
HEADER = ["condition", "engine", "steps", "ex/s", "accuracy", "ps / mw", "slowed / normal",
          "steps per worker", "staleness"]


def _worker_pid(launcher_pid: int, index: int):
    """tfdist-train of worker `index` among the launcher's children (by TF_CONFIG)."""
    children = subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True,
                              text=True).stdout.split()
    for pid in map(int, children):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        except OSError:
            continue
        task = json.loads(env.get(b"TF_CONFIG", b"{}")).get("task")
        if task == {"type": "worker", "index": index}:
            return pid
    return None


def _straggle(launcher_pid: int, stopped: float, period: float, done: threading.Event):
    """Duty-cycle worker 1: SIGSTOP for `stopped` x `period`, SIGCONT for the rest."""
    pid = None
    while pid is None and not done.is_set():
        pid = _worker_pid(launcher_pid, 1)
        time.sleep(0.1)
    while not done.is_set():
        try:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stopped * period)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return
        time.sleep((1 - stopped) * period)
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def run(command, timeout, straggler=None) -> dict:
    """Run a launcher command (optionally slowing worker 1); its chief's summary."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    done = threading.Event()
    if straggler:
        threading.Thread(target=_straggle, args=(process.pid, *straggler, done),
                         daemon=True).start()
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        done.set()
        _stop_group(process)
        process.communicate()
        raise RunFailed(f"timed out (> {timeout:.0f} s)") from None
    except BaseException:
        done.set()
        _stop_group(process, grace=5.0)
        raise
    finally:
        done.set()
    if process.returncode != 0:
        raise RunFailed(f"fails: {_error_line(stderr)}")
    for line in reversed(stdout.splitlines()):
        if "{" in line:
            return json.loads(line[line.find("{"):])
    raise RunFailed("fails: no run summary in its output")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--model", default="cnn", choices=sorted(MODELS))
    parser.add_argument("--global_batch", type=int, default=128)
    parser.add_argument("--stopped", type=float, default=0.75,
                        help="fraction of each period the straggler is stopped")
    parser.add_argument("--period", type=float, default=0.2, help="seconds")
    parser.add_argument("--timeout", type=float, default=400)
    parser.add_argument("--data_dir", default=None)
    args = parser.parse_args()
    print(hardware_header().replace("  \n", "\n"), flush=True)
    clock, rows, eps = Clock(), [], {}
    per_loop = max(1, args.steps // 5)
    conditions = [("normal", None), (f"worker 1 stopped {args.stopped:.0%} of the time",
                                      (args.stopped, args.period))]
    for condition, straggler in conditions:
        for engine, launcher, flags in ENGINES:
            command = [*launcher, TRAIN, *MODELS[args.model], *flags,
                       "--dataset=tfdist_shapes", f"--global_batch_size={args.global_batch}",
                       f"--train_steps={args.steps}", f"--steps_per_loop={per_loop}",
                       "--eval_every=0", "--collective_timeout_s=120",
                       *([f"--data_dir={args.data_dir}"] if args.data_dir else [])]
            try:
                summary = run(command, args.timeout, straggler)
                eps[condition, engine] = summary["examples_per_sec"]
                mw = eps.get((condition, "multi_worker"))
                normal = eps.get(("normal", engine))
                per_worker = summary.get("steps_per_worker") or {}
                staleness = summary.get("staleness_mean")
                cells = [summary["steps"], f"{summary['examples_per_sec']:.0f}",
                         f"{summary['accuracy']:.3f}",
                         f"{summary['examples_per_sec'] / mw:.2f}" if mw else "-",
                         f"{summary['examples_per_sec'] / normal:.2f}" if normal else "-",
                         "/".join(str(v) for v in per_worker.values()) or "-",
                         f"{staleness:.2f}" if staleness is not None else "-"]
            except RunFailed as failure:
                cells = [args.steps, str(failure), "-", "-", "-", "-", "-"]
            row = [condition, engine, *cells]
            rows.append(row)
            print_row(row, HEADER)
    body = (f"2 workers on one host (multi_worker: 2 processes, each half the batch, one "
            f"all-reduce per step; parameter_server: chief + 2 workers + 1 ps, each step one "
            f"worker's update on the whole batch), the {args.model} "
            f"({' '.join(MODELS[args.model])}) on tfdist_shapes, global batch "
            f"{args.global_batch}, {args.steps} steps ({args.steps * args.global_batch} "
            f"examples) each, {per_loop} per loop, the first loop (compiling) not timed; "
            "accuracy: test split at the end. Straggler: worker 1's process stopped "
            f"(SIGSTOP) {args.stopped:.0%} of every {args.period:g} s. All processes share "
            "the host's cores.")
    finish(NAME, TITLE, body, rows, HEADER, clock)


if __name__ == "__main__":
    main()
