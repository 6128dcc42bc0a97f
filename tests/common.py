"""Small deterministic data and models for in-process tests."""

import numpy as np

import tfdist   # before TensorFlow: tfdist keeps Keras from importing matplotlib
from tfdist.data.function_inputs import shard
from tfdist.data.spec import DatasetSpec

import tensorflow as tf  # noqa: E402

IMAGE_SPEC = DatasetSpec(name="random_images", kind="image", input_shape=(8, 8, 3),
                         num_classes=5, train_examples=512, eval_examples=96)
# Host inputs for a trained model's predictions, the same in every test and worker.
PROBE = np.random.default_rng(7).normal(size=(16, *IMAGE_SPEC.input_shape)).astype(np.float32)


def image_dataset_fn(split, context, spec=IMAGE_SPEC):
    """Fixed random images and labels of `spec`; the same stream under every
    strategy."""
    rng = np.random.default_rng(0 if split == "train" else 1)
    n = spec.train_examples if split == "train" else spec.eval_examples
    x = rng.normal(size=(n, *spec.input_shape)).astype(np.float32)
    y = rng.integers(spec.num_classes, size=n).astype(np.int32)
    return shard(tf.data.Dataset.from_tensor_slices((x, y)), context)


def run_config(strategy="default", *, optimizer="sgd", learning_rate=0.05, steps=5,
               batch=32, model="mlp", accum_steps=1, model_dir=None, steps_per_loop=None,
               checkpoint_every=0, width=16, depth=1, jit_compile="off", **train):
    """A small in-process run. XLA is off unless asked for: these tests compare
    the trainer's arithmetic across strategies and features to rounding, and
    XLA compiles each variant into a differently fused program; its own
    equivalence is tested in test_observe.py, and the CLI tests run the
    default (--jit_compile=auto). PowerSGD compresses every matrix here
    (`powersgd_min_compression=0`) unless asked otherwise: the small test
    models' matrices are not twice the size of their factors."""
    if train.get("grad_compression") == "powersgd":
        train.setdefault("powersgd_min_compression", 0.0)
    return tfdist.RunConfig(
        strategy=tfdist.StrategyConfig(name=strategy, virtual_devices=2),
        model=tfdist.ModelConfig(name=model, width=width, depth=depth),
        optimizer=tfdist.OptimizerConfig(name=optimizer, learning_rate=learning_rate),
        train=tfdist.TrainConfig(global_batch_size=batch, train_steps=steps,
                                 steps_per_loop=steps_per_loop or steps, accum_steps=accum_steps,
                                 model_dir=model_dir, checkpoint_every=checkpoint_every,
                                 jit_compile=jit_compile, **train),
    )


# Outputs of the same weights computed in another order (another strategy,
# device split or CPU kernel): float32 has a 24-bit mantissa (eps 1.2e-7), and
# each logit is a few hundred-term sum per layer over a handful of layers, so
# reordering moves it by a few ulps of its magnitude (seen: 6e-8 absolute,
# 9e-7 relative). 1e-6 absolute / 1e-5 relative bounds that with margin and
# still catches any real difference in weights or in what is computed.
PREDICTION_TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def assert_variables_equal(a, b):
    """Bit-identical variables (a restore or a broadcast copies bytes)."""
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y),
                                      err_msg=f"variable {i} {getattr(x, 'path', '')}")


def assert_weights_close(a, b, rtol=1e-5, atol=1e-7):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=f"weight {i}")


def mw_config(strategy, steps=10, **train):
    """The run tests/mw_worker.py makes (no shuffling: batches in file order).
    XLA is off unless a run asks for it (`jit_compile="auto"`), as in
    `run_config`: its compile costs seconds of CPU in every process of every
    run, and a cluster's XLA step is covered by the runs that ask for it."""
    train = {"global_batch_size": 32, "train_steps": steps, "steps_per_loop": 5,
             "jit_compile": "off", **train}
    return tfdist.RunConfig(
        strategy=tfdist.StrategyConfig(name=strategy, collective_timeout_s=60),
        model=tfdist.ModelConfig(name="mlp", width=16, depth=1),
        data=tfdist.DataConfig(shuffle_buffer=1),
        optimizer=tfdist.OptimizerConfig(name="sgd", learning_rate=0.1),
        train=tfdist.TrainConfig(**train))


def train_from(config, initial, dataset_fn=image_dataset_fn):
    """`tfdist.train` on the test images (or `dataset_fn`'s), starting from
    the `initial` weights."""
    from tfdist import models

    def model_fn(spec):
        model = models.build(config.model, spec)
        model.set_weights(initial)
        return model

    return tfdist.train(config, model_fn=model_fn, dataset_fn=dataset_fn, spec=IMAGE_SPEC)


TOKEN_SPEC = DatasetSpec(name="random_tokens", kind="tokens", input_shape=(16,), num_classes=11,
                         train_examples=256, eval_examples=64)


def token_dataset_fn_for(spec):
    """A dataset_fn of random token sequences of `spec`; targets are the
    inputs shifted by one."""
    length = spec.input_shape[0]

    def token_dataset_fn(split, context):
        rng = np.random.default_rng(2 if split == "train" else 3)
        n = spec.train_examples if split == "train" else spec.eval_examples
        seq = rng.integers(spec.num_classes, size=(n, length + 1)).astype(np.int32)
        return shard(tf.data.Dataset.from_tensor_slices((seq[:, :-1], seq[:, 1:])), context)

    return token_dataset_fn


token_dataset_fn = token_dataset_fn_for(TOKEN_SPEC)


# `tfdist-train` several times in ONE fresh process (each start of TensorFlow
# costs seconds of CPU): for CLI cases that fail after start-up, where what is
# tested is the exit status and the stderr of each invocation. Each case runs
# the console script's entry point (`tfdist.app.run`) with its own argv and
# with every flag reset to its default, its stdout and stderr (file
# descriptors 1 and 2: TensorFlow's C++ lines too) captured on their own.
# Like every `tfdist-train` process, the driver sets up the CLI's default
# --virtual_devices before the first case.
_CLI_CASES_DRIVER = r"""
import json, os, sys, tempfile, traceback
from absl import flags
from tfdist import app, cluster, flags as tfdist_flags
cluster.configure_virtual_cpus(tfdist_flags.CLI_VIRTUAL_DEVICES)
results = []
real_out, real_err = os.dup(1), os.dup(2)
for argv in json.loads(sys.argv[1]):
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
        flags.FLAGS.unparse_flags()
        sys.argv = ["tfdist-train", *argv]
        try:
            app.run()
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(real_out, 1), os.dup2(real_err, 2)
        out.seek(0), err.seek(0)
        results.append({"returncode": code, "stdout": out.read(), "stderr": err.read()})
print("CASES " + json.dumps(results), flush=True)
"""


def run_cli_cases(arg_lists, *, timeout=300):
    """`tfdist-train ARGS` for each of `arg_lists`, one after another in one
    fresh process; return a CompletedProcess-like result for each, in order."""
    import json
    import os
    import subprocess

    from conftest import BIN, REPO

    driver = subprocess.run([os.path.join(BIN, "python"), "-c", _CLI_CASES_DRIVER,
                             json.dumps([list(map(str, args)) for args in arg_lists])],
                            cwd=REPO, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
                            capture_output=True, text=True, timeout=timeout)
    lines = [line for line in driver.stdout.splitlines() if line.startswith("CASES ")]
    assert driver.returncode == 0 and lines, driver.stderr[-3000:]
    return [subprocess.CompletedProcess(args, r["returncode"], r["stdout"], r["stderr"])
            for args, r in zip(arg_lists, json.loads(lines[-1][len("CASES "):]))]


# keras-hub CausalLMs (the pipeline's tests, in one process and across processes)
HUB_TOKENS = DatasetSpec(name="random_tokens", kind="tokens", input_shape=(8,), num_classes=32,
                         train_examples=64, eval_examples=16)


def hub_dataset_fn(split, context):
    """keras-hub's features: {"token_ids", "padding_mask"} (the mask also
    read by every decoder block); targets are the tokens shifted by one."""
    import tensorflow as tf
    rng = np.random.default_rng(2 if split == "train" else 3)
    n = HUB_TOKENS.train_examples if split == "train" else HUB_TOKENS.eval_examples
    seq = rng.integers(1, HUB_TOKENS.num_classes, size=(n, 9)).astype(np.int32)
    mask = np.ones((n, 8), np.int32)
    mask[::3, 6:] = 0   # some padding
    features = {"token_ids": seq[:, :-1], "padding_mask": mask}
    return shard(tf.data.Dataset.from_tensor_slices((features, seq[:, 1:])), context)


def hub_causal_lm(kind, num_layers: int = 1):
    """A tiny keras-hub CausalLM of `kind` (with `num_layers` decoder
    blocks), its token embedding tied (used for the input and, reversed, for
    the logits)."""
    import pytest
    keras_hub = pytest.importorskip("keras_hub")
    vocab, common = HUB_TOKENS.num_classes, dict(num_layers=num_layers, hidden_dim=16,
                                                 intermediate_dim=32)
    if kind == "llama":
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=vocab, num_query_heads=4, num_key_value_heads=2, dropout=0,
            **common)
        return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    if kind == "gemma":
        backbone = keras_hub.models.GemmaBackbone(
            vocabulary_size=vocab, num_query_heads=2, num_key_value_heads=1, head_dim=8,
            dropout=0, **common)
        return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocab, num_heads=2, max_sequence_length=8, dropout=0, **common)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
