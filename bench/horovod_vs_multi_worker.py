"""Horovod vs MultiWorkerMirroredStrategy, 2 processes each, same model and batch.

    .venv/bin/python bench/horovod_vs_multi_worker.py [--steps=N] [--global_batch=B]

Both engines run the same tfdist trainer on synthetic data; only the
collective layer differs (Horovod's Gloo grouped all-reduce vs TensorFlow's
collective ops). Prints examples/sec of each and the ratio horovod / multi_worker.
"""

import argparse

from common import HOROVODRUN, LAUNCH, MODELS, TRAIN, summary, table


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--global_batch", type=int, default=128)
    args = parser.parse_args()
    rows = []
    for name, model_flags in MODELS.items():
        common = ["--synthetic", f"--train_steps={args.steps}", "--steps_per_loop=50",
                  f"--global_batch_size={args.global_batch}", *model_flags]
        mw = summary([LAUNCH, "--workers=2", "--", TRAIN, "--strategy=multi_worker", *common])
        hv = summary([HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", TRAIN,
                      "--strategy=horovod", *common])
        rows.append([name, f"{mw['examples_per_sec']:.0f}", f"{hv['examples_per_sec']:.0f}",
                     f"{hv['examples_per_sec'] / mw['examples_per_sec']:.2f}"])
    print(f"2 processes, global batch {args.global_batch}, synthetic data")
    print(table(rows, ["model", "multi_worker ex/s", "horovod ex/s", "ratio hvd/mw"]))


if __name__ == "__main__":
    main()
