"""`tfdist-compare`: does a distributed run converge like one device?

    tfdist-compare --strategy=mirrored|multi_worker|horovod|dtensor|pipeline
        [--workers=N] [--tolerance=T] [--window=W] [--grad_agreement_every=N]
        [--output_dir=DIR] [--distributed_flags="--flag=v ..."] [--timeout_s=S]
        -- <shared tfdist-train flags>

Trains the same configuration twice, as real processes, one after the other:
`tfdist-train --strategy=default` and the distributed run (`tfdist-train
--strategy=mirrored` on the local devices; `tfdist-launch --workers=N --
tfdist-train --strategy=multi_worker`; `horovodrun -np N -H localhost:N
--gloo tfdist-train --strategy=horovod`; `--strategy=dtensor` (any mesh and
ZeRO stage, e.g. `--distributed_flags="--mesh=batch:2,model:1
--zero_stage=3"`) and `--strategy=pipeline` on the local devices, or across
`--workers=N` processes of `tfdist-launch`), each logging its loss at every step to
TensorBoard (`--log_every=1`). It then aligns the two loss curves by step,
smooths each with a trailing moving average over `--window` steps and takes
the relative gap |distributed - default| / max(|default|, floor) of the
smoothed curves, where the floor is a quarter of the default run's first
smoothed loss: a gap relative to the loss, but not blown up as the loss
nears zero (batch-order noise stays roughly constant in absolute terms while
the loss falls). The run diverges when the largest smoothed relative gap
exceeds `--tolerance` (a non-finite loss on either side always diverges).

Why smooth: with per-worker input sharding (`--autoshard=file|data|off|auto`)
multi_worker and horovod replicas see other batches than the default run at
each step, so their per-step losses differ by batch noise even when training
is sound; a moving average keeps the trend. In the one global order (the
default `--autoshard=global`) they read the default run's global batches and
the curves agree to float32 rounding, as `mirrored`'s do.

Why 0.1 (10 %) as the default tolerance, with figures measured on a 2-core
Xeon (AVX-512), global batch 64-128, 15-100 steps:
- `mirrored` splits the same global batch over its devices and sums the
  gradients: the default run's update up to float32 rounding. The mlp's
  curves agree to 6e-8 to 2.3e-7 over 30 steps (the summation order varies
  from run to run), far inside 0.1. A model with BatchNorm normalises by each
  replica's half batch, so the cnn (demo.cfg) differs for real: 0.064 over
  60 steps, still inside.
- `multi_worker` and `horovod` with per-worker input sharding (measured so,
  before the global order was the default): every step sees other examples
  than the default run, and the curves match only in trend. On
  demo.cfg (horovod, 2 ranks) the largest smoothed gap is 0.057 over 30 steps
  and 0.084 over 40, while the loss is above 0.7; it grows as the loss nears
  zero (0.13 over 50 steps, 0.25 over 100, at a loss of 0.14) when divided
  by the loss itself; the floor (a quarter of the first loss, ~0.5 there)
  keeps that near 0.07.
  A configuration whose loss spikes early (mlp, Adam 3e-3) amplifies the
  different batches too: 0.086, 0.106, 0.34 for seeds 42, 1, 2.
- Broken distributed sides measured: learning rate x10 7.6 (mlp, 15 steps),
  x0.1 0.18 (mlp, 30 steps) and 4.4 (demo.cfg, 60 steps), x4 by a wrong
  `--lr_scaling` 0.64 (demo.cfg, 60 steps).
So 0.1 catches every break above and passes every sound `mirrored` run; for
`multi_worker`/`horovod` compare while the loss is still well above zero and
falling steadily (e.g. demo.cfg with --train_steps=30), or raise
--tolerance for longer runs. Note that Adam is invariant to a constant
gradient scale, so a sum-instead-of-mean bug shows only under SGD.

Writes into `--output_dir` (default `tfdist-compare-<strategy>`):
`default/` and `<strategy>/` (the runs' model dirs), `<run>.stdout.log` and
`<run>.stderr.log`, `loss_curves.png` and `report.md`; prints the report.
Exit status 0 within tolerance, 1 diverged, 2 bad input or a failed run
(one line on stderr naming the input or the run).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import logging as std_logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

# Bad input or a failed run: one line on stderr, exit status 2 (see main).
from tfdist import strategies
from tfdist.errors import UsageError
from tfdist.observe.compare_report import plot, report
from tfdist.observe.divergence import (DEFAULT_TOLERANCE, DEFAULT_WINDOW, LOSS_FLOOR,  # noqa: F401
                                       Divergence,
                                       agreement_table, align, divergence, moving_average)
from tfdist.strategies import records as engines_lib

REFERENCE = strategies.REFERENCE

PROG = "tfdist-compare"
REINSTALL = "reinstall tfdist (make install)"


def _launch_workers(opts, argv: list) -> list:
    return [engines_lib.executable("tfdist-launch", REINSTALL), f"--workers={opts.workers}",
            "--", *argv]


def _launch_horovod(opts, argv: list) -> list:
    if importlib.util.find_spec("horovod") is None:
        raise UsageError("--strategy=horovod: Horovod is not installed in this "
                         "environment; build it with `make horovod`")
    tool, *words = engines_lib.local_launcher(engines_lib.HOROVODRUN, opts.workers)
    return [engines_lib.executable(tool, "build Horovod with `make horovod`"), *words, *argv]


def _launch_workers_if_asked(opts, argv: list) -> list:
    return argv if opts.workers is None else _launch_workers(opts, argv)


# How each way of starting an engine's processes wraps a tfdist-train command
# (None: one process on the local devices; --workers does not apply).
_LAUNCHERS = {engines_lib.ONE_PROCESS: None, engines_lib.WORKERS: _launch_workers,
              engines_lib.ONE_OR_WORKERS: _launch_workers_if_asked,
              engines_lib.HOROVODRUN: _launch_horovod}


def comparable() -> dict:
    """{engine name: its launcher} of the engines a comparison can run: the
    synchronous ones, launched as `_LAUNCHERS` knows, but the reference."""
    return {e.name: _LAUNCHERS[e.launch] for e in strategies.engines()
            if e.synchronous and e.launch in _LAUNCHERS and e.name != strategies.REFERENCE}


def _default_workers(name: str):
    """Processes a comparison starts when --workers is not given (None: one)."""
    engine = strategies.engine(name)
    return engine.processes if _LAUNCHERS[engine.launch] in (_launch_workers,
                                                               _launch_horovod) else None


DEFAULT_TIMEOUT_S = 900.0
# Flags tfdist-compare sets on each run itself; they come after the shared
# flags (a --flagfile such as configs/demo.cfg sets --strategy) so they win.
OWNED_FLAGS = ("strategy", "model_dir", "log_every", "grad_agreement_every")
REPORT, PLOT = "report.md", "loss_curves.png"
_MARKER = ".tfdist-compare"   # marks an output dir this tool may clean
_STOP_GRACE_S = 10.0  # above tfdist-launch's own 5 s stop grace: it stops its workers first


class Interrupted(Exception):
    """SIGINT/SIGTERM/SIGHUP: the running training is stopped, then we exit."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum, _frame):
    raise Interrupted(signum)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    """Options grouped by concern, each help saying its default and valid values
    (the style of tfdist-train --help)."""
    p = _Parser(prog=PROG, allow_abbrev=False,
                usage=f"{PROG} --strategy=S [options] -- <tfdist-train flags of both runs>",
                formatter_class=argparse.RawDescriptionHelpFormatter,
                description="Train one configuration under --strategy=default and under a "
                            "distributed strategy;\ncompare the loss curves. Everything after "
                            "'--' goes to both runs' tfdist-train:\n\n"
                            f"    {PROG} --strategy=mirrored -- --model=mlp --train_steps=40",
                epilog="Exit status: 0 within tolerance, 1 diverged, 2 bad input or a "
                       "failed run.\nWrites loss_curves.png and report.md into --output_dir.")
    runs = p.add_argument_group("runs")
    runs.add_argument("--strategy", required=True, metavar="{" + ",".join(comparable()) + "}",
                      help="the distributed run's engine [required]")
    runs.add_argument("--workers", type=int, default=None, metavar="N",
                      help="processes: multi_worker, horovod [default: 2], dtensor, "
                           "pipeline [default: one process on the local devices]; an "
                           "integer >= 1")
    runs.add_argument("--distributed_flags", default="", metavar="FLAGS",
                      help='extra tfdist-train flags for the distributed run only, e.g. '
                           '--distributed_flags="--lr_scaling=linear" [default: none]')
    runs.add_argument("--timeout_s", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                      help="each run is stopped and fails after S seconds "
                           "[default: %(default)g; a number > 0]")
    verdict = p.add_argument_group("verdict")
    verdict.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE, metavar="T",
                         help="largest smoothed relative loss gap that passes; a relative gap "
                              "grows as the loss nears zero, so compare multi_worker/horovod "
                              "while it is well above [default: %(default)g; a number > 0]")
    verdict.add_argument("--window", type=int, default=DEFAULT_WINDOW, metavar="W",
                         help="moving-average window in steps "
                              "[default: %(default)s; an integer >= 1]")
    verdict.add_argument("--grad_agreement_every", type=int, default=1, metavar="N",
                         help="distributed run: measure per-replica gradient agreement every "
                              "N steps; 0: never [default: %(default)s; an integer >= 0]")
    output = p.add_argument_group("output")
    output.add_argument("--output_dir", default=None, metavar="DIR",
                        help="where runs, plot and report go "
                             "[default: tfdist-compare-<strategy>]")
    return p


def _check_train_flags(args: list, where: str) -> None:
    for arg in args:
        if not arg.startswith("-"):
            raise UsageError(f"{where}: {arg!r} is not a flag; tfdist-train flags start with --")
        name = arg.lstrip("-").split("=", 1)[0]
        if name in OWNED_FLAGS:
            raise UsageError(f"{where}: {arg} is set by {PROG} itself (it sets "
                             f"{', '.join('--' + f for f in OWNED_FLAGS)} on each run; use "
                             f"{PROG}'s --strategy, --output_dir, --grad_agreement_every)")


def parse_args(argv: list) -> tuple:
    """(options, shared tfdist-train flags); raises UsageError before any run."""
    cut = argv.index("--") if "--" in argv else len(argv)
    opts, stray = _parser().parse_known_args(argv[:cut])  # --help exits here
    if cut == len(argv):
        raise UsageError("missing '--' before the tfdist-train flags of both runs, e.g. "
                         f"{PROG} --strategy=mirrored -- --model=mlp --train_steps=40")
    if stray:
        raise UsageError(f"unrecognized arguments: {' '.join(stray)} (tfdist-train flags go "
                         "after --)")
    shared = argv[cut + 1:]
    launchers = comparable()
    if opts.strategy not in launchers:
        raise UsageError(f"--strategy={opts.strategy!r} cannot be compared; valid: "
                         f"{', '.join(launchers)}")
    if opts.workers is not None and launchers[opts.strategy] is None:
        several = ", ".join(s for s, launch in launchers.items() if launch)
        raise UsageError(f"--workers={opts.workers} applies to {several}; {opts.strategy} uses "
                         "the local devices (--virtual_devices after --)")
    if opts.workers is None:
        opts.workers = _default_workers(opts.strategy)
    if opts.workers is not None and opts.workers < 1:
        raise UsageError(f"--workers={opts.workers} must be at least 1")
    if not opts.tolerance > 0 or not np.isfinite(opts.tolerance):
        raise UsageError(f"--tolerance={opts.tolerance:g} must be a number above 0, e.g. "
                         f"{DEFAULT_TOLERANCE:g}")
    if opts.window < 1:
        raise UsageError(f"--window={opts.window} must be at least 1 step")
    if opts.grad_agreement_every < 0:
        raise UsageError(f"--grad_agreement_every={opts.grad_agreement_every} must be 0 "
                         "(never) or more")
    if not opts.timeout_s > 0:
        raise UsageError(f"--timeout_s={opts.timeout_s:g} must be above 0")
    try:
        opts.distributed_flags = shlex.split(opts.distributed_flags)
    except ValueError as error:
        raise UsageError(f"--distributed_flags: {error}") from None
    _check_train_flags(shared, "the tfdist-train flags after --")
    _check_train_flags(opts.distributed_flags, "--distributed_flags")
    opts.output_dir = os.path.abspath(opts.output_dir or f"{PROG}-{opts.strategy}")
    return opts, shared


def commands(opts, shared: list) -> dict:
    """{run name: argv} of the two runs, in the order they run."""
    train = engines_lib.executable("tfdist-train", REINSTALL)

    def flags(strategy, every):
        return [*shared, f"--strategy={strategy}",
                f"--model_dir={os.path.join(opts.output_dir, strategy)}", "--log_every=1",
                f"--grad_agreement_every={every}"]

    distributed = [train, *flags(opts.strategy, opts.grad_agreement_every),
                   *opts.distributed_flags]
    launch = comparable()[opts.strategy]
    if launch is not None:
        distributed = launch(opts, distributed)
    return {REFERENCE: [train, *flags(REFERENCE, 0)], opts.strategy: distributed}


def prepare_output(output_dir: str, runs) -> None:
    """Create `output_dir`; clear the run dirs of an earlier comparison (a run
    resumes from checkpoints in its model dir), but never a dir we did not make."""
    marker = os.path.join(output_dir, _MARKER)
    for run in runs:
        path = os.path.join(output_dir, run)
        used = os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path))
        if used and not os.path.exists(marker):
            raise UsageError(f"--output_dir={output_dir}: {path} exists and was not written "
                             f"by {PROG}; pick another --output_dir")
    try:
        os.makedirs(output_dir, exist_ok=True)
        with open(marker, "w") as f:
            f.write("written by tfdist-compare; its run dirs are replaced on each comparison\n")
        for run in runs:
            shutil.rmtree(os.path.join(output_dir, run), ignore_errors=True)
        for stale in (REPORT, PLOT):  # a failed comparison must not leave the last one's
            if os.path.exists(os.path.join(output_dir, stale)):
                os.remove(os.path.join(output_dir, stale))
    except OSError as error:
        raise UsageError(f"--output_dir={output_dir} is not a writable directory "
                         f"({error.strerror})") from None


# -- running ------------------------------------------------------------------
def progress(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the run's process group (launchers have children), then SIGKILL."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=_STOP_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


_CAUSE = re.compile(r"(error|fault): |\b\w*(Error|Exception): ")


def _tail(path: str, lines: int = 3) -> str:
    """The last lines of a log, after the last error line above them (a
    launcher's own closing lines would otherwise hide the workers' error)."""
    with open(path, errors="replace") as f:
        text = [" ".join(line.split()) for line in f if line.strip()]
    tail = text[-lines:]
    causes = [line for line in text[:-lines] if _CAUSE.search(line)]
    return " | ".join(causes[-1:] + tail) or "(nothing on stderr)"


def run(name: str, argv: list, output_dir: str, timeout_s: float) -> float:
    """Run one training to completion within `timeout_s`; return its seconds."""
    out_log = os.path.join(output_dir, f"{name}.stdout.log")
    err_log = os.path.join(output_dir, f"{name}.stderr.log")
    env = {**os.environ}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    progress(f"run {name}: started: {shlex.join(argv)}")
    started = time.monotonic()
    with open(out_log, "w") as out, open(err_log, "w") as err:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                                start_new_session=True)
        try:
            status = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            raise UsageError(f"run {name} did not finish within --timeout_s={timeout_s:g}; "
                             f"stopped; stderr: {_tail(err_log)}") from None
        except Interrupted:
            # The run is in its own session (so a launcher's workers can be
            # stopped as a group): a signal to us must be passed on.
            _stop(proc)
            raise
    seconds = time.monotonic() - started
    if status != 0:
        how = (f"exit status {status}" if status > 0
               else f"signal {signal.Signals(-status).name}")
        raise UsageError(f"run {name} failed with {how}: {_tail(err_log)} "
                         f"(full log: {err_log})")
    progress(f"run {name}: finished in {seconds:.1f}s")
    return seconds


# -- reading the runs -----------------------------------------------------------
def read_scalars(log_dir: str) -> dict:
    """{tag: {step: value}} of every scalar in the event files of `log_dir`."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf  # only once both runs are done: bad input stays instant

    # summary_iterator logs a deprecation notice (it still works in TF 2.21).
    std_logging.getLogger("tensorflow").setLevel(std_logging.ERROR)
    scalars: dict = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.HasField("tensor"):
                    number = float(tf.make_ndarray(value.tensor).reshape(-1)[0])
                else:
                    number = float(value.simple_value)
                scalars.setdefault(value.tag, {})[int(event.step)] = number
    return scalars


def read_run(name: str, model_dir: str) -> dict:
    """The run's summary.json and its train scalars; a missing loss curve is an error."""
    try:
        with open(os.path.join(model_dir, "summary.json")) as f:
            summary = json.load(f)
    except (OSError, ValueError) as error:
        raise UsageError(f"run {name} left no readable {model_dir}/summary.json ({error})") \
            from None
    train_dir = os.path.join(model_dir, "tensorboard", "train")
    scalars = read_scalars(train_dir)
    if not scalars.get("loss"):
        raise UsageError(f"run {name} wrote no 'loss' scalars to {train_dir}")
    return {"summary": summary, "scalars": scalars}


def compare(opts, shared: list) -> int:
    argvs = commands(opts, shared)
    prepare_output(opts.output_dir, argvs)
    seconds = {name: run(name, argv, opts.output_dir, opts.timeout_s)
               for name, argv in argvs.items()}
    runs = {name: read_run(name, os.path.join(opts.output_dir, name)) for name in argvs}
    try:
        result = divergence(runs[REFERENCE]["scalars"]["loss"],
                            runs[opts.strategy]["scalars"]["loss"],
                            window=opts.window, tolerance=opts.tolerance)
    except ValueError as error:  # e.g. a run resumed past the other's last step
        raise UsageError(f"cannot compare the loss curves: {error}") from None
    plot(result, (REFERENCE, opts.strategy), os.path.join(opts.output_dir, PLOT))
    text = report(opts, argvs, runs, result, seconds)
    with open(os.path.join(opts.output_dir, REPORT), "w") as f:
        f.write(text)
    print(text, flush=True)
    progress(f"{'diverged' if result.diverged else 'within tolerance'}: largest smoothed "
             f"relative gap {result.max_relative_gap:.4g} (tolerance {opts.tolerance:g}); "
             f"report and plot in {opts.output_dir}")
    return 1 if result.diverged else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is not signal.SIG_IGN:  # e.g. SIGINT in a background job
            signal.signal(signum, _interrupt)
    try:
        opts, shared = parse_args(argv)
        return compare(opts, shared)
    except UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr, flush=True)
        return 2
    except Interrupted as interrupted:
        print(f"{PROG}: interrupted by {interrupted}; the running training (if any) was "
              "stopped", file=sys.stderr, flush=True)
        return 128 + interrupted.signum


if __name__ == "__main__":
    sys.exit(main())
