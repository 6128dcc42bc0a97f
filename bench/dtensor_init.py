"""Initial values under ZeRO-3: each shard drawn alone (what tfdist does)
against each variable made whole and then split, and one device's whole
model, side by side, each in a fresh process.

    python bench/dtensor_init.py [--width=2880] [--depth=8] [--repeats=2]

Each process builds the mlp WIDTH x DEPTH (the model of `bench/fits.py` and
`tests/integration/test_zero.py`'s "does it fit" proof) and Adam's slots under
`--strategy=dtensor --mesh=batch:4,model:1 --zero_stage=3` on 4 virtual CPUs
(or under `default` for the one-device row), and prints the seconds it took
and its peak resident memory (getrusage). "whole, then split" is the same
engine with every variable's value made whole first (the slicing path tfdist
takes only for initializers that are not element-wise). One process holds
all four shards here, so the sharded rows show what drawing costs, not a
per-process saving; across four processes each holds a quarter.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

MODES = ("sharded", "whole_then_split", "one_device")


def child(mode: str, width: int, depth: int) -> None:
    sys.path.insert(0, common.REPO)
    import keras

    import tfdist
    from tfdist import models, strategies
    from tfdist.data.spec import DatasetSpec
    from tfdist.strategies.dtensor import init as dtensor_init

    if mode == "whole_then_split":   # no shard drawn alone: every value whole, then sliced
        dtensor_init.grouping = lambda kind, dtype_name: None
    config = (tfdist.StrategyConfig(name="default") if mode == "one_device" else
              tfdist.StrategyConfig(name="dtensor", virtual_devices=4, mesh="batch:4,model:1",
                                    zero_stage=3))
    spec = DatasetSpec(name="fits", kind="image", input_shape=(8, 8, 3), num_classes=10,
                       train_examples=64, eval_examples=16)
    strategy = strategies.create(config)
    strategy.setup()
    keras.utils.set_random_seed(42)
    start = time.perf_counter()
    with strategy.scope():
        model = models.build(tfdist.ModelConfig(name="mlp", width=width, depth=depth), spec)
        optimizer = keras.optimizers.Adam()
        optimizer.build(model.trainable_variables)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": seconds, "peak": peak, "params": model.count_params()}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2880)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", choices=MODES)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.width, args.depth)
    clock = common.Clock()
    print(common.hardware_header(), flush=True)
    found = {mode: [] for mode in MODES}
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    for _ in range(args.repeats):
        for mode in MODES:   # interleaved: the machine's noise falls on every mode
            out = subprocess.run([sys.executable, __file__, f"--child={mode}",
                                  f"--width={args.width}", f"--depth={args.depth}"],
                                 capture_output=True, text=True, env=env, timeout=900)
            if out.returncode:
                raise SystemExit(f"{mode}: {out.stderr.strip().splitlines()[-1]}")
            found[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    header = ["init", "seconds", "peak RSS GiB", "time vs whole, then split"]
    base = statistics.median(r["seconds"] for r in found["whole_then_split"])
    rows = []
    for mode in MODES:
        seconds = statistics.median(r["seconds"] for r in found[mode])
        peak = statistics.median(r["peak"] for r in found[mode]) / 2**30
        rows.append([mode.replace("_", " "), f"{seconds:.2f}", f"{peak:.2f}",
                     f"{seconds / base:.2f}"])
        common.print_row(rows[-1], header)
    params = found["sharded"][0]["params"]
    description = (
        f"The mlp {args.width} x {args.depth} ({params / 1e6:.0f}M parameters, "
        f"{params * 4 / 2**30:.2f} GiB float32) and Adam's slots built under dtensor "
        "batch:4 ZeRO-3 on 4 virtual CPUs in one process, and under default; each a fresh "
        f"process, the median of {args.repeats} interleaved repeats. Every mode gives the "
        "same initial weights for the same seed (tests/integration/test_dtensor_init.py).")
    common.finish("dtensor_init", "ZeRO-3 initial values: shard by shard", description, rows,
                  header, clock)


if __name__ == "__main__":
    main()
