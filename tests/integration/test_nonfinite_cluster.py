"""--on_nonfinite across processes: 2 multi_worker workers under tfdist-launch
(Horovod's 2 ranks: tests/integration/test_horovod.py), the NaN of test_nonfinite.py
injected at step NAN_STEP (tests/mw_worker.py {"nan": true}). Every worker sees
the same reduced loss, so every worker takes the same decision. One launch
per mode for Horovod; here one launch makes all three modes in turn (each
worker process runs skip, rollback, then stop: tests/mw_worker.py with a
list), so the 2 processes' TensorFlow start-up is paid once."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tfdist import checkpointing

from common import IMAGE_SPEC, mw_config, train_from
from conftest import BIN, REPO
from test_nonfinite import BATCH, NAN_STEP, STEPS, nan_dataset_fn

pytestmark = pytest.mark.integration
LAUNCH = [os.path.join(BIN, "tfdist-launch"), "--workers=2", "--"]


def run_nan_workers(launcher, tmp_path, engine, mode):
    """Both processes of `launcher` train STEPS steps of the NaN data under
    `mode`, checkpointing every 4 steps into tmp_path/run; returns the
    CompletedProcess, the model_dir, and per process its final weights and
    summary (None where it did not finish)."""
    from tfdist import models

    model_dir = str(tmp_path / "run")
    initial = models.build(mw_config(engine).model, IMAGE_SPEC).get_weights()
    np.savez(tmp_path / "initial.npz", *initial)
    overrides = {"nan": True, "on_nonfinite": mode, "steps_per_loop": 4,
                 "checkpoint_every": 4, "model_dir": model_dir, "global_batch_size": BATCH,
                 "jit_compile": "off"}
    result = subprocess.run([*launcher, sys.executable, "tests/mw_worker.py", str(tmp_path),
                             engine, str(STEPS), json.dumps(overrides)], cwd=REPO,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
                            capture_output=True, text=True, timeout=200)
    finished = []
    for index in (0, 1):
        weights = tmp_path / f"weights-{index}.npz"
        summary = tmp_path / f"summary-{index}.json"
        finished.append(None if not weights.exists() else (
            list(np.load(weights).values()), json.loads(summary.read_text())))
    return result, model_dir, finished, initial


def check_stop(result, model_dir, finished, process_unit):
    """Every process ends with one line naming the step and the last good
    checkpoint; nothing is saved after the NaN."""
    output = result.stdout + result.stderr
    assert result.returncode != 0 and finished == [None, None], output[-3000:]
    faults = [line for line in output.splitlines() if "fault:" in line]
    for index in (0, 1):
        mine = [line for line in faults if f"{process_unit} {index}:" in line]
        assert len(mine) == 1, output[-3000:]
        assert f"not finite at step {NAN_STEP} (--on_nonfinite=stop)" in mine[0]
        assert "ckpt-4" in mine[0]
    # No traceback from a worker (both launchers prefix worker lines with "[";
    # horovodrun adds one of its own about the failed ranks).
    assert not any(line.startswith("[") and "Traceback" in line
                   for line in output.splitlines()), output[-3000:]
    assert checkpointing.saved_steps(model_dir) == [4]


def check_skip(result, finished, initial):
    """Both finish with the same weights and loss, each counting the one
    skipped step; the result is that of one process skipping it."""
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    (weights_0, summary_0), (weights_1, summary_1) = finished
    for a, b in zip(weights_0, weights_1):
        np.testing.assert_array_equal(a, b)   # copies of one computation: bit for bit
    assert summary_0["nonfinite_steps"] == summary_1["nonfinite_steps"] == 1
    assert summary_0["steps"] == summary_1["steps"] == STEPS
    assert summary_0["loss"] == summary_1["loss"] and np.isfinite(summary_0["loss"])
    config = mw_config("default", STEPS, on_nonfinite="skip", steps_per_loop=4)
    single = train_from(config, initial, dataset_fn=nan_dataset_fn)
    assert single.summary["nonfinite_steps"] == 1
    for a, b in zip(weights_0, single.model.get_weights()):   # another device split
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def check_rollback(result, model_dir, finished):
    """Both finish at the requested step after one rollback, identical."""
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    (weights_0, summary_0), (weights_1, summary_1) = finished
    for a, b in zip(weights_0, weights_1):
        np.testing.assert_array_equal(a, b)
    for summary in (summary_0, summary_1):
        assert summary["steps"] == STEPS and summary["rollbacks"] == 1
        assert np.isfinite(summary["loss"])
    assert all(np.isfinite(w).all() for w in weights_0)
    assert checkpointing.saved_steps(model_dir) == [4, 8, 12]
    assert "rolled back to" in result.stdout + result.stderr


MODES = ("skip", "rollback", "stop")   # stop ends the processes: last


@pytest.fixture(scope="module")
def mode_runs(tmp_path_factory):
    """run_nan_workers for every mode of MODES on one 2-worker launch: mode ->
    (CompletedProcess, model_dir, finished, initial). A mode's process result
    is the launch's if the processes ended in it, else (they went on to the
    next mode, so both returned from it) exit status 0."""
    from tfdist import models

    directory = tmp_path_factory.mktemp("nonfinite")
    initial = models.build(mw_config("multi_worker").model, IMAGE_SPEC).get_weights()
    np.savez(directory / "initial.npz", *initial)
    # (The loop's non-finite handling, not XLA's arithmetic: no compiles.)
    runs = [{"nan": True, "on_nonfinite": mode, "steps_per_loop": 4, "checkpoint_every": 4,
             "model_dir": str(directory / mode), "global_batch_size": BATCH,
             "jit_compile": "off"} for mode in MODES]
    result = subprocess.run([*LAUNCH, sys.executable, "tests/mw_worker.py", str(directory),
                             "multi_worker", str(STEPS), json.dumps(runs)], cwd=REPO,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
                            capture_output=True, text=True, timeout=220)
    found = {}
    for k, mode in enumerate(MODES):
        finished = []
        for index in (0, 1):
            weights = directory / str(k) / f"weights-{index}.npz"
            summary = directory / str(k) / f"summary-{index}.json"
            finished.append(None if not weights.exists() else (
                list(np.load(weights).values()), json.loads(summary.read_text())))
        ended_here = k == len(MODES) - 1 or None in finished
        status = result.returncode if ended_here else 0
        found[mode] = (subprocess.CompletedProcess(result.args, status, result.stdout,
                                                   result.stderr),
                       str(directory / mode), finished, initial)
    return found


@pytest.mark.timeout(240)
def test_stop_ends_every_worker_with_one_line(mode_runs):
    result, model_dir, finished, _ = mode_runs["stop"]
    check_stop(result, model_dir, finished, "worker")


@pytest.mark.timeout(240)
def test_skip_agrees_on_every_worker(mode_runs):
    result, _, finished, initial = mode_runs["skip"]
    check_skip(result, finished, initial)


@pytest.mark.timeout(240)
def test_rollback_finishes_on_every_worker(mode_runs):
    result, model_dir, finished, _ = mode_runs["rollback"]
    check_rollback(result, model_dir, finished)
