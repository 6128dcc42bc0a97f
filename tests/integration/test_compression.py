"""PowerSGD, top-k and local SGD in process, on 2 mirrored replicas (virtual
CPUs): the limits where they must equal plain synchronous training, that they
really differ elsewhere, and that their per-replica state survives a resume.

Tolerances: the compared runs compute the same sums in another order or
through another factorisation, never bit for bit (see each test); a lost or
doubled gradient moves weights by about as much as the 5 steps of training do,
which each test checks is far larger than its tolerance.
"""

import dataclasses
import glob
import os
import shutil

import numpy as np
import pytest

from tfdist import models, strategies
from tfdist.training import compression
from tfdist.errors import UsageError

import tfdist
from common import IMAGE_SPEC, run_config, train_from

# mlp 8x8x3 -> 5 -> 5 classes: kernels [192, 5] and [5, 5], both of smaller
# dimension 5, so --powersgd_rank=5 is full rank everywhere.
WIDTH = 5


def _config(**train):
    optimizer = train.pop("optimizer", "sgd")
    return run_config("mirrored", learning_rate=0.1, width=WIDTH, optimizer=optimizer, **train)


@pytest.fixture(scope="module")
def initial():
    return models.build(_config().model, IMAGE_SPEC).get_weights()


@pytest.fixture(scope="module")
def plain(initial):
    return {name: train_from(_config(optimizer=name), initial) for name in ("sgd", "adam")}


def _largest_difference(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a.model.get_weights(),
                                                           b.model.get_weights()))


def _moved(run, initial):
    return max(float(np.abs(x - y).max()) for x, y in zip(run.model.get_weights(), initial))


# Orthogonalising with a Householder QR reconstructs a full-rank sum to a few
# float32 ulps of its entries per step (seen: 6e-8 after 5 steps); 1e-6 bounds
# that and is 1000x below how far the weights move.
FULL_RANK_TOLERANCE = 1e-6


def test_powersgd_at_full_rank_equals_uncompressed(initial, plain):
    full = train_from(_config(grad_compression="powersgd", powersgd_rank=WIDTH), initial)
    assert _moved(plain["sgd"], initial) > 1000 * FULL_RANK_TOLERANCE
    assert _largest_difference(full, plain["sgd"]) < FULL_RANK_TOLERANCE
    # Control: rank 2 is a real approximation, and sends fewer bytes.
    low = train_from(_config(grad_compression="powersgd", powersgd_rank=2), initial)
    assert _largest_difference(low, plain["sgd"]) > 100 * FULL_RANK_TOLERANCE
    assert (low.summary["bytes_reduced_per_update"]
            < full.summary["bytes_reduced_per_update"]
            < plain["sgd"].summary["bytes_reduced_per_update"] * 1.1)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_topk_of_every_entry_equals_uncompressed(initial, plain, optimizer):
    """Fraction 1 sends every entry; the scatter adds each entry's two
    replica values as the all-reduce does (one addition: exact, commutative)."""
    every = train_from(_config(optimizer=optimizer, grad_compression="topk", topk_fraction=1.0),
                       initial)
    assert _largest_difference(every, plain[optimizer]) < 1e-7
    sparse = train_from(_config(optimizer=optimizer, grad_compression="topk",
                                topk_fraction=0.05), initial)
    assert _largest_difference(sparse, plain[optimizer]) > 1e-4   # control: it compresses
    assert (sparse.summary["bytes_reduced_per_update"] * 5   # 5% of entries, 8 bytes each
            < plain[optimizer].summary["bytes_reduced_per_update"])


def test_topk_warm_up_sends_less_in_four_stages_and_loops_end_between_them(caplog, initial):
    """DGC's warm-up over 8 steps: 25%, 6.25%, 1.56%, 0.39%, then the target;
    a loop ends at each stage's first step (each stage is its own trace)."""
    import logging
    import re
    from tfdist.training.compression import TopK
    exchange = TopK(models.build(_config().model, IMAGE_SPEC).trainable_variables, 0.001,
                    warmup_updates=8)
    assert [exchange.density_at(s) for s in range(10)] == [
        0.25, 0.25, 0.0625, 0.0625, 0.25 ** 3, 0.25 ** 3, 0.25 ** 4, 0.25 ** 4, 0.001, 0.001]
    assert exchange.boundaries() == [2, 4, 6, 8]
    # absl's logger at INFO too: an earlier test in this process may have left
    # it at WARNING (a non-chief strategy quiets it).
    with caplog.at_level(logging.INFO, logger="absl"):
        warm = train_from(_config(steps=10, grad_compression="topk", topk_fraction=0.01,
                                  compression_warmup_steps=8), initial)
    logged = [int(m) for m in re.findall(r"step (\d+)/10", caplog.text)]
    assert logged == [2, 4, 6, 8, 10]   # --steps_per_loop=10, yet loops end at the stages
    cold = train_from(_config(steps=10, grad_compression="topk", topk_fraction=0.01), initial)
    assert _largest_difference(warm, cold) > 1e-4   # control: the warm-up sent more


def test_topk_moves_sgd_momentum_into_the_exchange(initial):
    """Momentum SGD under top-k: the momentum is applied before sparsification
    (DGC's momentum correction) and the optimizer steps without it. With
    momentum factor masking, every entry sent starts its momentum afresh, so
    at fraction 1 the run is plain SGD: that identity shows both the move and
    the masking (an optimizer that kept its momentum would differ)."""
    momentum = _config(optimizer="momentum", grad_compression="topk", topk_fraction=1.0)
    corrected = train_from(momentum, initial)
    assert corrected.optimizer.momentum == 0.0
    sgd = train_from(_config(grad_compression="topk", topk_fraction=1.0), initial)
    assert _largest_difference(corrected, sgd) < 1e-7
    kept = train_from(_config(optimizer="momentum"), initial)   # control: momentum SGD
    assert _largest_difference(kept, sgd) > 1e-4


# A local step applies R x (replica gradient) / R where synchronous training
# applies the sum of the replicas' gradients: the same numbers added in
# another order, a few ulps apart per step (seen: 1.2e-7).
LOCAL_TOLERANCE = 1e-6


@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
def test_local_sgd_averaging_every_step_equals_synchronous_sgd(initial, optimizer):
    """K=1: the mean of the replicas' SGD steps is the step on the mean
    gradient; with momentum too (each replica's momentum is linear in its
    gradients, and only their mean reaches the weights)."""
    sync = train_from(_config(optimizer=optimizer), initial)
    local = train_from(_config(optimizer=optimizer, sync_every=1), initial)
    assert _moved(sync, initial) > 1000 * LOCAL_TOLERANCE
    assert _largest_difference(local, sync) < LOCAL_TOLERANCE
    # Control: averaging every 4 steps lets the replicas drift apart in between.
    drifted = train_from(_config(optimizer=optimizer, sync_every=4), initial)
    assert _largest_difference(drifted, sync) > 100 * LOCAL_TOLERANCE


def test_local_adam_averaging_every_step_is_not_adam(initial, plain):
    """Under Adam, K=1 is not synchronous training: each replica normalises
    its own gradient by its own second moment before the weights are averaged."""
    local = train_from(_config(optimizer="adam", sync_every=1), initial)
    assert _largest_difference(local, plain["adam"]) > 100 * LOCAL_TOLERANCE


@pytest.mark.parametrize("train", [
    dict(grad_compression="powersgd", powersgd_rank=2),
    dict(grad_compression="topk", topk_fraction=0.1, optimizer="momentum"),
    dict(sync_every=3, optimizer="adam"),
], ids=["powersgd", "topk-momentum", "local-adam"])
def test_per_replica_state_survives_a_resume(tmp_path, initial, train):
    """6 steps straight equal 3 steps, a checkpoint, and a resume to 6 (the
    same computation in the same order: to float32 rounding of nothing, so
    tight). Control: the same resume without the saved per-replica state
    (the error feedback, or local SGD's per-replica optimizer state) differs."""
    def run(directory, steps):
        config = _config(steps=steps, steps_per_loop=3, checkpoint_every=3,
                         model_dir=str(directory), **train)
        return train_from(config, initial)

    straight = run(tmp_path / "straight", 6)
    run(tmp_path / "resumed", 3)
    shutil.copytree(tmp_path / "resumed", tmp_path / "control")
    resumed = run(tmp_path / "resumed", 6)
    assert _largest_difference(resumed, straight) < 1e-7
    saved = glob.glob(str(tmp_path / "control" / "checkpoints" / "replicas" / "*" / "*.npz"))
    assert [os.path.basename(p) for p in saved] == ["state-3.npz"]
    os.remove(saved[0])
    control = run(tmp_path / "control", 6)
    assert _largest_difference(control, straight) > 1e-5


def test_per_replica_state_of_another_replica_count_restarts_from_zero(tmp_path, initial,
                                                                      caplog):
    """Error feedback saved by 2 replicas and resumed by 4 is not re-partitioned:
    a warning names both layouts and the 4 replicas start from zero, exactly as
    a resume with no saved state does (the control: that state was saved and
    would be restored by 2 replicas, as the test above shows)."""
    train = dict(grad_compression="topk", topk_fraction=0.1, optimizer="momentum")

    def run(directory, steps, devices):
        config = _config(steps=steps, steps_per_loop=3, checkpoint_every=3,
                         model_dir=str(directory), **train)
        config = config.replace(strategy=config.strategy.replace(virtual_devices=devices))
        return train_from(config, initial)

    run(tmp_path / "two", 3, 2)
    shutil.copytree(tmp_path / "two", tmp_path / "none")
    for path in glob.glob(str(tmp_path / "none" / "checkpoints" / "replicas" / "*" / "*.npz")):
        os.remove(path)
    with caplog.at_level("WARNING"):
        four = run(tmp_path / "two", 6, 4)
    assert "saved under another number of processes or replicas" in caplog.text
    assert "process-0-of-1" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        reset = run(tmp_path / "none", 6, 4)
    assert "none was saved with step 3 in" in caplog.text
    assert _largest_difference(four, reset) < 1e-7


def test_local_sgd_loops_end_where_the_weights_are_averaged(tmp_path, initial):
    """--sync_every=4 with checkpoints and logs asked every 3 steps: loops
    (so checkpoints) end only at the averages, 4 and 8."""
    config = _config(steps=8, steps_per_loop=3, checkpoint_every=3, model_dir=str(tmp_path),
                     sync_every=4, keep_checkpoints=10)
    train_from(config, initial)
    saved = sorted(int(p.rsplit("-", 1)[1][:-len(".index")])
                   for p in glob.glob(str(tmp_path / "checkpoints" / "ckpt-*.index")))
    assert saved == [4, 8]


@pytest.mark.parametrize("train, expected", [
    (dict(grad_compression="powersgd", powersgd_rank=6),
     "--powersgd_rank=6 is larger than the smaller dimension (5)"),
    (dict(topk_fraction=1.5), "topk_fraction=1.5 must be in (0, 1]"),
    (dict(topk_fraction=0.0), "topk_fraction=0.0 must be in (0, 1]"),
    (dict(sync_every=4, accum_steps=2), "sync_every=4 (local SGD) with accum_steps=2"),
    (dict(sync_every=4, grad_compression="bf16"), "local SGD sends weights"),
    (dict(grad_compression="topk", reduce_bucket_mb=1.0), "use reduce_bucket_mb=0"),
    (dict(grad_compression="powersgd", precision="mixed_float16"), "mixed_float16"),
])
def test_bad_settings_are_one_line_usage_errors(initial, train, expected):
    with pytest.raises((UsageError, tfdist.ConfigError)) as error:
        train_from(_config(**train), initial)
    assert expected in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("train, expected", [
    (dict(grad_compression="powersgd"), "--grad_compression=powersgd needs replicas that "
     "each step on their own data and keep state of their own; --strategy=dtensor has none "
     "(engines that do: default, mirrored, multi_worker, horovod)"),
    (dict(grad_compression="bf16"), "DTensor reduces gradients inside"),
    (dict(sync_every=2), "--sync_every=2 needs replicas that each step on their own data "
     "and keep state of their own; --strategy=dtensor has none"),
])
def test_dtensor_refuses(train, expected):
    config = run_config("dtensor", width=WIDTH, **train)
    with pytest.raises(UsageError) as error:
        train_from(config, models.build(config.model, IMAGE_SPEC).get_weights())
    assert expected in str(error.value)


@pytest.mark.parametrize("name", ["parameter_server", "horovod", "mirrored", "pipeline"])
def test_engines_without_per_replica_state_or_elastic_refuse(name):
    """Checked from the engine's capabilities, before it is set up: one
    refusal for every engine without them, naming those that have them."""
    config = run_config(name, grad_compression="topk")
    strategy = strategies.create(dataclasses.replace(config.strategy, elastic=name == "horovod"))
    if name == "mirrored":   # control: an engine with per-replica state
        compression.check_engine(config.train, strategy)
        return
    with pytest.raises(UsageError) as error:
        compression.check_engine(config.train, strategy)
    assert {"parameter_server": "--strategy=parameter_server has none",
            "pipeline": "--strategy=pipeline has none",
            "horovod": "with --elastic"}[name] in str(error.value)
    if name != "horovod":
        assert "(engines that do: default, mirrored, multi_worker, horovod)" in str(error.value)


def test_preemption_between_averages_saves_at_the_next_one(tmp_path, initial):
    """SIGTERM before the first of K=4 local steps has finished: training goes
    on to the next average (step 4; --steps_per_loop=1 and --checkpoint_every=1
    would stop at 1), saves there with every replica's optimizer state, and a
    resume from it ends where an uninterrupted run does."""
    import signal
    import threading
    import time
    from tfdist.training import interrupts
    from tfdist.training.interrupts import Preempted

    def config(directory, steps):
        return _config(steps=steps, steps_per_loop=1, checkpoint_every=1, sync_every=4,
                       optimizer="adam", model_dir=str(directory))

    def sigterm_once_handled():
        # Once tfdist's handler is in (the controller's, around the loops):
        # the signal is then taken in Python as soon as it arrives, long
        # before the first loop's trace and compile end.
        default = signal.getsignal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while signal.getsignal(signal.SIGTERM) is default and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGTERM)

    straight = train_from(config(tmp_path / "straight", 12), initial)
    sender = threading.Thread(target=sigterm_once_handled)
    sender.start()
    try:
        with pytest.raises(Preempted) as stopped:
            train_from(config(tmp_path / "run", 12), initial)
    finally:
        sender.join()
    assert stopped.value.step == 4
    assert glob.glob(str(tmp_path / "run" / "checkpoints" / "replicas" / "*" / "state-4.npz"))
    resumed = train_from(config(tmp_path / "run", 12), initial)
    assert _largest_difference(resumed, straight) < 1e-7
    # The save ended in time: its deadline (--preemption_grace_s after the
    # signal) is called off, or it would end this process, which goes on (a
    # Python caller of tfdist.train that catches Preempted).
    for thread in threading.enumerate():
        if thread.name == interrupts.DEADLINE_THREAD:
            thread.join(timeout=5)
            assert not thread.is_alive()


@pytest.mark.parametrize("train, per_update", [
    (dict(grad_compression="powersgd", powersgd_rank=2), 2),   # P, then Q
    (dict(grad_compression="topk"), 1),                        # + the all-gather
])
def test_accumulation_compresses_once_per_update(train, per_update):
    """4 micro-batches, then one exchange: PowerSGD's two all-reduces and
    top-k's one (beside its all-gather) per replica, not per micro-batch."""
    from test_features import _reductions_in_one_step
    config = run_config("mirrored", batch=64, accum_steps=4, width=WIDTH, **train)
    adapter, traced = _reductions_in_one_step(config)
    assert traced == per_update * adapter.num_replicas


def test_powersgd_warm_up_sums_uncompressed_until_its_step(initial, plain):
    """--compression_warmup_steps=5 over a 5-step run: plain sums throughout
    (equal to uncompressed up to the order of a sum: same numbers, same order
    here); 3 warm-up steps then rank 2 differs (the control)."""
    warm = train_from(_config(grad_compression="powersgd", powersgd_rank=2,
                              compression_warmup_steps=5), initial)
    assert _largest_difference(warm, plain["sgd"]) < 1e-7
    partly = train_from(_config(grad_compression="powersgd", powersgd_rank=2,
                                compression_warmup_steps=3), initial)
    assert _largest_difference(partly, plain["sgd"]) > 1e-5


def test_topk_with_adam_on_a_batchnorm_model_is_warned_naming_momentum():
    """The measured accuracy cost (bench/compression_accuracy.py) is said at
    start-up where it applies; not with momentum SGD, nor without BatchNorm
    (the controls)."""
    cnn = models.build(run_config(model="cnn", width=4).model, IMAGE_SPEC)
    mlp = models.build(run_config(model="mlp", width=4).model, IMAGE_SPEC)
    topk = run_config(grad_compression="topk").train
    line = compression.accuracy_warning(topk, "adam", cnn)
    assert line.startswith("--grad_compression=topk with --optimizer=adam on a model with "
                           "BatchNorm") and "--optimizer=momentum" in line
    assert compression.accuracy_warning(topk, "momentum", cnn) is None
    assert compression.accuracy_warning(topk, "adam", mlp) is None
    assert compression.accuracy_warning(run_config().train, "adam", cnn) is None


def test_powersgd_sums_whole_the_matrices_its_factors_would_not_shrink():
    """PyTorch's min_compression_rate: at rank 2 and the default 2x, the
    [192, 5] kernel (960 entries, factors 2 x 197) is compressed and the
    [5, 5] one (25, factors 20) summed whole, as the 1-D biases are; at 0
    both are compressed (the control); a rate nothing passes is refused."""
    import keras
    variables = [keras.Variable(np.zeros(shape, np.float32))
                 for shape in ([192, 5], [5], [5, 5], [5])]
    default = compression.PowerSGD(variables, 2, 0, min_compression=2.0)
    assert default.compressed == [0] and default.dense == [1, 2, 3]
    assert default.bytes_per_update(variables) == (2 * (192 + 5) + 5 + 25 + 5) * 4
    every = compression.PowerSGD(variables, 2, 0, min_compression=0.0)
    assert every.compressed == [0, 2] and every.dense == [1, 3]
    with pytest.raises(UsageError, match="compresses none of the model's matrices"):
        compression.PowerSGD(variables, 2, 0, min_compression=3.0)
