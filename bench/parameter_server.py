"""parameter_server (asynchronous) vs multi_worker (synchronous): accuracy and speed.

    .venv/bin/python bench/parameter_server.py [--models=cnn,mlp] [--seeds=3]
        [--workers=1,2,4] [--global_batch=B] [--stopped=F] [--period=S] [--timeout=T]

Every run trains the same model on the bundled tfdist_shapes data with the
same global batch for the same number of steps (so the same examples):
multi_worker as 2 processes of tfdist-launch (each step one all-reduce over 2
replicas of half the batch: the synchronous reference), parameter_server as a
chief, N workers and 1 parameter server (each step one worker's update on the
whole batch, the workers not waiting for each other), with the default
staleness-aware learning rate (`--staleness_lr=divide`) and, at 2 workers,
without it (`none`). Each configuration runs under several seeds (model
initialisation and data order): the table shows test accuracy at the end as
mean and spread (min-max) and its difference from multi_worker's mean in
points, examples/sec as the median (timed loops, the compiling first loop left
out), and for parameter_server the mean staleness (the updates of other
workers that landed while a step computed its gradient) and steps per worker.

Then 2 workers with worker 1 slowed down: a straggler, made by stopping its
process (SIGSTOP) for a fraction --stopped of every --period seconds and
letting it run (SIGCONT) the rest, which slows that worker alone whatever the
engine. Synchronous training waits for the straggler at every all-reduce;
asynchronous training keeps most of its throughput, the straggler running
fewer of the steps.

All processes share this host's cores: 4 workers on 2 cores run one at a time
more often than 4 hosts would, so their staleness is lower than on 4 hosts.
Run time: about 25 minutes per model at 3 seeds on a 2-core machine.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    LAUNCH, REPO, TRAIN, Clock, RunFailed, _error_line, _stop_group, finish, hardware_header,
    print_row)

NAME = "parameter_server"
TITLE = ("parameter_server vs multi_worker: accuracy over seeds, 1-4 workers, with and without "
         "a straggler (bench/parameter_server.py)")
# model flags, steps: the mlp is the 512-wide one with Adam at 1e-3 whose
# asynchronous accuracy fell far behind; the cnn is the demo's.
MODELS = {
    "cnn": (["--model=cnn", "--model_width=16", "--learning_rate=0.003"], 200),
    "mlp": (["--model=mlp", "--model_width=512", "--learning_rate=0.001"], 600),
}
HEADER = ["model", "condition", "engine", "workers", "--staleness_lr", "ex/s", "accuracy",
          "vs sync (points)", "ex/s vs sync", "staleness", "steps per worker"]


def _configurations(workers: list[int]):
    """(engine, workers, staleness_lr, launcher args, flags) in table order."""
    yield ("multi_worker", 2, "-", [LAUNCH, "--workers=2", "--"], ["--strategy=multi_worker"])
    for n in workers:
        for staleness_lr in (("divide", "none") if n == 2 else ("divide",)):
            yield ("parameter_server", n, staleness_lr, [LAUNCH, f"--workers={n}", "--ps=1", "--"],
                   ["--strategy=parameter_server", f"--staleness_lr={staleness_lr}"])


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


def _spread(values: list[float]) -> str:
    return (f"{np.mean(values):.3f} ({min(values):.3f}-{max(values):.3f})" if len(values) > 1
            else f"{values[0]:.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--workers", default="1,2,4", help="parameter_server worker counts")
    parser.add_argument("--global_batch", type=int, default=128)
    parser.add_argument("--stopped", type=float, default=0.75,
                        help="fraction of each period the straggler is stopped")
    parser.add_argument("--period", type=float, default=0.2, help="seconds")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--data_dir", default=None)
    args = parser.parse_args()
    print(hardware_header().replace("  \n", "\n"), flush=True)
    clock, rows = Clock(), []
    workers = [int(n) for n in args.workers.split(",")]
    models = args.models.split(",")
    straggler = f"worker 1 stopped {args.stopped:.0%} of the time"
    for model in models:
        flags, steps = MODELS[model]
        per_loop = max(1, steps // 5)
        plan = [("normal", None, c) for c in _configurations(workers)]
        plan += [(straggler, (args.stopped, args.period), c) for c in _configurations([2])
                 if c[2] in ("-", "divide")]
        sync = {}
        for condition, slowed, (engine, n, staleness_lr, launcher, engine_flags) in plan:
            accuracy, speed, staleness, per_worker, failed = [], [], [], [], None
            for seed in range(1, args.seeds + 1):
                command = [*launcher, TRAIN, *flags, *engine_flags, "--dataset=tfdist_shapes",
                           f"--global_batch_size={args.global_batch}", f"--train_steps={steps}",
                           f"--steps_per_loop={per_loop}", "--eval_every=0", f"--seed={seed}",
                           "--collective_timeout_s=120",
                           *([f"--data_dir={args.data_dir}"] if args.data_dir else [])]
                try:
                    summary = run(command, args.timeout, slowed)
                except RunFailed as failure:
                    failed = str(failure)
                    break
                accuracy.append(summary["accuracy"])
                speed.append(summary["examples_per_sec"])
                if summary.get("staleness_mean") is not None:
                    staleness.append(summary["staleness_mean"])
                per_worker.append("/".join(str(v) for v in
                                           (summary.get("steps_per_worker") or {}).values()))
            if failed:
                row = [model, condition, engine, n, staleness_lr, failed, "-", "-", "-", "-", "-"]
            else:
                if engine == "multi_worker":
                    sync[condition] = (np.mean(accuracy), np.median(speed))
                ref = sync.get(condition)
                row = [model, condition, engine, n, staleness_lr, f"{np.median(speed):.0f}",
                       _spread(accuracy),
                       f"{100 * (np.mean(accuracy) - ref[0]):+.1f}" if ref else "-",
                       f"{np.median(speed) / ref[1]:.2f}" if ref else "-",
                       f"{np.mean(staleness):.2f}" if staleness else "-",
                       ", ".join(p for p in per_worker if p) or "-"]
            rows.append(row)
            print_row(row, HEADER)
    body = ("Each model on tfdist_shapes, global batch "
            f"{args.global_batch}, the same steps under every engine (so the same examples), "
            f"{args.seeds} seeds (`--seed=1..{args.seeds}`: initialisation and data order); "
            + "; ".join(f"{m}: `{' '.join(MODELS[m][0])}`, {MODELS[m][1]} steps" for m in models)
            + ". multi_worker: 2 processes, each half the batch, one all-reduce per step (the "
            "synchronous reference: its accuracy does not depend on the worker count). "
            "parameter_server: chief + N workers + 1 ps, each step one worker's update on the "
            "whole batch. Accuracy: test split at the end, mean (min-max) over seeds; vs sync: "
            "its mean less multi_worker's, in points. ex/s: median over seeds, the compiling "
            "first loop not timed. Staleness: the updates of other workers that landed while a "
            "step computed its gradient, mean over the run and seeds. Straggler: worker 1's "
            f"process stopped (SIGSTOP) {args.stopped:.0%} of every {args.period:g} s. All "
            "processes share the host's cores.")
    finish(NAME, TITLE, body, rows, HEADER, clock)


if __name__ == "__main__":
    main()
