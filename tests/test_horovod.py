"""horovod: real ranks under `horovodrun --gloo`, each test with a hard time limit.

`make test` builds Horovod first and sets TFDIST_REQUIRE_HOROVOD=1, so there a
missing Horovod fails these tests instead of skipping them.
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tfdist import checkpointing

from common import PREDICTION_TOLERANCE, assert_variables_equal, run_config
from conftest import BIN, REPO, run_cli
from test_multi_worker import assert_match_single_device, run_workers

HAVE_HOROVOD = importlib.util.find_spec("horovod") is not None
if not HAVE_HOROVOD and os.environ.get("TFDIST_REQUIRE_HOROVOD") == "1":
    raise RuntimeError("Horovod is required here (TFDIST_REQUIRE_HOROVOD=1): run `make horovod`")
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not HAVE_HOROVOD, reason="Horovod not built (make horovod)")]
HOROVODRUN = [os.path.join(BIN, "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo"]
TRAIN = os.path.join(BIN, "tfdist-train")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", ["multilabel", "tokens_ignore_class"])
def test_two_ranks_train_keras_losses_and_metrics_like_one_device(tmp_path, case):
    from test_tasks import run_case_workers
    run_case_workers(HOROVODRUN, tmp_path, "horovod", case)


@pytest.mark.timeout(240)
def test_custom_absl_script_under_horovodrun(tmp_path):
    script = os.path.join(REPO, "examples", "custom_script.py")
    result = subprocess.run([*HOROVODRUN, sys.executable, script, "--strategy=horovod",
                             "--examples=2048", "--train_steps=120", "--global_batch_size=64"],
                            cwd=REPO, capture_output=True, text=True, timeout=200,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = [json.loads(line[line.index("{"):]) for line in result.stdout.splitlines()
                 if "{" in line and '"strategy"' in line]
    assert len(summaries) == 1, result.stdout[-2000:]   # the chief (rank 0) prints it
    assert summaries[0]["strategy"] == "horovod" and summaries[0]["replicas"] == 2
    assert summaries[0]["auc"] > 0.85


@pytest.mark.timeout(240)
def test_two_ranks_match_single_process(tmp_path):
    workers, initial = run_workers(HOROVODRUN, tmp_path, "horovod")
    assert_match_single_device(workers, initial)


@pytest.mark.timeout(240)
def test_two_ranks_with_bucketed_reductions_match_single_process(tmp_path):
    workers, initial = run_workers(HOROVODRUN, tmp_path, "horovod", reduce_bucket_mb=0.001)
    assert_match_single_device(workers, initial)


@pytest.mark.timeout(240)
def test_two_ranks_accumulating_match_one_big_batch(tmp_path):
    workers, initial = run_workers(HOROVODRUN, tmp_path, "horovod", accum_steps=4)
    assert_match_single_device(workers, initial)


@pytest.mark.timeout(240)
def test_every_feature_at_once_keeps_ranks_identical(tmp_path):
    workers, initial = run_workers(HOROVODRUN, tmp_path, "horovod", accum_steps=2,
                                   grad_compression="fp16", precision="mixed_bfloat16")
    for a, b in zip(*workers):
        np.testing.assert_array_equal(a, b)
    assert all(np.isfinite(w).all() for w in workers[0])
    assert any(not np.array_equal(w, i) for w, i in zip(workers[0], initial))


@pytest.mark.timeout(300)
def test_horovod_checkpoint_restores_under_default_and_mirrored(tmp_path, data_dir):
    import tfdist

    model_dir = str(tmp_path / "run")
    args = ["--strategy=horovod", "--model=mlp", "--model_width=16", "--model_depth=1",
            "--global_batch_size=32", "--train_steps=20", "--steps_per_loop=10",
            "--grad_compression=fp16", f"--data_dir={data_dir}", f"--model_dir={model_dir}"]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run([*HOROVODRUN, TRAIN, *args], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert checkpointing.saved_steps(model_dir) == [20]
    assert sorted(os.listdir(model_dir)) == ["checkpoints", "run.json", "summary.json", "tensorboard"]
    with open(os.path.join(model_dir, "summary.json")) as f:
        summary = json.load(f)
    # fp16 gradients on the wire: half of the float32 parameter bytes.
    assert summary["grad_compression"] == "fp16" and summary["replicas"] == 2
    parameters = (32 * 32 * 3 + 1) * 16 + (16 + 1) * 10
    assert summary["bytes_reduced_per_update"] == parameters * 2
    probe = np.random.default_rng(3).uniform(size=(8, 32, 32, 3)).astype(np.float32)
    predictions, weights = [], []
    for strategy in ("default", "mirrored"):
        config = run_config(strategy, steps=20, batch=32, model_dir=model_dir, width=16)
        config = config.replace(data=tfdist.DataConfig(data_dir=data_dir))
        restored = tfdist.train(config)
        assert restored.summary["steps"] == 20  # restored at the final step: nothing retrained
        predictions.append(restored.model.predict(probe, verbose=0))
        weights.append(restored.model.get_weights())
    assert_variables_equal(weights[0], weights[1])  # both restored the same bytes
    # Computed under two strategies (another device split): float32 tolerance.
    np.testing.assert_allclose(predictions[0], predictions[1], **PREDICTION_TOLERANCE)


def _training_pids():
    """{rank: pid} of the Python processes running tfdist-train as a Horovod rank."""
    found = {}
    pids = subprocess.run(["pgrep", "-f", f"{TRAIN} --strategy=horovod"],
                          capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv0 = f.read().split(b"\0")[0]
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        except OSError:
            continue  # already gone
        if b"python" in os.path.basename(argv0) and b"HOROVOD_RANK" in env:
            found[int(env[b"HOROVOD_RANK"])] = int(pid)
    return found


def _rank_pid(rank):
    pids = _training_pids()
    assert sorted(pids) == [0, 1], pids
    return pids[rank]


@pytest.mark.timeout(180)
def test_dead_rank_ends_the_job(tmp_path, data_dir):
    args = ["--strategy=horovod", "--model=mlp", "--train_steps=1000000", "--steps_per_loop=10",
            "--global_batch_size=32", f"--data_dir={data_dir}", "--log_every=10"]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "HOROVOD_GLOO_TIMEOUT_SECONDS": "20"}
    proc = subprocess.Popen([*HOROVODRUN, TRAIN, *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:  # wait until training is under way
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, "training never started"
            if "step 10/" in line:
                break
        os.kill(_rank_pid(1), signal.SIGKILL)
        proc.communicate(timeout=60)  # bounded: a hang fails the test
    finally:
        proc.kill()
    assert proc.returncode != 0
    time.sleep(1)
    assert _training_pids() == {}


def test_without_horovodrun_it_is_a_single_rank(data_dir):
    result = run_cli(["--strategy=horovod", "--model=mlp", "--model_width=8", "--train_steps=2",
                      "--steps_per_loop=2", "--global_batch_size=8", f"--data_dir={data_dir}"],
                     timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["strategy"] == "horovod" and summary["replicas"] == 1
    assert summary["steps"] == 2


def test_without_horovod_says_how_to_build_it(tmp_path):
    fake = tmp_path / "fake" / "horovod"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named horovod (test)')\n")
    result = run_cli(["--strategy=horovod", "--model=mlp", "--train_steps=1"], timeout=60,
                     env={"PYTHONPATH": str(tmp_path / "fake")})
    assert result.returncode == 2
    errors = [l for l in result.stderr.splitlines() if "error:" in l]
    assert len(errors) == 1 and "Horovod is not installed" in errors[0]
    assert "make horovod" in errors[0]


@pytest.mark.timeout(120)
def test_build_script_reuses_what_is_built():
    result = subprocess.run([os.path.join(REPO, "launch", "build_horovod.sh"),
                             os.path.dirname(BIN)], capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "already installed" in result.stdout + result.stderr
    assert "nothing to do" in result.stdout + result.stderr


@pytest.mark.timeout(300)
def test_sigterm_to_one_rank_saves_one_step_on_both_and_a_rerun_finishes(tmp_path, data_dir):
    """A rank is preempted: both ranks agree (a collective), save the same step,
    exit 143; horovodrun ends; running it again finishes at the requested step."""
    from test_reliability import _preempted_steps

    model_dir = str(tmp_path / "run")
    args = ["--strategy=horovod", "--model=mlp", "--model_width=32", "--global_batch_size=32",
            "--steps_per_loop=10", "--checkpoint_every=20", "--keep_checkpoints=100",
            "--train_steps=200", f"--data_dir={data_dir}", f"--model_dir={model_dir}",
            "--preemption_grace_s=20"]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.Popen([*HOROVODRUN, TRAIN, *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 150
        while not checkpointing.saved_steps(model_dir):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.2)
        found = subprocess.run(["pgrep", "-f", "--", f"--model_dir={model_dir} "],
                               capture_output=True, text=True).stdout.split()
        ranks = [pid for pid in found   # python .../tfdist-train: not horovodrun or its shells
                 if open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[1].endswith(
                     b"tfdist-train")]
        assert len(ranks) == 2, found
        os.kill(int(sorted(ranks, key=int)[-1]), signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    steps = _preempted_steps(out + err)
    assert len(steps) == 2 and steps[0] == steps[1], (out + err)[-3000:]
    assert steps[0] in checkpointing.saved_steps(model_dir)
    rerun = subprocess.run([*HOROVODRUN, TRAIN, *args], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=200)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    saved = checkpointing.saved_steps(model_dir)
    assert saved == sorted(set(saved)) and saved[-1] == 200
