"""Bytes each ZeRO stage's collectives move per training step, measured.

    sudo .venv/bin/python bench/zero_traffic.py [--width=1024] [--depth=2] [--workers=4]

Each stage (`--zero_stage` 0-3) trains the mlp on `batch:N,model:1` over N
processes of one CPU each (`tfdist-launch --workers=N`, `--strategy=dtensor`,
synthetic data, Adam). The launcher runs the cluster in a private network
namespace whose only interface is loopback, so every byte the processes send
each other crosses that `lo`, whose counter (/proc/<worker>/net/dev) is read
until the cluster ends. Two runs per stage, of A and B steps in one loop each
(the same start-up, compilation, evaluation and final copy), give the bytes
per step as their difference / (B - A). Printed per process, in units of the
model's float32 bytes Psi, beside a ring's theory for N processes. Needs root
(or unprivileged user namespaces) for the private namespace; says so and
exits 2 otherwise.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from common import BIN, REPO, Clock, finish, print_row  # noqa: E402
from tfdist.observe import hardware  # noqa: E402

HEADER = ["stage", "bytes/step (all)", "per process (Psi)", "ring theory (Psi)"]
THEORY = {0: "all-reduce", 1: "reduce-scatter + all-gather", 2: "reduce-scatter + all-gather",
          3: "all-gather x2 + reduce-scatter"}


def theory(stage: int, n: int) -> float:
    share = (n - 1) / n
    return {0: 2, 1: 2, 2: 2, 3: 3}[stage] * share


def loopback_bytes(args, stage: int, steps: int, model_dir: str) -> int:
    """The cluster's loopback bytes over a run of `steps` steps (its summary
    goes to `model_dir`)."""
    command = [os.path.join(BIN, "tfdist-launch"), f"--workers={args.workers}",
               "--network=private", "--", os.path.join(BIN, "tfdist-train"),
               "--strategy=dtensor", f"--mesh=batch:{args.workers},model:1",
               "--virtual_devices=1", f"--zero_stage={stage}", "--model=mlp",
               f"--model_width={args.width}", f"--model_depth={args.depth}", "--synthetic",
               "--dataset=tfdist_shapes", "--optimizer=adam", "--global_batch_size=32",
               f"--train_steps={steps}", f"--steps_per_loop={steps}", "--jit_compile=off",
               f"--model_dir={model_dir}"]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    errors = tempfile.TemporaryFile("w+")   # a pipe read only at the end could fill
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                               stderr=errors, text=True)
    seen = 0
    while process.poll() is None:
        seen = max(seen, _cluster_lo(process.pid))
        time.sleep(0.2)
    if process.returncode != 0:
        errors.seek(0)
        sys.exit(f"zero_traffic.py: stage {stage}, {steps} steps failed: "
                 f"{errors.read().strip().splitlines()[-1:]}")
    return seen


def _cluster_lo(launcher: int) -> int:
    """Bytes received on `lo` in the namespace of one of `launcher`'s workers."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == launcher:
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            if parent != launcher:
                continue
            with open(f"/proc/{pid}/net/dev") as f:
                for line in f:
                    if line.strip().startswith("lo:"):
                        return int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", default="2,6", help="A,B: the two runs' step counts")
    args = parser.parse_args()
    a, b = (int(s) for s in args.steps.split(","))
    print(f"# ZeRO traffic on {hardware.describe()}", flush=True)
    clock, rows, psi = Clock(), [], None
    with tempfile.TemporaryDirectory() as scratch:
        for stage in range(4):
            runs = [loopback_bytes(args, stage, n, os.path.join(scratch, f"{stage}-{n}"))
                    for n in (a, b)]
            if psi is None:   # stage 0 on batch:N,model:1: every device holds the whole model
                with open(os.path.join(scratch, f"0-{b}", "summary.json")) as f:
                    psi = json.load(f)["device_parameter_bytes"]
            per_step = (runs[1] - runs[0]) / (b - a)
            row = [stage, f"{per_step:,.0f}", f"{per_step / args.workers / psi:.2f}",
                   f"{theory(stage, args.workers):.2f} ({THEORY[stage]})"]
            rows.append(row)
            print_row(row, HEADER)
    body = (f"`--strategy=dtensor` on batch:{args.workers},model:1 over {args.workers} "
            f"processes (tfdist-launch, private network namespace), mlp width {args.width} "
            f"depth {args.depth}, Adam, global batch 32; loopback bytes of a {b}-step run "
            f"minus a {a}-step run, per step; Psi = the model's float32 bytes ({psi:,}).")
    finish("zero_traffic", "ZeRO stages: bytes moved per step (bench/zero_traffic.py)", body,
           rows, HEADER, clock)


if __name__ == "__main__":
    main()
