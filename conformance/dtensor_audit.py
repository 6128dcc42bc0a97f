"""`make audit`: every Keras 3 built-in layer with weights, trained under DTensor.

For each layer, a tiny model (input -> the layer, named "probe" -> Flatten ->
Dense(classes)) is trained for two SGD steps through the product API
(`tfdist.train(config, model_fn=..., dataset_fn=..., spec=..., layout_rules=...)`)
on the default engine and then under `--strategy=dtensor` on four meshes:

  batch:4,model:1            data parallel
  batch:1,model:4            model only: the probe's largest weight split 4 ways
  batch:2,model:2            both axes
  batch:4,model:1 zero=3     ZeRO-3: every weight split over `batch`

The layout rule splits the probe's largest weight on `model` (its last
dimension divisible by 4, else another one) on the meshes with a `model` axis;
the batch-only and ZeRO-3 columns run without rules, as a user runs them.
A one-line refusal before compiling is recorded as `refused`. Each cell is
  pass      trained, the split took effect (device parameter bytes below the
            whole where a split was asked for), and every weight within
            float32 tolerance of the default engine's from the same initial weights;
  fail      an exception (the op DTensor could not lower and the first error line);
  mismatch  trained, but a weight differs (the largest difference), or the
            split did not take effect.

Tolerance: 1e-4 of each variable's largest magnitude (floored at 1e-3, so at
least 1e-7 absolute: float32 rounding of O(1) sums). Two SGD steps of the same
arithmetic summed in another order (partial matmuls and convolutions then an
all-reduce; per-shard moments) differ by float32 rounding: a few ulps of each
sum (eps 1.2e-7) times the number of terms reordered, ~1e-6 relative here; a
layout or gradient error moves weights by the learning rate times the gradient,
>= 1e-3 of the weights after the steps (checked: training must move them more).

Every cell runs in this one process (TensorFlow start-up once), each in its own
try/except. Also probes a few TensorFlow ops against the rule set extracted from
the TF source (tfdist/strategies/dtensor/rules.py). Writes a markdown report.

  python conformance/dtensor_audit.py --out docs/dtensor_coverage.md [--layers Dense,LSTM]
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import logging
import os
import platform
import re
import sys
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tfdist   # noqa: E402  (before TensorFlow: keeps Keras from importing matplotlib)
from tfdist import cluster  # noqa: E402

cluster.configure_virtual_cpus(4)   # before TensorFlow initialises

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfdist.data.function_inputs import shard  # noqa: E402
from tfdist.data.spec import DatasetSpec  # noqa: E402
from tfdist.strategies.dtensor import rules as dtensor_rules  # noqa: E402

CLASSES = 4
EXAMPLES = 64
BATCH = 16
STEPS = 2
RTOL = 1e-4
ABS_FLOOR = 1e-3   # differences are relative to max(|largest value|, this)
MESHES = [  # (column label, mesh, zero stage)
    ("batch:4,model:1", "batch:4,model:1", 0),
    ("batch:1,model:4", "batch:1,model:4", 0),
    ("batch:2,model:2", "batch:2,model:2", 0),
    ("batch:4,model:1 zero3", "batch:4,model:1", 3),
]

# Input shapes (without batch); every size a multiple of 4 where a weight takes it.
SHAPES = {
    "flat": ((16,), "float32"),
    "tokens": ((8,), "int32"),
    "seq": ((8, 4), "float32"),
    "img": ((8, 8, 4), "float32"),
    "vol": ((4, 4, 4, 4), "float32"),
    "video1d": ((3, 8, 4), "float32"),
    "video2d": ((3, 6, 6, 4), "float32"),
    "video3d": ((2, 4, 4, 4, 4), "float32"),
}


def _attention(layer_cls, **kw):
    """Self-attention: the layer called with (x, x)."""
    def call(x):
        return layer_cls(name="probe", **kw)(x, x)
    return call


L = keras.layers
# Layer class name -> list of (case label, input kind, function x -> y building the probe).
RECIPES = {
    "Dense": [("Dense", "flat", lambda x: L.Dense(8, name="probe")(x))],
    "EinsumDense": [("EinsumDense", "flat",
                     lambda x: L.EinsumDense("ab,bc->ac", output_shape=8, bias_axes="c",
                                             name="probe")(x))],
    "Embedding": [("Embedding", "tokens", lambda x: L.Embedding(16, 8, name="probe")(x))],
    "Conv1D": [("Conv1D", "seq", lambda x: L.Conv1D(8, 3, name="probe")(x)),
               ("Conv1D groups=2", "seq", lambda x: L.Conv1D(8, 3, groups=2, name="probe")(x))],
    "Conv2D": [("Conv2D", "img", lambda x: L.Conv2D(8, 3, name="probe")(x)),
               ("Conv2D groups=2", "img", lambda x: L.Conv2D(8, 3, groups=2, name="probe")(x)),
               ("Conv2D strides=2 same", "img",
                lambda x: L.Conv2D(8, 3, strides=2, padding="same", name="probe")(x))],
    "Conv3D": [("Conv3D", "vol", lambda x: L.Conv3D(8, 3, padding="same", name="probe")(x))],
    "Conv1DTranspose": [("Conv1DTranspose", "seq",
                         lambda x: L.Conv1DTranspose(8, 3, name="probe")(x))],
    "Conv2DTranspose": [("Conv2DTranspose", "img",
                         lambda x: L.Conv2DTranspose(8, 3, name="probe")(x))],
    "Conv3DTranspose": [("Conv3DTranspose", "vol",
                         lambda x: L.Conv3DTranspose(8, 3, name="probe")(x))],
    "DepthwiseConv1D": [("DepthwiseConv1D", "seq",
                         lambda x: L.DepthwiseConv1D(3, depth_multiplier=2, name="probe")(x))],
    "DepthwiseConv2D": [("DepthwiseConv2D", "img",
                         lambda x: L.DepthwiseConv2D(3, depth_multiplier=2, name="probe")(x)),
                        ("DepthwiseConv2D strides=2 same", "img",
                         lambda x: L.DepthwiseConv2D(3, strides=2, padding="same",
                                                     name="probe")(x))],
    "SeparableConv1D": [("SeparableConv1D", "seq",
                         lambda x: L.SeparableConv1D(8, 3, name="probe")(x))],
    "SeparableConv2D": [("SeparableConv2D", "img",
                         lambda x: L.SeparableConv2D(8, 3, name="probe")(x))],
    "BatchNormalization": [("BatchNormalization", "img",
                            lambda x: L.BatchNormalization(name="probe")(x))],
    "LayerNormalization": [("LayerNormalization", "seq",
                            lambda x: L.LayerNormalization(name="probe")(x))],
    "GroupNormalization": [("GroupNormalization", "img",
                            lambda x: L.GroupNormalization(groups=2, name="probe")(x))],
    "RMSNormalization": [("RMSNormalization", "seq",
                          lambda x: L.RMSNormalization(name="probe")(x))],
    "SpectralNormalization": [("SpectralNormalization(Dense)", "flat",
                               lambda x: L.SpectralNormalization(L.Dense(8), name="probe")(x))],
    "MultiHeadAttention": [("MultiHeadAttention", "seq",
                            _attention(L.MultiHeadAttention, num_heads=4, key_dim=4))],
    "GroupQueryAttention": [("GroupQueryAttention", "seq",
                               _attention(L.GroupQueryAttention, head_dim=4,
                                          num_query_heads=4, num_key_value_heads=2))],
    "AdditiveAttention": [("AdditiveAttention(use_scale)", "seq",
                           _attention(L.AdditiveAttention, use_scale=True))],
    "Attention": [("Attention(use_scale)", "seq", _attention(L.Attention, use_scale=True))],
    "SimpleRNN": [("SimpleRNN", "seq", lambda x: L.SimpleRNN(8, name="probe")(x))],
    "LSTM": [("LSTM", "seq", lambda x: L.LSTM(8, name="probe")(x))],
    "GRU": [("GRU", "seq", lambda x: L.GRU(8, name="probe")(x))],
    "RNN": [("RNN(LSTMCell)", "seq", lambda x: L.RNN(L.LSTMCell(8), name="probe")(x))],
    "Bidirectional": [("Bidirectional(LSTM)", "seq",
                       lambda x: L.Bidirectional(L.LSTM(8), name="probe")(x))],
    "TimeDistributed": [("TimeDistributed(Dense)", "seq",
                         lambda x: L.TimeDistributed(L.Dense(8), name="probe")(x))],
    "ConvLSTM1D": [("ConvLSTM1D", "video1d", lambda x: L.ConvLSTM1D(4, 3, name="probe")(x))],
    "ConvLSTM2D": [("ConvLSTM2D", "video2d", lambda x: L.ConvLSTM2D(4, 3, name="probe")(x))],
    "ConvLSTM3D": [("ConvLSTM3D", "video3d",
                    lambda x: L.ConvLSTM3D(4, 3, padding="same", name="probe")(x))],
    "PReLU": [("PReLU", "img", lambda x: L.PReLU(name="probe")(x))],
}
# Built-in layers with weights left out, and why.
SKIPPED_WITH_WEIGHTS = {
    "Normalization": "preprocessing: non-trainable mean/variance set by adapt(); nothing to train",
    "TextVectorization": "preprocessing: string input, lookup tables, not trainable",
    "StringLookup": "preprocessing: lookup table, not trainable",
    "IntegerLookup": "preprocessing: lookup table, not trainable",
    "Discretization": "preprocessing: bin boundaries, not trainable",
    "TorchModuleWrapper": "wraps a PyTorch module: torch backend only",
    "JaxLayer": "wraps a JAX function: jax backend only",
    "FlaxLayer": "wraps a Flax module: jax backend only",
    "TFSMLayer": "wraps a loaded SavedModel: needs an exported model, inference only",
    "Lambda": "user function: no built-in weights",
    "InputLayer": "no weights",
}
# Aliases of a recipe's class (same layer under another name).
ALIASES = {"Convolution1D": "Conv1D", "Convolution2D": "Conv2D", "Convolution3D": "Conv3D",
           "Convolution1DTranspose": "Conv1DTranspose",
           "Convolution2DTranspose": "Conv2DTranspose",
           "Convolution3DTranspose": "Conv3DTranspose",
           "SeparableConvolution1D": "SeparableConv1D",
           "SeparableConvolution2D": "SeparableConv2D"}


def enumerate_layers():
    """(tested class names, {skipped class name: reason}) over `keras.layers`."""
    tested, skipped = [], {}
    probe_input = {"img": np.zeros((2, 8, 8, 4), np.float32),
                   "seq": np.zeros((2, 8, 4), np.float32)}
    for name in sorted(dir(keras.layers)):
        cls = getattr(keras.layers, name)
        if not (inspect.isclass(cls) and issubclass(cls, keras.layers.Layer)):
            continue
        if name in RECIPES:
            tested.append(name)
            continue
        if name in ALIASES:
            skipped[name] = f"alias of {ALIASES[name]}"
            continue
        if name in SKIPPED_WITH_WEIGHTS:
            skipped[name] = SKIPPED_WITH_WEIGHTS[name]
            continue
        # Anything else: build it with default arguments on an image and a
        # sequence; a layer that then has weights and no recipe is flagged.
        reason = "no weights (built with default arguments)"
        try:
            layer = cls()
        except Exception:
            skipped[name] = "needs constructor arguments; not built (no recipe: assumed weight-free)"
            continue
        for kind, x in probe_input.items():
            try:
                layer(x)
                break
            except Exception:
                continue
        else:
            reason = "could not be called on an image or a sequence with default arguments"
        if layer.weights:
            reason = (f"HAS WEIGHTS ({[w.path for w in layer.weights]}) but no recipe here: "
                      "not audited")
        skipped[name] = reason
    return tested, skipped


def make_dataset_fn(shape, dtype):
    def dataset_fn(split, context):
        rng = np.random.default_rng(0 if split == "train" else 1)
        if dtype == "int32":
            x = rng.integers(16, size=(EXAMPLES, *shape)).astype(np.int32)
        else:
            x = rng.normal(size=(EXAMPLES, *shape)).astype(np.float32)
        y = rng.integers(CLASSES, size=EXAMPLES).astype(np.int32)
        return shard(tf.data.Dataset.from_tensor_slices((x, y)), context)
    return dataset_fn


def make_model_builder(kind, body):
    shape, dtype = SHAPES[kind]

    def build():
        x = keras.Input(shape, dtype=dtype, name="x")
        y = body(x)
        y = keras.layers.Flatten(name="flatten")(y)
        y = keras.layers.Dense(CLASSES, name="head")(y)
        return keras.Model(x, y)
    return build


def run_config(strategy, mesh="batch:1,model:2", zero=0):
    return tfdist.RunConfig(
        strategy=tfdist.StrategyConfig(name=strategy, virtual_devices=4, mesh=mesh,
                                       zero_stage=zero),
        model=tfdist.ModelConfig(name="mlp", width=16, depth=1),
        optimizer=tfdist.OptimizerConfig(name="sgd", learning_rate=0.05),
        train=tfdist.TrainConfig(global_batch_size=BATCH, train_steps=STEPS,
                                 steps_per_loop=STEPS, jit_compile="off"))


def split_rule(weights):
    """A rule splitting the largest probe weight on `model`: (pattern, spec, path, shape)."""
    probe = [w for w in weights if w.path.startswith("probe/")]
    if not probe:
        return None
    w = max(probe, key=lambda v: (int(np.prod(v.shape)), v.path))
    shape = tuple(w.shape)
    dims = [d for d in reversed(range(len(shape))) if shape[d] % 4 == 0]
    if not dims:
        return None
    spec = [None] * len(shape)
    spec[dims[0]] = "model"
    return (re.escape(w.path) + "$", tuple(spec), w.path, shape)


FAILURE_TEXTS = []   # (case, mesh, full error text), for --errors
# The op an MLIR diagnostic is about: "'tf.X' op ..." in the error line, else the
# "see current operation: %1 = "tf.X"(...)" note after it.
OP_PATTERNS = [r"'tf\.(\w+)' op", r"current operation: .*?\"tf\.(\w+)\"",
               r"Op type not registered '(\w+)'", r"\btf\.(\w+)\b"]


def failure(error):
    """(op type, first error line, full text) of a failed cell. The MLIR
    diagnostics look like '<file>:<line>:<col>: error: 'tf.X' op <message>',
    followed by 'note: see current operation' lines; the error line names the op."""
    text = "".join(traceback.format_exception_only(type(error), error))
    cause = error.__cause__ or error.__context__
    if cause is not None:
        text += "\n" + "".join(traceback.format_exception_only(type(cause), cause))
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r"\berror:", ln)]
    first = errors[0] if errors else (lines[0] if lines else repr(error))
    first = re.sub(r"^.*?:\d+:\d+: (error:)", r"\1", first)   # drop the source location
    op = None
    for candidate in [first, text]:
        for pattern in OP_PATTERNS:
            m = re.search(pattern, candidate)
            if m:
                op = m.group(1)
                break
        if op:
            break
    return op, first[:300], text


def variables(result):
    return [(v.path, np.array(v.numpy())) for v in result.model.variables]


def compare(got, want, initial):
    worst = (0.0, None)
    for (path, g), (_, w) in zip(got, want):
        # Floored at 1e-3: a variable that starts at 0 with an exact gradient of 0
        # (attention's key bias: softmax ignores a shared shift) holds only rounding
        # noise, ~1e-9, whose relative difference means nothing.
        scale = max(float(np.abs(w).max()), ABS_FLOOR)
        rel = float(np.abs(g - w).max()) / scale
        if rel > worst[0]:
            worst = (rel, path)
    moved = max(float(np.abs(w - i).max()) for (_, w), i in zip(want, initial))
    return worst, moved


def audit_case(label, kind, body, log):
    shape, dtype = SHAPES[kind]
    spec = DatasetSpec(name="audit_" + kind, kind="image", input_shape=shape,
                       num_classes=CLASSES, train_examples=EXAMPLES, eval_examples=16)
    dataset_fn = make_dataset_fn(shape, dtype)
    build = make_model_builder(kind, body)
    keras.utils.set_random_seed(1)
    host = build()
    initial = host.get_weights()
    rule = split_rule(host.weights)
    total_bytes = sum(int(np.prod(w.shape)) * w.dtype.itemsize for w in initial)
    row = {"label": label, "rule": rule, "total_bytes": total_bytes, "cells": {}}

    def model_fn(_spec):
        model = build()
        model.set_weights(initial)
        return model

    try:
        reference = tfdist.train(run_config("default"), model_fn=model_fn,
                                 dataset_fn=dataset_fn, spec=spec)
        want = variables(reference)
    except Exception as error:   # the layer itself does not train on one device
        op, first, _ = failure(error)
        row["reference_error"] = first
        log(f"  default engine FAILED: {first}")
        return row
    rules = [(rule[0], rule[1])] if rule else []
    for column, mesh, zero in MESHES:
        t0 = time.time()
        cell = {}
        try:
            # The model axis carries the rule; on a batch-only mesh (data
            # parallel, ZeRO-3) a rule naming `model` of size 1 would still
            # lay the weight out on it, which is not what a user runs there.
            on_model = "model:1" not in mesh
            result = tfdist.train(run_config("dtensor", mesh, zero), model_fn=model_fn,
                                  dataset_fn=dataset_fn, spec=spec,
                                  layout_rules=rules if on_model else [])
            got = variables(result)
            device_bytes = result.summary.get("device_parameter_bytes")
            (rel, path), moved = compare(got, want, initial)
            cell.update(rel=rel, path=path, moved=moved, device_bytes=device_bytes)
            split_expected = (bool(rule) and on_model) or zero == 3
            split_ok = (device_bytes is not None and device_bytes < total_bytes) \
                if split_expected else True
            cell["split"] = (device_bytes < total_bytes) if device_bytes is not None else None
            if moved <= 10 * RTOL:
                cell.update(status="mismatch", detail=f"training moved weights only {moved:.1e}")
            elif rel > RTOL:
                cell.update(status="mismatch", detail=f"{path}: {rel:.1e} of its largest value")
            elif not split_ok:
                cell.update(status="mismatch",
                            detail=f"no split: device bytes {device_bytes} of {total_bytes}")
            else:
                cell.update(status="pass", detail=f"max diff {rel:.1e}")
        except tfdist.UsageError as error:   # refused in one line before compiling
            cell.update(status="refused", detail=str(error).splitlines()[0][:200])
        except Exception as error:
            op, first, text = failure(error)
            cell.update(status="fail", op=op, detail=first, text=text)
            FAILURE_TEXTS.append((label, column, text))
        cell["seconds"] = time.time() - t0
        row["cells"][column] = cell
        log(f"  {column:22s} {cell['status']:8s} {cell.get('op') or ''} {cell['detail']} "
            f"({cell['seconds']:.1f} s)")
    return row


# Ops to check against the extracted rule set: (op type, function on DTensor inputs).
def _probe_ops():
    def conv_inputs():
        return tf.ones([4, 6, 6, 4]), tf.ones([3, 3, 4, 2])
    return {
        "MatMul": lambda: (tf.raw_ops.MatMul, dict(a=tf.ones([4, 4]), b=tf.ones([4, 4]))),
        "Conv2D": lambda: (tf.raw_ops.Conv2D, dict(input=tf.ones([4, 6, 6, 4]),
                                                  filter=tf.ones([3, 3, 4, 2]),
                                                  strides=[1, 1, 1, 1], padding="VALID")),
        "Conv2DBackpropFilter": lambda: (tf.raw_ops.Conv2DBackpropFilter, dict(
            input=tf.ones([4, 6, 6, 4]), filter_sizes=tf.constant([3, 3, 4, 2]),
            out_backprop=tf.ones([4, 4, 4, 2]), strides=[1, 1, 1, 1], padding="VALID")),
        "DepthwiseConv2dNative": lambda: (tf.raw_ops.DepthwiseConv2dNative, dict(
            input=tf.ones([4, 6, 6, 4]), filter=tf.ones([3, 3, 4, 1]),
            strides=[1, 1, 1, 1], padding="VALID")),
        "DepthwiseConv2dNativeBackpropFilter": lambda: (
            tf.raw_ops.DepthwiseConv2dNativeBackpropFilter, dict(
                input=tf.ones([4, 6, 6, 4]), filter_sizes=tf.constant([3, 3, 4, 1]),
                out_backprop=tf.ones([4, 4, 4, 4]), strides=[1, 1, 1, 1], padding="VALID")),
        "DepthwiseConv2dNativeBackpropInput": lambda: (
            tf.raw_ops.DepthwiseConv2dNativeBackpropInput, dict(
                input_sizes=tf.constant([4, 6, 6, 4]), filter=tf.ones([3, 3, 4, 1]),
                out_backprop=tf.ones([4, 4, 4, 4]), strides=[1, 1, 1, 1], padding="VALID")),
        "SoftplusGrad": lambda: (tf.raw_ops.SoftplusGrad, dict(gradients=tf.ones([4, 4]),
                                                               features=tf.ones([4, 4]))),
        "Conv3DBackpropFilterV2": lambda: (tf.raw_ops.Conv3DBackpropFilterV2, dict(
            input=tf.ones([4, 4, 4, 4, 2]), filter_sizes=tf.constant([3, 3, 3, 2, 2]),
            out_backprop=tf.ones([4, 2, 2, 2, 2]), strides=[1, 1, 1, 1, 1], padding="VALID")),
    }


def probe_rules(log):
    """Each probe op alone in a tf.function on DTensor inputs replicated over a
    batch:4 mesh: compiles (a rule) or 'does not implement layout propagation'."""
    from tensorflow.experimental import dtensor
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:4]
    mesh = dtensor.create_mesh([("batch", 4)], devices=devices)
    rows = []
    for op, make in _probe_ops().items():
        fn, kwargs = make()
        dkwargs = {}
        for key, value in kwargs.items():
            if isinstance(value, tf.Tensor):
                layout = dtensor.Layout.replicated(mesh, rank=value.shape.rank)
                dkwargs[key] = dtensor.copy_to_mesh(value, layout)
            else:
                dkwargs[key] = value
        tensors = {k: v for k, v in dkwargs.items() if isinstance(v, tf.Tensor)}
        static = {k: v for k, v in dkwargs.items() if not isinstance(v, tf.Tensor)}

        @tf.function
        def run(**ts):
            return fn(**ts, **static)
        try:
            with dtensor.default_mesh(mesh):
                run(**tensors)
            lowered, detail = True, "compiled and ran"
        except Exception as error:
            _, first, text = failure(error)
            lowered = "does not implement layout propagation" not in text
            detail = first
        predicted = op in dtensor_rules.OPS_WITH_RULES
        rows.append((op, predicted, lowered, detail))
        log(f"  probe {op}: rule in set={predicted} lowered={lowered} {detail[:120]}")
    return rows


def render(rows, skipped, probes, started, seconds, argv):
    from tfdist.observe import hardware
    cols = [c for c, _, _ in MESHES]
    out = ["# DTensor coverage of Keras 3 built-in layers", "",
           f"Generated by `conformance/dtensor_audit.py` (`make audit`) on "
           f"{started:%Y-%m-%d %H:%M UTC}; wall time {seconds:.0f} s.", "",
           f"- CPU: {hardware.describe()}",
           f"- TensorFlow {tf.__version__} ({tf.__git_version__}), Keras {keras.__version__}, "
           f"Python {platform.python_version()}, NumPy {np.__version__}",
           f"- DTensor rule set: `tfdist/strategies/dtensor/rules.py` "
           f"({len(dtensor_rules.OPS_WITH_RULES)} op types; {dtensor_rules.SOURCE})",
           f"- Command: `{' '.join(argv)}`", "",
           "Each row: input -> the layer (`probe`) -> Flatten -> Dense(4), trained 2 SGD steps "
           f"(lr 0.05, global batch {BATCH}) through `tfdist.train` on 4 virtual CPUs, under "
           "the default engine and under `--strategy=dtensor` on each mesh, from the same "
           "initial weights. The layout rule splits the probe's largest weight on `model` on "
           "the meshes with a `model` axis; the batch-only and ZeRO-3 columns run without "
           "rules. **refused**: a one-line `UsageError` before compiling.",
           "",
           f"- **pass**: trained; every variable within {RTOL:g} of max(its largest magnitude in the "
           f"default engine's run, {ABS_FLOOR:g}) of the "
           "default engine's (float32 reordering of sums is ~1e-6 here; a layout or "
           "gradient error is >= 1e-3); the weight split took effect (device parameter bytes "
           "below the whole on the model-split and ZeRO-3 meshes).",
           "- **fail**: an exception; the op type DTensor could not lower and the first line.",
           "- **mismatch**: trained, but a weight differed (the largest difference) or the split "
           "did not take effect.", "",
           "| layer | split weight (rule) | " + " | ".join(cols) + " |",
           "|---|---|" + "---|" * len(cols)]
    for row in rows:
        rule = row["rule"]
        rule_text = f"`{rule[2]}` {rule[3]} -> {rule[1]}" if rule else "none splittable"
        if "reference_error" in row:
            out.append(f"| {row['label']} | {rule_text} | "
                       + " | ".join(["default engine failed"] * len(cols)) + " |")
            continue
        cells = []
        for c in cols:
            cell = row["cells"].get(c)
            if cell is None:
                cells.append("-")
            elif cell["status"] == "pass":
                cells.append(f"pass ({cell['rel']:.0e})")
            elif cell["status"] == "fail":
                cells.append(f"**fail** `{cell.get('op')}`")
            elif cell["status"] == "refused":
                cells.append("refused")
            else:
                cells.append(f"**mismatch** {cell['detail']}")
        out.append(f"| {row['label']} | {rule_text} | " + " | ".join(cells) + " |")
    fails = [(row["label"], c, cell) for row in rows for c, cell in row["cells"].items()
             if cell["status"] != "pass"]
    out += ["", "## Failures and mismatches", ""]
    if not fails:
        out.append("None.")
    for label, c, cell in fails:
        op = cell.get("op")
        verdict = ""
        if op:
            if op in dtensor_rules.OPS_WITH_RULES:
                verdict = " (op HAS a rule in the extracted set: not predicted)"
            elif op in dtensor_rules.HANDLED_WITHOUT_RULES:
                verdict = " (op handled without a rule per the set: not predicted)"
            else:
                verdict = " (no rule in the extracted set: predicted)"
        out.append(f"- {label}, {c}: {cell['status']} `{op}`{verdict}: {cell['detail']}")
    ops = sorted({cell.get("op") for _, _, cell in fails if cell.get("op")})
    if ops:
        out += ["", "Op types in failures: " + ", ".join(
            f"`{op}` ({'rule' if op in dtensor_rules.OPS_WITH_RULES else 'no rule'})"
            for op in ops)]
    if probes:
        out += ["", "## Rule probes",
                "", "Each op alone in a `tf.function` on inputs replicated over a `batch:4` "
                "mesh; 'lowered' is False only for 'does not implement layout propagation'.", "",
                "| op | in OPS_WITH_RULES | lowered | agrees | first line |", "|---|---|---|---|---|"]
        for op, predicted, lowered, detail in probes:
            out.append(f"| {op} | {predicted} | {lowered} | "
                       f"{'yes' if predicted == lowered else '**NO**'} | {detail[:150]} |")
    out += ["", "## Keras layers not audited", "",
            "Enumerated from `dir(keras.layers)`; audited classes are the rows above.", ""]
    for name, reason in sorted(skipped.items()):
        out.append(f"- `{name}`: {reason}")
    return "\n".join(out) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description="DTensor coverage of Keras 3 layers")
    p.add_argument("--out", default="docs/dtensor_coverage.md")
    p.add_argument("--layers", default="", help="comma-separated case labels or class names")
    p.add_argument("--no-probes", action="store_true")
    p.add_argument("--errors", help="also write every failure's full error text to this file")
    a = p.parse_args(argv)
    logging.getLogger("absl").setLevel(logging.ERROR)
    tf.get_logger().setLevel(logging.ERROR)
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.time()

    def log(msg):
        print(msg, flush=True)

    tested, skipped = enumerate_layers()
    wanted = set(filter(None, a.layers.split(",")))
    rows = []
    for name in tested:
        for label, kind, body in RECIPES[name]:
            if wanted and label not in wanted and name not in wanted:
                continue
            log(f"{label} ({kind})")
            try:
                rows.append(audit_case(label, kind, body, log))
            except Exception as error:   # the host model itself failed to build
                rows.append({"label": label, "rule": None, "cells": {},
                             "reference_error": failure(error)[1]})
                log(f"  build FAILED: {failure(error)[1]}")
    probes = [] if a.no_probes else probe_rules(log)
    seconds = time.time() - t0
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        f.write(render(rows, skipped, probes, started, seconds, [sys.argv[0], *(argv or sys.argv[1:])]))
    if a.errors:
        with open(a.errors, "w", encoding="utf-8") as f:
            for label, column, text in FAILURE_TEXTS:
                f.write(f"===== {label} / {column}\n{text}\n")
    log(f"wrote {a.out} ({seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
