"""One engine's column of the conformance matrix, in one process.

    python conformance/cells.py WORKDIR ENGINE MODEL[,MODEL...] [--precision=P]

Trains each model in turn under ENGINE through `tfdist.train` from the
initial weights in WORKDIR/initial/<model>.npz (written by the first run that
needs them, the `default` column, with a fixed seed), then checks it and writes
WORKDIR/<column>/<model>.json (only the chief of a multi-process engine
writes). The column is ENGINE, or ENGINE+"-"+precision for mixed precision.

Under `multi_worker`, `horovod` and `parameter_server` every process of the
cluster runs this script (started by conformance/matrix.py through
`tfdist-launch` or `horovodrun`); the single-process engines split the CPU
into 4 virtual devices before TensorFlow starts.
"""

import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import tfdist  # noqa: E402  (before TensorFlow: tfdist keeps Keras from importing matplotlib)

import models as conformance_models  # noqa: E402
from models import BATCH, MODELS, STEPS  # noqa: E402

MULTI_PROCESS = ("multi_worker", "horovod", "parameter_server")
# Single-process engines: StrategyConfig fields (and TrainConfig overrides).
ENGINES = {
    "default": dict(name="default"),
    "mirrored": dict(name="mirrored", virtual_devices=2),
    "multi_worker": dict(name="multi_worker", collective_timeout_s=120),
    "horovod": dict(name="horovod"),
    "dtensor_dp": dict(name="dtensor", virtual_devices=4, mesh="batch:4,model:1"),
    "dtensor_tp": dict(name="dtensor", virtual_devices=4, mesh="batch:2,model:2"),
    "zero3": dict(name="dtensor", virtual_devices=4, mesh="batch:4,model:1", zero_stage=3),
    "parameter_server": dict(name="parameter_server", collective_timeout_s=120),
    "pipeline": dict(name="pipeline", virtual_devices=2, pipeline_stages=2),
}
LEARNING_RATE = 1e-3
# BatchNorm models train with plain SGD: some of their weights have an exact
# gradient of 0 (a BatchNormalization beta before a 1x1 convolution and
# another BatchNormalization: the shift is normalised away), which Adam turns
# into noise-sized steps of either sign, so engines that sum in another order
# end up a learning rate apart there; SGD keeps equal math equal.
SGD_LEARNING_RATE = 0.01
PIPELINE_MICROBATCHES = 2
# Engines whose 2 replicas (pipeline: micro-batches) each normalise by their own
# batch statistics.
PER_REPLICA_STATISTICS = ("mirrored", "multi_worker", "horovod", "pipeline")


def config_for(engine, precision="float32", sgd=False, learning_rate=None, steps=None):
    steps = steps or STEPS
    train = dict(global_batch_size=BATCH, train_steps=steps, steps_per_loop=steps,
                 jit_compile="off", precision=precision)
    if engine == "pipeline":
        train["accum_steps"] = PIPELINE_MICROBATCHES
    return tfdist.RunConfig(
        strategy=tfdist.StrategyConfig(**ENGINES[engine]),
        data=tfdist.DataConfig(shuffle_buffer=1),   # batches in file order under every engine
        optimizer=(tfdist.OptimizerConfig(name="sgd",
                                          learning_rate=learning_rate or SGD_LEARNING_RATE)
                   if sgd else tfdist.OptimizerConfig(name="adam",
                                                      learning_rate=learning_rate or LEARNING_RATE)),
        train=tfdist.TrainConfig(**train))


def first_line(error):
    text = str(error).strip().splitlines()
    line = text[0] if text else ""
    return f"{type(error).__name__}: {line}"[:300]


def is_chief():
    config = json.loads(os.environ.get("TF_CONFIG", "{}") or "{}")
    task = config.get("task")
    if os.environ.get("HOROVOD_RANK") is not None:
        return os.environ["HOROVOD_RANK"] == "0"
    if not task:
        return True
    if "chief" in config.get("cluster", {}):
        return task.get("type") == "chief"
    return task.get("type") == "worker" and task.get("index") == 0


def initial_weights(workdir, case, spec):
    import keras
    path = os.path.join(workdir, "initial", f"{case.name}.npz")
    if not os.path.exists(path):
        keras.utils.set_random_seed(0)
        model = case.build(spec)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        np.savez(path + ".tmp.npz", *model.get_weights())
        os.replace(path + ".tmp.npz", path)
    return list(np.load(path).values())


def host_data(case, split="train"):
    """Every example of `split` as host arrays (x, y)."""
    ds = conformance_models.dataset_fn_for(case)(split, None)
    x, y = next(iter(ds.batch(10_000)))
    x = {k: v.numpy() for k, v in x.items()} if isinstance(x, dict) else x.numpy()
    return x, y.numpy()


def mean_loss(model, x, y, training, chunk=None):
    """The mean loss over `x`, in chunks of `chunk` examples (a training-mode
    BatchNorm then normalises each chunk by its own statistics, as a replica
    or micro-batch of that size does)."""
    import keras
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    n = len(y)
    chunk = chunk or n
    parts = []
    for start in range(0, n, chunk):
        take = slice(start, start + chunk)
        xs = {k: v[take] for k, v in x.items()} if isinstance(x, dict) else x[take]
        parts.append(float(loss(y[take], model(xs, training=training))))
    return float(np.mean(parts))


def weight_difference(final, reference, paths):
    """Largest |a-b| over every weight, relative to the model's weight scale
    (the largest |w| of the reference); and the weight where it is."""
    scale = max(float(np.abs(r).max()) for r in reference if r.size)
    worst, where = 0.0, None
    for a, b, path in zip(final, reference, paths):
        if a.shape != b.shape:
            return float("inf"), f"{path}: shape {a.shape} vs {b.shape}"
        d = float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max()) if a.size else 0.0
        if d > worst:
            worst, where = d, path
    return worst / scale, where


def run_cell(workdir, engine, case, precision):
    import keras
    column = engine if precision == "float32" else f"{engine}-{precision}"
    spec = conformance_models.spec_for(case)
    dataset_fn = conformance_models.dataset_fn_for(case)
    initial = initial_weights(workdir, case, spec)

    def model_fn(spec_):
        model = case.build(spec_)
        model.set_weights(initial)
        return model

    cell = {"model": case.name, "engine": column, "status": "fail", "checks": {}}
    layout_rules = None
    if engine == "dtensor_tp":
        probe = case.build(spec)   # the plain model, for the rules' paths
        layout_rules, cell["layout"] = case.layout(probe)
        del probe
    start = time.monotonic()
    try:
        result = tfdist.train(config_for(engine, precision, sgd=case.batch_norm,
                                           learning_rate=case.learning_rate,
                                           steps=case.steps), model_fn=model_fn,
                              dataset_fn=dataset_fn, spec=spec, layout_rules=layout_rules)
    except tfdist.UsageError as error:
        cell.update(status="refused", reason=str(error).strip().splitlines()[0][:300],
                    seconds=round(time.monotonic() - start, 1))
        return cell
    except Exception as error:   # noqa: BLE001  (a cell's failure is a finding)
        traceback.print_exc()
        cell.update(reason="train: " + first_line(error),
                    seconds=round(time.monotonic() - start, 1))
        return cell
    cell["seconds"] = round(time.monotonic() - start, 1)
    if result.model is None:   # a parameter server or worker task: it only served
        return None
    # Under multi_worker `result.model.predict` is a collective (Keras runs it
    # under the engine's strategy): every process of the cluster makes every
    # check below, in the same order; only the chief's cell is written.
    chief = result.is_chief
    summary = result.summary
    cell["examples_per_sec"] = summary.get("examples_per_sec")
    cell["summary_loss"] = summary.get("loss")
    problems = []

    def check(name, fn):
        try:
            ok, detail = fn()
        except Exception as error:   # noqa: BLE001
            traceback.print_exc()
            ok, detail = False, first_line(error)
        cell["checks"][name] = {"ok": ok, "detail": detail}
        if not ok:
            problems.append(f"{name}: {detail}")

    model = result.model
    final = [np.asarray(w) for w in model.get_weights()]
    paths = [w.path for w in model.weights]
    os.makedirs(os.path.join(workdir, column), exist_ok=True)
    if chief:
        np.savez(os.path.join(workdir, column, f"{case.name}.npz"), *final)

    # 1. Against the default engine's trained weights (same initial weights,
    # same batches in the same order).
    def against_default():
        ref_path = os.path.join(workdir, "default", f"{case.name}.npz")
        if precision != "float32":
            ref_path = os.path.join(workdir, f"default-{precision}", f"{case.name}.npz")
        if column.startswith("default"):
            if case.batch_norm and precision == "float32":
                cell["sensitivity"] = sensitivity(case, spec, dataset_fn, initial, final, paths)
                return True, f"reference (sensitivity {cell['sensitivity']:.2e})"
            return True, "reference"
        if not os.path.exists(ref_path):
            return False, "no default-engine weights to compare with"
        reference = list(np.load(ref_path).values())
        rel, where = weight_difference(final, reference, paths)
        cell["rel_diff_vs_default"] = rel
        cell["rel_diff_where"] = where
        expected, why = expected_to_match(engine, case, precision)
        cell["match_expected"] = expected
        tolerance = 1e-4 if precision == "float32" else 2e-2
        measured = _default_sensitivity(workdir, case) if precision == "float32" else None
        if measured is not None and SENSITIVITY_MARGIN * measured > tolerance:
            tolerance = SENSITIVITY_MARGIN * measured
        if not expected:
            return True, f"{rel:.2e} (not compared: {why})"
        return rel <= tolerance, f"{rel:.2e} at {where} (tolerance {tolerance:.2g})"
    check("matches_default", against_default)

    # 2. Exported model.keras reloads and predicts like result.model.
    def export():
        import keras_hub  # noqa: F401  (registers keras-hub classes for loading)
        export_dir = os.path.join(workdir, column, f"{case.name}-export" if chief else
                                  f"{case.name}-export-{os.getpid()}")
        paths_written = tfdist.export(result, export_dir)
        reloaded = tfdist.load_model(os.path.join(export_dir, "model.keras"))
        x, _ = host_data(case, "test")
        a = np.asarray(model(x, training=False), np.float64)
        b = np.asarray(reloaded.predict(x, verbose=0), np.float64)
        diff = float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-12))
        cell["export_rel_diff"] = diff
        return diff <= 1e-5, f"reloaded predicts within {diff:.1e} (relative); {sorted(paths_written)}"
    check("export", export)

    # 2b. `result.model.predict` on host data (docs/guides/python-api.md: under every engine),
    # against calling the model.
    def predict():
        x, _ = host_data(case, "test")
        a = np.asarray(model.predict(x, verbose=0), np.float64)
        b = np.asarray(model(x, training=False), np.float64)
        diff = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))
        return diff <= 1e-5, f"predict within {diff:.1e} of model(x)"
    check("predict", predict)

    # 3. Tensor-parallel / ZeRO-3: each device holds less than the model.
    if engine in ("dtensor_tp", "zero3"):
        def device_bytes():
            whole = sum(w.nbytes for w in final)
            per = summary.get("device_parameter_bytes")
            cell["device_parameter_bytes"], cell["model_bytes"] = per, whole
            if per is None:
                return False, "summary has no device_parameter_bytes"
            most = max(per) if isinstance(per, (list, tuple)) else \
                max(per.values()) if isinstance(per, dict) else per
            return most < whole, f"per device {per} vs whole {whole}"
        check("device_bytes", device_bytes)

    # 4. keras-hub CausalLM still generates from the trained backbone.
    if case.causal_lm:
        def generate():
            import keras_hub
            lm = model
            if not isinstance(lm, keras_hub.models.CausalLM):
                lm = getattr(keras_hub.models, case.causal_lm)(backbone=model.backbone,
                                                               preprocessor=None)
            prompt = np.zeros((2, conformance_models.SEQ), np.int32)
            prompt[:, :4] = [[1, 2, 3, 4], [5, 6, 7, 8]]
            mask = np.zeros_like(prompt)
            mask[:, :4] = 1
            out = lm.generate({"token_ids": prompt, "padding_mask": mask}, stop_token_ids=None)
            tokens = np.asarray(out["token_ids"])
            ok = tokens.shape == prompt.shape and (tokens[:, :4] == prompt[:, :4]).all() and \
                bool(np.asarray(out["padding_mask"]).all()) and tokens.max() < case.spec_args[
                    "num_classes"]
            return bool(ok), f"generated {tokens[0, 4:8].tolist()}..."
        check("generate", generate)

    # 4b. LoRA: what the model leaves trainable trains, nothing else. keras-hub's
    # `enable_lora` freezes the backbone but its adapted layers' biases (Keras's
    # `enable_lora` freezes the kernel only) and anything outside the backbone (a
    # classifier's head) stay trainable. Frozen weights end bit for bit as
    # loaded, the optimizer holds slots for the trainable ones alone, and
    # engines that reduce gradients between replicas reduce their bytes only.
    if case.lora:
        def lora_only():
            trainable = {v.path for v in model.trainable_variables}
            adapters = [p for p in paths if "lora_kernel" in p]
            if not adapters or any(p not in trainable for p in adapters):
                return False, f"adapters {adapters[:4]} are not all trainable"
            changed = [p for a, b, p in zip(final, initial, paths)
                       if p not in trainable and not np.array_equal(a, b)]
            if changed:
                return False, f"frozen weights changed: {changed[:3]}"
            if not any(not np.array_equal(a, b)
                       for a, b, p in zip(final, initial, paths) if "lora_kernel_b" in p):
                return False, "no adapter moved"
            others = sorted(trainable - set(adapters))
            detail = (f"{len(adapters)} adapters and {len(others)} other trainable weights "
                      f"({', '.join(p.rsplit('/', 2)[-2] + '/' + p.rsplit('/', 1)[-1] for p in others[:3])}"
                      f"{'...' if len(others) > 3 else ''}) trained, frozen weights unchanged")
            optimizer = result.optimizer
            if optimizer is not None:
                slots = [v for v in optimizer.variables if len(v.shape)]
                if len(slots) != 2 * len(trainable):   # Adam: two slots per trainable weight
                    return False, f"{len(slots)} optimizer slots for {len(trainable)} weights"
                detail += f", {len(slots)} slots"
            if engine in ("mirrored", "multi_worker", "horovod"):
                trainable_bytes = sum(a.nbytes for a, p in zip(final, paths) if p in trainable)
                reduced = summary.get("bytes_reduced_per_update")
                cell["bytes_reduced_per_update"] = reduced
                if reduced != trainable_bytes:
                    return False, (f"{reduced} bytes reduced per update; the trainable weights "
                                   f"hold {trainable_bytes}")
                detail += f", {reduced} bytes reduced per update (the trainable weights')"
            return True, detail
        check("lora_only", lora_only)

    # 5. Training did something: the loss on the training examples falls
    # (training mode: BatchNorm then uses batch statistics, as in the step;
    # last, since a training-mode call moves moving statistics).
    def loss_falls():
        x, y = host_data(case, "train")
        seen = (case.steps or STEPS) * BATCH   # the examples training read (file order)
        x = {k: v[:seen] for k, v in x.items()} if isinstance(x, dict) else x[:seen]
        y = y[:seen]
        keras.utils.set_random_seed(0)
        before_model = case.build(spec)
        before_model.set_weights(initial)
        # Engines whose replicas (micro-batches) normalise by their own batch
        # statistics train BatchNorm models on half-batches: measure so.
        chunk = BATCH // 2 if case.batch_norm and engine in PER_REPLICA_STATISTICS else None
        before = mean_loss(before_model, x, y, training=True, chunk=chunk)
        after = mean_loss(model, x, y, training=True, chunk=chunk)
        moved = max(float(np.abs(a - b).max()) for a, b in zip(final, initial))
        cell.update(loss_before=before, loss_after=after, weights_moved=moved)
        ok = np.isfinite(after) and after < before and moved > 0
        return bool(ok), f"{before:.4f} -> {after:.4f}; weights moved up to {moved:.2e}"
    check("loss_falls", loss_falls)

    if not chief:
        return None
    cell["status"] = "pass" if not problems else "fail"
    if problems:
        cell["reason"] = problems[0][:300]
    return cell


# A BatchNorm model's sensitivity: the default engine trained again from its
# initial weights times (1 + 1e-7·noise), float32 rounding's size, ends this
# far (relative to the weights' scale) from its own run. Where that exceeds the
# 1e-4 rule (DenseNet121: 1.1e-3 after one step), another engine's reordering
# cannot be told from it: the tolerance becomes SENSITIVITY_MARGIN x it. An
# error of the engine (a dropped micro-batch, a wrong reduction) changes the
# gradient itself, not its last bits, and moves the weights by the step's size.
PERTURBATION = 1e-7
SENSITIVITY_MARGIN = 10


def sensitivity(case, spec, dataset_fn, initial, final, paths) -> float:
    rng = np.random.default_rng(0)
    nudged = [w * (1 + PERTURBATION * rng.standard_normal(w.shape)).astype(w.dtype)
              if w.dtype.kind == "f" else w for w in initial]

    def model_fn(spec_):
        model = case.build(spec_)
        model.set_weights(nudged)
        return model

    again = tfdist.train(config_for("default", sgd=case.batch_norm,
                                    learning_rate=case.learning_rate, steps=case.steps),
                         model_fn=model_fn, dataset_fn=dataset_fn, spec=spec)
    return weight_difference([np.asarray(w) for w in again.model.get_weights()], final,
                             paths)[0]


def _default_sensitivity(workdir, case):
    try:
        with open(os.path.join(workdir, "default", f"{case.name}.json")) as f:
            return json.load(f).get("sensitivity")
    except (OSError, ValueError):
        return None


def expected_to_match(engine, case, precision):
    """Whether the engine computes the same function of the same batches as
    one device (then the weights must agree to rounding), and why not."""
    if engine == "parameter_server":
        return False, "asynchronous: each step is one worker's global batch from its own pipeline"
    if case.batch_norm and engine in PER_REPLICA_STATISTICS:
        return False, "BatchNorm normalises by each replica's (micro-)batch statistics"
    return True, ""


def main(workdir, engine, names, precision="float32"):
    if engine not in MULTI_PROCESS:
        from tfdist import cluster
        cluster.configure_virtual_cpus(4)
    column = engine if precision == "float32" else f"{engine}-{precision}"
    os.makedirs(os.path.join(workdir, column), exist_ok=True)
    for name in names.split(","):
        case = MODELS[name]
        print(f"conformance: begin {column} {name}", flush=True)
        try:
            cell = run_cell(workdir, engine, case, precision)
        except Exception as error:   # noqa: BLE001
            traceback.print_exc()
            cell = {"model": name, "engine": column, "status": "fail",
                    "reason": "harness: " + first_line(error)}
        if cell is not None and is_chief():
            with open(os.path.join(workdir, column, f"{name}.json"), "w") as f:
                json.dump(cell, f, indent=1, default=str)
        print(f"conformance: end {column} {name} "
              f"{cell and cell['status']} {cell and cell.get('reason', '')}", flush=True)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--precision=")]
    precision = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--precision=")),
                     "float32")
    main(*args, precision=precision)
