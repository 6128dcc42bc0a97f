"""DTensor meshes side by side: throughput and per-device parameter + optimizer bytes.

    .venv/bin/python bench/dtensor.py [--seconds=S] [--steps=N] [--batch=B]
        [--models=transformer,mlp] [--timeout=T]

For the transformer and a wide mlp, each mesh (1x1, 2x1, 1x2, 2x2 as
batch x model, on as many virtual CPUs) and 2x2 with --shard_optimizer_state
(ZeRO-1) trains in its own process on synthetic data with Adam. Each row is
printed as soon as it is measured: examples/sec, bytes of parameters and of
optimizer state held by one device, and their sum as a ratio of 1x1's.
On a 2-core CPU the meshes' virtual devices share the same cores, so
examples/sec shows what the sharding's collectives cost, not a speed-up;
the memory columns are the point of tensor sharding.

Runs are sized by time: per model, a short 1x1 probe (PROBE_STEPS steps)
gives the step time, and every mesh of that model then trains the same
number of steps, about --seconds of timed loops on 1x1 (the first loop of
each run compiles and is not timed). --steps=N trains exactly N steps (N/4
per loop) instead. A run still going after --timeout seconds is stopped and
its row says `timed out`. The table also goes to bench/results/dtensor.md
and bench/results/report.md.

Run time: about 3.5 minutes on this 2-core Xeon (AVX-512) at the defaults,
estimated from tiny runs (~10-15 s to start each of the 12 runs; 2x2 steps
take ~2x 1x1's).
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from common import (  # noqa: E402
    TRAIN, Clock, finish, print_row, run_sizing, run_summary, RunFailed)
from tfdist.observe import hardware  # noqa: E402

MODELS = {
    "transformer": ["--model=transformer", "--model_width=256", "--model_depth=2",
                    "--num_heads=4", "--dataset=tfdist_tokens"],
    "mlp": ["--model=mlp", "--model_width=1024", "--model_depth=2", "--dataset=tfdist_shapes"],
}
# (label, mesh, extra flags); ratios are against the first.
MESHES = [("1x1", "batch:1,model:1", []), ("2x1", "batch:2,model:1", []),
          ("1x2", "batch:1,model:2", []), ("2x2", "batch:2,model:2", []),
          ("2x2 ZeRO-1", "batch:2,model:2", ["--shard_optimizer_state"])]
HEADER = ["model", "mesh", "steps", "ex/s", "ratio ex/s", "param B/device", "optim B/device",
          "param+optim vs 1x1"]


def command(model_flags, mesh, extra, batch, train_steps, per_loop):
    devices = 1
    for axis in mesh.split(","):
        devices *= int(axis.split(":")[1])
    return [TRAIN, "--strategy=dtensor", f"--mesh={mesh}", f"--virtual_devices={devices}",
            "--synthetic", "--optimizer=adam", f"--train_steps={train_steps}",
            f"--steps_per_loop={per_loop}", f"--global_batch_size={batch}", *model_flags,
            *extra]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0,
                        help="timed seconds per run on the first mesh (after its compiling "
                             "loop); the other meshes train as many steps")
    parser.add_argument("--steps", type=int, default=None,
                        help="train exactly this many steps per run instead (N/4 per loop)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--timeout", type=float, default=150,
                        help="seconds after which one run is stopped and reported as timed out")
    args = parser.parse_args()
    print(f"# dtensor meshes on {hardware.describe()}", flush=True)
    clock, rows = Clock(), []
    for name in args.models.split(","):
        model_flags = MODELS[name]
        label, mesh, extra = MESHES[0]
        sizing = run_sizing(args, lambda steps, loop: command(
            model_flags, mesh, extra, args.batch, steps, loop), f"{name} ({label})")
        base = None   # the first mesh's (examples/sec, parameter + optimizer bytes)
        for index, (label, mesh, extra) in enumerate(MESHES):
            row = [name, label, "-" if isinstance(sizing, RunFailed) else sizing[0]]
            try:
                if isinstance(sizing, RunFailed):
                    raise RunFailed(f"probe {sizing}")
                s = run_summary(command(model_flags, mesh, extra, args.batch, *sizing),
                                args.timeout)
                memory = s["device_parameter_bytes"] + s["device_optimizer_bytes"]
                base = (s["examples_per_sec"], memory) if index == 0 else base
                row += [f"{s['examples_per_sec']:.0f}",
                        f"{s['examples_per_sec'] / base[0]:.2f}" if base else "-",
                        f"{s['device_parameter_bytes']:,}", f"{s['device_optimizer_bytes']:,}",
                        f"{memory / base[1]:.2f}" if base else "-"]
            except RunFailed as failure:
                row += [str(failure), "-", "-", "-", "-"]
            rows.append(row)
            print_row(row, HEADER)
    how = (f"{args.steps} steps per run" if args.steps else
           f"steps per model sized by a 1x1 probe for about {args.seconds:g} s of timed loops "
           "on 1x1")
    body = (f"`--strategy=dtensor` on as many virtual CPUs as the mesh has devices (batch x "
            f"model), synthetic data, Adam, global batch {args.batch}; transformer width 256 "
            f"depth 2, mlp width 1024 depth 2; {how}, the first loop (compiling) not timed. "
            "Ratios against 1x1; the virtual devices share this host's cores.")
    finish("dtensor", "DTensor meshes (bench/dtensor.py)", body, rows, HEADER, clock)


if __name__ == "__main__":
    main()
