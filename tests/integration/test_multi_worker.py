"""multi_worker on real localhost clusters started by tfdist-launch."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tfdist import checkpointing, cluster, models
from tfdist.errors import UsageError

from common import IMAGE_SPEC, assert_weights_close, mw_config, train_from
from conftest import BIN, REPO, free_ports, run_cli, run_clis

pytestmark = pytest.mark.integration
LAUNCH = os.path.join(BIN, "tfdist-launch")
TRAIN = os.path.join(BIN, "tfdist-train")


def _launch(args, command, timeout):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.Popen([LAUNCH, *args, "--", *command], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _children(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def run_workers(launcher_args, tmp_path, engine, steps=10, **train):
    """Train `steps` on 2 processes under strategy `engine` (TrainConfig fields
    `train` overridden; `strategy={...}` overrides StrategyConfig fields);
    return each worker's final weights and the initial ones."""
    model = dataclasses.replace(mw_config(engine).model, **train.get("model", {}))
    initial = models.build(model, IMAGE_SPEC).get_weights()
    np.savez(tmp_path / "initial.npz", *initial)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run([*launcher_args, sys.executable, "tests/mw_worker.py", str(tmp_path),
                             engine, str(steps), json.dumps(train)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    return [list(np.load(tmp_path / f"weights-{i}.npz").values()) for i in (0, 1)], initial


def assert_match_single_device(workers, initial, steps=10, single=None):
    """`single`: the weights of the same run on 1 device, if already computed."""
    for a, b in zip(*workers):
        np.testing.assert_array_equal(a, b)  # the processes are identical, bit for bit
    if single is None:   # same global batches, 1 device
        single = train_from(mw_config("default", steps), initial).model.get_weights()
    assert max(np.abs(w - i).max() for w, i in zip(workers[0], initial)) > 1e-3
    assert_weights_close(workers[0], single, rtol=1e-4, atol=1e-6)


# Every run below on one 2-worker cluster: each worker process makes them in
# turn (tests/mw_worker.py with a list), so the cluster's TensorFlow start-up
# (seconds per process) is paid once, not once per run. Each run builds its
# own strategy, model and optimizer from scratch, as in a fresh process.
# The exact-resume runs (the input position, not the step's arithmetic; all
# three at the same setting): no XLA compile per run.
SHUFFLED = dict(data={"shuffle_buffer": 512}, steps_per_loop=2, checkpoint_every=4,
                jit_compile="off")
CLUSTER_RUNS = {
    # XLA as --jit_compile=auto picks (its default) in "plain" and
    # "every_feature"; the other runs without its compiles (seconds of CPU a run).
    "plain": {"jit_compile": "auto"},
    # 4 micro-batches per update on each of 2 workers == one step on the global batch.
    "accumulating": {"accum_steps": 4},
    # --reduce_bucket_mb: one collective per ~1 kB bucket, issued as the
    # backward pass produces it; the sums are the same.
    "bucketed": {"reduce_bucket_mb": 0.001},
    "batch_norm": {"model": {"name": "cnn", "width": 4, "depth": 1}},
    # The same with the global batch's statistics: one device's run.
    "batch_norm_synced": {"model": {"name": "cnn", "width": 4, "depth": 1},
                          "sync_batchnorm": True},
    "every_feature": {"accum_steps": 2, "grad_compression": "bf16",
                      "precision": "mixed_float16", "jit_compile": "auto"},
    # Compression and local SGD across processes (all-gather, per-worker state):
    # every entry sent, or weights averaged after every SGD step, is plain
    # synchronous training; rank-2 PowerSGD and 5 local steps are not.
    "topk_every_entry": {"grad_compression": "topk", "topk_fraction": 1.0},
    "powersgd": {"grad_compression": "powersgd", "powersgd_rank": 2,
                 "powersgd_min_compression": 0},
    # DGC's warm-up: the count sent changes at steps 2, 4, 6 and 8.
    "topk_warmup": {"grad_compression": "topk", "topk_fraction": 0.01,
                    "compression_warmup_steps": 8},
    "local_every_step": {"sync_every": 1},
    "local_every_5": {"sync_every": 5},
    # check_exact_resume's uninterrupted 12 steps and its first 8 (the resumed
    # 4 run in a fresh cluster: the position must come from the checkpoint).
    "straight": {**SHUFFLED, "train_steps": 12},
    "first": {**SHUFFLED, "train_steps": 8, "model_dir": None},   # model_dir: the fixture's
}


@pytest.fixture(scope="module")
def cluster_runs(tmp_path_factory):
    """CLUSTER_RUNS on one `tfdist-launch --workers=2` cluster: name -> (each
    worker's final weights, the initial weights); "model_dir" -> the "first"
    run's model_dir; "single" -> the 10 steps of "plain" on 1 device."""
    directory = tmp_path_factory.mktemp("cluster_runs")
    model_dir = str(directory / "run")
    initial = models.build(mw_config("multi_worker").model, IMAGE_SPEC).get_weights()
    np.savez(directory / "initial.npz", *initial)
    runs = []
    initials = {}
    for k, (name, overrides) in enumerate(CLUSTER_RUNS.items()):
        overrides = dict(overrides)
        if "model" in overrides:   # another model: its own initial weights
            model = dataclasses.replace(mw_config("multi_worker").model, **overrides["model"])
            os.makedirs(directory / str(k))
            initials[name] = models.build(model, IMAGE_SPEC).get_weights()
            np.savez(directory / str(k) / "initial.npz", *initials[name])
        if "model_dir" in overrides:
            overrides["model_dir"] = model_dir
        runs.append(overrides)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run([LAUNCH, "--workers=2", "--", sys.executable, "tests/mw_worker.py",
                             str(directory), "multi_worker", "10", json.dumps(runs)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=230)
    assert result.returncode == 0, result.stderr[-3000:]
    found = {"model_dir": model_dir}
    for k, name in enumerate(CLUSTER_RUNS):
        found[name] = ([list(np.load(directory / str(k) / f"weights-{i}.npz").values())
                        for i in (0, 1)], initials.get(name, initial))
    found["single"] = train_from(mw_config("default", 10), initial).model.get_weights()
    return found


@pytest.mark.timeout(240)
def test_two_workers_match_single_process(cluster_runs):
    workers, initial = cluster_runs["plain"]
    assert_match_single_device(workers, initial, single=cluster_runs["single"])


@pytest.mark.timeout(240)
def test_two_workers_accumulating_match_one_big_batch(cluster_runs):
    """4 micro-batches per update on each of 2 workers == one step on the global batch."""
    workers, initial = cluster_runs["accumulating"]
    assert_match_single_device(workers, initial, single=cluster_runs["single"])


@pytest.mark.timeout(240)
def test_two_workers_with_bucketed_reductions_match_single_process(cluster_runs):
    """--reduce_bucket_mb: one collective per ~1 kB bucket, issued as the
    backward pass produces it; the sums are the same."""
    workers, initial = cluster_runs["bucketed"]
    assert_match_single_device(workers, initial, single=cluster_runs["single"])


@pytest.mark.timeout(240)
def test_batch_norm_statistics_are_averaged_across_workers(cluster_runs):
    """The cnn's BatchNorm moving statistics (one copy per worker) are
    averaged over workers once per loop: the workers end bit-identical."""
    workers, initial = cluster_runs["batch_norm"]
    for a, b in zip(*workers):
        np.testing.assert_array_equal(a, b)
    moved = [np.abs(w - i).max() for w, i in zip(workers[0], initial)]
    assert min(moved) > 0   # every weight and statistic was trained or updated


@pytest.mark.timeout(240)
def test_synchronised_batch_norm_across_workers_matches_one_device(cluster_runs):
    """--sync_batchnorm across 2 processes: the cnn's weights and moving
    statistics match one device on the global batch (the moments' sums are
    all-reduced in the forward pass; tolerance: test_equivalence's
    SYNC_TOLERANCE, whose reasoning holds here, at twice the steps); the
    control: per-worker statistics differ by far more."""
    workers, initial = cluster_runs["batch_norm_synced"]
    for a, b in zip(*workers):
        np.testing.assert_array_equal(a, b)
    config = mw_config("default", 10)
    config = config.replace(model=dataclasses.replace(config.model, name="cnn", width=4,
                                                      depth=1))
    one = train_from(config, initial).model.get_weights()
    for index, (a, b) in enumerate(zip(workers[0], one)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"variable {index}")
    local, local_initial = cluster_runs["batch_norm"]
    local_one = train_from(config, local_initial).model.get_weights()
    assert max(np.abs(a - b).max() for a, b in zip(local[0], local_one)) > 10 * max(
        1e-6 + 1e-5 * np.abs(b).max() for b in local_one)


@pytest.mark.timeout(240)
def test_every_feature_at_once_keeps_workers_identical(cluster_runs):
    """The feature matrix's multi-process corner: mixed precision with loss
    scaling, accumulation, compression together; the workers must agree."""
    workers, initial = cluster_runs["every_feature"]
    for a, b in zip(*workers):
        np.testing.assert_array_equal(a, b)
    assert all(np.isfinite(w).all() for w in workers[0])
    assert any(not np.array_equal(w, i) for w, i in zip(workers[0], initial))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["topk_every_entry", "local_every_step"])
def test_two_workers_top_k_of_every_entry_and_local_sgd_every_step_match_single_process(
        cluster_runs, name):
    workers, initial = cluster_runs[name]
    assert_match_single_device(workers, initial, single=cluster_runs["single"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["powersgd", "topk_warmup", "local_every_5"])
def test_two_workers_compressed_or_local_agree_and_differ_from_plain(cluster_runs, name):
    """Rank-2 PowerSGD (both workers get the same approximate sum) and local
    SGD averaged every 5 steps (the run ends on an average): the workers end
    identical, and away from plain training (the control: they do compress
    or step locally)."""
    workers, initial = cluster_runs[name]
    for a, b in zip(*workers):
        np.testing.assert_array_equal(a, b)
    assert max(np.abs(w - s).max() for w, s in zip(workers[0], cluster_runs["single"])) > 1e-4


def _long_run(model_dir, data_dir, extra=()):
    return [TRAIN, "--strategy=multi_worker", "--model=mlp", "--model_width=32",
            "--global_batch_size=32", "--steps_per_loop=10", "--checkpoint_every=20",
            "--keep_checkpoints=100", f"--data_dir={data_dir}", f"--model_dir={model_dir}",
            "--collective_timeout_s=20",
            # Each input position saved holds the shuffle buffer: 1000 examples
            # (7 MB) instead of the default 10000 (70 MB) at every checkpoint.
            "--shuffle_buffer=1000",
            # A kill and a restart are about processes and checkpoints, not
            # the step's arithmetic: no XLA compile (seconds of CPU a process;
            # the equivalence runs above keep --jit_compile=auto).
            "--jit_compile=off", *extra]


def _wait_for_checkpoint(model_dir, proc, deadline_s=150):
    deadline = time.monotonic() + deadline_s
    while not checkpointing.saved_steps(model_dir):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.2)


# The kill lands at the first checkpoint (step 20); 4 more checkpoints after
# the restart show none is lost or repeated (each save costs ~1 s loaded).
RESTART_STEPS = 100


def _read(path):
    with open(path) as f:
        return f.read()


@pytest.mark.timeout(400)
def test_killed_worker_stops_everything_and_a_restart_resumes_and_finishes_exactly(
        tmp_path, data_dir):
    """One launch, --max_restarts=1: worker 1 is killed after the first
    checkpoint; every worker of that attempt is stopped within the collective
    timeout and the launcher names the killed one; the restarted group resumes
    and finishes exactly, no checkpoint step lost or repeated."""
    model_dir = str(tmp_path / "run")
    out_path, err_path = tmp_path / "launch.out", tmp_path / "launch.err"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen([LAUNCH, "--workers=2", "--max_restarts=1", "--",
                                 *_long_run(model_dir, data_dir,
                                            [f"--train_steps={RESTART_STEPS}"])],
                                cwd=REPO, env=env, stdout=out, stderr=err, text=True)
    try:
        deadline = time.monotonic() + 150
        while not checkpointing.saved_steps(model_dir):
            assert proc.poll() is None, _read(err_path)[-3000:]
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.1)
        workers = sorted(_children(proc.pid))
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGKILL)
        killed_at = time.monotonic()
        # The launcher logs the restart once every worker of the attempt is gone.
        while "restarting all workers (restart 1 of 1)" not in _read(err_path):
            assert proc.poll() is None, _read(err_path)[-3000:]
            # collective_timeout_s + margin (a hang fails the test)
            assert time.monotonic() - killed_at < 20 + 10, _read(err_path)[-3000:]
            time.sleep(0.1)
        for pid in workers:
            assert not os.path.exists(f"/proc/{pid}") or \
                open(f"/proc/{pid}/stat").read().split()[2] == "Z"
        proc.wait(timeout=350)
    finally:
        proc.kill()
    out, err = _read(out_path), _read(err_path)
    assert "worker 1 was killed by signal SIGKILL" in err, err[-3000:]
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads([l for l in out.splitlines() if l.startswith("[worker 0] {")][-1]
                         .split(" ", 2)[2])
    assert summary["steps"] == RESTART_STEPS and summary["workers"] == 2
    # none lost or repeated
    assert checkpointing.saved_steps(model_dir) == list(range(20, RESTART_STEPS + 1, 20))
    assert sorted(os.listdir(model_dir)) == ["checkpoints", "run.cfg", "run.json", "summary.json",
                                           "tensorboard"]


def _workers_train(launcher, engine, out_dir, initial, steps, **train):
    """2 processes under `launcher` from `initial`; worker 0's final weights."""
    os.makedirs(out_dir, exist_ok=True)
    np.savez(os.path.join(out_dir, "initial.npz"), *initial)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run([*launcher, sys.executable, "tests/mw_worker.py", out_dir, engine,
                             str(steps), json.dumps(train)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    return list(np.load(os.path.join(out_dir, "weights-0.npz")).values()), result.stderr


def check_exact_resume(launcher, engine, tmp_path):
    """The global order's position (examples read) is saved with every
    checkpoint, so 12 steps stopped at 8 and resumed equal 12 straight steps (shuffled
    data, fixed seed). Same engine, same reduction order: 1e-6 is the issue's
    bound; a batch read in another order would move the weights far more."""
    initial = models.build(mw_config(engine).model, IMAGE_SPEC).get_weights()
    shuffled = dict(data={"shuffle_buffer": 512}, steps_per_loop=2, checkpoint_every=4)
    straight, _ = _workers_train(launcher, engine, str(tmp_path / "straight"), initial, 12,
                                 **shuffled)
    model_dir = str(tmp_path / "run")
    _workers_train(launcher, engine, str(tmp_path / "first"), initial, 8, model_dir=model_dir,
                   **shuffled)
    positions = sorted(os.listdir(os.path.join(checkpointing.checkpoint_dir(model_dir), "input")))
    assert len(positions) == 1 and positions[0].startswith("global-"), positions
    resumed, err = _workers_train(launcher, engine, str(tmp_path / "resumed"), initial, 12,
                                  model_dir=model_dir, **shuffled)
    assert "fresh permutation" not in err
    assert_weights_close(resumed, straight, rtol=0, atol=1e-6)
    assert max(np.abs(w - i).max() for w, i in zip(straight, initial)) > 1e-3


@pytest.mark.timeout(400)
def test_resumed_workers_read_exactly_the_batches_of_an_uninterrupted_run(cluster_runs, tmp_path):
    """check_exact_resume, its uninterrupted 12 steps and its first 8 made on
    the module's cluster (cluster_runs), the resumed 4 by a fresh cluster."""
    (straight, _), initial = cluster_runs["straight"]
    model_dir = cluster_runs["model_dir"]
    # One position for the cluster: the global order's examples read.
    positions = sorted(os.listdir(os.path.join(checkpointing.checkpoint_dir(model_dir), "input")))
    assert len(positions) == 1 and positions[0].startswith("global-"), positions
    resumed, err = _workers_train([LAUNCH, "--workers=2", "--"], "multi_worker",
                                  str(tmp_path / "resumed"), initial, 12, model_dir=model_dir,
                                  **SHUFFLED)
    assert "fresh permutation" not in err
    assert_weights_close(resumed, straight, rtol=0, atol=1e-6)
    assert max(np.abs(w - i).max() for w, i in zip(straight, initial)) > 1e-3


@pytest.mark.timeout(240)
def test_two_shuffled_workers_read_the_global_batches_of_one_device(cluster_runs):
    """The one global order: with shuffling on, 2 workers train on the global
    batches one device reads from the same seed (the weights agree to the
    all-reduce's rounding, as `plain`); the control: another order (another
    seed, the same initial weights) ends elsewhere."""
    workers, initial = cluster_runs["straight"]
    train = {k: v for k, v in SHUFFLED.items() if k != "data"}

    def single(**more):
        config = mw_config("default", 12, **train, **more)
        config = config.replace(data=config.data.replace(**SHUFFLED["data"]))
        return train_from(config, initial).model.get_weights()

    assert_match_single_device(workers, initial, single=single())
    other = single(seed=mw_config("default").train.seed + 1)
    assert max(np.abs(a - b).max() for a, b in zip(other, workers[0])) > 1e-3


@pytest.mark.timeout(240)
def test_a_two_worker_checkpoint_resumes_on_one_device(cluster_runs, tmp_path):
    """Another engine and size: the cluster's checkpoint at step 8 (2 workers)
    resumed by one device to step 12 ends where the cluster's uninterrupted
    12 steps end (to the all-reduce's rounding), reading the same batches."""
    import glob
    import re
    import shutil
    workers, initial = cluster_runs["straight"]
    model_dir = str(tmp_path / "run")
    shutil.copytree(cluster_runs["model_dir"], model_dir)
    # The cluster's run may have been resumed to 12 already (the test above):
    # keep its checkpoints up to step 8 only.
    directory = checkpointing.checkpoint_dir(model_dir)
    for path in glob.glob(os.path.join(directory, "ckpt-*")):
        if int(re.match(r"ckpt-(\d+)", os.path.basename(path)).group(1)) > 8:
            os.remove(path)
    os.remove(os.path.join(directory, "checkpoint"))
    train = {k: v for k, v in SHUFFLED.items() if k != "data"}
    config = mw_config("default", 12, **{**train, "model_dir": model_dir})
    config = config.replace(data=config.data.replace(**SHUFFLED["data"]))
    resumed = train_from(config, initial)
    assert resumed.summary["steps"] == 12
    assert_weights_close(resumed.model.get_weights(), workers[0], rtol=1e-4, atol=1e-6)


BAD_TF_CONFIGS = [
    ("{not json", "TF_CONFIG: not valid JSON"),
    ('{"task": {"type": "worker", "index": 0}}', "TF_CONFIG: missing or empty 'cluster'"),
    ('{"cluster": {"worker": ["localhost:1234"]}}', "TF_CONFIG: missing 'task'"),
    ('{"cluster": {"ps": ["localhost:1234"]}, "task": {"type": "ps", "index": 0}}',
     "TF_CONFIG: cluster has task type 'ps'; valid: chief, worker"),
    ('{"cluster": {"worker": ["localhost:1234"]}, "task": {"type": "worker", "index": 3}}',
     "TF_CONFIG: task.index=3 is out of range for 1 worker task(s) (valid: 0-0)"),
    ('{"cluster": {"worker": ["localhost:1234", "localhost:1234"]}, '
     '"task": {"type": "worker", "index": 0}}',
     "TF_CONFIG: address localhost:1234 appears more than once"),
    ('{"cluster": {"worker": ["localhost:99999"]}, "task": {"type": "worker", "index": 0}}',
     "is not host:port with a port in 1-65535"),
    ('{"cluster": {"worker": ["192.0.2.10:1234", "localhost:1235"]}, '
     '"task": {"type": "worker", "index": 0}}',
     "this task's address 192.0.2.10:1234 (worker 0) is not an address of this machine"),
]


@pytest.mark.parametrize("text,message", BAD_TF_CONFIGS)
def test_bad_tf_config_is_rejected(text, message):
    with pytest.raises(UsageError, match=None) as caught:
        cluster.parse_tf_config(text)
    assert message in str(caught.value)


def test_bad_tf_config_exits_2_without_waiting(tmp_path):
    cases = BAD_TF_CONFIGS[::3]
    args = ["--strategy=multi_worker", "--model=mlp", "--train_steps=1"]
    results = run_clis([args] * len(cases), envs=[{"TF_CONFIG": t} for t, _ in cases],
                       timeout=90)
    for (text, message), result in zip(cases, results):
        assert result.returncode == 2, result.stderr[-2000:]
        errors = [l for l in result.stderr.splitlines() if "error:" in l]
        assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]


def test_the_cluster_is_checked_before_tensorflow_without_touching_the_environment(
        monkeypatch):
    """tfdist-train's early check (tests above: a bad TF_CONFIG exits 2) reads
    the same sources as the engine, but writes TF_CONFIG only into a copy."""
    from tfdist import strategies
    from tfdist.config import StrategyConfig
    monkeypatch.delenv("TF_CONFIG", raising=False)
    hosts = dict(worker_hosts=("localhost:2001", "localhost:2002"))
    strategies.check_cluster(StrategyConfig(name="multi_worker", task_index=1, **hosts))
    assert "TF_CONFIG" not in os.environ
    with pytest.raises(UsageError, match="--task_index=2 is out of range"):
        strategies.check_cluster(StrategyConfig(name="dtensor", task_index=2, **hosts))
    with pytest.raises(UsageError, match="--strategy=multi_worker needs a cluster"):
        strategies.check_cluster(StrategyConfig(name="multi_worker"))
    strategies.check_cluster(StrategyConfig(name="dtensor"))   # one process: no cluster needed
    with pytest.raises(UsageError, match="--strategy=parameter_server needs a cluster"):
        strategies.check_cluster(StrategyConfig(name="parameter_server"))


def test_worker_hosts_writes_tf_config():
    environ = {}
    spec = cluster.resolve(("localhost:2001", "localhost:2002"), 1, environ=environ)
    assert json.loads(environ["TF_CONFIG"])["task"] == {"type": "worker", "index": 1}
    assert spec.num_workers == 2 and spec.worker_index == 1 and not spec.is_chief
    with pytest.raises(UsageError, match="--task_index=2 is out of range"):
        cluster.resolve(("localhost:2001", "localhost:2002"), 2, environ={})
    with pytest.raises(UsageError, match="needs --task_index"):
        cluster.resolve(("localhost:2001",), None, environ={})


def _child_catching_sigterm(pid: int, script: str) -> bool:
    """Whether process `pid` has a child whose command line names `script` and
    which has a SIGTERM handler installed (/proc/PID/status SigCgt)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    command = f.read()
                with open(f"/proc/{entry}/status") as f:
                    caught = int(next(line for line in f if line.startswith("SigCgt:"))
                                 .split()[1], 16)
            except (OSError, IndexError, ValueError, StopIteration):
                continue
            if ppid == pid and script.encode() in command and caught >> (signal.SIGTERM - 1) & 1:
                return True
    return False


@pytest.mark.timeout(120)
def test_sigterm_while_the_cluster_forms_stops_the_worker_at_once():
    """SIGTERM to the worker's process group (a launcher, Kubernetes, Slurm)
    while TensorFlow waits for a peer that never starts, holding the GIL and
    swallowing SIGTERM: the worker ends at once with one line, long before
    --collective_timeout_s. (The control is history: the signal used to end
    only the deadline's process, and the worker waited with no deadline.)"""
    mine, peer = free_ports(2)
    tf_config = json.dumps({"cluster": {"worker": [f"localhost:{mine}", f"localhost:{peer}"]},
                            "task": {"type": "worker", "index": 0}})
    proc = subprocess.Popen(
        [os.path.join(BIN, "tfdist-train"), "--strategy=multi_worker", "--model=mlp",
         "--train_steps=1", "--collective_timeout_s=100"], cwd=REPO, text=True,
        env={**os.environ, "TF_CONFIG": tf_config, "TF_CPP_MIN_LOG_LEVEL": "2"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        waited = time.monotonic() + 60
        while not _child_catching_sigterm(proc.pid, "watchdog.py"):   # the guarded wait
            assert proc.poll() is None and time.monotonic() < waited
            time.sleep(0.05)
        signalled = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert time.monotonic() - signalled < 20, err[-2000:]
    assert proc.returncode != 0
    assert "stopped by SIGTERM while TensorFlow waited for the cluster" in err, err[-2000:]


@pytest.mark.timeout(120)
def test_peer_that_never_starts_fails_within_timeout(tmp_path):
    mine, peer = free_ports(2)   # not fixed: another test's cluster may run meanwhile
    tf_config = json.dumps({"cluster": {"worker": [f"localhost:{mine}", f"localhost:{peer}"]},
                            "task": {"type": "worker", "index": 0}})
    started = time.monotonic()
    result = run_cli(["--strategy=multi_worker", "--model=mlp", "--train_steps=1",
                      "--collective_timeout_s=8"], env={"TF_CONFIG": tf_config}, timeout=90)
    assert result.returncode != 0
    assert time.monotonic() - started < 8 + 30
    assert ("the cluster did not form within --collective_timeout_s=8s; unreachable: "
            f"worker 1 (localhost:{peer})") in result.stderr
