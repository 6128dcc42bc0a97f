"""`tfdist-train`: parse flags, build, train, print the run summary.

User errors (bad flags, bad config, data that cannot be prepared, ...) are
reported as one line on stderr with exit status 2 and no traceback.

Your own absl script gets the same handling with `tfdist.app.run(main)`
(see examples/custom_script.py): absl parses its flags and tfdist's together,
and `main` may raise `tfdist.UsageError`.

`--help` (`-h`, `-?`, `--helpshort`) prints tfdist's flags by group and, for
your script, its own flags after them (tfdist/help.py), before TensorFlow loads.
"""

from __future__ import annotations

import functools
import json
import logging as std_logging
import os
import sys

# Quiet TensorFlow's C++ start-up chatter unless the user asked for it.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

from absl import app, flags, logging  # noqa: E402

from tfdist import flags as tfdist_flags  # noqa: E402  (defines the flags)
from tfdist import help as tfdist_help  # noqa: E402
from tfdist import models, strategies  # noqa: E402  (registries; no TensorFlow yet)
from tfdist.startup import load  # noqa: E402
from tfdist.strategies import records  # noqa: E402
from tfdist.errors import UsageError, WorkerFault  # noqa: E402
from tfdist.training.interrupts import PREEMPTED_EXIT, Preempted  # noqa: E402

USAGE_ERROR = 2
PROG = "tfdist-train"


def _prog() -> str:
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else PROG
    return name or PROG


def usage_exit(message: str) -> None:
    print(f"{_prog()}: error: {message}", file=sys.stderr)
    sys.exit(USAGE_ERROR)


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parse, but a bad flag exits 2 with one line (absl exits 1)."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as error:
        usage_exit(" ".join(str(error).split()))
    except UnicodeDecodeError as error:   # a flagfile that is not UTF-8
        usage_exit(f"a --flagfile is not UTF-8 text: {error.reason} at byte {error.start}")
    except ValueError as error:   # absl: a negated boolean given a value, e.g. --nosynthetic=1
        usage_exit(" ".join(str(error).split()))


def _guarded(main):
    """`main` with tfdist's exits: a `UsageError` is one line and status 2, a
    `WorkerFault` one line and status 1 at once, a preemption (SIGTERM) status
    143 after its checkpoint, Ctrl-C status 130."""

    @functools.wraps(main)
    def guarded(argv):
        logging.set_verbosity(logging.INFO)
        # TensorFlow's own Python INFO lines (one per traced collective) drown the progress.
        std_logging.getLogger("tensorflow").setLevel(std_logging.WARNING)
        try:
            return main(argv)
        except UsageError as error:
            usage_exit(str(error))
        except WorkerFault as fault:
            # Exit at once: with a dead peer, TensorFlow's teardown can block.
            sys.stderr.write(f"{_prog()}: fault: {fault}\n")
            sys.stderr.flush()
            os._exit(1)
        except Preempted as preempted:
            sys.stderr.write(f"{_prog()}: {preempted}\n")
            sys.stderr.flush()
            # At once, as for a fault: a peer may already be gone.
            os._exit(PREEMPTED_EXIT)
        except KeyboardInterrupt:
            print(f"{_prog()}: interrupted; the last complete checkpoint (if any) is intact",
                  file=sys.stderr)
            sys.exit(130)
    return guarded


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        usage_exit(f"unexpected arguments {' '.join(argv[1:])!r}; flags must start with --")
    config = tfdist_flags.run_config()
    strategies.check_name(config.strategy.name)
    strategies.check_cluster(config.strategy)
    models.check_name(config.model.name)
    if strategies.is_auto(config.strategy) and (tfdist_flags.print_stages()
                                                or tfdist_flags.print_layouts()):
        usage_exit("--print_stages and --print_layouts describe one engine's layout; "
                   "--strategy=auto chooses the engine as it trains: run tfdist-plan and "
                   "pass them with its flagfile")
    api = load("api")   # TensorFlow loads here, after the flags are known good
    if tfdist_flags.print_stages():
        print(api.describe_stages(config), flush=True)
        return
    if tfdist_flags.print_layouts():
        print(api.describe_layouts(config), flush=True)
        return
    result = api.train(config, plan_options=tfdist_flags.plan_options()
                       if strategies.is_auto(config.strategy) else None)
    if result.is_chief:
        print(json.dumps(result.summary, sort_keys=True), flush=True)


def export_main(argv: list[str]) -> None:
    """`tfdist-export --model_dir=D --export_dir=E`: D's latest checkpoint, no training."""
    if len(argv) > 1:
        usage_exit(f"unexpected arguments {' '.join(argv[1:])!r}; flags must start with --")
    model_dir, export_dir = flags.FLAGS.model_dir, flags.FLAGS.export_dir
    if not model_dir or not export_dir:
        usage_exit("tfdist-export needs --model_dir (a run's directory) and --export_dir "
                   "(where to write model.keras and saved_model/)")
    exporting = load("exporting")   # TensorFlow loads here
    print(json.dumps(exporting.export_checkpoint(model_dir, export_dir), sort_keys=True),
          flush=True)


def plan_main(argv: list[str]) -> None:
    """`tfdist-plan [run flags]`: choose the engine and options; write the flagfile."""
    if len(argv) > 1:
        usage_exit(f"unexpected arguments {' '.join(argv[1:])!r}; flags must start with --")
    config = tfdist_flags.run_config()
    models.check_name(config.model.name)
    options = tfdist_flags.plan_options()
    plan_file, explain = tfdist_flags.plan_output()
    target = os.path.abspath(plan_file)
    if os.path.isdir(target) or not os.path.isdir(os.path.dirname(target)):
        usage_exit(f"--plan_file={plan_file}: must be a file in an existing directory")
    planner = load("planner")   # TensorFlow loads here, after the flags are known good
    plan = planner.plan(config, log=lambda line: print(f"{_prog()}: {line}", flush=True),
                        **options)
    print(plan.table(), flush=True)
    if explain:
        print(plan.explain(), flush=True)
    temporary = f"{target}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        f.write(plan.flagfile())
    os.replace(temporary, target)
    runner_up, hosts = plan.runner_up, plan.facts.host.hosts
    expected = plan.winner.expected_rate(plan.facts.global_batch)
    print(f"{_prog()}: chose {plan.winner.describe()} "
          f"({plan.winner.measured_rate():,.0f} examples/s measured"
          + (f" here, {expected:,.0f} expected over {hosts} hosts" if hosts > 1 else "")
          + (f"; runner-up {runner_up.describe()}, {runner_up.measured_rate():,.0f}"
             if runner_up else "")
          + f"); wrote {plan_file}: {_start(plan, plan_file)}", flush=True)


def _start(plan, plan_file: str) -> str:
    """How to run the plan: on this host, or, over several, how its engine starts."""
    engine, host = strategies.engine(plan.winner.engine), plan.facts.host
    if host.hosts > 1:
        return (f"tfdist-train --flagfile={plan_file} in each of its {host.processes} "
                f"processes ({records.command(engine)})")
    return records.local_command(engine, host.processes, f"--flagfile={plan_file}")


PLAN_HELP = """Choose the engine and its options for the model, data and batch the run
flags describe, on this host: every engine's candidates, their predicted memory and
time, trials of the best, a ranked table, and the winner as a flagfile:

    tfdist-plan --model=mlp --global_batch_size=256 && tfdist-train --flagfile=plan.cfg"""


def _plan_help() -> str:
    return tfdist_help.program_help(_prog(), description=PLAN_HELP)


def run_plan() -> None:
    """Console-script entry point of tfdist-plan."""
    tfdist_help.install(_plan_help)
    app.run(_guarded(plan_main), flags_parser=parse_flags)


TRAIN_HELP = """Train a Keras 3 model under one of TensorFlow's distribution engines
(--strategy) and print the run summary as one JSON line. Canned runs are flagfiles:

    tfdist-train --flagfile=configs/demo.cfg [--flag=value ...]

Several processes (multi_worker, parameter_server): tfdist-launch --workers=N --
tfdist-train ...; Horovod: horovodrun -np N --gloo tfdist-train --strategy=horovod."""

EXPORT_FLAGS = ("model_dir", "export_dir")
EXPORT_HELP = """Write model.keras and a SavedModel (saved_model/, signature serve) into
--export_dir from the latest checkpoint of the tfdist-train run in --model_dir, without
training (the run's run.json says how to rebuild its model)."""


def _train_help() -> str:
    return tfdist_help.program_help(_prog(), description=TRAIN_HELP)


def _script_help() -> str:
    """A user's script: its docstring, tfdist's groups, then its own flags."""
    return tfdist_help.program_help(_prog(), description=sys.modules["__main__"].__doc__ or "",
                                    script=True)


def _export_help() -> str:
    return tfdist_help.program_help(
        _prog(), usage=f"usage: {_prog()} --model_dir=DIR --export_dir=DIR",
        description=EXPORT_HELP, only=EXPORT_FLAGS)


def run_export() -> None:
    """Console-script entry point of tfdist-export."""
    tfdist_help.install(_export_help)
    app.run(_guarded(export_main), flags_parser=parse_flags)


def run(user_main=None) -> None:
    """Run `user_main(argv)` (default: tfdist-train's) under absl with tfdist's
    flag parsing, grouped --help and error handling; the console-script entry point."""
    tfdist_help.install(_script_help if user_main else _train_help)
    app.run(_guarded(user_main or main), flags_parser=parse_flags)


if __name__ == "__main__":
    run()
