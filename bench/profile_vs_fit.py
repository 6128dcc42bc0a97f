"""Where tfdist's step and Keras `fit`'s spend their time: one vs_fit row, profiled.

    .venv/bin/python bench/profile_vs_fit.py --rows=cnn:mixed_bfloat16,transformer:float32:off:off
        [--fit_jit=auto] [--tfdist_jit=auto] [--steps=100]

For each row (model:precision, default strategy; the models, batches and
input of bench/vs_fit.py), one child process traces, one after the other, the
best-measured `fit` variant and `tfdist.train` with the TensorFlow profiler
over the same number of steps after their compilation and warm-up, and reads
both traces with xprof's framework op statistics. It prints, per step, the
self-time of every op type on each side and the difference (tfdist minus
fit), grouped into what the step spends it on: matmuls and convolutions,
XLA-compiled clusters, the optimizer update, BatchNormalization (by layer
name), casts, the input pipeline and the rest. Self-times are summed over the threads that ran ops, so with inter-
op parallelism a step's sum can exceed its wall time; the examples/s of each
side over the traced window are printed beside them. The tables go to
bench/results/profile_vs_fit.md.

--fit_jit: `fit`'s jit_compile (auto: the faster of on and off, measured
first for 2 s each); --tfdist_jit: tfdist's --jit_compile; a row may set
both for itself (model:precision:fit_jit:tfdist_jit). A step XLA compiles
whole is one opaque function to TensorFlow's op statistics: its ops do not
show (compare such sides by their examples/s only).
"""

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from common import REPO, markdown_table, write_section  # noqa: E402

STEPS_PER_LOOP = 20

# What the step spends an op's time on, by op type (first match wins).
CATEGORIES = [
    ("XLA cluster", ("_XlaRun", "XlaLaunch", "_XlaCompile", "XlaClusterOutput")),
    ("matmul/conv", ("MatMul", "Conv", "Einsum", "BatchMatMul")),
    ("cast", ("Cast",)),
    ("input", ("Iterator", "Dataset", "Prefetch", "OptionalGetValue", "OptionalHasValue")),
    ("variables", ("ReadVariableOp", "AssignVariableOp", "AssignAddVariableOp",
                   "AssignSubVariableOp", "ResourceApply", "VarHandleOp")),
]


# BatchNorm: the fused kernels, or any op under a layer named like the
# bench models' (bn_a, stem_bn) or Keras's default (batch_normalization).
BATCHNORM = re.compile(r"(^|/)(\w*_bn|bn_\w+|batch_normalization\w*)/")


def category(op_type: str, op_name: str) -> str:
    if "adam" in op_name.lower() or "optimizer" in op_name.lower():
        return "optimizer update"
    if op_type.startswith("FusedBatchNorm") or op_type.startswith("_MklFusedBatchNorm") \
            or BATCHNORM.search(op_name):
        return "batchnorm"
    for name, prefixes in CATEGORIES:
        if any(p in op_type for p in prefixes):
            return name
    return "other ops"


def op_stats(trace_dir: str) -> dict:
    """{(type, category): total self-time in us} from the xplane under `trace_dir`."""
    from xprof.convert import raw_to_tool_data
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        raise RuntimeError(f"no profiler trace under {trace_dir}")
    data, _ = raw_to_tool_data.xspace_to_tool_data(paths[-1:], "framework_op_stats", {})
    table = json.loads(data)[0]
    columns = [c["id"] for c in table["cols"]]
    out = {}
    for row in table["rows"]:
        r = dict(zip(columns, (c.get("v") for c in row["c"])))
        if r["type"] in ("IDLE", "") or not r["total_self_time"]:
            continue
        key = (r["type"], category(r["type"], r["operation"]))
        out[key] = out.get(key, 0.0) + r["total_self_time"]
    return out


# -- child: one row -----------------------------------------------------------
def child(model, precision, fit_jit, tfdist_jit, steps):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from absl import logging
    logging.set_verbosity(logging.WARNING)
    work = tempfile.mkdtemp(prefix="profile_vs_fit-")
    try:
        _profile_both(model, precision, fit_jit, tfdist_jit, steps, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)   # the traces: tens to hundreds of MB


def _profile_both(model, precision, fit_jit, tfdist_jit, steps, work):
    import keras
    import tensorflow as tf

    import tfdist
    from tfdist.config import RunConfig, StrategyConfig, TrainConfig
    from vs_fit import BATCH, _dataset_fn, _model_fn, _spec, compiled_model, fit_data

    spec, batch = _spec(model), BATCH[model]
    model_fn, dataset_fn = _model_fn(model), _dataset_fn(spec)
    data = fit_data(spec, batch)

    def fit(jit, executions, trace_dir=None):
        """examples/s of `executions` fit executions after two untimed ones."""
        keras.utils.set_random_seed(0)
        m = compiled_model(model, spec, precision, jit, STEPS_PER_LOOP)

        class Window(keras.callbacks.Callback):
            calls, started, elapsed = 0, None, None

            def on_train_batch_end(self, batch_index, logs=None):
                self.calls += 1
                if self.calls == 2:
                    if trace_dir:
                        tf.profiler.experimental.start(trace_dir)
                    self.started = time.perf_counter()
                elif self.calls == 2 + executions:
                    self.elapsed = time.perf_counter() - self.started
                    if trace_dir:
                        tf.profiler.experimental.stop()
                    self.model.stop_training = True

        window = Window()
        m.fit(data, steps_per_epoch=10_000_000, epochs=1, verbose=0, callbacks=[window])
        return executions * STEPS_PER_LOOP * batch / window.elapsed

    executions = max(1, steps // STEPS_PER_LOOP)
    if fit_jit == "auto":
        rates = {jit: fit(jit, max(2, 40 // STEPS_PER_LOOP)) for jit in (False, True)}
        fit_jit = max(rates, key=rates.get)
    else:
        fit_jit = fit_jit == "on"
    fit_dir = os.path.join(work, "fit")
    fit_rate = fit(fit_jit, executions, fit_dir)
    print(json.dumps({"side": "fit", "jit": fit_jit, "examples_per_sec": fit_rate,
                      "ops": [[t, c, v] for (t, c), v in op_stats(fit_dir).items()]}), flush=True)

    model_dir = os.path.join(work, "tfdist")
    first = 2 * STEPS_PER_LOOP + 1
    config = RunConfig(
        strategy=StrategyConfig(name="default"),
        train=TrainConfig(global_batch_size=batch, train_steps=first - 1 + steps,
                          steps_per_loop=STEPS_PER_LOOP, precision=precision,
                          jit_compile=tfdist_jit, seed=0, model_dir=model_dir,
                          profile_steps=(first, first - 1 + steps)))
    summary = tfdist.train(config, model_fn=model_fn, dataset_fn=dataset_fn, spec=spec).summary
    print(json.dumps({"side": "tfdist", "jit": summary["jit_compile"],
                      "examples_per_sec": summary["examples_per_sec"],
                      "ops": [[t, c, v] for (t, c), v in op_stats(model_dir).items()]}),
          flush=True)


# -- parent -------------------------------------------------------------------
def _table(fit, ours, steps, top):
    """Per-category and per-op-type rows: us per step on each side."""
    def per_step(side):
        out = {}
        for op_type, cat, us in side["ops"]:
            out[(op_type, cat)] = out.get((op_type, cat), 0.0) + us / steps
        return out
    a, b = per_step(fit), per_step(ours)
    cats = {}
    for (op_type, cat), us in a.items():
        cats.setdefault(cat, [0.0, 0.0])[0] += us
    for (op_type, cat), us in b.items():
        cats.setdefault(cat, [0.0, 0.0])[1] += us
    rows = [[cat, f"{x:.0f}", f"{y:.0f}", f"{y - x:+.0f}"]
            for cat, (x, y) in sorted(cats.items(), key=lambda kv: -abs(kv[1][1] - kv[1][0]))]
    rows.append(["**all ops**", f"{sum(a.values()):.0f}", f"{sum(b.values()):.0f}",
                 f"{sum(b.values()) - sum(a.values()):+.0f}"])
    keys = sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, 0) - a.get(k, 0)))[:top]
    detail = [[f"{t} ({c})", f"{a.get((t, c), 0):.0f}", f"{b.get((t, c), 0):.0f}",
               f"{b.get((t, c), 0) - a.get((t, c), 0):+.0f}"] for t, c in keys]
    return rows, detail


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        model, precision, fit_jit, tfdist_jit, steps = sys.argv[2:7]
        return child(model, precision, fit_jit, tfdist_jit, int(steps))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="cnn:float32,cnn:mixed_bfloat16,"
                        "transformer:mixed_bfloat16:off:off",
                        help="model:precision[:fit_jit:tfdist_jit], comma-separated (default "
                             "strategy)")
    parser.add_argument("--fit_jit", default="auto", choices=["auto", "on", "off"])
    parser.add_argument("--tfdist_jit", default="auto", choices=["auto", "on", "off", "optimizer"])
    parser.add_argument("--steps", type=int, default=100, help="traced steps per side")
    parser.add_argument("--top", type=int, default=12, help="op types listed per row")
    args = parser.parse_args()
    sections = []
    for row in args.rows.split(","):
        model, precision, fit_jit, tfdist_jit = (row.split(":") + [args.fit_jit,
                                                                   args.tfdist_jit])[:4]
        command = [sys.executable, __file__, "--child", model, precision, fit_jit,
                   tfdist_jit, str(args.steps)]
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1800)
        sides = {}
        for line in result.stdout.splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                sides[record["side"]] = record
        if result.returncode != 0 or len(sides) != 2:
            sys.exit(f"{row}: child failed:\n{result.stderr[-3000:]}")
        fit, ours = sides["fit"], sides["tfdist"]
        header = ["what", f"fit (jit_compile={fit['jit']}) us/step",
                  f"tfdist ({ours['jit']}) us/step", "tfdist - fit"]
        categories, detail = _table(fit, ours, args.steps, args.top)
        text = (f"### {model} {precision} (default strategy, {args.steps} traced steps)\n\n"
                f"examples/s over the traced window: fit {fit['examples_per_sec']:.0f}, "
                f"tfdist {ours['examples_per_sec']:.0f} "
                f"(tfdist / fit {ours['examples_per_sec'] / fit['examples_per_sec']:.2f}; "
                "the profiler's overhead is in both)\n\n"
                + markdown_table(categories, header) + "\n\nOp types with the largest "
                "differences:\n\n" + markdown_table(detail, header))
        print(text + "\n", flush=True)
        sections.append(text)
    body = ("Self-time per step of each op type "
            "(xprof framework op statistics), summed over threads; a step XLA compiles whole "
            "is one opaque function there.\n\n" + "\n\n".join(sections))
    print(write_section("profile_vs_fit", "Where the step's time goes: tfdist vs fit "
                        "(bench/profile_vs_fit.py)", body))


if __name__ == "__main__":
    main()
