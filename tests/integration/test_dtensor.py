"""dtensor: tensor sharding must train exactly what one device trains.

In-process, on the 4 logical CPUs conftest configures. A DTensor step
computes the same sums as one device but split differently over the mesh
(partial matmuls, then all-reduces), so weights agree within float32
reordering error, not bit for bit: 1e-5 relative (as for mirrored).
"""

import dataclasses

import keras
import numpy as np
import pytest

import tfdist
from tfdist import models, sharding
from tfdist.data.spec import DatasetSpec
from tfdist.errors import UsageError

from common import (IMAGE_SPEC, PREDICTION_TOLERANCE, assert_variables_equal, image_dataset_fn,
                    run_config, token_dataset_fn_for)

# Vocabulary and length divisible by every model-axis size used here (the
# transformer's embeddings are sharded on those dimensions).
TOKENS = DatasetSpec(name="random_tokens", kind="tokens", input_shape=(16,), num_classes=12,
                     train_examples=256, eval_examples=64)


token_dataset_fn = token_dataset_fn_for(TOKENS)


CASES = {
    "mlp": (tfdist.ModelConfig(name="mlp", width=16, depth=2), IMAGE_SPEC, image_dataset_fn),
    "transformer": (tfdist.ModelConfig(name="transformer", width=16, depth=1, num_heads=4),
                    TOKENS, token_dataset_fn),
}


def _config(strategy, model, *, mesh="batch:2,model:2", steps=4, batch=32, **train):
    config = run_config("default", optimizer="adam", learning_rate=0.01, steps=steps,
                        batch=batch, **train)
    return config.replace(
        model=model, strategy=tfdist.StrategyConfig(
            name=strategy, virtual_devices=4 if strategy == "dtensor" else 2, mesh=mesh))


_RUNS = {}


def _train(config, case, initial, model_config=None):
    """Train `case` from `initial` under `config`. Runs without a model_dir
    are deterministic, so tests that only read a result share one run."""
    default_model_config, spec, dataset_fn = CASES[case]
    model_config = model_config or default_model_config
    key = (config, case, model_config, id(initial))
    if config.train.model_dir is None and key in _RUNS:
        return _RUNS[key]
    _RUNS[key] = _fresh_run(config, initial, model_config, spec, dataset_fn)
    return _RUNS[key]


def _fresh_run(config, initial, model_config, spec, dataset_fn):
    def model_fn(s):
        model = models.build(model_config, s)
        model.set_weights(initial)   # host values onto the mesh
        return model

    return tfdist.train(config, model_fn=model_fn, dataset_fn=dataset_fn, spec=spec,
                        layout_rules=models.layout_rules(model_config))


class _References(dict):
    """One-device training of each case (the reference), with its initial
    weights, made when a test first asks for the case (`-m "not slow"` runs
    no transformer test here)."""

    def __missing__(self, case):
        model_config, spec, _ = CASES[case]
        keras.utils.set_random_seed(1)   # the same initial weights in every session
        initial = models.build(model_config, spec).get_weights()
        self[case] = initial, _train(_config("default", model_config), case, initial)
        return self[case]


@pytest.fixture(scope="module")
def references():
    return _References()


ADAM_BOUND = 2 * 0.01 * 4   # 2 x lr x steps: the most two Adam runs can drift apart


def _assert_matches(result, reference, initial):
    """Weights within 1e-5 relative (as for mirrored), allowing for Adam.

    Adam divides each gradient element by its own running RMS, so an element
    whose gradient is ~0 turns float32 reordering noise into up to lr-sized
    steps, with either sign (seen: 1.6e-5 on 1 of 3072 mlp weights, for one
    random initialisation). Such elements are rare; a layout or update error
    moves a whole shard. So: every weight within Adam's bound, and at most
    max(2, 0.1%) of each variable's elements outside 1e-5 relative/absolute.
    """
    weights = [v.numpy() for v in result.model.variables]
    expected = [v.numpy() for v in reference.model.variables]
    moved = max(np.abs(w - i).max() for w, i in zip(expected, initial))
    assert moved > 1e-3  # training moved the weights, so agreement means something
    for variable, got, want in zip(reference.model.variables, weights, expected):
        assert np.abs(got - want).max() <= ADAM_BOUND, variable.path
        if variable.path.endswith("attn/key/bias"):
            continue  # its exact gradient is 0 (softmax ignores a shared shift): all noise
        outside = ~np.isclose(got, want, rtol=1e-5, atol=1e-5)
        assert outside.sum() <= max(2, outside.size // 1000), (
            variable.path, int(outside.sum()), float(np.abs(got - want).max()))
    assert result.summary["loss"] == pytest.approx(reference.summary["loss"], rel=1e-5)


# Every mesh shape for the mlp; the transformer on 2x2 (`slow`, ~16 s), where both axes' collectives run at once (its
# 1x4 and 4x1 meshes matched too, and were left out for the suite's time).
@pytest.mark.parametrize("case,mesh", [
    *[("mlp", m) for m in ("batch:1,model:4", "batch:2,model:2", "batch:4,model:1")],
    pytest.param("transformer", "batch:2,model:2", marks=pytest.mark.slow)])
def test_dtensor_matches_one_device(references, case, mesh):
    initial, reference = references[case]
    model_config = CASES[case][0]
    result = _train(_config("dtensor", model_config, mesh=mesh), case, initial)
    assert result.summary["mesh"] == mesh and result.summary["replicas"] == int(mesh[6])
    _assert_matches(result, reference, initial)


def test_dtensor_accumulation_matches_one_big_batch(references):
    initial, reference = references["mlp"]
    result = _train(_config("dtensor", CASES["mlp"][0], accum_steps=2), "mlp", initial)
    _assert_matches(result, reference, initial)


WIDE_SPEC = dataclasses.replace(IMAGE_SPEC, input_shape=(32, 32, 3), train_examples=64)


def _wide_dataset_fn(split, context):
    return image_dataset_fn(split, context, spec=WIDE_SPEC)


def test_eight_micro_batches_of_a_wide_model_match_one_device():
    """The unrolled micro-batches' gradient sums of a wide model: grappler
    folds them into one AddN, which its memory scheduling would rewrite with
    the variables' global shapes (`compat.dtensor_without_grappler_memory_scheduling`;
    without it this first step failed with "Parameters and update must be
    the same size")."""
    wide = tfdist.ModelConfig(name="mlp", width=1024, depth=2)
    keras.utils.set_random_seed(1)
    initial = models.build(wide, WIDE_SPEC).get_weights()
    one = _fresh_run(_config("default", wide, steps=1), initial, wide, WIDE_SPEC,
                     _wide_dataset_fn)
    config = _config("dtensor", wide, mesh="batch:1,model:2", steps=1, accum_steps=8)
    config = config.replace(strategy=dataclasses.replace(config.strategy, virtual_devices=2))
    result = _fresh_run(config, initial, wide, WIDE_SPEC, _wide_dataset_fn)
    _assert_matches(result, one, initial)


@pytest.mark.parametrize("case,optimizer,model", [
    ("mlp", {"name": "adamw"}, {}),
    ("mlp", {"name": "momentum", "learning_rate": 0.05}, {}),
    ("mlp", {"clip_grad_norm": 0.01}, {}),
    ("mlp", {"lr_decay": "cosine", "warmup_steps": 2}, {}),
    # `slow`: the transformer traced with recomputed blocks.
    pytest.param("transformer", {}, {"recompute": True}, marks=pytest.mark.slow),
])
def test_trainer_features_match_one_device(references, case, optimizer, model):
    """Optimizers, clipping, schedules and recomputation on the 2x2 mesh."""
    initial, _ = references[case]
    model_config = dataclasses.replace(CASES[case][0], **model)
    results = []
    for strategy in ("default", "dtensor"):
        config = _config(strategy, model_config)
        config = config.replace(optimizer=dataclasses.replace(config.optimizer, **optimizer))
        results.append(_train(config, case, initial, model_config))
    _assert_matches(results[1], results[0], initial)


def _zero_config(model_config):
    config = _config("dtensor", model_config)
    return config.replace(strategy=dataclasses.replace(config.strategy, shard_optimizer_state=True))


@pytest.mark.parametrize("case", ["mlp", pytest.param("transformer", marks=pytest.mark.slow)])
def test_sharded_optimizer_state_matches_one_device(references, case):
    initial, reference = references[case]
    result = _train(_zero_config(CASES[case][0]), case, initial)
    _assert_matches(result, reference, initial)
    plain = _train(_config("dtensor", CASES[case][0]), case, initial)
    # ZeRO-1: optimizer bytes per device fall (slots also split over batch=2).
    assert (result.summary["device_optimizer_bytes"]
            < 0.75 * plain.summary["device_optimizer_bytes"]), (result.summary, plain.summary)
    assert result.summary["device_parameter_bytes"] == plain.summary["device_parameter_bytes"]


def _shard_bytes(variable):
    from tensorflow.experimental import dtensor
    return [int(np.prod(s.shape)) * s.dtype.size
            for s in dtensor.unpack(variable._value.read_value())]


@pytest.mark.slow   # a transformer run (~10 s)
def test_each_shard_holds_its_share(references):
    """Per-device bytes of every sharded variable and of its Adam slots are the
    global bytes / the sizes of the axes it is split over (read with unpack)."""
    initial, _ = references["transformer"]
    result = _train(_zero_config(CASES["transformer"][0]), "transformer", initial)
    axes = {"batch": 2, "model": 2}
    slots = {v.path.split("/", 1)[1]: v for v in result.optimizer.variables}
    checked = 0
    for variable in result.sharded_model.trainable_variables:
        spec = sharding.LayoutRules(models.layout_rules(CASES["transformer"][0])).spec_for(
            variable.path, variable.shape, axes)
        global_bytes = int(np.prod(variable.shape)) * 4
        split = int(np.prod([axes[a] for a in spec if a]))
        assert _shard_bytes(variable) == [global_bytes // split] * 4, variable.path
        slot_spec = sharding.zero_spec(spec, variable.shape, axes)
        slot_split = int(np.prod([axes[a] for a in slot_spec if a]))
        for name in ("momentum", "velocity"):
            slot = slots[f"{variable.path.replace('/', '_')}_{name}"]
            assert _shard_bytes(slot) == [global_bytes // slot_split] * 4, slot.path
        checked += split > 1
    assert checked >= 6  # the rules really sharded q/k/v, output, ffn, embeddings


@pytest.mark.parametrize("rules,shape,message", [
    ([("kernel", (None, "model")), ("dense", ("model", None))], (8, 8),
     "is matched by more than one rule"),
    ([("kernel", (None, "tensor"))], (8, 8), "unknown mesh axis 'tensor'"),
    ([("kernel", (None, "model"))], (8, 6), "dimension 1 of size 6 is not divisible by "
                                              "mesh axis model=4"),
    ([("kernel", ("model",))], (8, 8), "has rank 2 but the spec"),
])
def test_bad_layout_rules_name_the_variable(rules, shape, message):
    with pytest.raises(UsageError, match="dense/kernel") as caught:
        sharding.LayoutRules(rules).spec_for("dense/kernel", shape, {"batch": 1, "model": 4})
    assert message in str(caught.value)


@pytest.mark.parametrize("text,message", [
    ("batch:2", "must name exactly the axes batch and model"),
    ("batch:2,model:x", "'model:x' is not name:size"),
    ("batch:2,model:2,batch:1", "must name exactly the axes"),
])
def test_bad_mesh_is_a_config_error(text, message):
    with pytest.raises(UsageError, match=message):
        tfdist.StrategyConfig(name="dtensor", mesh=text)


def test_grad_compression_is_refused_with_the_reason():
    config = _config("dtensor", CASES["mlp"][0], grad_compression="fp16")
    with pytest.raises(UsageError, match="--grad_compression=fp16 does not apply to "
                                         "--strategy=dtensor"):
        tfdist.train(config, model_fn=lambda s: models.build(CASES["mlp"][0], s),
                     dataset_fn=image_dataset_fn, spec=IMAGE_SPEC)


@pytest.mark.parametrize("precision", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_trains_on_the_mesh(references, precision):
    """bf16 and loss-scaled fp16 steps run SPMD and stay close to one device
    at the same precision. Adam moves each weight by about lr per step whatever the
    gradient's size, so where 16-bit rounding flips a tiny gradient's sign a
    weight may differ by up to 2 x lr x steps; in bulk they must agree."""
    initial, _ = references["mlp"]
    reference = _train(_config("default", CASES["mlp"][0], precision=precision), "mlp", initial)
    result = _train(_config("dtensor", CASES["mlp"][0], precision=precision), "mlp", initial)
    assert result.summary["precision"] == precision
    if precision == "mixed_float16":
        assert result.summary["loss_scale"] == 2.0 ** 15   # 4 finite steps: unchanged
    _assert_close_in_bulk(result, reference, initial)


def _assert_close_in_bulk(result, reference, initial):
    got = np.concatenate([w.ravel() for w in result.model.get_weights()])
    want = np.concatenate([w.ravel() for w in reference.model.get_weights()])
    start = np.concatenate([w.ravel() for w in initial])
    assert np.abs(got - want).max() <= ADAM_BOUND
    assert np.abs(got - want).mean() <= 0.05 * np.abs(want - start).mean()
    assert result.summary["loss"] == pytest.approx(reference.summary["loss"], rel=2e-2)


# -- a mesh across processes (integration) ------------------------------------
TWO_BY_TWO = {"mesh": "batch:2,model:2", "virtual_devices": 2, "zero_stage": 3}


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_two_processes_train_what_one_process_trains_on_the_same_mesh(tmp_path):
    """2 processes x 2 virtual CPUs as one 2x2 mesh (tfdist-launch, TF_CONFIG),
    under ZeRO-3 (each variable split over both processes, gathered for use)
    == one process with 4 virtual CPUs on a 2x2 mesh, same global batches; the
    chief's checkpoint holds every process's shards (restores in one process);
    each process's trained model predicts on host data."""
    import dataclasses as dc
    from common import mw_config, train_from
    from test_multi_worker import LAUNCH, run_workers

    model_dir = str(tmp_path / "run")
    workers, initial = run_workers([LAUNCH, "--workers=2", "--"], tmp_path, "dtensor",
                                   strategy=TWO_BY_TWO, model_dir=model_dir)
    for a, b in zip(*workers):
        np.testing.assert_array_equal(a, b)   # both processes gather the same global values
    config = mw_config("dtensor")
    config = config.replace(strategy=dc.replace(config.strategy, mesh="batch:2,model:2",
                                                virtual_devices=4, zero_stage=3))
    single = train_from(config, initial)
    assert max(np.abs(w - i).max() for w, i in zip(workers[0], initial)) > 1e-3
    for got, want in zip(workers[0], single.model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # Every process's RunResult.model predicts on host data, as one process's does.
    from common import PROBE
    expected = single.model.predict(PROBE, verbose=0)
    for index in (0, 1):
        np.testing.assert_allclose(np.load(tmp_path / f"predictions-{index}.npy"), expected,
                                   **PREDICTION_TOLERANCE)
    restored = train_from(mw_config("default", model_dir=model_dir), initial)
    assert restored.summary["steps"] == 10                  # restored, nothing retrained
    assert_variables_equal(restored.model.get_weights(), workers[0])


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_a_dead_process_ends_the_mesh_with_a_fault_naming_it(tmp_path, data_dir):
    """No launcher (as on Kubernetes): kill one process of a 2-process mesh;
    the other fails its next collective and exits 1 naming the dead worker."""
    import json
    import os
    import signal
    import subprocess
    import time
    from conftest import BIN, REPO, free_ports

    addresses = [f"localhost:{p}" for p in free_ports(2)]
    args = [os.path.join(BIN, "tfdist-train"), "--strategy=dtensor", "--mesh=batch:2,model:2",
            "--virtual_devices=2", "--model=mlp", "--train_steps=1000000", "--steps_per_loop=10",
            "--log_every=10", "--collective_timeout_s=20", f"--data_dir={data_dir}"]
    procs = []
    for index in (0, 1):
        tf_config = {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}}
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_CONFIG": json.dumps(tf_config)}
        procs.append(subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                      stderr=open(tmp_path / f"w{index}.log", "w")))
    try:
        deadline = time.monotonic() + 120
        while "step 20/" not in (tmp_path / "w0.log").read_text():
            assert all(p.poll() is None for p in procs), (tmp_path / "w0.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.5)
        procs[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        procs[0].wait(timeout=20 + 10)   # bounded: a hang fails the test
        stopped_after = time.monotonic() - killed_at
    finally:
        for proc in procs:
            proc.kill()
    log = (tmp_path / "w0.log").read_text()
    assert procs[0].returncode == 1, log[-2000:]
    faults = [line for line in log.splitlines() if line.startswith("tfdist-train: fault:")]
    assert len(faults) == 1, log[-3000:]
    assert f"worker 0 ({addresses[0]}): peer worker 1 ({addresses[1]}) failed" in faults[0]
    assert stopped_after < 20 + 10


def test_print_layouts_lists_every_variable_and_the_totals(data_dir):
    config = _config("dtensor", CASES["mlp"][0], mesh="batch:1,model:4")
    report = tfdist.describe_layouts(config, model_fn=lambda s: models.build(CASES["mlp"][0], s),
                                  dataset_fn=image_dataset_fn, spec=IMAGE_SPEC,
                                  layout_rules=models.layout_rules(CASES["mlp"][0]))
    lines = report.splitlines()
    kernel = next(l for l in lines if l.startswith("variable  hidden_0/kernel "))
    # 192x16 float32 = 12,288 bytes, split 4 ways over `model`, stored as used.
    assert kernel.split()[2:] == ["192x16", "(-,", "model)", "(-,", "model)", "12,288",
                                  "3,072"], kernel
    # Its gradient, read from the shards of a backward pass, and its Adam slot
    # (Keras numbers repeated optimizers: adam, adam_1, ...).
    assert any(l.startswith("gradient  hidden_0/kernel ") and l.endswith(" 3,072")
               for l in lines), report
    assert any(l.startswith("slot      adam") and "/hidden_0_kernel_momentum " in l
               and l.endswith(" 3,072") for l in lines), report
    assert lines[-1].startswith("parameters + gradients + optimizer per device:")


# -- the trained model on host data -------------------------------------------
def _two_input_model(spec):
    """A user's own functional model with two named inputs."""
    image = keras.Input(IMAGE_SPEC.input_shape, name="image")
    extra = keras.Input((4,), name="extra")
    x = keras.layers.Concatenate()([keras.layers.Flatten()(image), extra])
    x = keras.layers.Dense(16, activation="relu", name="wide")(x)
    x = keras.layers.Dense(8, activation="relu", name="narrow")(x)
    return keras.Model({"image": image, "extra": extra},
                       keras.layers.Dense(IMAGE_SPEC.num_classes, name="logits")(x))


# The user's layout rules: `wide` split by output column, `narrow` by input row.
TWO_INPUT_RULES = [(r"wide/kernel$", (None, "model")), (r"wide/bias$", ("model",)),
                   (r"narrow/kernel$", ("model", None))]


def _two_input_arrays(split):
    rng = np.random.default_rng(0 if split == "train" else 1)
    n = IMAGE_SPEC.train_examples if split == "train" else IMAGE_SPEC.eval_examples
    x = {"image": rng.normal(size=(n, *IMAGE_SPEC.input_shape)).astype(np.float32),
         "extra": rng.normal(size=(n, 4)).astype(np.float32)}
    return x, rng.integers(IMAGE_SPEC.num_classes, size=n).astype(np.int32)


def _two_input_dataset_fn(split, context):
    import tensorflow as tf
    return tfdist.shard(tf.data.Dataset.from_tensor_slices(_two_input_arrays(split)), context)


def test_a_dtensor_trained_model_predicts_and_evaluates_on_host_data():
    """After a 2x2 run, `result.model` predicts, evaluates and is called on
    NumPy arrays like the one-device model (its weights gathered from the
    mesh); the sharded model (`result.sharded_model`), as trained, cannot."""
    keras.utils.set_random_seed(3)
    initial = _two_input_model(None).get_weights()

    def model_fn(spec):
        model = _two_input_model(spec)
        model.set_weights(initial)
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model

    runs = {}
    for strategy in ("default", "dtensor"):
        config = run_config(strategy, steps=4).replace(strategy=tfdist.StrategyConfig(
            name=strategy, virtual_devices=4 if strategy == "dtensor" else 2,
            mesh="batch:2,model:2"))
        runs[strategy] = tfdist.train(config, model_fn=model_fn,
                                      dataset_fn=_two_input_dataset_fn,
                                      layout_rules=TWO_INPUT_RULES)
    want, got = runs["default"].model, runs["dtensor"].model
    sharded = runs["dtensor"].sharded_model
    from tensorflow.experimental import dtensor
    assert dtensor.fetch_layout(sharded.get_layer("wide").kernel.value).sharding_specs == [
        dtensor.UNSHARDED, "model"]   # it really trained split over the mesh
    assert max(np.abs(w - i).max() for w, i in zip(want.get_weights(), initial)) > 1e-3
    x, y = _two_input_arrays("test")
    expected = want.predict(x, verbose=0)
    np.testing.assert_allclose(got.predict(x, verbose=0), expected, **PREDICTION_TOLERANCE)
    np.testing.assert_allclose(np.asarray(got(x)), expected, **PREDICTION_TOLERANCE)
    np.testing.assert_allclose(got.evaluate(x, y, verbose=0), want.evaluate(x, y, verbose=0),
                               rtol=1e-5)
    with pytest.raises(Exception, match="DTensor"):   # the defect this copy fixes
        sharded.predict(x, verbose=0)
