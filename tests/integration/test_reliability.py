"""Preemption: SIGTERM makes every worker save at the same step and exit 143;
a re-run (or tfdist-launch --max_restarts) resumes and ends at exactly the
requested step; saved steps never go backwards."""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tfdist import checkpointing
from tfdist.training.interrupts import PREEMPTED_EXIT

from conftest import BIN, REPO
from test_multi_worker import _children, _wait_for_checkpoint

pytestmark = pytest.mark.integration
TRAIN = os.path.join(BIN, "tfdist-train")
LAUNCH = os.path.join(BIN, "tfdist-launch")
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
GRACE_S = 20
# Preemption, restarts and a full disk are about the loop's step and
# checkpoint boundaries, not the step's arithmetic: no XLA compile (seconds
# of CPU per process; 2 cores shared by ~10 processes here). The XLA-compiled
# step runs multi-process in the equivalence tests (tests/mw_worker.py runs at
# --jit_compile=auto) and in the CLI tests.
NO_XLA = ["--jit_compile=off"]


def _args(strategy, model_dir, data_dir, steps=300):
    return [TRAIN, f"--strategy={strategy}", "--model=mlp", "--model_width=32",
            "--global_batch_size=32", "--steps_per_loop=10", "--checkpoint_every=50",
            "--keep_checkpoints=100", f"--train_steps={steps}", f"--data_dir={data_dir}",
            f"--model_dir={model_dir}", f"--preemption_grace_s={GRACE_S}",
            "--collective_timeout_s=30", *NO_XLA,
            # Each input position saved holds the shuffle buffer: 1000
            # examples (7 MB) instead of the default 10000 (70 MB).
            "--shuffle_buffer=1000"]


def _start(command):
    return subprocess.Popen(command, cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _preempted_steps(stderr):
    return [int(s) for s in re.findall(r"preempted \(SIGTERM\) at step (\d+)", stderr)]


def _sigterm_after_checkpoint(command, model_dir, timeout):
    """Start `command`, SIGTERM it once a checkpoint exists; (its stderr,
    seconds from the signal to its exit)."""
    proc = _start(command)
    try:
        _wait_for_checkpoint(model_dir, proc)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    assert proc.returncode == PREEMPTED_EXIT, err[-3000:]
    return err, time.monotonic() - sent


def _finish(command, model_dir, steps=300):
    """Re-run: it resumes and ends at exactly `steps`; no saved step went backwards."""
    result = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads([line for line in result.stdout.splitlines() if "{" in line][-1]
                         .split("] ", 1)[-1])
    assert summary["steps"] == steps
    saved = checkpointing.saved_steps(model_dir)
    assert saved == sorted(set(saved)) and saved[-1] == steps, saved


@pytest.fixture(scope="module")
def preempted_default(tmp_path_factory, data_dir):
    """A default-strategy run SIGTERMed once a checkpoint exists: (its
    command, model_dir, stderr, seconds from the signal to its exit). Its
    checkpoint also sizes the full-disk test's tmpfs (same model flags)."""
    model_dir = str(tmp_path_factory.mktemp("preempted") / "run")
    command = _args("default", model_dir, data_dir)
    err, seconds = _sigterm_after_checkpoint(command, model_dir, timeout=GRACE_S + 10)
    return command, model_dir, err, seconds


@pytest.mark.timeout(300)
def test_sigterm_saves_exits_143_and_a_rerun_finishes(preempted_default):
    command, model_dir, err, seconds = preempted_default
    assert seconds < GRACE_S
    [step] = _preempted_steps(err)
    assert step % 10 == 0 and step in checkpointing.saved_steps(model_dir)
    assert [line for line in err.splitlines() if "preempted" in line][-1].startswith(
        "tfdist-train: preempted (SIGTERM) at step")
    _finish(command, model_dir)


def _read(path):
    with open(path) as f:
        return f.read()


def _wait_until(condition, proc, err_path, deadline_s, what):
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert proc.poll() is None, _read(err_path)[-3000:]
        assert time.monotonic() < deadline, f"{what} within {deadline_s}s\n" + \
            _read(err_path)[-3000:]
        time.sleep(0.1)


@pytest.mark.timeout(400)
def test_sigterm_to_one_worker_then_to_launch_stops_all_at_one_step_restarts_and_reruns(
        tmp_path, data_dir):
    """One launch (--max_restarts=1), the two preemptions in turn.
    Kubernetes evicts one pod: both workers save the same step, exit 143, and
    tfdist-launch restarts the group, which resumes from that step. Then
    SIGTERM to tfdist-launch: it stops the group with 143 within the grace
    period, both workers saving one step; a re-run finishes at exactly the
    requested step, no saved step going backwards."""
    model_dir = str(tmp_path / "run")
    # 200 steps: the launcher's SIGTERM lands at the restarted group's first
    # checkpoint (step 100), 100 steps and 2 checkpoints before the end.
    total = 200
    command = [LAUNCH, "--workers=2", "--max_restarts=1", "--",
               *_args("multi_worker", model_dir, data_dir, steps=total)]
    err_path = tmp_path / "launch.err"
    with open(tmp_path / "launch.out", "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=out, stderr=err, text=True)
    try:
        _wait_until(lambda: checkpointing.saved_steps(model_dir), proc, err_path, 150,
                    "no checkpoint")
        workers = sorted(_children(proc.pid))
        os.kill(workers[1], signal.SIGTERM)
        _wait_until(lambda: "restarting all workers" in _read(err_path), proc, err_path, 120,
                    "no restart")
        evicted = _preempted_steps(_read(err_path))
        assert len(evicted) == 2 and evicted[0] == evicted[1], _read(err_path)[-3000:]
        assert "worker 1 exited with status 143" in _read(err_path)
        assert evicted[0] in checkpointing.saved_steps(model_dir)
        # The restarted group resumes: a checkpoint after the evicted step.
        _wait_until(lambda: checkpointing.saved_steps(model_dir)[-1] > evicted[0], proc,
                    err_path, 150, "no checkpoint after the restart")
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        proc.wait(timeout=GRACE_S + 20)
        seconds = time.monotonic() - sent
    finally:
        proc.kill()
    err = _read(err_path)
    assert proc.returncode == PREEMPTED_EXIT, err[-3000:]
    assert seconds < GRACE_S + 5
    steps = _preempted_steps(err)[2:]
    assert len(steps) == 2 and steps[0] == steps[1] > evicted[0], err[-3000:]
    saved = checkpointing.saved_steps(model_dir)
    assert steps[0] in saved and saved == sorted(set(saved)), saved
    _finish(command, model_dir, steps=total)


def _mount_tmpfs(path, size_bytes):
    os.makedirs(path, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs",
                             str(path)], capture_output=True, text=True)
    if result.returncode:
        pytest.skip(f"cannot mount a small tmpfs here ({result.stderr.strip()})")


@pytest.mark.timeout(300)
def test_full_disk_mid_run_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, data_dir,
                                                                         preempted_default):
    """--model_dir fills up: the run ends with one fault line naming the step
    that could not be saved; the previous checkpoint is intact and readable."""
    import tensorflow as tf

    # The model flags of _args: preempted_default's checkpoints size the disk.
    _, probe_dir, _, _ = preempted_default
    args = ["--strategy=default", "--model=mlp", "--model_width=32",
            "--global_batch_size=32", "--steps_per_loop=10", "--checkpoint_every=10",
            "--keep_checkpoints=100", "--shuffle_buffer=1000", f"--data_dir={data_dir}",
            *NO_XLA]
    # A checkpoint: the model's files and the input position saved beside them.
    first = checkpointing.saved_steps(probe_dir)[0]
    size = sum(os.path.getsize(p) for p in
               (Path(probe_dir) / "checkpoints").rglob(f"ckpt-{first}.*"))
    assert size > 0
    model_dir = tmp_path / "small"
    _mount_tmpfs(model_dir, int(2.6 * size) + 64 * 1024)   # two checkpoints and the logs
    try:
        result = subprocess.run([TRAIN, *args, "--train_steps=200", f"--model_dir={model_dir}"],
                                cwd=REPO, env=ENV, capture_output=True, text=True, timeout=200)
        assert result.returncode == 1, result.stderr[-3000:]
        faults = [l for l in result.stderr.splitlines() if l.startswith("tfdist-train: fault:")]
        assert len(faults) == 1, result.stderr[-3000:]
        assert "cannot save the checkpoint of step" in faults[0] and "is intact" in faults[0]
        saved = checkpointing.saved_steps(str(model_dir))
        assert saved and saved == sorted(saved)
        latest = tf.train.latest_checkpoint(checkpointing.checkpoint_dir(str(model_dir)))
        assert f"ckpt-{saved[-1]}" in faults[0]
        reader = tf.train.load_checkpoint(latest)
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)   # complete, not half-written
    finally:   # lazily, so a straggling handle cannot leave the mount behind
        subprocess.run(["umount", "-l", str(model_dir)], capture_output=True)


@pytest.mark.timeout(300)
def test_worker_killed_by_the_oom_killer_is_named_with_what_to_change(tmp_path, data_dir):
    """A worker whose batch exceeds its memory cgroup's limit: the kernel kills
    it (SIGKILL) and tfdist-launch says so in one line, with the batch and
    what would use less memory."""
    cgroup = f"/sys/fs/cgroup/memory/tfdist-oom-{os.getpid()}"
    try:
        os.makedirs(cgroup)
        with open(f"{cgroup}/memory.limit_in_bytes", "w") as f:
            f.write(str(1200 * 2**20))
    except OSError as error:
        pytest.skip(f"no cgroup v1 memory controller to limit a worker here ({error})")
    try:
        train = " ".join([TRAIN, "--strategy=default", "--model=mlp", "--model_width=4096",
                          "--model_depth=2", "--global_batch_size=12000", "--train_steps=3",
                          "--steps_per_loop=1", *NO_XLA, f"--data_dir={data_dir}"])
        result = subprocess.run(
            [LAUNCH, "--workers=1", "--", "sh", "-c",
             f"echo $$ > {cgroup}/cgroup.procs && exec {train}"],
            cwd=REPO, env=ENV, capture_output=True, text=True, timeout=240)
    finally:
        os.rmdir(cgroup)
    assert result.returncode == 1, result.stderr[-3000:]
    [line] = [l for l in result.stderr.splitlines() if l.startswith("tfdist-launch: failed:")]
    assert "worker 0 was killed by signal SIGKILL: out of memory" in line, line
    assert "global batch 12000 = 1 replica(s) x 12000" in line
    assert "--accum_steps" in line and "--recompute" in line and "OOM killer" in line
