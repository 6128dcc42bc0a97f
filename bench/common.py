"""Shared helpers for the benchmarks: run tfdist-train in real processes, read
the run summary (the JSON line the chief prints), print ratio tables.

Benchmarks compare configurations side by side in one invocation, because
absolute times on shared 2-core machines mean little; ratios travel better.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
import sys

BIN = os.path.dirname(sys.executable)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(BIN, "tfdist-train")
LAUNCH = os.path.join(BIN, "tfdist-launch")
HOROVODRUN = os.path.join(BIN, "horovodrun")

# Model shapes: an FFN-heavy MLP and the small Transformer decoder.
MODELS = {
    "mlp": ["--model=mlp", "--model_width=1024", "--model_depth=3", "--dataset=tfdist_shapes"],
    "transformer": ["--model=transformer", "--model_width=128", "--model_depth=2",
                    "--dataset=tfdist_tokens"],
}


def summary(command: list[str], timeout: float = 900) -> dict:
    """Run `command`; return the run summary JSON the chief printed."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=timeout)
    if result.returncode != 0:
        sys.exit(f"benchmark run failed ({' '.join(command)}):\n{result.stderr[-3000:]}")
    for line in reversed(result.stdout.splitlines()):
        start = line.find("{")
        if start >= 0:
            return json.loads(line[start:])
    sys.exit(f"no run summary in the output of {' '.join(command)}")


def table(rows: list[list], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    line = lambda r: "  ".join(str(x).rjust(w) for x, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def markdown_table(rows: list[list], header: list[str]) -> str:
    lines = ["| " + " | ".join(map(str, header)) + " |",
             "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


RESULTS = os.path.join(REPO, "bench", "results")
# The order sections appear in the collected report.
SECTIONS = ("vs_fit", "profile_vs_fit", "features", "scaling", "horovod_vs_multi_worker", "allreduce", "dtensor",
            "depthwise", "dtensor_init", "input_order", "soak", "parameter_server", "staleness_sim",
            "slow_link",
            "compression_accuracy_cnn", "compression_accuracy_transformer",
            "compression_accuracy_transformer_adam0.001",
            "planner", "planner_memory", "planner_cnn_transformer",
            "planner_memory_cnn_transformer", "planner_link", "xla_cache")


def versions_line() -> str:
    """TensorFlow, Keras and Python versions, without importing TensorFlow."""
    from importlib import metadata
    found = []
    for dist in ("tensorflow-cpu", "tensorflow", "keras"):
        try:
            found.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(found + [f"Python {platform.python_version()}"])


def hardware_header() -> str:
    sys.path.insert(0, REPO)
    from tfdist.observe import hardware
    return (f"Hardware: {hardware.describe()}  \nSoftware: {versions_line()}")


def write_section(name: str, title: str, body: str) -> str:
    """Write `bench/results/<name>.md` (with the hardware it ran on) and rebuild
    `bench/results/report.md` from every section present; return the section."""
    os.makedirs(RESULTS, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = f"## {title}\n\nMeasured {stamp}.  \n{hardware_header()}\n\n{body}\n"
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
        f.write(section)
    parts = [f"# tfdist benchmark report\n\n{hardware_header()}\n\nEach section names the "
             "machine it ran on; sections measured on another machine say so.\n"]
    for other in SECTIONS:
        path = os.path.join(RESULTS, f"{other}.md")
        if os.path.exists(path):
            with open(path) as f:
                parts.append(f.read())
    tmp = os.path.join(RESULTS, f".report.md.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write("\n".join(parts))
    os.replace(tmp, os.path.join(RESULTS, "report.md"))
    return section


def print_row(row: list, header: list[str]) -> None:
    """One result line as soon as it is measured (benchmarks take minutes)."""
    print("  ".join(f"{h}={v}" for h, v in zip(header, row)), flush=True)


# -- Time-budgeted runs -------------------------------------------------------
# A benchmark must finish in minutes on a slow CPU too (AVX2-only, fp16/bf16
# emulated), so runs are sized by time: a short probe gives the seconds per
# step, `sized_steps` turns a budget into steps, and every run has a timeout
# after which its row says so instead of hanging the whole benchmark.

LOOPS = 4          # timed loops per measurement; the first (compiling) loop comes on top
PROBE_STEPS = 4    # a probe: a compiling loop of 2 steps, then a timed loop of 2


class RunFailed(Exception):
    """A run that crashed or ran out of time; str() is what its table cell says."""


def _stop_group(process: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM the run's process group (launchers pass it on to their workers and
    stop them), then SIGKILL what is left (TensorFlow may ignore SIGTERM)."""
    import signal
    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=grace)
            break
        except subprocess.TimeoutExpired:
            continue


def _error_line(stderr: str) -> str:
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    line = next((t for t in reversed(lines) if "rror" in t or "fault" in t),
                lines[-1] if lines else "no output")
    return line[-100:].replace("|", "/")   # it goes into a markdown table


def run_lines(command: list[str], timeout: float) -> str:
    """Run `command` in its own process group; return its stdout. Raises
    RunFailed("timed out (> N s)") after `timeout` seconds (the group is stopped)
    or RunFailed("fails: <last error line>") on a non-zero exit."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop_group(process)
        process.communicate()
        raise RunFailed(f"timed out (> {timeout:.0f} s)") from None
    except BaseException:   # e.g. Ctrl-C: leave no run behind
        _stop_group(process, grace=5.0)
        raise
    if process.returncode != 0:
        raise RunFailed(f"fails: {_error_line(stderr)}")
    return stdout


def run_summary(command: list[str], timeout: float) -> dict:
    """Like `summary`, but a crash or a timeout raises RunFailed (the row says
    so) instead of ending the benchmark."""
    stdout = run_lines(command, timeout)
    for line in reversed(stdout.splitlines()):
        start = line.find("{")
        if start >= 0:
            return json.loads(line[start:])
    raise RunFailed("fails: no run summary in its output")


def step_seconds(run: dict) -> float:
    """Seconds per step of a run summary (its timed loops)."""
    return run["global_batch_size"] / run["examples_per_sec"]


def sized_steps(seconds: float, seconds_per_step: float, loops: int = LOOPS) -> tuple[int, int]:
    """(train_steps, steps_per_loop) for about `seconds` of timed training at
    `seconds_per_step`: `loops` timed loops after the first, which compiles and
    is not timed (so a run trains about (loops + 1) / loops x `seconds`)."""
    per_loop = max(1, math.ceil(seconds / loops / seconds_per_step))
    return (loops + 1) * per_loop, per_loop


def run_sizing(args, command_for, what: str):
    """(train_steps, steps_per_loop) for every run of one model: `--steps` if
    given (N/4 per loop), else sized from a probe of `command_for` for about
    `--seconds` of timed loops; the RunFailed the probe hit otherwise (each
    row of the model then says it)."""
    if args.steps:
        return args.steps, max(1, args.steps // 4)
    try:
        step_s = probe(command_for, args.timeout)
    except RunFailed as failure:
        return failure
    sizing = sized_steps(args.seconds, step_s)
    print(f"{what}: {sizing[0]} steps ({sizing[1]} per loop) per run, from a probe of "
          f"{step_s:.3f} s/step", flush=True)
    return sizing


def probe(command_for, timeout: float) -> float:
    """Seconds per step of `command_for(train_steps, steps_per_loop)`, from a
    short run of PROBE_STEPS steps (half compiling, half timed)."""
    return step_seconds(run_summary(command_for(PROBE_STEPS, PROBE_STEPS // 2), timeout))


class Clock:
    """Wall time since the benchmark started, for its closing line."""

    def __init__(self):
        import time
        self._time = time.monotonic
        self.started = time.monotonic()

    def minutes(self) -> str:
        return f"{(self._time() - self.started) / 60:.1f} min"


def finish(name: str, title: str, description: str, rows: list, header: list,
           clock: "Clock", after: str = "") -> None:
    """A benchmark's end: the table on stdout, its report section (what was
    measured, then the table, then `after`) written and printed, and how
    long it took."""
    print()
    print(table(rows, header))
    print()
    body = f"{description}\n\n{markdown_table(rows, header)}"
    print(write_section(name, title, body + (f"\n\n{after}" if after else "")))
    print(f"{name}: {clock.minutes()}")
