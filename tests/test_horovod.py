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
from conftest import BIN, REPO, run_cli, run_clis
from test_multi_worker import assert_match_single_device, check_exact_resume, run_workers

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


@pytest.mark.timeout(400)
def test_resumed_ranks_read_exactly_the_batches_of_an_uninterrupted_run(tmp_path):
    check_exact_resume(HOROVODRUN, "horovod", tmp_path)


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


def test_elastic_without_horovodrun_is_one_rank_and_needs_an_elastic_horovodrun(data_dir):
    """--elastic alone trains as one rank (committing every loop); under a
    horovodrun with a fixed -np (HOROVOD_RANK set, no HOROVOD_ELASTIC) it is a
    one-line error before training."""
    args = ["--strategy=horovod", "--elastic", "--model=mlp", "--model_width=8",
            "--train_steps=4", "--steps_per_loop=2", "--global_batch_size=8",
            f"--data_dir={data_dir}"]
    alone, fixed = run_clis([args, args], envs=[{}, {"HOROVOD_RANK": "0"}], timeout=120)
    assert alone.returncode == 0, alone.stderr[-2000:]
    summary = json.loads(alone.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 4 and summary["replicas"] == 1
    assert "elastic (commit every loop)" in alone.stderr
    assert fixed.returncode == 2, fixed.stderr[-2000:]
    errors = [line for line in fixed.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--elastic needs an elastic horovodrun" in errors[0]
    assert "Traceback" not in fixed.stderr


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


def _elastic_horovodrun(tmp_path, *, cooldown_s=None):
    """horovodrun for an elastic job of at most 2 ranks on this machine.

    The machine is named twice (localhost and 127.0.0.1, one slot each):
    Horovod blacklists the whole host of a failed rank, so with one name
    (localhost:2) killing a rank would end the job. A cooldown lets the
    blacklisted name come back, and a new rank start there."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    command = [os.path.join(BIN, "horovodrun"), "--gloo", "-np", "2", "--min-np", "1",
               "--max-np", "2", "--host-discovery-script", str(discover),
               "--network-interface", "lo"]   # else elastic mode wants two real hosts
    if cooldown_s:
        command += ["--blacklist-cooldown-range", str(cooldown_s), str(cooldown_s + 1)]
    return command


@pytest.mark.timeout(300)
def test_elastic_survives_a_killed_rank_and_takes_it_back(tmp_path, data_dir):
    """2 ranks; SIGKILL rank 1 mid-run: rank 0 rolls back to its last commit,
    goes on alone, takes a new rank back when the host returns (after the
    blacklist cooldown), and the run ends at the requested step."""
    import re

    steps, commit_every = 600, 20
    model_dir = str(tmp_path / "run")
    args = ["--strategy=horovod", "--elastic", f"--elastic_commit_every={commit_every}",
            "--model=mlp", "--model_width=16", "--model_depth=1", "--global_batch_size=32",
            f"--train_steps={steps}", "--steps_per_loop=50", "--log_every=50",
            "--checkpoint_every=200", f"--data_dir={data_dir}", f"--model_dir={model_dir}"]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.Popen([*_elastic_horovodrun(tmp_path, cooldown_s=1), TRAIN, *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines = []
    try:
        deadline = time.monotonic() + 150
        while not any(f"step 100/{steps}" in line for line in lines):
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(lines)[-3000:]
            lines.append(line)
        os.kill(_rank_pid(1), signal.SIGKILL)
        out, _ = proc.communicate(timeout=200)   # bounded: a hang fails the test
    finally:
        proc.kill()
    output = "".join(lines) + out
    assert proc.returncode == 0, output[-4000:]
    regrouped = [(int(n), int(s)) for n, s in re.findall(
        r"now (\d) replica\(s\) \(global batch 32 = .*?; going on from step (\d+)", output)]
    # Rank 0 alone from its last commit, then both again (the new rank 1 starts
    # from the state rank 0 broadcasts).
    assert [n for n, _ in regrouped][:2] == [1, 2], output[-4000:]
    assert all(step % commit_every == 0 and step < steps for _, step in regrouped), regrouped
    summaries = [json.loads(line[line.index("{"):]) for line in output.splitlines()
                 if '"strategy": "horovod"' in line]
    assert len(summaries) == 1, output[-3000:]   # the chief's
    assert summaries[0]["steps"] == steps and summaries[0]["replicas"] == 2
    assert summaries[0]["elastic_reforms"] == len(regrouped)
    assert np.isfinite(summaries[0]["loss"])
    assert checkpointing.saved_steps(model_dir)[-1] == steps
    time.sleep(1)
    assert _training_pids() == {}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["stop", "skip", "rollback"])
def test_on_nonfinite_under_two_ranks(tmp_path, mode):
    """--on_nonfinite with a NaN at one step (tests/test_nonfinite_cluster.py,
    there under multi_worker): stop ends both ranks with one line naming the
    step; skip and rollback finish with both ranks identical."""
    from test_nonfinite_cluster import check_rollback, check_skip, check_stop, run_nan_workers

    result, model_dir, finished, initial = run_nan_workers(HOROVODRUN, tmp_path, "horovod", mode)
    if mode == "stop":
        check_stop(result, model_dir, finished, "rank")
    elif mode == "skip":
        check_skip(result, finished, initial)
    else:
        check_rollback(result, model_dir, finished)
