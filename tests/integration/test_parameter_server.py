"""parameter_server: chief + workers + parameter servers on localhost, started
by `tfdist-launch --ps=P` (a hard time limit each; a cluster shared by the
assertions it can serve), plus the
cluster-spec checks, which need no cluster."""

import json
import os
import re
import signal
import subprocess
import threading
import time

import pytest

from tfdist import checkpointing, cluster
from tfdist.errors import UsageError

from conftest import BIN, REPO, run_clis

pytestmark = pytest.mark.integration
LAUNCH = os.path.join(BIN, "tfdist-launch")
TRAIN = os.path.join(BIN, "tfdist-train")
DEMO = os.path.join(REPO, "configs", "demo.cfg")


class Cluster:
    """`tfdist-launch --workers=W --ps=P -- tfdist-train ARGS`, its output read
    line by line in the background (so a test can wait for a line)."""

    def __init__(self, args, *, workers=2, ps=1, launcher=()):
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
        self.proc = subprocess.Popen(
            [LAUNCH, f"--workers={workers}", f"--ps={ps}", "--grace_s=10", *launcher, "--", TRAIN,
             *args,
             "--strategy=parameter_server"],   # last: after any --flagfile
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        self.out, self.err = [], []
        self._readers = [threading.Thread(target=self._read, args=(pipe, lines), daemon=True)
                         for pipe, lines in ((self.proc.stdout, self.out),
                                             (self.proc.stderr, self.err))]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(pipe, lines):
        for line in pipe:
            lines.append(line.rstrip("\n"))

    def wait_for(self, text, timeout, count=1):
        """Wait until `count` lines of stderr contain `text`."""
        deadline = time.monotonic() + timeout
        while sum(text in line for line in self.err) < count:
            assert self.proc.poll() is None, self.stderr()
            assert time.monotonic() < deadline, f"no {text!r} within {timeout}s\n{self.stderr()}"
            time.sleep(0.2)

    def task_pid(self, task_type, index):
        """The pid of the tfdist-train process of one task (by its TF_CONFIG)."""
        children = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True,
                                  text=True).stdout.split()
        for pid in map(int, children):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    environ = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
            except OSError:
                continue
            task = json.loads(environ.get(b"TF_CONFIG", b"{}")).get("task")
            if task == {"type": task_type, "index": index}:
                return pid
        raise AssertionError(f"no {task_type} {index} among {children}")

    def finish(self, timeout):
        """Wait for the launcher; every process must be gone by then."""
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for reader in self._readers:
            reader.join(5)
        return self.proc.returncode

    def summary(self):
        line = [l for l in self.out if l.startswith("[chief 0] {")][-1]
        return json.loads(line.split(" ", 2)[2])

    def stderr(self):
        return "\n".join(self.err[-60:])


def _no_strays(pids):
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or \
            open(f"/proc/{pid}/stat").read().split()[2] == "Z", f"process {pid} is still running"


# -- cluster specs (no cluster needed) -------------------------------------------
_PS_CLUSTER = {"chief": ["localhost:2000"], "worker": ["localhost:2001", "localhost:2002"],
               "ps": ["localhost:2003"]}
BAD_SPECS = [
    ({"chief": ["localhost:2000"], "worker": ["localhost:2001"]}, ("chief", 0),
     "needs at least a parameter server ('ps' task), the cluster has none"),
    ({"worker": ["localhost:2001"], "ps": ["localhost:2003"]}, ("worker", 0),
     "needs exactly one chief task (the coordinator), the cluster has 0"),
    (_PS_CLUSTER, ("ps", 1), "task.index=1 is out of range for 1 ps task(s) (valid: 0-0)"),
    ({**_PS_CLUSTER, "evaluator": ["localhost:2004"]}, ("chief", 0),
     "cluster has task type 'evaluator'; valid: chief, worker, ps"),
]


@pytest.mark.parametrize("spec,task,message", BAD_SPECS)
def test_bad_cluster_spec_is_rejected(spec, task, message):
    text = json.dumps({"cluster": spec, "task": {"type": task[0], "index": task[1]}})
    with pytest.raises(UsageError) as caught:
        cluster.parse_ps_tf_config(text)
    assert message in str(caught.value)


def test_host_lists_write_tf_config():
    environ = {}
    hosts = ("localhost:2000", "localhost:2001", "localhost:2002")
    spec = cluster.resolve_ps(hosts, ("localhost:2003",), "worker", 2, environ=environ)
    assert json.loads(environ["TF_CONFIG"]) == {
        "cluster": {"chief": ["localhost:2000"], "worker": ["localhost:2001", "localhost:2002"],
                    "ps": ["localhost:2003"]}, "task": {"type": "worker", "index": 1}}
    assert (spec.task_type, spec.task_index) == ("worker", 1)
    spec = cluster.resolve_ps(hosts, ("localhost:2003",), "worker", 0, environ={})
    assert spec.task_type == "chief"   # worker 0 is the chief (TensorFlow 1's convention)
    with pytest.raises(UsageError, match=r"--task_index=1 is out of range for 1 --ps_hosts"):
        cluster.resolve_ps(hosts, ("localhost:2003",), "ps", 1, environ={})
    with pytest.raises(UsageError, match="needs the chief and at least one worker"):
        cluster.resolve_ps(hosts[:1], ("localhost:2003",), "worker", 0, environ={})
    with pytest.raises(UsageError, match="needs a cluster: set TF_CONFIG"):
        cluster.resolve_ps(environ={})


def test_bad_cluster_specs_exit_2_in_one_line():
    cases = BAD_SPECS[:3]
    args = ["--strategy=parameter_server", "--model=mlp", "--train_steps=1"]
    envs = [{"TF_CONFIG": json.dumps({"cluster": spec, "task": {"type": t, "index": i}})}
            for spec, (t, i), _ in cases]
    # All four at once (each is mostly TensorFlow start-up): one batch, not two.
    results = run_clis([[*args] for _ in cases] + [["--strategy=multi_worker",
                                                   "--ps_hosts=localhost:2003"]],
                       envs=envs + [{}], timeout=90)
    for (_, _, message), result in zip(cases, results):
        assert result.returncode == 2, result.stderr[-2000:]
        errors = [l for l in result.stderr.splitlines() if "error:" in l]
        assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]
    assert results[-1].returncode == 2
    assert "--ps_hosts and --task_type name server tasks, which --strategy=multi_worker " \
        "does not have" in results[-1].stderr


# -- clusters -------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, data_dir):
    """The demo's cnn on 2 workers for 200 steps; worker 1 is SIGKILLed once
    the chief has logged step 100: (the finished Cluster, its model_dir)."""
    model_dir = tmp_path_factory.mktemp("demo") / "run"
    run = Cluster([f"--flagfile={DEMO}", "--train_steps=200", f"--data_dir={data_dir}",
                   f"--model_dir={model_dir}"])
    try:
        run.wait_for("step 100/200", timeout=150)
        os.kill(run.task_pid("worker", 1), signal.SIGKILL)
    finally:
        returncode = run.finish(timeout=130)   # 280 s in all, as before
    assert returncode == 0, run.stderr()
    return run, model_dir


# make slow: an accuracy run (200 cnn steps on 4 processes, ~50 CPU-s). make
# test: the killed-PS test's finished cluster (variables on the server, the
# summary's staleness and steps per worker, the TensorBoard tags) and the
# SIGTERM test's killed worker.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cluster_trains_cnn_to_demo_accuracy_with_variables_on_ps(demo_run):
    """The demo's cnn and accuracy bar (0.90), asynchronously on 2 workers
    (worker 1 killed half-way: worker 0 runs the rest, so more than half of
    the steps); every variable lives on the parameter server; staleness is
    reported."""
    run, model_dir = demo_run
    summary = run.summary()
    assert summary["strategy"] == "parameter_server" and summary["steps"] == 200
    assert summary["workers"] == 2 and summary["parameter_servers"] == 1
    assert summary["accuracy"] >= 0.90, summary
    _assert_variables_on_the_server(summary)
    per_worker = summary["steps_per_worker"]
    assert sum(per_worker.values()) == 200 and per_worker["steps_worker_0"] > 100, per_worker
    assert min(per_worker.values()) > 0, per_worker
    assert 0 <= summary["staleness_mean"] <= summary["staleness_max"] < 200
    assert checkpointing.saved_steps(str(model_dir)) == [200]
    assert any("worker 1 was killed by signal SIGKILL; the chief runs its steps on the other "
               "workers" in line for line in run.err), run.stderr()
    assert (model_dir / "tensorboard").is_dir()
    tags = _tensorboard_tags(model_dir / "tensorboard")
    assert {"staleness_mean", "steps_worker_0", "steps_worker_1"} <= tags, tags


def _assert_variables_on_the_server(summary):
    devices = summary["variable_devices"]
    assert devices and all(d == ["/job:ps/replica:0/task:0/device:CPU:0"]
                           for d in devices.values()), devices


def _tensorboard_tags(directory):
    import tensorflow as tf
    tags = set()
    for root, _, files in os.walk(directory):
        for name in files:
            if "tfevents" in name:
                for event in tf.compat.v1.train.summary_iterator(os.path.join(root, name)):
                    tags.update(value.tag for value in event.summary.value)
    return tags


@pytest.mark.timeout(300)
def test_embedding_is_partitioned_over_two_ps_and_checkpoints_whole(tmp_path, data_dir):
    """The transformer's token embedding (and its AdamW slots) split over 2
    parameter servers by --ps_shard_bytes, trained with accumulation, clipping
    and skip-on-nonfinite; its checkpoint holds whole tensors, which the
    default strategy restores."""
    model_dir = tmp_path / "run"
    common = ["--model=transformer", "--dataset=tfdist_tokens", "--model_width=32",
              "--model_depth=1", "--global_batch_size=32", "--optimizer=adamw",
              f"--data_dir={data_dir}",
              f"--model_dir={model_dir}"]
    run = Cluster([*common, "--train_steps=20", "--steps_per_loop=10", "--ps_shard_bytes=1024",
                   "--accum_steps=2", "--clip_grad_norm=1", "--on_nonfinite=skip"], ps=2)
    assert run.finish(timeout=280) == 0, run.stderr()
    summary = run.summary()
    devices = summary["variable_devices"]
    embedding = [path for path in devices if "embedding" in path and len(devices[path]) == 2]
    assert embedding, devices
    assert sorted(devices[embedding[0]]) == [f"/job:ps/replica:0/task:{i}/device:CPU:0"
                                             for i in (0, 1)]
    assert all(d.startswith("/job:ps/") for ds in devices.values() for d in ds), devices
    # The same run directory resumed by one process: it restores and evaluates.
    resumed = run_clis([["--strategy=default", *common, "--train_steps=20"]], timeout=200)[0]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert again["steps"] == 20
    assert abs(again["test_loss"] - summary["test_loss"]) < 1e-4 * max(1, summary["test_loss"])


@pytest.mark.timeout(400)
def test_killed_ps_ends_every_process_with_one_line_and_max_restarts_finishes_exactly(
        tmp_path, data_dir):
    """One cluster, --max_restarts=2: the parameter server is SIGKILLed after
    the first checkpoint; every process of that attempt ends within 60 s, the
    chief with one fault line naming the server; the restarted cluster resumes
    and finishes at exactly --train_steps, every checkpoint step saved once.
    (Two restarts allowed: once in CI a restarted chief died of SIGSEGV inside
    TensorFlow's coordinator thread, copying a closure's outputs, TF 2.21;
    a crashed process is what the restart policy is for.)"""
    model_dir = tmp_path / "run"
    steps = 150
    run = Cluster(["--model=mlp", "--model_width=64", f"--train_steps={steps}",
                   "--steps_per_loop=50", "--checkpoint_every=50", "--keep_checkpoints=10",
                   f"--data_dir={data_dir}", f"--model_dir={model_dir}"],
                  launcher=["--max_restarts=2"])
    try:
        run.wait_for("saved ", timeout=150)
        pids = [run.task_pid(t, i) for t, i in (("chief", 0), ("worker", 0), ("worker", 1))]
        ps = run.task_pid("ps", 0)
        os.kill(ps, signal.SIGKILL)
        killed_at = time.monotonic()
        # The launcher restarts once every process of the attempt has ended.
        run.wait_for("restarting all workers (restart 1 of 2)", timeout=60)
        assert time.monotonic() - killed_at < 60, run.stderr()
        _no_strays([*pids, ps])
        faults = [line for line in run.err if "tfdist-train: fault:" in line]
        assert len(faults) == 1, run.stderr()
        assert "parameter server ps 0 (localhost:" in faults[0], faults
        assert any("chief 0 exited with status 1" in line for line in run.err), run.stderr()
    finally:
        returncode = run.finish(timeout=180)
    assert returncode == 0, run.stderr()
    assert len([line for line in run.err if "tfdist-train: fault:" in line]) == 1, run.stderr()
    assert checkpointing.saved_steps(str(model_dir)) == list(range(50, steps + 1, 50))
    # The restarted attempt's summary: every variable on the server, the
    # steps it ran (from the checkpoint it restored) spread over both workers,
    # their staleness, and the same figures in TensorBoard.
    summary = run.summary()
    assert summary["strategy"] == "parameter_server" and summary["steps"] == steps
    assert summary["workers"] == 2 and summary["parameter_servers"] == 1
    _assert_variables_on_the_server(summary)
    restored = [int(re.search(r"ckpt-(\d+)", line).group(1)) for line in run.err
                if re.search(r"\brestored \S*ckpt-\d+", line)]
    assert len(restored) == 1 and restored[0] in (50, 100), run.stderr()
    per_worker = summary["steps_per_worker"]
    assert sum(per_worker.values()) == steps - restored[0], per_worker
    assert 0 <= summary["staleness_mean"] <= summary["staleness_max"] < steps
    tags = _tensorboard_tags(model_dir / "tensorboard")
    assert {"staleness_mean", "steps_worker_0", "steps_worker_1"} <= tags, tags


@pytest.mark.timeout(300)
def test_a_killed_worker_is_replaced_by_the_others_and_sigterm_to_the_chief_saves_and_exits_143(
        tmp_path, data_dir):
    """Worker 1 SIGKILLed after the first checkpoint: the launcher names it,
    and the chief runs its steps on worker 0 (a later checkpoint is saved);
    then SIGTERM to the chief: it saves the step it is at and exits 143, and
    every process ends."""
    model_dir = tmp_path / "run"
    run = Cluster(["--model=mlp", "--model_width=64", "--train_steps=100000",
                   "--steps_per_loop=20", "--checkpoint_every=40", f"--data_dir={data_dir}",
                   f"--model_dir={model_dir}"])
    run.wait_for("saved ", timeout=150)
    chief = run.task_pid("chief", 0)
    servers = [run.task_pid(t, i) for t, i in (("worker", 0), ("worker", 1), ("ps", 0))]
    os.kill(servers[1], signal.SIGKILL)
    run.wait_for("worker 1 was killed by signal SIGKILL; the chief runs its steps on the other "
                 "workers", timeout=60)
    saved = sum("saved " in line for line in run.err)
    run.wait_for("saved ", timeout=120, count=saved + 1)   # steps go on, on worker 0
    os.kill(chief, signal.SIGTERM)
    assert run.finish(timeout=120) == 1
    assert any("chief 0 exited with status 143" in line for line in run.err), run.stderr()
    preempted = [line for line in run.err if "preempted (SIGTERM) at step" in line]
    assert preempted, run.stderr()
    step = int(preempted[0].split("at step ")[1].split(":")[0])
    assert step in checkpointing.saved_steps(str(model_dir))
    _no_strays([chief, *servers])


# -- tfdist-launch --ps (tiny Python tasks, no TensorFlow) -----------------------
_TASK = """\
import json, os, sys, time
config = json.loads(os.environ["TF_CONFIG"])
task = config["task"]
print(json.dumps(config), flush=True)
if task["type"] == "chief":
    time.sleep(float(sys.argv[1]))
    sys.exit(0)
if task == {"type": "worker", "index": 1}:
    sys.exit(3)          # a worker that dies early
time.sleep(600)          # a server: serves until stopped
"""


def test_launcher_ps_cluster_follows_the_chief():
    """--ps=P: chief + workers + ps tasks in TF_CONFIG; a dead worker is only
    reported; when the chief ends, the servers are stopped and the status is
    the chief's."""
    started = time.monotonic()
    result = subprocess.run([LAUNCH, "--workers=2", "--ps=2", "--grace_s=5", "--", "python3",
                             "-c", _TASK, "3"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 3 + 10
    configs = {}
    for line in result.stdout.splitlines():
        prefix, _, payload = line.partition("] ")
        configs[prefix.lstrip("[")] = json.loads(payload)
    assert sorted(configs) == ["chief 0", "ps 0", "ps 1", "worker 0", "worker 1"]
    clusters = {json.dumps(c["cluster"], sort_keys=True) for c in configs.values()}
    assert len(clusters) == 1
    spec = configs["chief 0"]["cluster"]
    assert [len(spec[t]) for t in ("chief", "worker", "ps")] == [1, 2, 2]
    assert len({a for addresses in spec.values() for a in addresses}) == 5
    assert ("tfdist-launch: worker 1 exited with status 3; the chief runs its steps on the "
            "other workers") in result.stderr
    failed = subprocess.run([LAUNCH, "--workers=1", "--ps=1", "--", "python3", "-c",
                             "import sys, os, json; t = json.loads(os.environ['TF_CONFIG'])"
                             "['task']; sys.exit(5 if t['type'] == 'chief' else 0) if "
                             "t['type'] == 'chief' else __import__('time').sleep(600)"],
                            capture_output=True, text=True, timeout=60)
    assert failed.returncode == 1
    assert "failed: chief 0 exited with status 5" in failed.stderr, failed.stderr
    bad = subprocess.run([LAUNCH, "--workers=1", "--ps=-1", "--", "true"],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "--ps=-1 must be 0 or more" in bad.stderr
