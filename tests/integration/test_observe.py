"""Observability and XLA: TensorBoard scalars, profiler traces, MFU, gradient
agreement, per-rank log lines, and --jit_compile's equivalence with plain graphs."""

import glob
import os
import subprocess

import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist import api, models
from tfdist.errors import UsageError
from tfdist.training import xla

from common import (IMAGE_SPEC, TOKEN_SPEC, assert_weights_close, run_config, token_dataset_fn,
                    train_from)
from conftest import BIN, REPO

TRAIN_SCALARS = {"loss", "accuracy", "learning_rate", "grad_norm", "examples_per_sec", "tflops",
                 "mfu", "bytes_reduced_per_update"}


def read_scalars(directory):
    """{tag: {step: value}} from every event file under `directory`."""
    scalars = {}
    for path in glob.glob(os.path.join(directory, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = float(
                    tf.make_ndarray(value.tensor))
    return scalars


@pytest.mark.slow   # the profiler's trace (~15 s)
def test_tensorboard_has_every_scalar_and_the_profile_trace(tmp_path):
    config = run_config("mirrored", steps=6, steps_per_loop=2, model_dir=str(tmp_path),
                        precision="mixed_float16", profile_steps=(3, 4), grad_agreement_every=3)
    summary = train_from(config, models.build(config.model, IMAGE_SPEC).get_weights()).summary
    train = read_scalars(tmp_path / "tensorboard" / "train")
    assert TRAIN_SCALARS | {"loss_scale", "grad_agreement_min", "grad_agreement_mean",
                            "grad_agreement_replica_0", "grad_agreement_replica_1"} <= set(train)
    # One point per loop, at its last step: loops stop at the profiled steps
    # (3-4: before 3 and at 4) and at the sampled steps (every 3).
    assert sorted(train["loss"]) == [2, 3, 4, 6]
    assert sorted(train["grad_agreement_min"]) == [3, 6]  # the sampled steps
    for replica in (0, 1):   # two halves of one batch: similar, not identical, directions
        assert 0 < train[f"grad_agreement_replica_{replica}"][6] <= 1 + 1e-6
    assert train["bytes_reduced_per_update"][2] == summary["bytes_reduced_per_update"]
    assert train["loss_scale"][6] == summary["loss_scale"]
    assert all(np.isfinite(v) and v > 0 for v in train["grad_norm"].values())
    evaluation = read_scalars(tmp_path / "tensorboard" / "eval")
    assert {"loss", "accuracy"} <= set(evaluation) and 6 in evaluation["accuracy"]
    traces = glob.glob(str(tmp_path / "tensorboard" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert traces, "no profiler trace written"


def test_mfu_and_flops_in_the_summary():
    config = run_config("default", steps=40, steps_per_loop=10)
    summary = train_from(config, models.build(config.model, IMAGE_SPEC).get_weights()).summary
    # The mlp (8x8x3 -> 16 -> 5): 2 matmuls, 3x forward for training.
    assert summary["flops_per_example"] == 3 * 2 * (8 * 8 * 3 * 16 + 16 * 5)
    assert 0 < summary["mfu"] <= 1
    assert summary["peak_tflops"] > 0
    assert summary["tflops"] == pytest.approx(
        summary["examples_per_sec"] * summary["flops_per_example"] / 1e12)
    assert summary["cpu"]


def test_bad_profile_steps_and_missing_model_dir_are_usage_errors():
    with pytest.raises(tfdist.ConfigError):
        tfdist.TrainConfig(train_steps=5, profile_steps=(5, 3))
    with pytest.raises(UsageError, match="--model_dir"):
        tfdist.train(run_config("default", profile_steps=(1, 2)))


# -- XLA ----------------------------------------------------------------------
def _initial(config):
    return models.build(config.model, IMAGE_SPEC).get_weights()


@pytest.mark.slow   # XLA compiles (~30 s)
@pytest.mark.parametrize("strategy", ["default", "mirrored"])
def test_jit_compile_on_matches_off(strategy):
    """XLA fuses and reorders float operations, so weights after 5 Adam steps
    agree to rounding, not bit for bit: 1e-4 absolute bounds a few ulps of
    each step's update (lr 1e-3) with room, and catches any real difference
    (a missed or doubled update moves weights by ~1e-3)."""
    def config(jit, accum_steps=1):
        return run_config(strategy, optimizer="adam", learning_rate=1e-3, batch=64, depth=2,
                          jit_compile=jit, accum_steps=accum_steps)
    initial = _initial(config("off"))
    off = train_from(config("off"), initial)
    on = train_from(config("on"), initial)
    assert on.summary["jit_compile"] == xla.STEP and off.summary["jit_compile"] == xla.OFF
    assert_weights_close(on.model.get_weights(), off.model.get_weights(), rtol=0, atol=1e-4)
    # Micro-batches compiled one by one, their loop in TensorFlow: the same update.
    accumulated = train_from(config("on", accum_steps=2), initial)
    assert_weights_close(accumulated.model.get_weights(), off.model.get_weights(), rtol=0,
                         atol=1e-4)
    assert max(np.abs(w - i).max() for w, i in zip(on.model.get_weights(), initial)) > 1e-3
    # Every device's copy was updated (the fused update runs once per copy).
    for variable in on.model.trainable_variables:
        copies = [c.numpy() for c in getattr(variable.value, "values", [variable.value])]
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0])


def test_fused_optimizer_update_keeps_each_variables_slots():
    """Two variables of one shape: each fused update must use its own Adam
    moments (a compiled function shared by shape would reuse the first's)."""
    import keras

    a, b = keras.Variable(np.ones((3, 3), np.float32)), keras.Variable(np.ones((3, 3), np.float32))
    plain, fused = keras.optimizers.Adam(0.1), keras.optimizers.Adam(0.1)
    plain.build([a, b])
    fused.build([a, b])
    xla.fuse_optimizer_update(fused)
    grads = [tf.fill((3, 3), 1.0), tf.fill((3, 3), -2.0)]
    results = []
    for optimizer in (plain, fused):
        a.assign(np.ones((3, 3))), b.assign(np.ones((3, 3)))
        for _ in range(3):
            optimizer.apply(grads, [a, b])
        results.append([a.numpy(), b.numpy()])
    assert_weights_close(results[1], results[0], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_jit_compile_with_accumulation_and_recompute():
    """The transformer with recomputed blocks, 2 micro-batches, under XLA."""
    def train(jit):
        config = run_config("mirrored", model="transformer", width=8, batch=32, accum_steps=2,
                            jit_compile=jit, optimizer="sgd", learning_rate=0.1)
        config = config.replace(model=tfdist.ModelConfig(name="transformer", width=8, depth=1,
                                                         num_heads=2, recompute=True))
        return tfdist.train(config, model_fn=lambda s: _seeded(config, s),
                            dataset_fn=token_dataset_fn, spec=TOKEN_SPEC)

    def _seeded(config, spec):
        model = models.build(config.model, spec)
        model.set_weights(initial)
        return model

    initial = models.build(tfdist.ModelConfig(name="transformer", width=8, depth=1, num_heads=2,
                                              recompute=True), TOKEN_SPEC).get_weights()
    on, off = train("on"), train("off")
    assert_weights_close(on.model.get_weights(), off.model.get_weights(), rtol=0, atol=1e-4)


def test_auto_picks_by_precision_and_isa(monkeypatch):
    from tfdist.observe import hardware
    monkeypatch.setattr(hardware, "bf16_support", lambda: "AMX")
    assert xla.auto_level("mixed_bfloat16") == xla.OPTIMIZER
    assert xla.auto_level("float32") == xla.STEP
    assert xla.auto_level("float32", whole_step=False) == xla.STEP
    assert xla.auto_level("float32", whole_step=False, buckets=True) == xla.OPTIMIZER
    # convolutions: oneDNN's, the update fused only where large matrices hold
    # most parameters (a VGG's dense head)
    assert xla.auto_level("float32", convolution_share=0.9, large_share=0.0) == xla.OFF  # a cnn
    assert xla.auto_level("float32", convolution_share=0.9) == xla.OPTIMIZER
    assert xla.auto_level("mixed_bfloat16", convolution_share=0.9) == xla.OPTIMIZER  # AMX
    # native bf16, small matrices: XLA's fusion on one device, plain
    # TensorFlow where convolutions dominate and under replicated engines
    small = dict(large_share=0.0)
    assert xla.auto_level("mixed_bfloat16", **small) == xla.STEP   # a small transformer
    assert xla.auto_level("mixed_bfloat16", convolution_share=0.9, **small) == xla.OFF
    assert xla.auto_level("mixed_bfloat16", whole_step=False, **small) == xla.OFF
    assert xla.auto_level("mixed_bfloat16", whole_step=False, large_share=0.9) == xla.OPTIMIZER
    assert xla.auto_level("float32", whole_step=False, **small) == xla.STEP
    # float32 replicas sharing the cores: plain TensorFlow for large matrices
    # (the mlp under mirrored over virtual CPUs), the step for small ones and
    # for one replica per device (the controls)
    assert xla.auto_level("float32", whole_step=False, shared_replicas=2) == xla.OFF
    assert xla.auto_level("float32", whole_step=False, shared_replicas=2, **small) == xla.STEP
    assert xla.auto_level("float32", whole_step=False, shared_replicas=0) == xla.STEP
    monkeypatch.setattr(hardware, "bf16_support", lambda: "emulated")
    assert xla.auto_level("mixed_bfloat16") == xla.STEP
    assert xla.auto_level("mixed_bfloat16", whole_step=False) == xla.STEP
    assert xla.auto_level("mixed_bfloat16", convolution_share=0.9) == xla.STEP
    # AVX512-BF16 without AMX: on AMD (full-rate bf16) oneDNN's native kernels
    # with the fused update; on Intel (half-rate bf16) XLA's float32
    # computation; float32 as before.
    monkeypatch.setattr(hardware, "bf16_support", lambda: "AVX-512")
    monkeypatch.setattr(hardware, "cpu_vendor", lambda: "AMD")
    assert xla.auto_level("mixed_bfloat16") == xla.OPTIMIZER   # an mlp
    assert xla.auto_level("mixed_bfloat16", **small) == xla.OFF   # a small transformer
    assert xla.auto_level("mixed_bfloat16", convolution_share=0.9, **small) == xla.OFF  # a cnn
    assert xla.auto_level("mixed_bfloat16", whole_step=False, **small) == xla.OFF
    assert xla.auto_level("float32", convolution_share=0.9, **small) == xla.OFF
    assert xla.auto_level("mixed_float16") == xla.STEP   # float16 is emulated everywhere
    assert xla.auto_level("float32") == xla.STEP
    monkeypatch.setattr(hardware, "cpu_vendor", lambda: "Intel")
    assert xla.auto_level("mixed_bfloat16") == xla.STEP
    assert xla.auto_level("mixed_bfloat16", convolution_share=0.9) == xla.STEP
    assert xla.auto_level("mixed_bfloat16", whole_step=False, **small) == xla.STEP


def test_large_share_is_the_share_of_parameters_in_large_matrices():
    import keras
    wide = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(1024),
                             keras.layers.Dense(10)])
    assert xla.large_share(wide) == (1024 * 1024) / (1024 * 1024 + 1024 + 1024 * 10 + 10)
    narrow = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64)])
    assert xla.large_share(narrow) == 0.0
    assert xla.large_share(keras.Sequential([keras.Input((4,))])) == 1.0   # no parameters


def test_slow_choices_are_named(monkeypatch):
    from tfdist.observe import hardware
    monkeypatch.setattr(hardware, "bf16_support", lambda: "emulated")
    warnings = api.slow_choice_warnings(run_config(precision="mixed_bfloat16",
                                                   jit_compile="off"), xla.OFF)
    assert len(warnings) == 2
    assert "emulated" in warnings[0] and "float32" in warnings[0]
    assert "--jit_compile=auto" in warnings[1]
    assert api.slow_choice_warnings(run_config(), xla.STEP) == []


def test_mirrored_over_virtual_cpus_is_steered_to_default(monkeypatch):
    """Replicas sharing one CPU get a line pointing to --strategy=default; the
    control, one device, does not."""
    from tfdist.observe import hardware
    monkeypatch.setattr(hardware, "bf16_support", lambda: "emulated")

    class Engine:
        supports_xla, xla_whole_step = True, False

        def __init__(self, shared):
            self.shared_cpu_replicas = shared

    shared = api.slow_choice_warnings(run_config(jit_compile="auto"), xla.STEP, Engine(2))
    assert len(shared) == 1, shared
    assert "2 replicas share this CPU" in shared[0] and "--strategy=default" in shared[0]
    assert api.slow_choice_warnings(run_config(jit_compile="auto"), xla.STEP, Engine(0)) == []


def test_mirrored_on_cpu_reports_its_shared_replicas():
    """What the steering reads: mirrored over 2 virtual CPUs has 2 replicas
    sharing the CPU; the control, the default strategy, none."""
    from tfdist import strategies
    mirrored = strategies.create(tfdist.StrategyConfig(name="mirrored", virtual_devices=2))
    mirrored.setup()
    default = strategies.create(tfdist.StrategyConfig(name="default"))
    default.setup()
    assert (mirrored.shared_cpu_replicas, default.shared_cpu_replicas) == (2, 0)


# -- per-rank log lines (2 real workers) ----------------------------------------
@pytest.mark.integration
@pytest.mark.timeout(240)
def test_log_lines_carry_the_rank_and_only_the_chief_speaks_by_default():
    args = ["--strategy=multi_worker", "--model=mlp", "--model_width=16", "--synthetic",
            "--train_steps=4", "--steps_per_loop=2", "--global_batch_size=16",
            "--jit_compile=off"]   # log lines, not XLA: no compile in each of 4 processes

    def launch(extra):
        return subprocess.Popen(
            [os.path.join(BIN, "tfdist-launch"), "--workers=2", "--",
             os.path.join(BIN, "tfdist-train"), *args, *extra], cwd=REPO,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)

    runs = [launch([]), launch(["--log_all_ranks", "--collective_timeout_s=60"])]
    outputs = [run.communicate(timeout=200) for run in runs]
    for run, (out, err) in zip(runs, outputs):
        assert run.returncode == 0, err[-2000:]
    quiet, loud = (err for _, err in outputs)
    assert "[worker 0/2 chief] step 4/4" in quiet
    assert "[worker 1/2] step" not in quiet
    assert "[worker 1/2] step 4/4" in loud and "[worker 0/2 chief] step 4/4" in loud

