"""Trainer features side by side: precision, accumulation, recomputation.

    .venv/bin/python bench/features.py [--steps=N]

Every configuration runs in its own child process (default strategy,
synthetic data, so only the model's arithmetic is measured), which reports
examples/sec and its peak resident memory above what it held just before
training (the model, optimizer and runtime are excluded, leaving mostly
activations and workspace). Printed as ratios against the baseline of each
group: precision vs float32 (this CPU has AMX-BF16), accumulation k=8 vs
k=1 at the same global batch, recompute on vs off.
"""

import argparse
import json
import resource
import subprocess
import sys

from common import MODELS, REPO, table

GROUPS = {
    "precision": [("float32", []), ("mixed_bfloat16", ["--precision=mixed_bfloat16"]),
                  ("mixed_float16", ["--precision=mixed_float16"])],
    "accumulation": [("k=1", ["--accum_steps=1"]), ("k=8", ["--accum_steps=8"])],
    "recompute": [("off", []), ("on", ["--recompute"])],
}


def child(flags):
    """Train with `flags` in this process; print examples/sec and peak memory."""
    from absl import flags as absl_flags

    import tfdist
    from tfdist import flags as tfdist_flags

    absl_flags.FLAGS(["bench", *flags])
    config = tfdist_flags.run_config()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Build and a first step happen inside train(); measure the peak it adds.
    summary = tfdist.train(config).summary
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"examples_per_sec": summary["examples_per_sec"],
                      "extra_peak_mb": (peak - before) / 1024}))


def measure(flags):
    out = subprocess.run([sys.executable, __file__, "--child", *flags], cwd=REPO,
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        sys.exit(f"run failed: {flags}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    if "--child" in sys.argv:
        return child([a for a in sys.argv[1:] if a != "--child"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--global_batch", type=int, default=256)
    parser.add_argument("--mlp_width", type=int, default=4096,
                        help="FFN width of the mlp: wide, so its matmuls dominate")
    args = parser.parse_args()
    rows = []
    for model, model_flags in MODELS.items():
        base = ["--strategy=default", "--synthetic", f"--train_steps={args.steps}",
                "--steps_per_loop=20", f"--global_batch_size={args.global_batch}", *model_flags]
        if model == "transformer":
            base.append("--model_depth=4")  # enough blocks for recomputation to matter
        else:
            base.append(f"--model_width={args.mlp_width}")
        for group, variants in GROUPS.items():
            results = [(name, measure(base + flags)) for name, flags in variants]
            baseline = results[0][1]
            for name, r in results:
                rows.append([model, group, name, f"{r['examples_per_sec']:.0f}",
                             f"{r['examples_per_sec'] / baseline['examples_per_sec']:.2f}",
                             f"{r['extra_peak_mb']:.0f}",
                             f"{r['extra_peak_mb'] / max(baseline['extra_peak_mb'], 1):.2f}"])
    print(f"default strategy, synthetic data, global batch {args.global_batch}, "
          f"{args.steps} steps; ratios against the first row of each group")
    print(table(rows, ["model", "group", "variant", "ex/s", "speed ratio", "extra peak MB",
                       "memory ratio"]))


if __name__ == "__main__":
    main()
