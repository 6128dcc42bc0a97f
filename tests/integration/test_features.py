"""Trainer features under the in-process strategies: accumulation, compression."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from tfdist import models, strategies
from tfdist.data.function_inputs import FunctionInputs
from tfdist.training import optimizers
from tfdist.training.task import task_for
from tfdist.training.trainer import Trainer

import tfdist
from common import (IMAGE_SPEC, TOKEN_SPEC, assert_weights_close, image_dataset_fn, run_config,
                    token_dataset_fn, train_from)


@pytest.mark.parametrize("strategy", ["default", "mirrored"])
def test_accumulated_micro_batches_match_one_big_batch(strategy):
    big = run_config(strategy, optimizer="adam", learning_rate=0.001, batch=64)
    initial = models.build(big.model, IMAGE_SPEC).get_weights()
    one = train_from(big, initial)
    four = train_from(run_config(strategy, optimizer="adam", learning_rate=0.001, batch=64,
                                 accum_steps=4), initial)
    # Adam moves each weight by about lr x m / sqrt(v): for an entry whose
    # gradient is near 0 that ratio is sensitive to the last bits of the
    # gradient, which summing 4 micro-batches instead of one batch changes
    # (seen once in a suite run: 4.8e-7 apart after 5 steps, under the default
    # strategy). 2e-6 is 1/500 of the lr a step moves a weight, and a lost or
    # doubled micro-batch moves weights by a good fraction of that lr.
    moved = max(float(np.abs(w - i).max()) for w, i in zip(one.model.get_weights(), initial))
    assert moved > 1e-3
    assert_weights_close(four.model.get_weights(), one.model.get_weights(), atol=2e-6)


@pytest.mark.slow   # the transformer's traces (~15 s)
@pytest.mark.parametrize("compression", ["none", "bf16"])
def test_transformer_accumulates_and_compresses(compression):
    """Embedding gradients (sparse in TensorFlow) through accumulation and
    compression: 2 micro-batches match one batch (to 1e-5 without compression)."""
    def train(accum_steps):
        config = run_config("mirrored", model="transformer", width=8, batch=32,
                            accum_steps=accum_steps, grad_compression=compression)
        config = config.replace(model=tfdist.ModelConfig(name="transformer", width=8, depth=1,
                                                         num_heads=2))
        return tfdist.train(config, model_fn=lambda s: _model_from(initial, config, s),
                            dataset_fn=token_dataset_fn, spec=TOKEN_SPEC)

    initial = models.build(tfdist.ModelConfig(name="transformer", width=8, depth=1, num_heads=2),
                           TOKEN_SPEC).get_weights()
    one, two = train(1), train(2)
    # Embedding gradients are summed by a multi-threaded segment sum, whose
    # order (so the last float bits) varies from run to run, and 5 steps
    # through attention amplify it: uncompressed, up to 9.5e-6 was seen (1 run
    # in ~10), hence atol 2e-5. A lost or doubled micro-batch moves weights by
    # about as much as training does, which is checked to be far larger.
    rtol, atol = {"none": (1e-5, 2e-5), "bf16": (1e-2, 1e-3)}[compression]
    moved = max(float(np.abs(a - b).max()) for a, b in zip(one.model.get_weights(), initial))
    assert moved > 50 * atol, moved
    for a, b in zip(two.model.get_weights(), one.model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("strategy", ["default", "mirrored"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_compressed_gradients_stay_close_and_halve_the_bytes(strategy, dtype):
    """Documented tolerance: after 5 SGD steps, weights within 1e-3 absolute
    (fp16) / 1e-2 (bf16) of uncompressed training; the 16-bit rounding of each
    replica's gradient is the only difference."""
    base = run_config(strategy, learning_rate=0.1)
    initial = models.build(base.model, IMAGE_SPEC).get_weights()
    plain = train_from(base, initial)
    squeezed = train_from(run_config(strategy, learning_rate=0.1, grad_compression=dtype),
                          initial)
    assert (squeezed.summary["bytes_reduced_per_update"] * 2
            == plain.summary["bytes_reduced_per_update"])
    tolerance = {"fp16": 1e-3, "bf16": 1e-2}[dtype]
    diffs = [np.abs(a - b).max() for a, b in zip(squeezed.model.get_weights(),
                                                  plain.model.get_weights())]
    assert max(diffs) < tolerance
    assert max(diffs) > 0  # the rounding really happened


@pytest.mark.parametrize("strategy", ["default", "mirrored"])
def test_one_cross_replica_reduction_per_update_with_accumulation(strategy):
    """Trace one replica step with 4 micro-batches: the adapter's reduce hook
    runs once per replica, not once per micro-batch."""

    adapter, traced = _reductions_in_one_step(run_config(strategy, batch=64, accum_steps=4))
    assert traced == adapter.num_replicas


def _trainer(config, **options):
    """(adapter, a `Trainer` of `config`'s model and optimizer on image data)."""
    adapter = strategies.create(config.strategy)
    adapter.setup()
    with adapter.scope():
        model = models.build(config.model, IMAGE_SPEC)
        optimizer = optimizers.create(config.optimizer, global_batch_size=64, total_steps=5)
        optimizer.build(model.trainable_variables)
    task = task_for(config, model, FunctionInputs(image_dataset_fn, IMAGE_SPEC))[0]
    return adapter, Trainer(config=config, strategy=adapter, model=model, optimizer=optimizer,
                            task=task, **options)


def _reductions_in_one_step(config):
    """(adapter, cross-replica reductions traced by one replica step of `config`)."""
    adapter, trainer = _trainer(config)
    per_replica = config.train.global_batch_size // adapter.num_replicas
    batch = (tf.zeros((per_replica, 8, 8, 3)), tf.zeros((per_replica,), tf.int32),
             tf.ones((per_replica,)))
    before = adapter.reductions_traced
    # Traced as tfdist traces it: without AutoGraph.
    tf.function(lambda: adapter.run(trainer._replica_train_step, batch),
                autograph=False).get_concrete_function()
    return adapter, adapter.reductions_traced - before


@pytest.mark.parametrize("accum_steps", [1, 2])
def test_xla_compiles_each_micro_batch_and_tensorflow_runs_their_loop(accum_steps):
    """XLA:CPU runs a convolution inside a loop body many times slower than
    at the top level (the cnn at 2 micro-batches: 35 against 1004 examples/s
    on an AMX Xeon), so with micro-batches `--jit_compile=on` compiles each
    micro-batch's gradients and leaves their loop (and the update, fused per
    variable) to TensorFlow; the control: one micro-batch, the whole step."""
    from tfdist.training import xla
    config = run_config("default", optimizer="adam", batch=64, accum_steps=accum_steps,
                        jit_compile="on")
    _, trainer = _trainer(config, jit_level=xla.STEP)
    batch = (tf.zeros((64, 8, 8, 3)), tf.zeros((64,), tf.int32), tf.ones((64,)))
    step = tf.function(trainer._local_gradients, autograph=False).get_concrete_function(*batch)
    compiled = [f for f in step.graph.as_graph_def().library.function
                if f.attr["_XlaMustCompile"].b]
    loops = [n for n in step.graph.as_graph_def().node if n.op in ("While", "StatelessWhile")]
    if accum_steps == 1:
        assert getattr(trainer._step_fn, "_jit_compile", False) and not compiled
        return
    assert not getattr(trainer._step_fn, "_jit_compile", False)
    assert len(loops) == 1 and compiled, (len(loops), len(compiled))
    assert not any(n.op in ("While", "StatelessWhile") for f in compiled for n in f.node_def)


def test_the_micro_batch_loop_starts_after_the_first_micro_batch():
    """The loop's body needs only its counter to start a micro-batch's forward
    pass, so TensorFlow ran it beside the first micro-batch (two
    micro-batches' activations alive; the transformer peaked as high at 2
    micro-batches as at one): the counter waits for the first's gradients."""
    config = run_config("default", optimizer="adam", batch=64, accum_steps=2)
    _, trainer = _trainer(config)
    batch = (tf.zeros((64, 8, 8, 3)), tf.zeros((64,), tf.int32), tf.ones((64,)))
    graph = tf.function(trainer._local_gradients, autograph=False).get_concrete_function(
        *batch).graph
    loop = [op for op in graph.get_operations() if op.type in ("While", "StatelessWhile")]
    assert len(loop) == 1
    # The loop's inputs: while_v2's own counter and bound, then ours; ours (the
    # start, 1: an identity of a constant) waits for the first micro-batch's sums.
    waits_for = {c for tensor in loop[0].inputs
                 for op in (tensor.op, *(t.op for t in tensor.op.inputs))
                 for c in op.control_inputs}
    assert waits_for, [t.op.type for t in loop[0].inputs]
    first_gradients = {t.op for t in loop[0].inputs[3:]}
    assert waits_for & first_gradients


def test_bucketed_reductions_match_one_reduction():
    """--reduce_bucket_mb: each bucket is its own reduction (a sum of the same
    two values whichever way the tensors are grouped, so weights match to
    rounding), and the counters still arrive with the last bucket."""
    config = run_config("mirrored", batch=64, depth=2, optimizer="adam", learning_rate=1e-3)
    initial = models.build(config.model, IMAGE_SPEC).get_weights()
    one = train_from(config, initial)
    # 8x8x3 -> 16 -> 16 -> 5: kernels of 12 kB, 1 kB, 320 B; 1 kB buckets.
    bucketed = train_from(bucketed_config(config), initial)
    assert_weights_close(bucketed.model.get_weights(), one.model.get_weights())
    assert bucketed.summary["loss"] == pytest.approx(one.summary["loss"], rel=1e-6)

    adapter, traced = _reductions_in_one_step(bucketed_config(config))
    # Buckets from the last variable back: [logits b, logits k, hidden_1 b,
    # hidden_1 k (1 kB reached)], [hidden_0 b, hidden_0 k, counters].
    assert traced == 2 * adapter.num_replicas


def bucketed_config(config):
    return config.replace(train=dataclasses.replace(config.train, reduce_bucket_mb=0.001))


def test_linear_and_sqrt_lr_scaling_rules():
    from tfdist.training.schedules import WarmupDecay, scaled_learning_rate

    assert scaled_learning_rate(0.1, "linear", 1024, 256) == pytest.approx(0.4)
    assert scaled_learning_rate(0.1, "sqrt", 1024, 256) == pytest.approx(0.2)
    assert scaled_learning_rate(0.1, "none", 1024, 256) == pytest.approx(0.1)
    schedule = WarmupDecay(0.4, warmup_steps=10, total_steps=110, decay="cosine")
    assert float(schedule(0)) == pytest.approx(0.04)
    assert float(schedule(9)) == pytest.approx(0.4)
    assert float(schedule(60)) == pytest.approx(0.2, rel=1e-5)
    assert float(schedule(110)) == pytest.approx(0.0, abs=1e-7)


def test_effective_lr_follows_replicas_and_batch():
    """mirrored, 2 replicas x 32 = global 64, tuned at 16: linear -> x4, and the
    optimizer really runs at that rate after warm-up."""
    config = run_config("mirrored", learning_rate=0.01, batch=64, steps=6)
    config = config.replace(optimizer=config.optimizer.__class__(
        name="sgd", learning_rate=0.01, lr_scaling="linear", base_batch_size=16,
        warmup_steps=2))
    result = train_from(config, models.build(config.model, IMAGE_SPEC).get_weights())
    assert result.summary["replicas"] == 2
    assert result.summary["learning_rate"] == pytest.approx(0.04)
    assert result.summary["final_learning_rate"] == pytest.approx(0.04)


def test_clipping_applies_to_the_reduced_gradient():
    """With a tiny clip norm every SGD step moves the weights by exactly
    lr x clip_norm in global norm, under 2 replicas as under one."""
    for strategy in ("default", "mirrored"):
        config = run_config(strategy, learning_rate=1.0, steps=1)
        config = config.replace(optimizer=config.optimizer.__class__(
            name="sgd", learning_rate=1.0, clip_grad_norm=1e-3))
        initial = models.build(config.model, IMAGE_SPEC).get_weights()
        result = train_from(config, initial)
        moved = np.sqrt(sum(((w - i) ** 2).sum()
                            for w, i in zip(result.model.get_weights(), initial)))
        assert moved == pytest.approx(1e-3, rel=1e-3), strategy


def _poisoned_dataset_fn(split, context):
    """The test images, with an infinite pixel in the very first example."""
    import tensorflow as tf

    def poison(index, example):
        x, y = example
        return tf.where(tf.equal(index, 0), x + np.inf, x), y

    return image_dataset_fn(split, context).enumerate().map(poison)


@pytest.mark.parametrize("strategy", ["default", "mirrored"])
def test_fp16_skips_a_non_finite_step_and_adapts_the_loss_scale(strategy):
    def fp16(steps, growth=2000):
        return run_config(strategy, learning_rate=0.1, steps=steps, steps_per_loop=1,
                          precision="mixed_float16", loss_scale_growth_steps=growth)

    config = fp16(1, growth=2)
    initial = models.build(config.model, IMAGE_SPEC).get_weights()
    poisoned = tfdist.train(config.replace(data=tfdist.DataConfig(shuffle_buffer=1)),
                            model_fn=lambda spec: _model_from(initial, config, spec),
                            dataset_fn=_poisoned_dataset_fn, spec=IMAGE_SPEC)
    assert poisoned.summary["loss_scale"] == 2.0 ** 14            # halved from 2^15
    for w, i in zip(poisoned.model.get_weights(), initial):      # the update was skipped
        np.testing.assert_array_equal(w, i)
    clean = train_from(fp16(4, growth=2), initial)
    assert clean.summary["loss_scale"] == 2.0 ** 17               # doubled every 2 finite steps
    assert any(not np.array_equal(w, i) for w, i in zip(clean.model.get_weights(), initial))


def _model_from(initial, config, spec):
    model = models.build(config.model, spec)
    model.set_weights(initial)
    return model


@pytest.mark.slow   # two models traced twice each (~45 s)
@pytest.mark.parametrize("model", ["cnn", "transformer"])
def test_recompute_gives_the_same_weights(model):
    spec, dataset_fn = ((IMAGE_SPEC, image_dataset_fn) if model == "cnn"
                        else (TOKEN_SPEC, token_dataset_fn))
    results = []
    for recompute in (False, True):
        config = run_config("mirrored", model=model, width=8, depth=1, optimizer="adam",
                            learning_rate=0.001)
        config = config.replace(model=tfdist.ModelConfig(name=model, width=8, depth=1,
                                                         num_heads=2, recompute=recompute))
        if not results:
            initial = models.build(config.model, spec).get_weights()
        results.append(tfdist.train(
            config, model_fn=lambda s, c=config: _model_from(initial, c, s),
            dataset_fn=dataset_fn, spec=spec))
    plain, recomputed = results
    assert_weights_close([v.numpy() for v in recomputed.model.trainable_variables],
                         [v.numpy() for v in plain.model.trainable_variables])
