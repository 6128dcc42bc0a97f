"""Gradient compression's accuracy per model, optimizer and seed, and
whether a gap is learning or BatchNorm's moving statistics.

    python bench/compression_accuracy.py [--model cnn|transformer]
        [--optimizers momentum,adam] [--configs none,powersgd,topk]
        [--seeds 0,1,2] [--steps 300]

Each run is, with --model=cnn, the demo's model and data (the cnn, width 16,
on the bundled tfdist_shapes images; global batch 128), with
--model=transformer the transformer of bench/slow_link.py (width 256, depth
2, on the bundled tfdist_tokens; global batch 64), under mirrored over 2
virtual CPU devices, in a process of its own, evaluated every --steps/6
steps:

- none: gradients summed uncompressed;
- powersgd r4: `--grad_compression=powersgd --powersgd_rank=4`;
- powersgd16 (r16): `--grad_compression=powersgd --powersgd_rank=16`;
- topk 1%: `--grad_compression=topk --topk_fraction=0.01`;
- topk10 (10%): `--grad_compression=topk --topk_fraction=0.1`;

with `--optimizer=momentum` (0.9, learning rate 0.05 on the cnn, 0.1 on the
transformer: the optimizer of the PowerSGD and deep gradient compression
papers; top-k applies the momentum before sparsifying) or `--optimizer=adam`
(learning rate 0.003, the demo's and slow_link's; `--adam_lr` another).

Per run: the test accuracy with the moving statistics as trained (what
`tfdist-train` reports) and, for a model with BatchNorm, with them
re-estimated for the final weights (each BatchNorm's moving mean and
variance replaced by the mean of its batch statistics over 20 training
batches, the weights untouched). Where the two
differ the trained weights are good and the moving averages lag them. Per
configuration: the mean over the seeds, the spread (max - min), the mean
difference to none, and whether none had plateaued (its last two
evaluations within 0.5 point).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

CONFIGS = {
    "none": ("none", {}),
    "powersgd": ("powersgd r4", {"grad_compression": "powersgd", "powersgd_rank": 4}),
    "powersgd16": ("powersgd r16", {"grad_compression": "powersgd", "powersgd_rank": 16}),
    "topk": ("topk 1%", {"grad_compression": "topk", "topk_fraction": 0.01}),
    "topk10": ("topk 10%", {"grad_compression": "topk", "topk_fraction": 0.1}),
}
MODELS = {   # model flags, global batch, momentum's learning rate
    "cnn": (dict(name="cnn", width=16), "tfdist_shapes", 128, 0.05),
    "transformer": (dict(name="transformer", width=256, depth=2), "tfdist_tokens", 64, 0.1),
}
ADAM_LR = 0.003
_EVALUATION = re.compile(r"step (\d+)/\d+ .*test_accuracy=([0-9.]+)")


def child(spec: dict) -> None:
    """One run in this process; prints one JSON line."""
    import numpy as np
    import keras
    import tensorflow as tf
    from absl import logging
    import tfdist
    from tfdist.compat import model_layers
    from tfdist.data.inputs import of_run
    logging.set_verbosity(logging.INFO)
    steps = spec["steps"]
    model_fields, dataset, batch, momentum_lr = MODELS[spec["model"]]
    config = tfdist.RunConfig(
        strategy=tfdist.StrategyConfig(name="mirrored", virtual_devices=2),
        model=tfdist.ModelConfig(**model_fields),
        data=tfdist.DataConfig(dataset=dataset),
        optimizer=tfdist.OptimizerConfig(
            name=spec["optimizer"],
            learning_rate=momentum_lr if spec["optimizer"] == "momentum" else spec["adam_lr"]),
        train=tfdist.TrainConfig(global_batch_size=batch, train_steps=steps,
                                 steps_per_loop=steps // 6, eval_every=steps // 6,
                                 seed=spec["seed"], **CONFIGS[spec["config"]][1]))
    result = tfdist.train(config)
    norms = [layer for layer in model_layers(result.model)
             if isinstance(layer, keras.layers.BatchNormalization)]
    reported = result.summary.get("accuracy")
    if not norms:   # nothing to re-estimate
        print(json.dumps({"reported": reported, "trained": reported,
                          "reestimated": reported}), flush=True)
        return
    inputs = of_run(config)
    context = tf.distribute.InputContext()
    test = inputs.examples("test", context).batch(256)
    train = inputs.examples("train", context, shuffle_seed=1).batch(128).take(20)
    model = result.model

    def accuracy():
        right = total = 0
        for x, y in test:
            predicted = np.argmax(model(x, training=False), -1)
            right += int(np.sum(predicted == np.asarray(y).reshape(-1)))
            total += len(predicted)
        return right / total

    trained = accuracy()
    batch_stats = {id(n): ([], []) for n in norms}
    for n in norms:
        n.momentum = 0.0          # each training-mode call leaves its batch's statistics
    for x, _ in train:
        model(x, training=True)
        for n in norms:
            batch_stats[id(n)][0].append(n.moving_mean.numpy())
            batch_stats[id(n)][1].append(n.moving_variance.numpy())
    for n in norms:
        means, variances = batch_stats[id(n)]
        n.moving_mean.assign(np.mean(means, 0))
        n.moving_variance.assign(np.mean(variances, 0))
    print(json.dumps({"reported": reported, "trained": trained,
                      "reestimated": accuracy()}), flush=True)


def run(model: str, optimizer: str, config: str, seed: int, steps: int,
        timeout: float, adam_lr: float = ADAM_LR) -> dict:
    spec = json.dumps({"model": model, "optimizer": optimizer, "config": config, "seed": seed,
                       "steps": steps, "adam_lr": adam_lr})
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run([sys.executable, __file__, "--child", spec], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=common.REPO)
    if done.returncode:
        sys.exit(f"run {spec} failed:\n{done.stderr[-2000:]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    found["evaluations"] = sorted({int(s): float(a) for s, a
                                   in _EVALUATION.findall(done.stderr)}.items())
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn", choices=sorted(MODELS))
    parser.add_argument("--optimizers", default="momentum,adam")
    parser.add_argument("--configs", default="none,powersgd,topk")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--adam_lr", type=float, default=ADAM_LR,
                        help="Adam's learning rate (another than the default writes its own "
                             "section, compression_accuracy_<model>_adam<lr>)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))
    print(common.hardware_header(), flush=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    header = ["model", "optimizer", "config", "seeds", "test acc (mean)", "spread", "vs none (pp)",
              "re-estimated statistics (mean)", "none plateaued", "per seed (reported / "
              "re-estimated)"]
    rows = []
    for optimizer in args.optimizers.split(","):
        results = {}
        for config in args.configs.split(","):
            results[config] = [run(args.model, optimizer, config, seed, args.steps, args.timeout,
                                   args.adam_lr) for seed in seeds]
            for seed, r in zip(seeds, results[config]):
                print(f"{optimizer} {config} seed {seed}: {json.dumps(r)}", flush=True)
        none = results.get("none")
        base = statistics.mean(r["trained"] for r in none) if none else None
        plateau = ("yes" if none and all(abs(r["evaluations"][-1][1] - r["evaluations"][-2][1])
                                         <= 0.005 for r in none if len(r["evaluations"]) > 1)
                   else "no" if none else "-")
        for config, found in results.items():
            accuracies = [r["trained"] for r in found]
            mean = statistics.mean(accuracies)
            row = [args.model, optimizer, CONFIGS[config][0], len(found), f"{mean:.4f}",
                   f"{max(accuracies) - min(accuracies):.4f}",
                   f"{100 * (mean - base):+.1f}" if base is not None else "-",
                   f"{statistics.mean(r['reestimated'] for r in found):.4f}", plateau,
                   ", ".join(f"{r['trained']:.3f} / {r['reestimated']:.3f}" for r in found)]
            rows.append(row)
            common.print_row(row, header)
    fields, dataset, batch, momentum_lr = MODELS[args.model]
    body = (f"The {args.model} ({fields}) on {dataset} under mirrored over 2 virtual "
            f"devices, global batch {batch}, {args.steps} steps, seeds {args.seeds}; momentum "
            f"0.9 at learning rate {momentum_lr}, Adam at {args.adam_lr:g}. \"re-estimated "
            "statistics\": the same weights with each BatchNorm's moving statistics replaced "
            "by the mean of its batch statistics over 20 training batches (a model without "
            "BatchNorm: as reported).\n\n" + common.markdown_table(rows, header))
    other_lr = args.adam_lr != ADAM_LR
    print(common.write_section(
        f"compression_accuracy_{args.model}" + (f"_adam{args.adam_lr:g}" if other_lr else ""),
        f"Gradient compression's accuracy on the {args.model}"
        + (f" with Adam at {args.adam_lr:g}" if other_lr else "")
        + " (bench/compression_accuracy.py)", body))


if __name__ == "__main__":
    main()
