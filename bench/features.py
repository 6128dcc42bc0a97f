"""Trainer features side by side: precision, accumulation, recomputation.

    .venv/bin/python bench/features.py [--seconds=S] [--steps=N] [--models=mlp,transformer]
        [--global_batch=B] [--mlp_width=W] [--timeout=T]

Every configuration runs in its own child process (default strategy,
synthetic data, so only the model's arithmetic is measured), which reports
examples/sec and its peak resident memory above what it held just before
`tfdist.train` (TensorFlow's runtime excluded; the model, optimizer state,
activations and workspace included). Printed as ratios against the baseline
of each group: precision vs float32, accumulation k=8 vs k=1 at the same
global batch, recompute on vs off (transformer only: the mlp has no blocks
to recompute). The three baselines are one configuration
(float32, k=1, recompute off), so it is measured once per model.

Runs are sized by time, not steps, because fp16/bf16 are emulated on CPUs
without AVX512-BF16/FP16 (up to ~15x slower than float32): a run watches its
loops through tfdist's progress reporter and stops once --seconds of loops
after the first (compiling) one are timed. Each model's baseline runs one
step per loop (if its steps turn out short, it stops after one timed loop
and trains again with more per loop); its step time sizes the steps per loop
of the model's other runs to about --seconds/4, so an emulated variant costs
a loop or two of its own speed, not a fixed step count. --steps=N instead
trains exactly N steps (N/3 per loop) per run. A run still going after
--timeout seconds is stopped and its row says `timed out`. Each row is
printed when measured; the table also goes to bench/results/features.md and
bench/results/report.md.

Run time: about 4 minutes on this 2-core Xeon (AVX-512) at the defaults,
estimated from tiny runs on a busy machine (9 runs: ~10 s to start an mlp
run, ~25 s a transformer one, plus ~5 s of steps each).
"""

import argparse
import dataclasses
import json
import os
import resource
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import (  # noqa: E402
    LOOPS, MODELS, Clock, finish, print_row, run_lines, RunFailed, sized_steps)

# The first variant of each group is the baseline; the baselines share one run.
GROUPS = {
    "precision": [("float32", []), ("mixed_bfloat16", ["--precision=mixed_bfloat16"]),
                  ("mixed_float16", ["--precision=mixed_float16"])],
    "accumulation": [("k=1", []), ("k=8", ["--accum_steps=8"])],
    "recompute": [("off", []), ("on", ["--recompute"])],
}
# --recompute acts on the blocks of the cnn and the transformer; the mlp has none.
SKIP = {("mlp", "recompute")}
HEADER = ["model", "group", "variant", "ex/s", "speed ratio", "extra peak MB", "memory ratio",
          "timed steps"]


class _Stop(Exception):
    """Raised from the progress hook to end a run early."""


def child(options, flags):
    """Train with `flags` in this process; print examples/sec and peak memory."""
    from absl import flags as absl_flags

    import tfdist
    from tfdist import flags as tfdist_flags
    from tfdist.observe import progress

    absl_flags.FLAGS(["bench", *flags])
    config = tfdist_flags.run_config()
    batch, seconds = config.train.global_batch_size, options["seconds"]

    def peak_mb():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def train(train_steps, per_loop, budget=None, resize=False):
        """Train; return the timed loops [(steps, seconds)] (all but the first,
        which compiles). Stops once `budget` seconds are timed; with `resize`,
        already after one timed loop if its step is too short to run one step
        per loop (the caller then trains again with more)."""
        timed, state = [], {"step": 0, "first": True}
        update = progress.Progress.update

        def observe(self, step, metrics, *args, **kwargs):
            # Every loop reports its examples/sec here (tfdist's progress reporter).
            update(self, step, metrics, *args, **kwargs)
            steps, state["step"] = step - state["step"], step
            if state["first"]:
                state["first"] = False
                return
            timed.append((steps, steps * batch / metrics["examples_per_sec"]))
            if resize and sized_steps(seconds, timed[0][1] / timed[0][0])[1] > 2:
                raise _Stop()
            if budget and sum(s for _, s in timed) >= budget:
                raise _Stop()

        progress.Progress.update = observe
        run_config = config.replace(train=dataclasses.replace(
            config.train, train_steps=train_steps, steps_per_loop=per_loop))
        try:
            rate = tfdist.train(run_config).summary["examples_per_sec"]
            if not timed:   # a single loop: its rate includes compiling
                timed.append((train_steps, train_steps * batch / rate))
        except _Stop:
            pass
        finally:
            progress.Progress.update = update
        return timed

    before, extra_mb = peak_mb(), None
    if options["steps"]:
        timed = train(options["steps"], max(1, options["steps"] // 3))
    elif options["step_seconds"]:
        timed = train(*sized_steps(seconds, options["step_seconds"]), budget=seconds)
    else:
        # This model's first run: one step per loop, which is right for slow
        # steps; fast ones stop after a loop and train again, sized by it.
        timed = train(2 * LOOPS + 2, 1, budget=seconds, resize=True)
        step_s = timed[0][1] / timed[0][0]
        if sized_steps(seconds, step_s)[1] > 2:
            extra_mb = peak_mb() - before   # before a second model exists
            timed = train(*sized_steps(seconds, step_s), budget=seconds)
    rate = sum(n for n, _ in timed) * batch / sum(s for _, s in timed)
    print(json.dumps({
        "examples_per_sec": rate,
        "extra_peak_mb": extra_mb if extra_mb is not None else peak_mb() - before,
        "step_seconds": batch / rate, "timed_steps": sum(n for n, _ in timed)}), flush=True)


def measure(flags, options, timeout):
    """One child run: its result dict, or RunFailed (crash or timeout)."""
    try:
        out = run_lines([sys.executable, __file__, "--child", json.dumps(options), *flags],
                        timeout)
        return json.loads(out.strip().splitlines()[-1])
    except RunFailed as failure:
        return failure


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(json.loads(sys.argv[2]), sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0,
                        help="timed seconds per run, after its compiling loop")
    parser.add_argument("--steps", type=int, default=None,
                        help="train exactly this many steps per run instead (N/3 per loop)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--global_batch", type=int, default=256)
    parser.add_argument("--mlp_width", type=int, default=4096,
                        help="FFN width of the mlp: wide, so its matmuls dominate")
    parser.add_argument("--timeout", type=float, default=240,
                        help="seconds after which one run is stopped and reported as timed out")
    args = parser.parse_args()
    clock, rows = Clock(), []
    for model in args.models.split(","):
        base = ["--strategy=default", "--synthetic", f"--global_batch_size={args.global_batch}",
                *MODELS[model]]
        if model == "transformer":
            base.append("--model_depth=4")  # enough blocks for recomputation to matter
        else:
            base.append(f"--model_width={args.mlp_width}")
        runs, step_s = {}, None   # one run per distinct configuration
        for group, variants in GROUPS.items():
            if (model, group) in SKIP:
                continue
            results = []
            for name, flags in variants:
                if tuple(flags) not in runs:
                    options = {"seconds": args.seconds, "steps": args.steps,
                               "step_seconds": step_s}
                    runs[tuple(flags)] = measure(base + flags, options, args.timeout)
                r = runs[tuple(flags)]
                if step_s is None and not isinstance(r, RunFailed):
                    step_s = r["step_seconds"]   # sizes this model's other runs
                results.append(r)
                b = results[0]
                ok = not isinstance(r, RunFailed)
                both = ok and not isinstance(b, RunFailed)
                row = [model, group, name,
                       f"{r['examples_per_sec']:.0f}" if ok else str(r),
                       f"{r['examples_per_sec'] / b['examples_per_sec']:.2f}" if both else "-",
                       f"{r['extra_peak_mb']:.0f}" if ok else "-",
                       f"{r['extra_peak_mb'] / max(b['extra_peak_mb'], 1):.2f}" if both else "-",
                       r["timed_steps"] if ok else "-"]
                rows.append(row)
                print_row(row, HEADER)
    sizing = (f"{args.steps} steps per run ({max(1, args.steps // 3)} per loop, the first loop "
              "not timed)" if args.steps else
              f"about {args.seconds:g} s of timed loops per run after its compiling loop "
              f"(steps per loop sized from the model's float32 step time for about {LOOPS} "
              "timed loops)")
    body = (f"Default strategy, synthetic data, global batch {args.global_batch}, Adam; mlp "
            f"width {args.mlp_width} (depth 3), transformer width 128 depth 4; {sizing}. One "
            "process per configuration (recompute: transformer only, the mlp has no blocks to "
            "recompute); the first row of each group is the same run (float32, "
            "k=1, recompute off) and the ratios are against it. Extra peak MB: peak RSS above "
            "what the process held before `tfdist.train` (model, optimizer state, activations, "
            "workspace).")
    finish("features", "Trainer features (bench/features.py)", body, rows, HEADER, clock)


if __name__ == "__main__":
    main()
