"""DTensor meshes side by side: throughput and per-device parameter + optimizer bytes.

    .venv/bin/python bench/dtensor.py [--steps=N] [--batch=B]

For the transformer and a wide mlp, each mesh (1x1, 2x1, 1x2, 2x2 as
batch x model, on as many virtual CPUs) and 2x2 with --shard_optimizer_state
(ZeRO-1) trains in its own process on synthetic data with Adam. Each row is
printed as soon as it is measured: examples/sec, bytes of parameters and of
optimizer state held by one device, and their sum as a ratio of 1x1's.
On a 2-core CPU the meshes' virtual devices share the same cores, so
examples/sec shows what the sharding's collectives cost, not a speed-up;
the memory columns are the point of tensor sharding.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import TRAIN, summary, table  # noqa: E402
from tfdist.observe import hardware  # noqa: E402

MODELS = {
    "transformer": ["--model=transformer", "--model_width=256", "--model_depth=2",
                    "--num_heads=4", "--dataset=tfdist_tokens"],
    "mlp": ["--model=mlp", "--model_width=1024", "--model_depth=2", "--dataset=tfdist_shapes"],
}
MESHES = [("1x1", "batch:1,model:1", []), ("2x1", "batch:2,model:1", []),
          ("1x2", "batch:1,model:2", []), ("2x2", "batch:2,model:2", []),
          ("2x2 ZeRO-1", "batch:2,model:2", ["--shard_optimizer_state"])]
HEADER = ["model", "mesh", "ex/s", "ratio ex/s", "param B/device", "optim B/device",
          "param+optim vs 1x1"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    print(f"# dtensor meshes on {hardware.describe()}")
    print(f"synthetic data, Adam, global batch {args.batch}, {args.steps} steps "
          "(the first loop, which compiles, is not timed)\n", flush=True)
    rows = []
    for name, model_flags in MODELS.items():
        base = None
        for label, mesh, extra in MESHES:
            batch, model = (int(axis.split(":")[1]) for axis in mesh.split(","))
            s = summary([TRAIN, "--strategy=dtensor", f"--mesh={mesh}",
                         f"--virtual_devices={batch * model}", "--synthetic", "--optimizer=adam",
                         f"--train_steps={args.steps}", f"--steps_per_loop={args.steps // 4}",
                         f"--global_batch_size={args.batch}", *model_flags, *extra])
            memory = s["device_parameter_bytes"] + s["device_optimizer_bytes"]
            base = base or (s["examples_per_sec"], memory)
            rows.append([name, label, f"{s['examples_per_sec']:.0f}",
                         f"{s['examples_per_sec'] / base[0]:.2f}",
                         f"{s['device_parameter_bytes']:,}", f"{s['device_optimizer_bytes']:,}",
                         f"{memory / base[1]:.2f}"])
            print(table(rows[-1:], HEADER).splitlines()[-1], flush=True)
    print()
    print(table(rows, HEADER))


if __name__ == "__main__":
    main()
