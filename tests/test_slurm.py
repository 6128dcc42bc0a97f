"""Slurm: each task's cluster from Slurm's variables (tfdist/slurm.py), and
launch/slurm/tfdist.sbatch on a real one-node Slurm (launch/slurm/local_slurm.sh).

The unit tests feed synthetic SLURM_* environments; the integration tests
install and start Debian's Slurm (root only, skipped with the reason if it
cannot be installed) and submit the sbatch script unchanged, only sbatch's
options, the environment and its arguments varying, all jobs at once: a
multi_worker job and a DTensor mesh across 2 processes (2 tasks each, on one
node), a one-task job, and --strategy=horovod without horovodrun.
"""

import importlib.util
import json
import os
import socket
import subprocess
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tfdist import cluster, slurm
from tfdist.errors import UsageError
from tfdist.strategies.horovod import engine as horovod_strategy

from conftest import BIN, REPO, wait_for_horovod_build


def step_env(rank, *, nodes="node[9-10]", tasks_per_node="2(x2)", job=41, step=0, **changes):
    """The SLURM_* variables srun gives task `rank` of a step (block
    distribution); `changes` replace some (None: unset)."""
    counts = slurm.expand_tasks_per_node(tasks_per_node)
    node, local = slurm.block_placement(rank, counts)
    env = {"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": str(step), "SLURM_PROCID": str(rank),
           "SLURM_STEP_NUM_TASKS": str(sum(counts)), "SLURM_NTASKS": str(sum(counts)),
           "SLURM_STEP_NODELIST": nodes, "SLURM_JOB_NODELIST": nodes,
           "SLURM_STEP_TASKS_PER_NODE": tasks_per_node, "SLURM_TASKS_PER_NODE": tasks_per_node,
           "SLURM_NODEID": str(node), "SLURM_LOCALID": str(local), **changes}
    return {name: value for name, value in env.items() if value is not None}


# -- Slurm's notations ------------------------------------------------------------
@pytest.mark.parametrize("text, hosts", [
    ("node[9-10]", ["node9", "node10"]),                        # Slurm's order, not sorted
    ("n[01-03,7],gpu5", ["n01", "n02", "n03", "n7", "gpu5"]),   # zero padding kept
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("vm", ["vm"]),
    ("a[1-2]b,c", ["a1b", "a2b", "c"]),
])
def test_host_lists_expand_in_slurms_order(text, hosts):
    assert slurm.expand_hostlist(text) == hosts


def test_tasks_per_node_expand():
    assert slurm.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert slurm.expand_tasks_per_node("1") == [1]


# -- the cluster every task builds --------------------------------------------------
def test_every_task_builds_the_same_cluster_in_slurms_rank_order():
    """node[9-10], 2 tasks each: ranks 0-1 on node9, 2-3 on node10 (TensorFlow's
    resolver sorts node10 first); each task is the worker SLURM_PROCID says."""
    tasks = [slurm.task_from_environ(step_env(rank)) for rank in range(4)]
    addresses = tasks[0].addresses
    base = tasks[0].port_base
    assert addresses == [f"node9:{base}", f"node9:{base + 1}",
                         f"node10:{base}", f"node10:{base + 1}"]
    for rank, task in enumerate(tasks):
        assert task.addresses == addresses
        config = json.loads(task.tf_config())
        assert config == {"cluster": {"worker": addresses},
                          "task": {"type": "worker", "index": rank}}


def test_uneven_tasks_per_node():
    env = step_env(4, nodes="n[01-03]", tasks_per_node="2(x2),1")
    task = slurm.task_from_environ(env)
    assert [a.rpartition(":")[0] for a in task.addresses] == ["n01", "n01", "n02", "n02", "n03"]
    assert task.address == f"n03:{task.port_base}"


def _ports(job, step=0, rank=0, **changes):
    task = slurm.task_from_environ(step_env(rank, job=job, step=step, **changes))
    return {int(a.rpartition(":")[2]) for a in task.addresses}


def test_two_jobs_on_one_node_get_different_ports():
    assert _ports(41).isdisjoint(_ports(42))
    assert _ports(41, step=0).isdisjoint(_ports(41, step=1))    # two steps of one job
    # No two of 375 consecutive job ids share a window (up to 16 tasks a node).
    windows = {min(_ports(job)) for job in range(1000, 1375)}
    assert len(windows) == 375
    assert all(slurm.PORT_LOW <= port < slurm.PORT_HIGH < 32768 for port in windows)


def test_port_base_can_be_chosen():
    assert _ports(41, TFDIST_SLURM_PORT_BASE="30000") == {30000, 30001}


def test_one_task_is_a_one_worker_cluster():
    task = slurm.task_from_environ(step_env(0, nodes="vm", tasks_per_node="1"))
    assert len(task.addresses) == 1 and task.rank == 0
    # The batch script itself (no srun) of a one-task job: the same.
    batch = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
             "SLURM_JOB_NODELIST": "vm", "SLURM_NODEID": "0"}
    assert slurm.task_from_environ(batch).addresses == [f"vm:{slurm.task_from_environ(batch).port_base}"]
    with pytest.raises(UsageError, match=r"SLURM_NTASKS=2.*start it with srun"):
        slurm.task_from_environ({**batch, "SLURM_NTASKS": "2"})


def test_outside_slurm_there_is_no_slurm_cluster():
    assert slurm.task_from_environ({}) is None
    assert cluster.resolve(environ={}) is None


def test_cyclic_distribution_is_refused_naming_the_variables():
    # Under --distribution=cyclic rank 1 is on node 1, local 0; block puts it on node 0.
    env = step_env(1, SLURM_NODEID="1", SLURM_LOCALID="0", SLURM_DISTRIBUTION="cyclic")
    with pytest.raises(UsageError) as error:
        slurm.task_from_environ(env)
    message = str(error.value)
    assert "\n" not in message
    for part in ("SLURM_PROCID=1", "SLURM_NODEID=1", "SLURM_LOCALID=0",
                 "SLURM_DISTRIBUTION='cyclic'", "--distribution=block"):
        assert part in message


MALFORMED = [
    ({"SLURM_STEP_NODELIST": "node[9-"}, "SLURM_STEP_NODELIST", "never closed"),
    ({"SLURM_STEP_NODELIST": "node]9"}, "SLURM_STEP_NODELIST", "unbalanced"),
    ({"SLURM_STEP_NODELIST": "node[10-9]"}, "SLURM_STEP_NODELIST", "empty"),
    ({"SLURM_STEP_NODELIST": "node[a-b]"}, "SLURM_STEP_NODELIST", "bad range"),
    ({"SLURM_STEP_NODELIST": "node9,,node10"}, "SLURM_STEP_NODELIST", "bad host entry"),
    ({"SLURM_STEP_NODELIST": "node9,node9"}, "SLURM_STEP_NODELIST", "more than once"),
    ({"SLURM_STEP_NODELIST": ""}, "SLURM_STEP_NODELIST", "bad host entry"),
    ({"SLURM_STEP_NODELIST": "node[9-11]"}, "SLURM_STEP_TASKS_PER_NODE", "must match"),
    ({"SLURM_STEP_NODELIST": None, "SLURM_JOB_NODELIST": None}, "SLURM_STEP_NODELIST",
     "is not set"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x)"}, "SLURM_STEP_TASKS_PER_NODE", "bad entry"),
    ({"SLURM_STEP_TASKS_PER_NODE": "0,4"}, "SLURM_STEP_TASKS_PER_NODE", "bad entry"),
    ({"SLURM_STEP_TASKS_PER_NODE": "two"}, "SLURM_STEP_TASKS_PER_NODE", "bad entry"),
    ({"SLURM_STEP_TASKS_PER_NODE": "3,2"}, "SLURM_STEP_NUM_TASKS", "must match"),
    ({"SLURM_STEP_NUM_TASKS": "four"}, "SLURM_STEP_NUM_TASKS", "whole number"),
    ({"SLURM_STEP_NUM_TASKS": "0"}, "SLURM_STEP_NUM_TASKS", "whole number"),
    ({"SLURM_PROCID": "-1"}, "SLURM_PROCID", "whole number"),
    ({"SLURM_PROCID": "4"}, "SLURM_PROCID", "out of range"),
    ({"SLURM_NODEID": "one"}, "SLURM_NODEID", "whole number"),
    ({"SLURM_NODEID": None}, "SLURM_NODEID", "is not set"),
    ({"SLURM_LOCALID": "1.5"}, "SLURM_LOCALID", "whole number"),
    ({"SLURM_JOB_ID": "abc"}, "SLURM_JOB_ID", "whole number"),
    ({"SLURM_STEP_ID": "batch"}, "SLURM_STEP_ID", "whole number"),
    ({"TFDIST_SLURM_PORT_BASE": "http"}, "TFDIST_SLURM_PORT_BASE", "whole number"),
    ({"TFDIST_SLURM_PORT_BASE": "0"}, "TFDIST_SLURM_PORT_BASE", "whole number"),
    ({"TFDIST_SLURM_PORT_BASE": "65535"}, "TFDIST_SLURM_PORT_BASE", "beyond 65535"),
]


@pytest.mark.parametrize("changes, variable, problem", MALFORMED,
                         ids=[f"{v}-{c}" for c, v, _ in MALFORMED])
def test_a_malformed_variable_is_one_line_naming_it(changes, variable, problem):
    with pytest.raises(UsageError) as error:
        slurm.task_from_environ(step_env(1, **changes))
    message = str(error.value)
    assert "\n" not in message and variable in message and problem in message, message


STEP_VARIABLES = sorted(step_env(1)) + ["TFDIST_SLURM_PORT_BASE", "SLURM_DISTRIBUTION"]
SLURM_LIKE = st.text(alphabet="node0123456789[]-,()x \n", max_size=24)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(STEP_VARIABLES), SLURM_LIKE | st.text(max_size=16))
def test_any_value_is_a_cluster_or_one_line_naming_the_variable(variable, value):
    """Fuzzed: whatever one variable holds, the result is a consistent cluster
    or a UsageError on one line that names that variable; never a traceback."""
    try:
        task = slurm.task_from_environ(step_env(1, **{variable: value}))
    except UsageError as error:
        assert "\n" not in str(error) and variable in str(error), str(error)
        return
    assert len(set(task.addresses)) == len(task.addresses) == task.num_tasks
    assert task.address == task.addresses[task.rank]
    assert all(0 < int(a.rpartition(":")[2]) < 65536 for a in task.addresses)


# -- the hook in cluster.resolve ------------------------------------------------------
def _free_port():
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def test_resolve_writes_the_slurm_cluster_to_tf_config():
    port = _free_port()   # rank 1 listens on base + 1
    env = step_env(1, nodes="localhost", tasks_per_node="2", TFDIST_SLURM_PORT_BASE=str(port - 1))
    spec = cluster.resolve(environ=env)
    assert (spec.num_workers, spec.worker_index, spec.address) == (2, 1, f"localhost:{port}")
    assert json.loads(env["TF_CONFIG"])["cluster"]["worker"] == [f"localhost:{port - 1}",
                                                               f"localhost:{port}"]
    # TF_CONFIG, once set (by the user or a launcher), wins over Slurm.
    mine = {"cluster": {"worker": ["localhost:1234"]}, "task": {"type": "worker", "index": 0}}
    assert cluster.resolve(environ={**env, "TF_CONFIG": json.dumps(mine)}).num_workers == 1


def test_a_port_in_use_is_named_before_tensorflow_starts():
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = step_env(0, nodes="localhost", tasks_per_node="2",
                       TFDIST_SLURM_PORT_BASE=str(port))
        with pytest.raises(UsageError, match=rf"port {port} is in use.*TFDIST_SLURM_PORT_BASE"):
            cluster.resolve(environ=env)
    assert "TF_CONFIG" not in env


def test_a_node_name_that_is_not_this_machine_is_named():
    env = step_env(0, nodes="192.0.2.1", tasks_per_node="1")   # TEST-NET-1, never local
    with pytest.raises(UsageError, match=r"node name '192.0.2.1' is not an address of this"):
        cluster.resolve(environ=env)


# -- Horovod under srun without horovodrun --------------------------------------------
class FakeHorovod:
    def __init__(self, *, mpi=False, size=1):
        self.mpi, self._size, self.shut_down = mpi, size, False

    def mpi_built(self):
        return self.mpi

    def size(self):
        return self._size

    def shutdown(self):
        self.shut_down = True


def test_horovod_split_by_srun_is_a_usage_error_naming_horovodrun():
    env = step_env(0, tasks_per_node="1(x2)")
    check = horovod_strategy._check_not_split_by_srun
    with pytest.raises(UsageError) as error:
        check(FakeHorovod(mpi=False), env, initialised=False)   # before hvd.init
    message = str(error.value)
    assert "\n" not in message
    for part in ("SLURM_STEP_NUM_TASKS=2", "horovodrun -np 2 -H node9:1,node10:1",
                 "--strategy=multi_worker"):
        assert part in message
    # With MPI, judged after init by the ranks MPI found.
    check(FakeHorovod(mpi=True), env, initialised=False)
    alone = FakeHorovod(mpi=True, size=1)
    with pytest.raises(UsageError, match="sees 1 rank"):
        check(alone, env, initialised=True)
    assert alone.shut_down
    check(FakeHorovod(mpi=True, size=2), env, initialised=True)


@pytest.mark.parametrize("env", [
    {},                                                        # not Slurm
    step_env(0, nodes="vm", tasks_per_node="1"),               # one task
    {**step_env(0, tasks_per_node="1(x2)"), "HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"},
    {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"},   # the batch script
], ids=["no-slurm", "one-task", "horovodrun", "batch-script"])
def test_horovod_is_left_alone_when_it_is_not_split(env):
    horovod_strategy._check_not_split_by_srun(FakeHorovod(), env, initialised=False)
    horovod_strategy._check_not_split_by_srun(FakeHorovod(), env, initialised=True)


# -- a real one-node Slurm (integration) ------------------------------------------------
LOCAL_SLURM = os.path.join(REPO, "launch", "slurm", "local_slurm.sh")
SBATCH = os.path.join(REPO, "launch", "slurm", "tfdist.sbatch")
JOB_LIMIT_S = 240   # each job's hard limit (Slurm's --time is in whole minutes: 5)
TINY = ["--model=mlp", "--model_width=16", "--model_depth=1", "--dataset=tfdist_shapes",
        "--global_batch_size=32", "--train_steps=6", "--steps_per_loop=3",
        "--checkpoint_every=6", "--log_every=3", "--jit_compile=off",
        "--collective_timeout_s=60"]
# name -> (tfdist-train flags after TINY, tasks). JOBS run tests/slurm_worker.py
# (tfdist-train, then each task saves its weights); the others plain tfdist-train.
JOBS = {"multi_worker": (["--strategy=multi_worker"], 2),
        "dtensor": (["--strategy=dtensor", "--mesh=batch:2,model:2", "--virtual_devices=2"], 2)}
ONE_TASK_JOB = {"one_task": (["--strategy=multi_worker"], 1)}
HOROVOD_JOB = {"horovod": (["--strategy=horovod"], 2)}   # no horovodrun


def _free_port_pair():
    """Ports P and P+1, both free (slurmctld's and slurmd's)."""
    for _ in range(50):
        port = _free_port()
        try:
            with socket.socket() as probe:
                probe.bind(("", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture(scope="module")
def local_slurm(tmp_path_factory):
    """`make slurm`: Slurm installed (skipped with the reason if it cannot be)
    and started in a temporary directory, on free ports; stopped at the end
    however the tests end. Yields the environment for sbatch and scontrol."""
    if os.geteuid() != 0:
        pytest.skip("Slurm test: installing and running slurm-wlm needs root")
    directory = str(tmp_path_factory.mktemp("slurm"))
    env = {**os.environ, "TFDIST_SLURM_DIR": directory,
           "TFDIST_SLURMCTLD_PORT": str(_free_port_pair()),
           "SLURM_CONF": os.path.join(directory, "slurm.conf")}
    installed = subprocess.run([LOCAL_SLURM, "install"], env=env, capture_output=True,
                               text=True, timeout=600)
    if installed.returncode == 2:
        pytest.skip(f"Slurm test: {installed.stderr.strip().splitlines()[-1]}")
    assert installed.returncode == 0, installed.stderr
    try:
        # `make slurm` installs (done: a no-op now) and starts it, polling
        # `sinfo` until the node is idle.
        started = subprocess.run(["make", "--no-print-directory", "-C", REPO, "slurm"], env=env,
                                 capture_output=True, text=True, timeout=120)
        assert started.returncode == 0, started.stdout + started.stderr
        state = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=env, capture_output=True,
                               text=True, timeout=30).stdout.split()
        assert state == ["idle"], state
        yield env
    finally:
        subprocess.run([LOCAL_SLURM, "stop"], env=env, timeout=60)


def _submit(env, name, spec, tmp_path, data_dir):
    """sbatch the unchanged script: `spec` = (tfdist-train flags, given as its
    arguments, number of tasks, all on the one node)."""
    flags, tasks = spec
    out = tmp_path / name
    out.mkdir()
    exports = {"TFDIST_VENV": os.path.dirname(BIN), "TFDIST_MODEL_DIR": str(out / "run"),
               "TFDIST_SLURM_TEST_OUT": str(out), "TF_CPP_MIN_LOG_LEVEL": "2"}
    if name in JOBS:
        exports["TFDIST_TRAIN"] = "python tests/slurm_worker.py"
    command = ["sbatch", "--parsable", "--nodes=1", f"--ntasks={tasks}",
               f"--ntasks-per-node={tasks}",
               "--cpus-per-task=1", f"--time={JOB_LIMIT_S // 60 + 1}", f"--job-name=tfdist-{name}",
               f"--chdir={REPO}", f"--output={out}/tfdist-%j.out",
               "--export=ALL," + ",".join(f"{k}={v}" for k, v in exports.items()),
               SBATCH, *TINY, f"--data_dir={data_dir}", *flags]
    submitted = subprocess.run(command, env={k: v for k, v in env.items() if k != "TFDIST_TRAIN"},
                               capture_output=True, text=True, timeout=30)
    assert submitted.returncode == 0, submitted.stderr
    return submitted.stdout.strip().split(";")[0], out


def _job_state(env, job):
    """(JobState, ExitCode) of a job, from `scontrol show job` (kept 300 s after it ends)."""
    text = subprocess.run(["scontrol", "-o", "show", "job", job], env=env, capture_output=True,
                          text=True, timeout=30).stdout
    fields = dict(item.split("=", 1) for item in text.split() if "=" in item)
    return fields.get("JobState"), fields.get("ExitCode")


def run_jobs(env, specs, tmp_path, data_dir):
    """Submit every job of `specs` (name -> (flags, tasks)) at once; wait for them within
    their time limit, polling scontrol (`sbatch --wait` polls at 2, 10 and 42 s).
    name -> dict(job, state, exit_code, out_dir, output: the job's output file)."""
    submitted = {name: _submit(env, name, spec, tmp_path, data_dir)
                 for name, spec in specs.items()}
    deadline = time.monotonic() + JOB_LIMIT_S + 30
    states = {}
    while len(states) < len(submitted):
        assert time.monotonic() < deadline, f"the jobs did not end: {submitted}"
        for name, (job, _) in submitted.items():
            state, code = _job_state(env, job)
            if state not in (None, "PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
                states[name] = (state, code)
        time.sleep(0.25)
    jobs = {}
    for name, (job, out) in submitted.items():
        path = out / f"tfdist-{job}.out"
        jobs[name] = {"job": job, "state": states[name][0], "exit_code": states[name][1],
                      "out_dir": out, "output": path.read_text() if path.exists() else ""}
    return jobs


def _horovod_ready() -> bool:
    """Horovod is installed now (under `make test`: its build, beside the suite, ended well)."""
    status = os.environ.get("TFDIST_HOROVOD_BUILD_STATUS")
    if status and not os.path.exists(status):
        return False
    importlib.invalidate_caches()
    return importlib.util.find_spec("horovod") is not None


@pytest.fixture(scope="module")
def slurm_jobs(local_slurm, tmp_path_factory, data_dir):
    """The JOBS, ONE_TASK_JOB, and HOROVOD_JOB if Horovod is ready, submitted
    at once to the one-node Slurm (OverSubscribe=FORCE: they share the CPUs)."""
    specs = {**JOBS, **ONE_TASK_JOB, **(HOROVOD_JOB if _horovod_ready() else {})}
    return run_jobs(local_slurm, specs, tmp_path_factory.mktemp("jobs"), data_dir)


def _summary_lines(output):
    """The JSON run summaries printed in a job's output (tfdist-train's last line)."""
    found = []
    for line in output.splitlines():
        if line.startswith("{"):
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return [s for s in found if isinstance(s, dict) and "strategy" in s]


def _check_job(job, strategy):
    assert (job["state"], job["exit_code"]) == ("COMPLETED", "0:0"), job["output"][-4000:]
    out = job["out_dir"]
    tasks = [json.loads((out / f"task-{rank}.json").read_text()) for rank in (0, 1)]
    weights = [list(np.load(out / f"weights-{rank}.npz").values()) for rank in (0, 1)]
    # Both tasks in one cluster, numbered as Slurm numbers them; rank 0 the chief.
    assert [t["worker_index"] for t in tasks] == [0, 1]
    assert [t["num_workers"] for t in tasks] == [2, 2]
    assert [t["is_chief"] for t in tasks] == [True, False]
    assert tasks[0]["tf_config"]["cluster"] == tasks[1]["tf_config"]["cluster"]
    # In sync: the same final weights, bit for bit, and they are finite.
    assert len(weights[0]) == len(weights[1]) > 0
    for a, b in zip(*weights):
        np.testing.assert_array_equal(a, b)
    assert all(np.isfinite(w).all() for w in weights[0])
    # Only the chief prints the run summary and writes it, with its checkpoint.
    printed = _summary_lines(job["output"])
    assert len(printed) == 1, job["output"][-4000:]
    written = json.loads((out / "run" / "summary.json").read_text())
    assert printed[0] == written
    assert (written["strategy"], written["workers"], written["steps"]) == (strategy, 2, 6)
    assert np.isfinite(written["loss"])
    assert (out / "run" / "checkpoints" / "ckpt-6.index").exists()
    return tasks, written


@pytest.mark.integration
@pytest.mark.timeout(JOB_LIMIT_S + 400)
def test_sbatch_trains_multi_worker_tasks_in_sync(slurm_jobs):
    _check_job(slurm_jobs["multi_worker"], "multi_worker")


@pytest.mark.integration
@pytest.mark.timeout(JOB_LIMIT_S + 400)
def test_sbatch_trains_a_dtensor_mesh_across_two_tasks(slurm_jobs):
    _, summary = _check_job(slurm_jobs["dtensor"], "dtensor")
    assert summary["mesh"] == "batch:2,model:2"


@pytest.mark.integration
@pytest.mark.timeout(JOB_LIMIT_S + 400)
def test_a_one_task_job_trains_as_a_single_worker(slurm_jobs):
    """sbatch --ntasks=1, plain tfdist-train: a one-worker cluster."""
    job = slurm_jobs["one_task"]
    assert (job["state"], job["exit_code"]) == ("COMPLETED", "0:0"), job["output"][-4000:]
    printed = _summary_lines(job["output"])
    assert len(printed) == 1, job["output"][-4000:]
    assert (printed[0]["strategy"], printed[0]["workers"], printed[0]["steps"]) == (
        "multi_worker", 1, 6)
    assert printed[0] == json.loads((job["out_dir"] / "run" / "summary.json").read_text())


@pytest.mark.integration
@pytest.mark.timeout(JOB_LIMIT_S + 400)
def test_two_jobs_at_once_on_one_node_listen_on_different_ports(slurm_jobs):
    clusters = [json.loads((slurm_jobs[name]["out_dir"] / "task-0.json").read_text())
                ["tf_config"]["cluster"] for name in JOBS]
    ports = [{int(a.rpartition(":")[2]) for a in c["worker"]} for c in clusters]
    hosts = {a.rpartition(":")[0] for c in clusters for a in c["worker"]}
    assert hosts == {socket.gethostname().split(".")[0]}
    assert all(len(p) == 2 for p in ports) and ports[0].isdisjoint(ports[1])


@pytest.mark.integration
@pytest.mark.timeout(JOB_LIMIT_S + 1300)   # may wait for the Horovod build (make test)
def test_sbatch_with_horovod_is_one_usage_error_per_task(slurm_jobs, local_slurm,
                                                         tmp_path_factory, data_dir):
    """srun -n 2 tfdist-train --strategy=horovod (a Horovod without MPI, no
    horovodrun): a task exits 2 with one line naming horovodrun, before
    training; nothing is written."""
    job = slurm_jobs.get("horovod")
    if job is None:   # Horovod was still building when the other jobs started
        wait_for_horovod_build()
        if importlib.util.find_spec("horovod") is None:
            pytest.skip("Horovod not built (make horovod)")
        job = run_jobs(local_slurm, HOROVOD_JOB, tmp_path_factory.mktemp("hvd"),
                       data_dir)["horovod"]
    assert job["state"] == "FAILED", job["output"][-3000:]
    # srun --kill-on-bad-exit may stop the second task before it prints its line.
    assert "Exited with exit code 2" in job["output"], job["output"][-3000:]
    errors = [line for line in job["output"].splitlines() if line.startswith("tfdist-train:")]
    assert 1 <= len(errors) <= 2 and "Traceback" not in job["output"], job["output"][-3000:]
    host = socket.gethostname().split(".")[0]
    for line in errors:
        assert line.startswith("tfdist-train: error: --strategy=horovod under srun with 2 "
                               "tasks"), line
        assert f"horovodrun -np 2 -H {host}:2 --gloo" in line and "multi_worker" in line
    assert not (job["out_dir"] / "run").exists()
