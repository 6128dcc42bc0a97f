"""The pipeline engine on virtual CPU devices: one update equals
gradient accumulation of the same micro-batches on one device, stages hold
their own variables and slots, checkpoints are whole, bad input is one line.

Virtual CPUs share one process's threadpool, so these runs prove correctness
and placement only; speed needs a process per stage (bench/).

Tolerance: the pipeline runs the same kernels on the same micro-batches as
accumulation on one device, but differentiates each stage apart (a stage's
backward starts from its output's gradient) and, with R pipeline replicas,
adds the replicas' gradients in another order: float32 rounding moves. Seen
after three Adam steps at lr 0.01: the mlp and the cnn bit-identical with
R=1, 5e-7 with R=2; the transformer 3e-8 on weights of order 0.03-0.5, and
up to 1.5e-6 on the attention key biases, whose true gradient is exactly
zero (softmax ignores a shift shared by all keys), so their gradient is
rounding noise that Adam, which normalises by the gradient's size, turns into
steps of its own. 1e-5 absolute (1e-3 of one Adam step of lr 0.01) and 1e-5
relative bound that, while a wrong gradient (a micro-batch dropped or counted
twice, a stage's gradient scaled) moves weights by ~1e-3.
"""

import keras
import numpy as np
import pytest

import tfdist
from tfdist import compat
from tfdist.errors import UsageError, WorkerFault
from tfdist.pipeline import schedule

from common import (HUB_TOKENS, IMAGE_SPEC, TOKEN_SPEC, assert_weights_close, hub_causal_lm,
                    hub_dataset_fn, image_dataset_fn, run_cli_cases, run_config,
                    token_dataset_fn)


def _config(strategy, *, model="mlp", depth=3, devices=2, stages=2, sched="1f1b",
            precision="float32", clip=None, recompute=False, steps=3, model_dir=None,
            split=(), microbatches=4, batch=32, chunks=1):
    config = run_config(strategy, optimizer="adam", learning_rate=0.01, steps=steps, batch=batch,
                        model=model, depth=depth, width=16, accum_steps=microbatches,
                        precision=precision, model_dir=model_dir,
                        checkpoint_every=steps if model_dir else 0)
    return config.replace(
        model=config.model.replace(recompute=recompute, num_heads=2),
        optimizer=config.optimizer.replace(clip_grad_norm=clip),
        strategy=config.strategy.replace(virtual_devices=devices, pipeline_stages=stages,
                                         pipeline_schedule=sched, pipeline_split=split,
                                         pipeline_chunks=chunks))


def _train(config):
    tokens = config.model.name == "transformer"
    return tfdist.train(config, dataset_fn=token_dataset_fn if tokens else image_dataset_fn,
                        spec=TOKEN_SPEC if tokens else IMAGE_SPEC)


# (model, extra settings, [(devices, stages, schedule)]): each row's pipeline
# runs against one accumulation run of the same settings on one device.
CASES = {
    # (S=2 on its own: the checkpoint test here, and the process test's)
    # Interleaved: 2 devices x 2 chunks (stages 0 and 2 on the first device, 1
    # and 3 on the second) and 2 pipeline replicas.
    "mlp": ("mlp", {}, [(4, 4, "gpipe"), (4, 2, "1f1b", False, 2)]),
    # bf16 with R=1: the same micro-batches as one device, so the same bf16
    # roundings (R=2 replicas' micro-batches are other rows, which in bf16
    # differ by ~1e-2). bf16 here on the mlp, not the transformer: emulated
    # bf16 (no AMX) made the transformer case the suite's slowest.
    "mlp bf16": ("mlp", {"microbatches": 2, "precision": "mixed_bfloat16"},
                 [(2, 2, "1f1b")]),
    "transformer clip": (
        "transformer", {"depth": 2, "microbatches": 2, "clip": 0.05}, [(4, 4, "1f1b")]),
    # --recompute re-runs each block's forward in the backward pass: the same
    # trainable weights; BatchNorm's second update comes in the schedule's order.
    "cnn (BatchNorm)": ("cnn", {"depth": 1, "microbatches": 2},
                        [(2, 2, "1f1b"), (2, 2, "gpipe", True)]),
}


# make slow: the transformer (attention's traces, ~20 CPU-s); make test: the mlp and
# cnn cases, and clipping by the whole model's norm in test_pipeline_processes.py.
SLOW_CASES = {"transformer clip"}


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case in SLOW_CASES
                                  else case for case in CASES])
def test_an_update_equals_accumulating_the_micro_batches_on_one_device(case):
    model, settings, runs = CASES[case]
    depth = settings.get("depth", 4)
    extra = {k: v for k, v in settings.items() if k != "depth"}
    reference = _train(_config("default", model=model, depth=depth, **extra))
    for devices, stages, sched, *more in runs:
        recompute, chunks = (*more, *(False, 1)[len(more):])
        result = _train(_config("pipeline", model=model, depth=depth, devices=devices,
                                stages=stages, sched=sched, recompute=recompute,
                                chunks=chunks, **extra))
        summary = result.summary
        assert summary["pipeline_stages"] == stages, summary
        assert len(summary["stage_layers"]) == stages * chunks, summary
        if chunks > 1:   # stage s on device s mod S of its pipeline replica
            devices_of = {name: result.strategy.stage_device(s)
                          for s, layers in enumerate(summary["stage_layers"]) for name in layers}
            assert devices_of["hidden_0"] == devices_of["hidden_2"] != devices_of["hidden_1"]
            for variable in result.model.trainable_variables:
                assert variable.value.device.endswith(
                    devices_of[variable.path.split("/")[0]].split("device:")[-1]), variable.path
        assert summary["pipeline_replicas"] == devices // stages
        assert summary["microbatches"] == extra.get("microbatches", 4)
        # every layer with weights is on exactly one stage
        placed = [name for layers in summary["stage_layers"] for name in layers]
        assert sorted(placed) == sorted({layer.name for layer in result.model.layers
                                         if type(layer).__name__ != "InputLayer"})
        # trainable weights: BatchNorm's moving statistics (non-trainable) take
        # recompute's second update in another order under a pipeline
        # (tfdist/models/blocks.py), which no gradient reads.
        assert_weights_close([w.numpy() for w in reference.model.trainable_weights],
                             [w.numpy() for w in result.model.trainable_weights], atol=1e-5)
        if not recompute:
            assert_weights_close([w.numpy() for w in reference.model.weights],
                                 [w.numpy() for w in result.model.weights], atol=1e-5)
        assert summary["loss"] == pytest.approx(reference.summary["loss"], rel=1e-5)
        assert summary["train_accuracy"] == pytest.approx(reference.summary["train_accuracy"],
                                                          rel=1e-5)
        if not recompute:   # evaluation reads the moving statistics
            assert summary["test_loss"] == pytest.approx(reference.summary["test_loss"],
                                                         rel=1e-5)


def test_each_stage_holds_its_variables_and_their_optimizer_slots():
    result = _train(_config("pipeline", devices=4, stages=4, depth=4))
    strategy = result.strategy
    momentums, velocities = compat.adam_slots(result.optimizer)
    stage_of = {name: s for s, layers in enumerate(result.summary["stage_layers"])
                for name in layers}
    seen = set()
    for variable in result.model.trainable_variables:
        layer = variable.path.split("/")[0]
        device = strategy.stage_device(stage_of[layer])
        seen.add(device)
        index = compat.variable_index(result.optimizer, variable)
        for held in (variable, momentums[index], velocities[index]):
            assert held.value.device.endswith(device.split("device:")[-1]), \
                (variable.path, held.value.device, device)
    assert len(seen) == 4
    # control: the same model under default has every variable on one device
    single = _train(_config("default", depth=4))
    assert len({v.value.device for v in single.model.trainable_variables}) == 1


def test_schedules_bound_the_micro_batches_in_flight():
    # 1F1B holds at most S - s micro-batches on stage s; GPipe holds all M.
    assert schedule.peak_in_flight(schedule.schedule(8, "1f1b", 4)) == [4, 3, 2, 1]
    assert schedule.peak_in_flight(schedule.schedule(8, "gpipe", 4)) == [8, 8, 8, 8]
    # Interleaved (2 devices x 2 chunks): device 0 warms up with 2(S-1) +
    # (v-1)S = 4 forwards, so it holds 5 (stage, micro-batch) activations;
    # GPipe's chunks hold all 2 x 8.
    assert schedule.peak_in_flight(schedule.schedule(8, "1f1b", 2, 2)) == [5, 3]
    assert schedule.peak_in_flight(schedule.schedule(8, "gpipe", 2, 2)) == [16, 16]
    for kind, devices, chunks, m in [("1f1b", 3, 1, 5), ("gpipe", 3, 1, 5),
                                     ("1f1b", 2, 3, 4), ("gpipe", 3, 2, 5)]:
        plan = schedule.schedule(m, kind, devices, chunks)
        order = schedule.build_order(plan)
        last = devices * chunks - 1
        assert sorted(order) == sorted((s, k, i) for s in range(last + 1) for k in "FB"
                                       for i in range(m))
        for d, items in enumerate(plan):   # each device's stages, in its own order
            assert {s % devices for s, _, _ in items} == {d}
            assert [item for item in order if item in items] == items
        for s, k, i in order:   # every item after its inputs
            before = order[:order.index((s, k, i))]
            if k == "F" and s:
                assert (s - 1, "F", i) in before
            if k == "B":
                assert (s, "F", i) in before
                assert s == last or (s + 1, "B", i) in before
        # equal-time items reach the ideal bubble exactly: the formula is the schedule's
        assert schedule.simulated_bubble(plan) == pytest.approx(
            schedule.bubble(devices, m, chunks))
    # the control: one micro-batch through every stage and back before the
    # next (a valid order, no overlap) idles far more than the formula
    serial = [[(d, kind, i) for i in range(8) for kind in "FB"] for d in range(2)]
    assert schedule.simulated_bubble(serial) > 2 * schedule.bubble(2, 8)
    assert schedule.bubble(2, 8) == pytest.approx(1 / 9)
    assert schedule.bubble(2, 8, 2) == pytest.approx(1 / 17)
    with pytest.raises(ValueError, match="groups of the devices"):
        schedule.schedule(6, "1f1b", 4, 2)


def test_checkpoints_are_whole_and_resume_under_another_engine(tmp_path):
    # 3 pipeline steps, then 3 more under default from its checkpoint, equal 6
    # pipeline steps; and the reverse (default first, pipeline resumes).
    straight = _train(_config("pipeline", steps=6))
    for first, then in (("pipeline", "default"), ("default", "pipeline")):
        model_dir = str(tmp_path / first)
        _train(_config(first, steps=3, model_dir=model_dir))
        resumed = _train(_config(then, steps=6, model_dir=model_dir))
        assert resumed.summary["steps"] == 6
        assert_weights_close([w.numpy() for w in straight.model.weights],
                             [w.numpy() for w in resumed.model.weights])


def test_a_pipeline_checkpoint_restores_under_mirrored_and_dtensor(tmp_path):
    # Whole variables and slots: restored (nothing retrained) bit-identical
    # under the engines that lay them out otherwise (replicas; a mesh).
    model_dir = str(tmp_path)
    written = _train(_config("pipeline", steps=3, model_dir=model_dir))
    saved = [v.numpy() for v in [*written.model.variables, *written.optimizer.variables]]
    for strategy in ("mirrored", "dtensor"):
        config = _config(strategy, steps=3, model_dir=model_dir)
        config = config.replace(strategy=config.strategy.replace(mesh="batch:2,model:1"))
        other = _train(config)
        assert other.summary["steps"] == 3, strategy
        restored = [v.numpy() for v in [*other.model.variables, *other.optimizer.variables]]
        assert len(restored) == len(saved)
        for a, b in zip(restored, saved):
            np.testing.assert_array_equal(a, b)


def test_a_named_split_and_an_export(tmp_path):
    result = _train(_config("pipeline", depth=4, split=("hidden_2",)))
    assert result.summary["stage_layers"][1][0] == "hidden_2"
    export = tfdist.export(result, str(tmp_path / "export"))
    loaded = keras.saving.load_model(export["keras"])
    x = np.random.default_rng(0).normal(size=(4, *IMAGE_SPEC.input_shape)).astype("float32")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), result.model.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("changes, expected", [
    (dict(stages=3, devices=4), "--pipeline_stages=3 does not divide onto the 4 local"),
    (dict(stages=2, devices=2, batch=30), "--global_batch_size=30 must be divisible by "
                                          "pipeline replicas (1) x --microbatches (4)"),
    (dict(stages=4, devices=4, depth=1), "--pipeline_stages=4: model 'mlp' splits into only 3"),
    (dict(split=("nope",)), "pipeline_split=nope: model 'mlp' has no layer 'nope'"),
])
def test_bad_pipeline_settings_are_one_line(changes, expected):
    with pytest.raises(UsageError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        _train(_config("pipeline", **changes))


def test_across_processes_fp16_loss_scaling_is_refused():
    # Each worker applies its own stage's update, and a loss scale would skip
    # steps stage by stage. (The check of a worker of a cluster; here without
    # one, since the cluster forms before the checks run.)
    from tfdist.strategies.pipeline import PipelineStrategy
    strategy = PipelineStrategy.__new__(PipelineStrategy)
    strategy.processes, strategy.pipeline_replicas = True, 1
    config = _config("pipeline", precision="mixed_float16")
    with pytest.raises(UsageError, match="--precision=mixed_float16: across processes"):
        strategy.check_config(config)
    strategy.check_config(_config("pipeline", precision="mixed_bfloat16"))   # the control


def test_across_processes_an_export_without_the_final_gather_is_refused(tmp_path):
    """--export_dir needs the whole model on the chief: with
    --nopipeline_gather it is one line before training (a cluster's worker,
    checked as in `test_across_processes_fp16_loss_scaling_is_refused`)."""
    from tfdist.strategies.pipeline import PipelineStrategy
    strategy = PipelineStrategy.__new__(PipelineStrategy)
    strategy.processes, strategy.pipeline_replicas = True, 1
    config = _config("pipeline")
    config = config.replace(train=config.train.replace(export_dir=str(tmp_path / "export")))
    strategy.config = config.strategy.replace(pipeline_gather=False)
    with pytest.raises(UsageError, match=r"--export_dir=.*: with --nopipeline_gather no process "
                                         r"holds the whole trained model .*tfdist-export"):
        strategy.check_config(config)
    strategy.config = config.strategy   # the control: gathered at the end
    strategy.check_config(config)


def test_the_final_gather_is_skipped_where_the_weights_would_not_fit(monkeypatch):
    """The chief gathers the other stages' weights at the end only where they,
    plus one transfer's copy of the largest, fit under its memory limit."""
    import tensorflow as tf
    from tfdist.observe import hardware
    from tfdist.strategies.pipeline import PipelineStrategy
    strategy = PipelineStrategy.__new__(PipelineStrategy)
    weights = [tf.Variable(tf.zeros([1024, 256])), tf.Variable(tf.zeros([256]))]
    strategy._released = {id(weights[0])}   # 1 MiB held elsewhere; the bias here
    monkeypatch.setattr(hardware, "resident_bytes", lambda: 1 << 20)
    monkeypatch.setattr(hardware, "memory_limit_bytes", lambda: 3 << 20)
    assert strategy._gather_refusal([(v, v) for v in weights]) is None
    monkeypatch.setattr(hardware, "memory_limit_bytes", lambda: (3 << 20) - (100 << 10))
    assert strategy._gather_refusal([(v, v) for v in weights]) == (
        "the other stages' weights need 2.0 MiB and its memory limit leaves 1.9 MiB")


def test_zero_stage_under_the_pipeline_needs_replicas_across_processes():
    """ZeRO-1 splits a stage's slots over its pipeline replicas across
    processes: in one process, with one replica per stage, or at stage 2 or 3
    it is one line before training. (A cluster's worker is checked as in
    `test_across_processes_fp16_loss_scaling_is_refused`.)"""
    def config(stage):
        config = _config("pipeline")
        return config.replace(strategy=config.strategy.replace(zero_stage=stage))

    with pytest.raises(UsageError, match=r"--zero_stage=1: --strategy=pipeline splits each "
                                         r"stage's optimizer slots .* in one process every "
                                         r"slot has one copy"):
        _train(config(1))
    with pytest.raises(UsageError, match=r"--zero_stage=2: --strategy=pipeline offers ZeRO "
                                         r"stage\(s\) 1$"):
        _train(config(2))
    from tfdist.strategies.pipeline import PipelineStrategy
    strategy = PipelineStrategy.__new__(PipelineStrategy)
    strategy.processes, strategy.pipeline_replicas = True, 1
    with pytest.raises(UsageError, match=r"this cluster runs 1 replica of each stage; run S x R "
                                         r"workers with R >= 2 \(e.g. tfdist-launch "
                                         r"--workers=4\), or --zero_stage=0"):
        strategy.check_zero(config(1))
    strategy.pipeline_replicas = 2
    strategy.check_zero(config(1))   # the control


def test_the_cli_prints_stages_and_refuses_bad_input_before_training():
    base = ["--strategy=pipeline", "--model=mlp", "--model_depth=3", "--microbatches=4",
            "--global_batch_size=32", "--train_steps=1"]
    stages, two_names, flag, both = run_cli_cases([
        [*base, "--print_stages"],
        [*base, "--pipeline_split=hidden_1,logits"],
        [*base, "--pipeline_schedule=zigzag"],
        [*base, "--accum_steps=2"],
    ])
    assert stages.returncode == 0, stages.stderr[-2000:]
    assert "stage 0 on /device:CPU:0" in stages.stdout and "hidden_0" in stages.stdout
    assert "ideal bubble" in stages.stdout
    for result, text in ((two_names, "2 stages need 1 layer name"),
                         (flag, "pipeline_schedule"),
                         (both, "--microbatches=4 and --accum_steps=2 name the same number")):
        assert result.returncode == 2, result.stderr[-2000:]
        lines = [line for line in result.stderr.splitlines() if "tfdist-train" in line]
        assert len(lines) == 1 and text in lines[0], result.stderr[-2000:]
        assert "step 1/" not in result.stderr


def test_a_stage_fault_names_the_stage_and_its_device():
    def model_fn(spec):
        inputs = keras.Input(spec.input_shape)
        x = keras.layers.Flatten(name="flatten")(inputs)
        x = keras.layers.Dense(8, name="first")(x)
        # raises in the forward pass of stage 1, at run time
        x = keras.layers.Lambda(lambda t: t + tf_check(t), name="faulty")(x)
        return keras.Model(inputs, keras.layers.Dense(IMAGE_SPEC.num_classes, name="out")(x))

    import tensorflow as tf

    def tf_check(t):
        tf.debugging.assert_less(tf.reduce_max(t), -1e9, message="stage fault")
        return tf.zeros_like(t)

    config = _config("pipeline", split=("faulty",))
    with pytest.raises(WorkerFault,
                       match=r"pipeline stage 1 on /device:CPU:1 \(forward of micro-batch 0\)"):
        tfdist.train(config, model_fn=model_fn, dataset_fn=image_dataset_fn, spec=IMAGE_SPEC)


def test_a_subclassed_model_is_refused_in_one_line():
    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(IMAGE_SPEC.num_classes)

        def call(self, x):
            return self.dense(keras.ops.reshape(x, (keras.ops.shape(x)[0], -1)))

    with pytest.raises(UsageError, match="is not a functional Keras model"):
        tfdist.train(_config("pipeline"), model_fn=lambda spec: Sub(),
                     dataset_fn=image_dataset_fn, spec=IMAGE_SPEC)


# -- keras-hub's language models, unchanged ---------------------------------------

# Gemma ties its token embedding (one variable: two gradients summed, across
# devices); Llama keeps the logits' projection apart in the same layer (each
# stage's unused weight gets a zero gradient). GPT-2 ties as Gemma does: its
# stages compute the whole model's output (tests/unit/test_pipeline_split.py).
@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_keras_hub_causal_lms_pipeline_like_one_device(kind):
    """keras-hub's CausalLMs, as keras-hub builds them, on 2 stages: the
    backbone is split between its decoder blocks, the token embedding layer
    lives on both stages (the tokens' embedding on stage 0, the logits on
    stage 1) and the update equals accumulating the same micro-batches on one
    device."""
    keras.utils.set_random_seed(5)
    initial = hub_causal_lm(kind).get_weights()

    def model_fn(spec):
        model = hub_causal_lm(kind)
        model.set_weights(initial)
        return model

    results = {}
    for strategy in ("default", "pipeline"):
        config = _config(strategy, steps=2, microbatches=2, batch=16)
        results[strategy] = tfdist.train(config, model_fn=model_fn, dataset_fn=hub_dataset_fn,
                                         spec=HUB_TOKENS)
    reference, result = results["default"], results["pipeline"]
    layers = result.summary["stage_layers"]
    assert layers[0][0] == "token_embedding" and layers[1][-1] == "token_embedding", layers
    assert_weights_close([w.numpy() for w in reference.model.trainable_weights],
                         [w.numpy() for w in result.model.trainable_weights], atol=1e-5)
    assert result.summary["loss"] == pytest.approx(reference.summary["loss"], rel=1e-5)
