"""DTensor meshes and ZeRO stages side by side: throughput and per-device bytes.

    .venv/bin/python bench/dtensor.py [--seconds=S] [--steps=N] [--batch=B]
        [--models=transformer,mlp] [--timeout=T] [--fits]

For the transformer and a wide mlp, each mesh (1x1, 2x1, 1x2, 2x2, 4x1 as
batch x model, on as many virtual CPUs) and ZeRO stage (`--zero_stage` 1 and
2 on 2x2, 2 and 3 on 4x1, 3 on 2x2) trains in its own process on synthetic
data with Adam. Each row is printed as soon as it is measured: examples/sec,
and the bytes of parameters, gradients and optimizer state one device holds,
read from the shards by `--print_layouts` (a second process per row: it builds
the model on the mesh and takes one backward pass), their sum as a ratio of
1x1's, and the largest weight a device gathers for use (ZeRO-3).
On a 2-core CPU the meshes' virtual devices share the same cores, so
examples/sec shows what the sharding's collectives cost, not a speed-up;
the memory columns are the point of sharding.

Runs are sized by time: per model, a short 1x1 probe (PROBE_STEPS steps)
gives the step time, and every row of that model then trains the same
number of steps, about --seconds of timed loops on 1x1 (the first loop of
each run compiles and is not timed). --steps=N trains exactly N steps (N/4
per loop) instead. A run still going after --timeout seconds is stopped and
its row says `timed out`. The table also goes to bench/results/dtensor.md
and bench/results/report.md. --fits then runs the "does it fit" proof
(bench/fits.py: a model whose state is 1.3x a per-process memory cap trains
under ZeRO-3 on four capped processes and is killed in one).
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from common import (  # noqa: E402
    TRAIN, Clock, finish, print_row, run_lines, run_sizing, run_summary, RunFailed)
from tfdist.observe import hardware  # noqa: E402

MODELS = {
    "transformer": ["--model=transformer", "--model_width=256", "--model_depth=2",
                    "--num_heads=4", "--dataset=tfdist_tokens"],
    "mlp": ["--model=mlp", "--model_width=1024", "--model_depth=2", "--dataset=tfdist_shapes"],
}
# (label, mesh, extra flags); ratios are against the first.
MESHES = [("1x1", "batch:1,model:1", []), ("2x1", "batch:2,model:1", []),
          ("1x2", "batch:1,model:2", []), ("2x2", "batch:2,model:2", []),
          ("2x2 ZeRO-1", "batch:2,model:2", ["--zero_stage=1"]),
          ("2x2 ZeRO-2", "batch:2,model:2", ["--zero_stage=2"]),
          ("2x2 ZeRO-3", "batch:2,model:2", ["--zero_stage=3"]),
          ("4x1", "batch:4,model:1", []),
          ("4x1 ZeRO-2", "batch:4,model:1", ["--zero_stage=2"]),
          ("4x1 ZeRO-3", "batch:4,model:1", ["--zero_stage=3"])]
HEADER = ["model", "mesh", "steps", "ex/s", "ratio ex/s", "param B/device", "grad B/device",
          "optim B/device", "p+g+o vs 1x1", "largest gathered B"]


def layout_bytes(command_line, timeout) -> dict:
    """Per-device bytes of parameters, gradients and optimizer state, and the
    largest gathered weight, as `--print_layouts` reads them from the shards."""
    found = {}
    for line in run_lines([*command_line, "--print_layouts"], timeout).splitlines():
        for kind in ("parameters", "gradients", "optimizer"):
            if line.startswith(f"{kind} total: "):
                found[kind] = int(line.split("per device ")[1].split()[0].replace(",", ""))
        if line.startswith("largest gathered weight: "):
            found["gathered"] = int(line.split(", ")[-1].split()[0].replace(",", ""))
    if not {"parameters", "gradients", "optimizer"} <= found.keys():
        raise RunFailed("fails: no layout totals in --print_layouts' output")
    return found


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
    parser.add_argument("--fits", action="store_true",
                        help="then the 'does it fit' row: bench/fits.py with its defaults "
                             "(~8 minutes, 12 GiB of memory)")
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
                line = command(model_flags, mesh, extra, args.batch, *sizing)
                s = run_summary(line, args.timeout)
                b = layout_bytes(line, args.timeout)
                memory = b["parameters"] + b["gradients"] + b["optimizer"]
                base = (s["examples_per_sec"], memory) if index == 0 else base
                row += [f"{s['examples_per_sec']:.0f}",
                        f"{s['examples_per_sec'] / base[0]:.2f}" if base else "-",
                        f"{b['parameters']:,}", f"{b['gradients']:,}", f"{b['optimizer']:,}",
                        f"{memory / base[1]:.2f}" if base else "-",
                        f"{b['gathered']:,}" if "gathered" in b else "-"]
            except RunFailed as failure:
                row += [str(failure), "-", "-", "-", "-", "-", "-"]
            rows.append(row)
            print_row(row, HEADER)
    how = (f"{args.steps} steps per run" if args.steps else
           f"steps per model sized by a 1x1 probe for about {args.seconds:g} s of timed loops "
           "on 1x1")
    body = (f"`--strategy=dtensor` on as many virtual CPUs as the mesh has devices (batch x "
            f"model), synthetic data, Adam, global batch {args.batch}; transformer width 256 "
            f"depth 2, mlp width 1024 depth 2; {how}, the first loop (compiling) not timed. "
            "Ratios against 1x1; the virtual devices share this host's cores. Bytes per "
            "device read from the shards by --print_layouts (gradients: as one backward pass "
            "leaves them).")
    finish("dtensor", "DTensor meshes (bench/dtensor.py)", body, rows, HEADER, clock)
    if args.fits:
        import subprocess
        subprocess.run([sys.executable, os.path.join(HERE, "fits.py")], check=False)


if __name__ == "__main__":
    main()
