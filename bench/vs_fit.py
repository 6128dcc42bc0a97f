"""tfdist vs Keras 3 `model.fit` on the same model and the same tf.data input.

    .venv/bin/python bench/vs_fit.py [--seconds=S] [--models=mlp,cnn,transformer]
        [--precisions=float32,mixed_bfloat16] [--strategies=default,mirrored]

For each model (an FFN-heavy mlp 1024 -> [4096 -> 1024] x 2 -> 10, the cnn
and transformer builders), precision and strategy, one child process
measures, one after the other on the same pipeline (tfdist's own: shuffled,
repeated, batched random examples):
  fit          `model.fit`, steps_per_execution matched to tfdist's
               --steps_per_loop (20), no XLA; one fit call, timed after its
               first execution (which compiles)
  fit+XLA      the same with `jit_compile=True`
  fit spe=1    (mirrored only) steps_per_execution=1, which Keras needs there
  tfdist off   `tfdist.train` with --jit_compile=off
  tfdist XLA   with --jit_compile=on
  tfdist auto  with --jit_compile=auto, where it picks neither (the fused
               optimizer update alone)
  auto, Keras BN  (models with BatchNormalization) tfdist's choice with
               --nofused_batchnorm: "fused BN gain" is tfdist(auto) over it
A setting that crashes is reported as such, not as a ratio. Every row is
printed as soon as it is measured; the table (ratio tfdist / best working
fit, MFU against this host's matmul peak, mirrored vs default) goes to
bench/results/vs_fit.md and bench/results/report.md. Each measurement runs
for about --seconds after a warm-up; a row that would likely end past
--budget_minutes (9) is reported as not measured, so the bench ends in
under 10 minutes on either CPU kind (all 12 rows took 13 minutes here at
--seconds=2, mostly start-up and compilation).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from common import REPO, markdown_table, print_row, write_section  # noqa: E402

STEPS_PER_LOOP = 20
BATCH = {"mlp": 256, "cnn": 128, "transformer": 64}


# -- child: one (model, precision, strategy) ----------------------------------
def _spec(model):
    from tfdist.data.builders import shapes, tokens
    from tfdist.data.spec import DatasetSpec
    if model == "mlp":
        return DatasetSpec("ffn", "image", (1024,), 10)
    if model == "cnn":
        return DatasetSpec("images", "image", (shapes.IMAGE_SIZE, shapes.IMAGE_SIZE, 3), 10)
    return DatasetSpec("tokens", "tokens", (tokens.SEQUENCE_LENGTH,), tokens.VOCAB_SIZE)


def _model_fn(model):
    import keras

    from tfdist import models
    from tfdist.config import ModelConfig

    def build(spec):
        if model != "mlp":
            return models.build(ModelConfig(name=model, width=32 if model == "cnn" else 128,
                                            depth=2), spec)
        inputs = keras.Input(spec.input_shape)
        x = inputs
        for i in range(2):
            x = keras.layers.Dense(4096, activation="relu", name=f"ffn_in_{i}")(x)
            x = keras.layers.Dense(1024, name=f"ffn_out_{i}")(x)
        logits = keras.layers.Dense(spec.num_classes, dtype="float32", name="logits")(x)
        return keras.Model(inputs, logits, name="ffn_mlp")

    return build


def _dataset_fn(spec):
    import tensorflow as tf

    def dataset_fn(split, context):
        n = 2048 if split == "train" else 64
        seed = (1, 0) if split == "train" else (2, 0)
        if spec.kind == "tokens":
            x = tf.random.stateless_uniform((n, *spec.input_shape), seed, 0, spec.num_classes,
                                            dtype=tf.int32)
            y = tf.roll(x, -1, axis=1)
        else:
            x = tf.random.stateless_uniform((n, *spec.input_shape), seed)
            y = tf.random.stateless_uniform((n,), seed, 0, spec.num_classes, dtype=tf.int32)
        return tf.data.Dataset.from_tensor_slices((x, y))

    return dataset_fn


def fit_data(spec, batch):
    """tfdist's training pipeline for `spec` as `fit` takes it: (x, y) batches
    (tfdist's are (x, y, weight))."""
    import tensorflow as tf

    from tfdist.data import inputs as inputs_lib
    from tfdist.data.function_inputs import FunctionInputs
    data = inputs_lib.train_dataset_fn(FunctionInputs(_dataset_fn(spec), spec),
                                       global_batch_size=batch, seed=0,
                                       shuffle_buffer=10_000)(tf.distribute.InputContext())
    return data.map(lambda x, y, weight: (x, y))


def compiled_model(model, spec, precision, jit, steps_per_execution):
    """`model`'s Keras model under the `precision` policy, compiled for `fit`
    with Adam as tfdist trains it (in the caller's distribution scope)."""
    import keras
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(precision)
    try:
        m = _model_fn(model)(spec)
        m.compile(keras.optimizers.Adam(1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=jit,
                  steps_per_execution=steps_per_execution)
    finally:
        keras.config.set_dtype_policy(previous)
    return m


def _step_timer(seconds, max_steps=None):
    """A Keras callback timing the steps after the first execution (which
    compiles); it stops training after `seconds` of them or `max_steps`."""
    import keras

    class StepTimer(keras.callbacks.Callback):
        first, started, steps, elapsed = None, None, 0, 0.0

        def on_train_batch_end(self, batch, logs=None):
            now = time.perf_counter()
            if self.started is None:
                self.first, self.started = batch, now
                return
            self.steps, self.elapsed = batch - self.first, now - self.started
            if self.steps >= max_steps if max_steps else self.elapsed >= seconds:
                self.model.stop_training = True

    return StepTimer()


def _short_error(error) -> str:
    """The telling line of a TensorFlow error (not 'Graph execution error:')."""
    lines = [t.strip() for t in str(error).strip().splitlines() if t.strip()]
    telling = [t for t in lines if "execution error" not in t and not t.startswith(
        ("File ", "Detected at node", "Traceback"))]
    line = next((t for t in telling if t.startswith("(0)") or "must" in t),
                next((t for t in telling if "rror" in t), telling[0] if telling else ""))
    return f"{type(error).__name__}: {line[:100]}"


def child(model, precision, strategy_name, seconds):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from absl import logging
    logging.set_verbosity(logging.WARNING)
    from tfdist import cluster
    if strategy_name == "mirrored":
        cluster.local_devices(2)   # before TensorFlow starts
    import keras
    import tensorflow as tf

    import tfdist
    from tfdist.config import RunConfig, StrategyConfig, TrainConfig
    from tfdist.observe import flops, peak

    spec, batch = _spec(model), BATCH[model]
    model_fn, dataset_fn = _model_fn(model), _dataset_fn(spec)
    data = fit_data(spec, batch)   # (x, y), as a user would give it
    peak_tflops = peak.precision_peak_tflops(precision)

    def emit(variant, examples_per_sec=None, error=None, flops_per_example=None, **extra):
        mfu = (flops.mfu(examples_per_sec, flops_per_example, peak_tflops)
               if examples_per_sec and flops_per_example else None)
        print(json.dumps({"variant": variant, "examples_per_sec": examples_per_sec,
                          "error": error, "mfu": mfu, **extra}), flush=True)

    timed_steps = None

    def fit(variant, jit, spe):
        nonlocal timed_steps
        keras.utils.set_random_seed(0)
        distribution = (tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
                        if strategy_name == "mirrored" else tf.distribute.get_strategy())
        try:
            with distribution.scope():
                m = compiled_model(model, spec, precision, jit, spe)
            count = flops.try_training_flops_per_example(m)
            # One fit call, so one iterator (a new one per call would refill the
            # shuffle buffer inside the timed part) and one long epoch; the
            # first execution compiles, the later ones are timed.
            timer = _step_timer(seconds, timed_steps)
            m.fit(data, steps_per_epoch=10_000_000, epochs=1, verbose=0, callbacks=[timer])
            steps, elapsed = timer.steps, timer.elapsed
            timed_steps = timed_steps or steps
            emit(variant, steps * batch / elapsed, flops_per_example=count)
        except Exception as error:  # noqa: BLE001 - a crash is a result here
            emit(variant, error=_short_error(error))

    strategy_config = StrategyConfig(name=strategy_name,
                                     virtual_devices=2 if strategy_name == "mirrored" else None)

    def train(variant, jit, **options):
        steps = timed_steps or 5 * STEPS_PER_LOOP
        config = RunConfig(
            strategy=strategy_config,
            train=TrainConfig(global_batch_size=batch, train_steps=STEPS_PER_LOOP + steps,
                              steps_per_loop=STEPS_PER_LOOP, precision=precision,
                              jit_compile=jit, seed=0, **options))
        try:
            summary = tfdist.train(config, model_fn=model_fn, dataset_fn=dataset_fn,
                                   spec=spec).summary
            emit(variant, summary["examples_per_sec"],
                 flops_per_example=summary["flops_per_example"], level=summary["jit_compile"])
        except Exception as error:  # noqa: BLE001
            emit(variant, error=_short_error(error))

    fit("fit", False, STEPS_PER_LOOP)
    fit("fit+XLA", True, STEPS_PER_LOOP)
    if strategy_name == "mirrored":
        fit("fit spe=1", False, 1)
    train("tfdist off", "off")
    train("tfdist XLA", "on")
    from tfdist.training import xla
    share = flops.convolution_share(flops.forward_flops_by_op(model_fn(spec)))
    from tfdist import strategies
    strategy = strategies.create(strategy_config)   # what tfdist.train resolves "auto" with
    strategy.setup()
    level = xla.resolve("auto", precision, strategy, share, large=xla.large_share(model_fn(spec)))
    strategy.close()
    print(json.dumps({"auto_level": level}), flush=True)
    if level == xla.OPTIMIZER:
        train("tfdist auto", "auto")    # the fused optimizer update only
    from tfdist import compat
    if any(isinstance(layer, keras.layers.BatchNormalization)
           for layer in compat.model_layers(model_fn(spec))):
        # tfdist's choice with Keras's own BatchNormalization (--nofused_batchnorm)
        train("auto, Keras BN", "auto", fused_batchnorm=False)
    print(json.dumps({"peak_tflops": peak_tflops}), flush=True)


# -- parent -------------------------------------------------------------------
HEADER = ["model", "precision", "strategy", "fit", "fit+XLA", "fit spe=1", "tfdist off",
          "tfdist XLA", "tfdist auto", "auto picks", "tfdist(auto) / best fit", "MFU tfdist(auto)", "MFU best fit",
          "mirrored / default", "fused BN gain"]


def measure(model, precision, strategy, seconds):
    """Stream one child's measurements as they come."""
    command = [sys.executable, __file__, "--child", model, precision, strategy, str(seconds)]
    # stderr to a file: a pipe nobody reads until the end fills (XLA's
    # cache-load errors, 2 KB each) and stops the child mid-row.
    errors = tempfile.TemporaryFile("w+")
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=errors,
                               text=True)
    results = {}
    for line in process.stdout:
        if line.startswith("{"):
            result = json.loads(line)
            if "variant" in result:
                results[result["variant"]] = result
                value = (f"{result['examples_per_sec']:.0f} ex/s" if result["examples_per_sec"]
                         else f"FAILS ({result['error']})")
                print(f"  {model} {precision} {strategy} {result['variant']}: {value}",
                      flush=True)
            else:
                results.update(result)
    returncode = process.wait()
    errors.seek(0)
    stderr = errors.read()
    if returncode != 0:
        sys.exit(f"{model} {precision} {strategy}: child failed:\n{stderr[-3000:]}")
    return results


def _rate(result):
    if result is None:
        return "-"
    return f"{result['examples_per_sec']:.0f}" if result["examples_per_sec"] else "fails"


def _gain(ours, keras_bn):
    """tfdist(auto) / the same with Keras's own BatchNormalization."""
    if not (ours and keras_bn and ours["examples_per_sec"] and keras_bn["examples_per_sec"]):
        return "-"
    return f"{ours['examples_per_sec'] / keras_bn['examples_per_sec']:.2f}"


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        model, precision, strategy, seconds = sys.argv[2:6]
        return child(model, precision, strategy, float(seconds))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget_minutes", type=float, default=9.0,
                        help="start no new row that would likely end past this many minutes "
                             "(such rows are reported as not measured)")
    parser.add_argument("--seconds", type=float, default=1.0,
                        help="timed seconds per measurement (after a warm-up)")
    parser.add_argument("--models", default="mlp,cnn,transformer")
    parser.add_argument("--precisions", default="float32,mixed_bfloat16")
    parser.add_argument("--strategies", default="default,mirrored")
    args = parser.parse_args()
    sys.path.insert(0, REPO)
    from tfdist.observe import peak
    from tfdist.training import xla

    # The peak MFU divides by, measured again before any row (the machine is
    # quiet now): an entry cached while other work shared the cores is too low.
    for dtype in sorted({"float32", *map(peak.compute_dtype, args.precisions.split(","))}):
        print(f"{dtype} matmul peak: {peak.matmul_peak_tflops(dtype, refresh=True):.3f} "
              "TFLOP/s", flush=True)

    rows, defaults, peaks = [], {}, {}
    started, measured = time.perf_counter(), 0
    for model in args.models.split(","):
        for precision in args.precisions.split(","):
            for strategy in args.strategies.split(","):
                elapsed = time.perf_counter() - started
                if measured and elapsed * (measured + 1) / measured > 60 * args.budget_minutes:
                    row = [model, precision, strategy] + ["not measured (time budget)"] + \
                          ["-"] * (len(HEADER) - 4)
                    rows.append(row)
                    print_row(row, HEADER)
                    continue
                r = measure(model, precision, strategy, args.seconds)
                measured += 1
                auto = {xla.STEP: "tfdist XLA", xla.OFF: "tfdist off"}.get(
                    r.get("auto_level"), "tfdist auto")
                peaks[precision] = r.get("peak_tflops")
                working = [r[v] for v in ("fit", "fit+XLA", "fit spe=1")
                           if v in r and r[v]["examples_per_sec"]]
                best_fit = max(working, key=lambda x: x["examples_per_sec"], default=None)
                ours = r.get(auto)
                eps = ours["examples_per_sec"] if ours else None
                if strategy == "default":
                    defaults[(model, precision)] = eps
                base = defaults.get((model, precision))
                row = [model, precision, strategy, _rate(r.get("fit")), _rate(r.get("fit+XLA")),
                       _rate(r.get("fit spe=1")), _rate(r.get("tfdist off")),
                       _rate(r.get("tfdist XLA")), _rate(r.get("tfdist auto")),
                       ours.get("level", "-") if ours else "-",
                       f"{eps / best_fit['examples_per_sec']:.2f}" if eps and best_fit else "-",
                       f"{ours['mfu']:.0%}" if ours and ours.get("mfu") else "-",
                       f"{best_fit['mfu']:.0%}" if best_fit and best_fit.get("mfu") else "-",
                       f"{eps / base:.2f}" if strategy != "default" and eps and base else "-",
                       _gain(ours, r.get("auto, Keras BN"))]
                rows.append(row)
                print_row(row, HEADER)
    peak_text = ", ".join(f"{p}: {v:.3f} TFLOP/s" for p, v in peaks.items() if v)
    body = (f"Examples/sec, side by side in one process per row; tfdist(auto) is the "
            f"--jit_compile=auto choice on this CPU. MFU against this host's matmul peak "
            f"({peak_text}; `tfdist-peak`). Global batch: mlp {BATCH['mlp']}, cnn "
            f"{BATCH['cnn']}, transformer {BATCH['transformer']}; Adam; steps_per_loop / "
            f"steps_per_execution {STEPS_PER_LOOP}; mirrored over 2 virtual CPUs.\n\n"
            + markdown_table(rows, HEADER))
    print()
    print(write_section("vs_fit", "tfdist vs Keras fit (bench/vs_fit.py)", body))


if __name__ == "__main__":
    main()
