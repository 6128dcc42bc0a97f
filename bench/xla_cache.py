"""XLA executables shared between processes: what a process start costs with and without.

    .venv/bin/python bench/xla_cache.py [--steps=4]

Each row is one configuration started as a user starts it, three times in a
fresh cache folder (`TFDIST_CACHE_DIR`): with sharing off
(`TFDIST_XLA_CACHE=0`), then on and cold (it compiles and publishes), then on
and warm (a later process, a restart or a planner trial: it finds the
executables). Prints the CPU-seconds and wall seconds of each (the whole
process tree: start-up, tracing, compiling, the steps) and the warm/off
ratios, and checks that the three runs end at the same loss. Figures:
bench/results/xla_cache.md.

Run time: about a minute (nine process starts, one of them a 2-worker cluster).
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import BIN, LAUNCH, MODELS, TRAIN, Clock, finish, print_row  # noqa: E402

PEAK = os.path.join(BIN, "tfdist-peak")

NAME = "xla_cache"
TITLE = "XLA executables shared between processes (bench/xla_cache.py)"
HEADER = ["configuration", "off CPU s", "cold CPU s", "warm CPU s", "warm / off CPU",
          "off wall s", "warm wall s", "same loss"]
CONFIGS = {
    "mlp, one process": ([TRAIN], MODELS["mlp"] + ["--strategy=default"]),
    "transformer, one process": ([TRAIN], MODELS["transformer"] + ["--strategy=default"]),
    "mlp, multi_worker x2": ([LAUNCH, "--workers=2", "--", TRAIN],
                             MODELS["mlp"] + ["--strategy=multi_worker"]),
}


def _run(prefix, flags, env) -> tuple:
    """(CPU-seconds of the process tree, wall seconds, loss)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    result = subprocess.run([*prefix, *flags], env=env, capture_output=True, text=True,
                            timeout=900)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(prefix + flags)} failed:\n{result.stderr[-2000:]}")
    # The chief's summary line (under tfdist-launch prefixed with its task).
    summary = json.loads(next(line[line.index("{"):] for line in reversed(
        result.stdout.splitlines()) if '{"' in line))
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return cpu, wall, summary["loss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    clock, rows = Clock(), []
    cache = tempfile.mkdtemp(prefix="bench-xla-cache-")
    env = {**os.environ, "TFDIST_CACHE_DIR": cache, "TF_CPP_MIN_LOG_LEVEL": "2",
           "TFDIST_XLA_CACHE": "1"}   # on whatever the CPU; the "off" rows turn it off
    env.pop("TF_XLA_FLAGS", None)
    # The matmul peak (for MFU) measured once first, not inside the first row.
    subprocess.run([PEAK], env=env, capture_output=True, timeout=300, check=True)
    for name, (prefix, model_flags) in CONFIGS.items():
        flags = [*model_flags, "--synthetic", "--jit_compile=on", "--global_batch_size=64",
                 f"--train_steps={args.steps}", f"--steps_per_loop={args.steps}"]
        shutil.rmtree(os.path.join(cache, "xla"), ignore_errors=True)   # cold again
        off = _run(prefix, flags, {**env, "TFDIST_XLA_CACHE": "0"})
        cold = _run(prefix, flags, env)
        warm = _run(prefix, flags, env)
        row = [name, f"{off[0]:.1f}", f"{cold[0]:.1f}", f"{warm[0]:.1f}",
               f"{warm[0] / off[0]:.2f}", f"{off[1]:.1f}", f"{warm[1]:.1f}",
               "yes" if off[2] == cold[2] == warm[2] else f"no: {off[2]}, {cold[2]}, {warm[2]}"]
        print_row(row, HEADER)
        rows.append(row)
    description = (
        "Each configuration started three times in a fresh cache folder: sharing off "
        "(`TFDIST_XLA_CACHE=0`), on and cold (compiles, publishes), on and warm (finds "
        f"the executables); `--jit_compile=on --synthetic`, {args.steps} steps, batch 64. "
        "CPU-seconds of the whole process tree (start-up, tracing, compiling, steps); "
        "\"same loss\": the three runs' final losses are equal.")
    shutil.rmtree(cache, ignore_errors=True)
    finish(NAME, TITLE, description, rows, HEADER, clock)


if __name__ == "__main__":
    main()
