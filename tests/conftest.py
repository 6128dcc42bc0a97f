"""Shared test set-up.

Virtual CPU devices must exist before TensorFlow's runtime starts, so the
whole in-process suite runs on 4 logical CPUs configured here, first:
mirrored runs use the first 2 (`virtual_devices=2`), DTensor meshes all 4.
"""

import glob
import os
import shutil
import socket
import subprocess
import sys
import resource
import tempfile
import threading
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The suite's runs measure the matmul peak while other tests load the cores: a
# figure too low for the user's cache (~/.cache/tfdist), where it would stay
# and inflate every later MFU. One cache for the whole run instead (shared by
# the xdist workers, which inherit it from the controller, and by the processes
# the tests start), removed at the end.
_TEST_CACHE_DIR = None
if not os.environ.get("PYTEST_XDIST_WORKER"):
    _TEST_CACHE_DIR = os.environ["TFDIST_CACHE_DIR"] = tempfile.mkdtemp(prefix="tfdist-tests-")

import pytest  # noqa: E402
from absl import flags as absl_flags  # noqa: E402

from tfdist import cluster, compat  # noqa: E402  (first: tfdist defers Keras's matplotlib)

import tensorflow as tf  # noqa: E402

cluster.configure_virtual_cpus(4)

# The in-process suite trains stage 3 on 1-D and 2-D meshes in one process, and
# DTensor reads its gather lowering once per process: keep its default gather
# here (as a first DTensor run that is not stage 3 does). The collective
# gather that a stage-3 run on a 1-D mesh picks is tested in processes of its
# own (the "does it fit" test in tests/integration/test_zero.py, the 2-process run of
# tests/integration/test_dtensor.py).
compat.dtensor_fsdp_lowering({"batch": 2, "model": 2}, 0)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory, worker_id):
    """One TFDS data_dir for the whole run, shared by the xdist workers: a
    bundled dataset is generated once (about 50 s for tfdist_shapes on a
    loaded 2-core machine), under the preparation lock of
    `tfdist.data.tfds_inputs`, and only read afterwards."""
    root = tmp_path_factory.getbasetemp()
    if worker_id != "master":   # each xdist worker's base is under the run's
        root = root.parent
    path = root / "tfds-shared"
    path.mkdir(exist_ok=True)
    return str(path)


@pytest.fixture(scope="session")
def prepared_data_dir(data_dir):
    """The session's data_dir with the bundled dataset generated, once, in the
    test process: the workers a test starts then only read it."""
    from tfdist.config import DataConfig
    from tfdist.data import tfds_inputs
    tfds_inputs.load(DataConfig(data_dir=data_dir))
    return data_dir


def run_cli(args, *, timeout=300, env=None, cwd=REPO):
    """Run `tfdist-train ARGS` in a fresh process; return CompletedProcess."""
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    return subprocess.run([os.path.join(BIN, "tfdist-train"), *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def start_all(commands, envs=None):
    """Start `commands` at once, each a process of its own (stdout and stderr
    piped); `envs`: extra environment variables for each. Collect them with
    `finish_all`."""
    envs = envs or [{}] * len(commands)
    return [subprocess.Popen(command, cwd=REPO,
                             env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **env},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for command, env in zip(commands, envs)]


def finish_all(procs, *, timeout):
    """Wait for processes from `start_all` (each at most `timeout` s); their
    CompletedProcess in order. None is left running."""
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            proc.kill()
    return results


def run_all(commands, *, timeout=300, envs=None):
    """Run several commands at once (each is mostly TensorFlow start-up, so
    they overlap well); their CompletedProcess in order."""
    return finish_all(start_all(commands, envs), timeout=timeout)


def tfdist_train(args):
    """The command line of `tfdist-train ARGS`."""
    return [os.path.join(BIN, "tfdist-train"), *args]


def run_clis(arg_lists, *, timeout=300, envs=None):
    """`run_all` of several `tfdist-train` invocations; each result's `args`
    are its invocation's ARGS."""
    results = run_all([tfdist_train(args) for args in arg_lists], timeout=timeout, envs=envs)
    return [subprocess.CompletedProcess(args, r.returncode, r.stdout, r.stderr)
            for args, r in zip(arg_lists, results)]


def demo_config(*overrides):
    """The RunConfig of configs/demo.cfg with `overrides` (flags) after it."""
    from absl.testing import flagsaver
    from tfdist import flags as tfdist_flags
    with flagsaver.flagsaver():
        absl_flags.FLAGS.unparse_flags()
        absl_flags.FLAGS(["tfdist-train", f"--flagfile={os.path.join(REPO, 'configs/demo.cfg')}",
                          *overrides])
        return tfdist_flags.run_config()


def free_ports(n):
    """n ports free now on localhost (bound and released by this process)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("localhost", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port():
    return free_ports(1)[0]


@pytest.fixture(scope="session")
def tfds_dir(tmp_path_factory):
    """The TFDS test builders' data (tests/tfds_fixtures.py), once per worker."""
    import tfds_fixtures
    path = str(tmp_path_factory.mktemp("tfds_fixtures"))
    tfds_fixtures.prepare_all(path)
    return path


# What the suite writes at its busiest (the capped proof of `make slow`: a
# snapshot, a reference and one run of a 59M-parameter model with Adam, 3.4 GB
# measured; `make test` under 1 GB), with room to spare.
NEEDS_FREE_BYTES = 5 * 2**30


def pytest_configure(config):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        free = shutil.disk_usage(tempfile.gettempdir()).free
        if free < NEEDS_FREE_BYTES:
            pytest.exit(f"only {free / 2**30:.1f} GiB free in {tempfile.gettempdir()}; the "
                        f"suite writes up to {NEEDS_FREE_BYTES / 2**30:.0f} GiB of checkpoints "
                        "there: free some space (or set TMPDIR to a larger disk)", returncode=2)
    config.addinivalue_line("markers", "integration: a real training run (tests/integration/: "
                                       "an engine in this process or real processes)")
    config.addinivalue_line("markers", "slow: a long run (accuracy, XLA compiles, capped memory "
                            "proofs): `make slow` runs these, `make test` the others")


# -- the Horovod build beside the suite (tests/run_suite.sh) ----------------------
HOROVOD_BUILD_WAIT_S = 900


def wait_for_horovod_build() -> None:
    """`make test` builds Horovod while the other tests run and names a file
    the build writes "<exit status> <seconds>" into when it ends: wait for it
    (polling), and fail with the build log's end if it failed."""
    status_file = os.environ.get("TFDIST_HOROVOD_BUILD_STATUS")
    if not status_file:
        return
    deadline = time.monotonic() + HOROVOD_BUILD_WAIT_S
    while not os.path.exists(status_file):
        if time.monotonic() > deadline:
            pytest.fail(f"the Horovod build did not end within {HOROVOD_BUILD_WAIT_S}s")
        time.sleep(1)
    with open(status_file) as f:
        code = f.read().split()[0]
    if code != "0":
        log = os.environ.get("TFDIST_HOROVOD_BUILD_LOG", "")
        tail = open(log).read()[-3000:] if log and os.path.exists(log) else ""
        pytest.fail(f"make horovod failed (exit {code}):\n{tail}")


# -- order: the longest files first, so two workers end together ------------------
# Files in this order, then the rest alphabetically. test_horovod.py waits for
# the Horovod build, which takes 2-4 minutes on a fresh machine: it comes
# after enough other work to cover that. test_slurm_runs.py (about a minute of
# Slurm jobs; alphabetically it would come last) also wants Horovod built.
# (xdist itself then sends the files with the most tests first, so one-test
# files run last: the "does it fit" test, 100 s of processes, ran alone at the
# end as test_fits.py, so it now leads tests/integration/test_zero.py. Measured: keeping this order
# instead (--no-loadscope-reorder, the longest multi-process files first) ran
# every cluster at the same time as another and made the suite slower, 1158 s
# against 1040 s, with 2050 against 1855 CPU-seconds: two clusters at once on
# 2 cores cost more than a cluster beside in-process tests.)
FIRST = ["test_multi_worker.py", "test_parameter_server.py", "test_reliability.py",
         "test_dtensor.py", "test_zero.py", "test_horovod.py", "test_netns.py",
         "test_demo_runs.py", "test_cli.py", "test_slurm_runs.py", "test_exposure.py"]


def pytest_collection_modifyitems(config, items):
    for item in items:   # the folder says what a test is
        if f"{os.sep}integration{os.sep}" in str(item.fspath):
            item.add_marker(pytest.mark.integration)

    def rank(item):
        name = os.path.basename(str(item.fspath))
        return (FIRST.index(name) if name in FIRST else len(FIRST), name)

    items.sort(key=rank)   # stable: the order within a file is kept


# Before the module's fixtures start horovodruns, and outside the test's
# timeout (pytest-timeout's timer starts in its own protocol wrapper, inside
# this one): a fresh build can take longer than the first test's timeout.
@pytest.hookimpl(hookwrapper=True, tryfirst=True, specname="pytest_runtest_protocol")
def pytest_runtest_protocol_horovod_built_first(item, nextitem):
    if os.path.basename(str(item.fspath)) == "test_horovod.py":
        wait_for_horovod_build()
    yield


# -- a test that waits far longer than any should: every thread's stack --------
# A test still running after STALL_S in its worker (not waiting on processes it
# started: a cluster's test may take longer) writes every Python thread of the
# worker to a file, printed at the end of the run: where it was waiting.
# In-process tests take up to ~26 s here, yet some have taken 30-120 s with a
# few seconds of CPU (not yet explained). TFDIST_TEST_STALL_S sets another
# threshold. From a timer thread holding the GIL (`sys._current_frames`):
# faulthandler's dump reads the other threads' frames without it and once
# crashed a worker mid-dump.
STALL_S = float(os.environ.get("TFDIST_TEST_STALL_S", 45))


def _has_children() -> bool:
    """Whether this process has live child processes (Linux; False where unknown)."""
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                if f.read().split():
                    return True
        except OSError:
            pass
    return False


def _write_stacks(nodeid: str, path: str) -> None:
    if _has_children():
        return
    frames = sys._current_frames()
    with open(path, "w") as stacks:
        stacks.write(f"{nodeid} ran over {STALL_S:g}s in this process; its threads then:\n")
        for ident, frame in frames.items():
            stacks.write(f"\nThread {ident:#x}:\n" + "".join(traceback.format_stack(frame)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.path.join(os.environ["TFDIST_CACHE_DIR"],
                        f"stall-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{time.time():.0f}")
    timer = threading.Timer(STALL_S, _write_stacks, args=(item.nodeid, path))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


# -- where the suite's time goes: wall and CPU seconds per test file ------------
# The CPU seconds are this worker's own (all its threads) and those of the
# processes the test started and reaped (resource.RUSAGE_CHILDREN counts a
# child's own reaped descendants too: a launcher's workers, horovodrun's ranks).
# The suite is CPU-bound on 2 cores, so CPU, not wall time, says what a cut saves.
# A module-scoped cluster's CPU lands on the test whose teardown reaps it.
_FILE_SECONDS = {}
_FILE_CPU = {}
_TEST_CPU = {}
_cpu_mark = None   # this worker's CPU seconds when its last report was made


def _cpu_seconds() -> float:
    own, children = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                    resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    global _cpu_mark
    outcome = yield
    now = _cpu_seconds()
    start, _cpu_mark = (now if _cpu_mark is None else _cpu_mark), now
    outcome.get_result().user_properties.append(("cpu_s", now - start))


def pytest_runtest_logreport(report):
    """Each test file's wall and CPU time (setup, call and teardown of its
    tests; with xdist, as the workers report them), for `pytest_terminal_summary`."""
    name = report.nodeid.split("::")[0]
    _FILE_SECONDS[name] = _FILE_SECONDS.get(name, 0.0) + report.duration
    cpu = dict(report.user_properties).get("cpu_s", 0.0)
    _FILE_CPU[name] = _FILE_CPU.get(name, 0.0) + cpu
    _TEST_CPU[report.nodeid] = _TEST_CPU.get(report.nodeid, 0.0) + cpu


def pytest_terminal_summary(terminalreporter):
    """The slowest test files: --dist loadfile runs each file in one worker,
    so the suite's wall time is bounded below by the largest of these."""
    if hasattr(terminalreporter.config, "workerinput"):
        return
    for path in sorted(glob.glob(os.path.join(os.environ["TFDIST_CACHE_DIR"], "stall-*"))):
        terminalreporter.write_sep("=", "a stalled test")
        terminalreporter.write_line(open(path).read())
    if not _FILE_SECONDS:
        return
    total, cpu = sum(_FILE_SECONDS.values()), sum(_FILE_CPU.values())
    terminalreporter.write_sep("=", f"slowest test files (all files: {total:.0f}s of worker "
                                    f"time, {cpu:.0f} CPU-s with their processes)")
    for name, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:15]:
        terminalreporter.write_line(f"{seconds:8.1f}s {_FILE_CPU.get(name, 0):7.1f} CPU-s  {name}")
    if os.environ.get("TFDIST_TEST_CPU_REPORT"):   # every file, by CPU
        with open(os.environ["TFDIST_TEST_CPU_REPORT"], "w") as out:
            for name, c in sorted(_FILE_CPU.items(), key=lambda kv: -kv[1]):
                out.write(f"{c:8.1f} {_FILE_SECONDS[name]:8.1f} {name}\n")
            out.write("\n")
            for name, c in sorted(_TEST_CPU.items(), key=lambda kv: -kv[1]):
                out.write(f"{c:8.1f} {name}\n")


def pytest_unconfigure(config):
    if _TEST_CACHE_DIR:
        shutil.rmtree(_TEST_CACHE_DIR, ignore_errors=True)
