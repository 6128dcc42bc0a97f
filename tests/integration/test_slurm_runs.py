"""launch/slurm/tfdist.sbatch on a real one-node Slurm
(launch/slurm/local_slurm.sh; the clusters Slurm's variables give:
tests/unit/test_slurm.py). The tests
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

from conftest import BIN, REPO, free_port, wait_for_horovod_build


LOCAL_SLURM = os.path.join(REPO, "launch", "slurm", "local_slurm.sh")
SBATCH = os.path.join(REPO, "launch", "slurm", "tfdist.sbatch")
# make slow: Slurm jobs (about a minute, its daemons' CPU beside it); make test:
# tests/unit/test_slurm.py (the allocation to TF_CONFIG), the engines under tfdist-launch.
pytestmark = pytest.mark.slow

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
        port = free_port()
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
