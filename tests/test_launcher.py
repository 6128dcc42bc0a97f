"""tfdist-launch: TF_CONFIG per worker, prefixed output, fail-fast with every
worker gone, restarts, signal forwarding, ports in use skipped, bad usage exit 2.

Workers are tiny `python -c` scripts (no TensorFlow), so each test takes about a
second. Workers hand their pids to the test through files in tmp_path, so the
test can check by pid that the launcher really ended them.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import BIN

pytestmark = pytest.mark.integration

LAUNCH = os.path.join(BIN, "tfdist-launch")

# Every worker script starts with this: its index, attempt and helpers to hand
# its pid to the test (mark) and to wait for another worker (wait_for).
PRELUDE = """\
import json, os, signal, sys, time
IDX = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
ATTEMPT = int(os.environ["TFDIST_LAUNCH_ATTEMPT"])
DIR = sys.argv[1]
def mark(name):
    path = os.path.join(DIR, name)
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(path + ".tmp", path)
def wait_for(name):
    while not os.path.exists(os.path.join(DIR, name)):
        time.sleep(0.02)
"""


def worker_cmd(body, tmp_path):
    return [sys.executable, "-c", PRELUDE + textwrap.dedent(body), str(tmp_path)]


def launch(options, body, tmp_path, timeout=30):
    """Run the launcher to completion; return (CompletedProcess, seconds it took)."""
    start = time.monotonic()
    result = subprocess.run([LAUNCH, *options, "--", *worker_cmd(body, tmp_path)],
                            capture_output=True, text=True, timeout=timeout)
    return result, time.monotonic() - start


def read_pid(tmp_path, name):
    return int((tmp_path / name).read_text())


def gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def last_line(text):
    return text.strip().splitlines()[-1]


def tf_configs(stdout):
    """{index: TF_CONFIG} from lines '[worker i] {json}'."""
    configs = {}
    for line in stdout.splitlines():
        prefix, _, payload = line.partition("] ")
        configs[int(prefix.removeprefix("[worker "))] = json.loads(payload)
    return configs


@pytest.mark.timeout(30)
def test_each_worker_gets_its_own_task_in_one_cluster(tmp_path):
    result, _ = launch(["--workers=3"], "print(os.environ['TF_CONFIG'])", tmp_path)
    assert result.returncode == 0, result.stderr
    configs = tf_configs(result.stdout)
    assert sorted(configs) == [0, 1, 2]
    cluster = configs[0]["cluster"]
    assert list(cluster) == ["worker"] and len(cluster["worker"]) == 3
    assert all(a.startswith("localhost:") for a in cluster["worker"])
    assert len({a.split(":")[1] for a in cluster["worker"]}) == 3, cluster
    for index, config in configs.items():
        assert config["cluster"] == cluster
        assert config["task"] == {"type": "worker", "index": index}


@pytest.mark.timeout(30)
def test_output_is_prefixed_and_keeps_its_stream(tmp_path):
    body = """
        print("out", IDX, flush=True)
        print("err", IDX, file=sys.stderr, flush=True)
        sys.stdout.buffer.write(b"bin \\xff\\xfe\\x00 garbage\\n")
        sys.stdout.write("partial last line")
    """
    result = subprocess.run([LAUNCH, "--workers=2", "--", *worker_cmd(body, tmp_path)],
                            capture_output=True, timeout=30)
    assert result.returncode == 0, result.stderr
    out, err = result.stdout.splitlines(), result.stderr.splitlines()
    for i in (0, 1):
        p = b"[worker %d] " % i
        assert p + b"out %d" % i in out and p + b"partial last line" in out, out
        assert p + b"bin \xff\xfe\x00 garbage" in out
        assert p + b"err %d" % i in err and p + b"out %d" % i not in err
    assert all(line.startswith(b"[worker ") for line in out), out


@pytest.mark.timeout(30)
def test_a_failed_worker_stops_the_others(tmp_path):
    body = """
        if IDX == 0:
            mark("sleeper"); time.sleep(600)
        wait_for("sleeper"); sys.exit(3)
    """
    result, seconds = launch(["--workers=2"], body, tmp_path)
    assert result.returncode == 1 and seconds < 10, (seconds, result.stderr)
    assert "tfdist-launch: worker 1 exited with status 3" in result.stderr
    assert "worker 1 exited with status 3" in last_line(result.stderr)
    assert gone(read_pid(tmp_path, "sleeper"))


@pytest.mark.timeout(30)
def test_a_worker_killed_by_a_signal_is_named_by_signal(tmp_path):
    body = """
        if IDX == 0:
            mark("sleeper"); time.sleep(600)
        wait_for("sleeper"); os.kill(os.getpid(), signal.SIGKILL)
    """
    result, _ = launch(["--workers=2"], body, tmp_path)
    assert result.returncode == 1, result.stderr
    assert "tfdist-launch: worker 1 was killed by signal SIGKILL" in result.stderr
    assert gone(read_pid(tmp_path, "sleeper"))


@pytest.mark.timeout(30)
def test_a_worker_ignoring_sigterm_is_killed_after_grace(tmp_path):
    body = """
        if IDX == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            mark("stubborn"); time.sleep(600)
        wait_for("stubborn"); sys.exit(1)
    """
    result, seconds = launch(["--workers=2", "--grace_s=0.5"], body, tmp_path)
    assert result.returncode == 1 and seconds < 10, (seconds, result.stderr)
    assert "worker 0 still running 0.5s after SIGTERM; sending SIGKILL" in result.stderr
    assert "worker 1 exited with status 1" in last_line(result.stderr)
    assert gone(read_pid(tmp_path, "stubborn"))


FAILS_ON_FIRST_ATTEMPT = """
    print("attempt", ATTEMPT, os.environ["TF_CONFIG"], flush=True)
    if IDX == 1 and ATTEMPT == 0:
        sys.exit(4)
"""


@pytest.mark.timeout(30)
def test_restart_recovers_from_a_failed_attempt(tmp_path):
    result, _ = launch(["--workers=2", "--max_restarts=1"], FAILS_ON_FIRST_ATTEMPT, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "tfdist-launch: worker 1 exited with status 4" in result.stderr
    assert "tfdist-launch: restarting all workers (restart 1 of 1)" in result.stderr
    assert "[worker 0] attempt 1 " in result.stdout and "[worker 1] attempt 1 " in result.stdout


@pytest.mark.timeout(30)
def test_without_restarts_the_failure_is_final(tmp_path):
    result, _ = launch(["--workers=2", "--max_restarts=0"], FAILS_ON_FIRST_ATTEMPT, tmp_path)
    assert result.returncode == 1, result.stderr
    assert "restarting" not in result.stderr and "attempt 1" not in result.stdout
    assert "worker 1 exited with status 4" in last_line(result.stderr)


@pytest.mark.timeout(30)
def test_restarts_are_bounded(tmp_path):
    result, _ = launch(["--workers=2", "--max_restarts=2"], "sys.exit(5 if IDX else 0)", tmp_path)
    assert result.returncode == 1, result.stderr
    assert "restart 2 of 2" in result.stderr and "restart 3" not in result.stderr
    assert last_line(result.stderr) == ("tfdist-launch: failed: worker 1 exited with status 5; "
                                        "all workers stopped (restarts used: 2 of 2)")


@pytest.mark.timeout(30)
def test_port_base_skips_a_port_in_use(tmp_path):
    with socket.socket() as held:
        held.bind(("localhost", 0))
        taken = held.getsockname()[1]
        result, _ = launch(["--workers=2", f"--port_base={taken}"],
                           "print(os.environ['TF_CONFIG'])", tmp_path)
    assert result.returncode == 0, result.stderr
    ports = [int(a.split(":")[1]) for a in tf_configs(result.stdout)[0]["cluster"]["worker"]]
    assert taken not in ports and len(set(ports)) == 2
    assert all(taken < p < taken + 100 for p in ports), (taken, ports)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_is_forwarded_and_not_restarted(tmp_path, signum):
    body = """
        if IDX == 1:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # must be SIGKILLed after grace
        mark(f"worker{IDX}"); time.sleep(600)
    """
    proc = subprocess.Popen([LAUNCH, "--workers=2", "--max_restarts=3", "--grace_s=1", "--",
                             *worker_cmd(body, tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not all((tmp_path / f"worker{i}").exists() for i in (0, 1)):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=15)
    assert proc.returncode == 128 + signum, stderr
    assert "restarting" not in stderr
    assert f"interrupted by {signal.Signals(signum).name}" in last_line(stderr)
    assert all(gone(read_pid(tmp_path, f"worker{i}")) for i in (0, 1))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("args,message", [
    (["--workers=0", "--", "true"], "--workers=0 must be at least 1"),
    (["--workers=2", "true"], "missing the worker command: put it after '--'"),
    (["--workers=2", "--"], "missing the worker command"),
    (["--", "true"], "--workers"),
    (["--workers=two", "--", "true"], "--workers: invalid int value: 'two'"),
    (["--workers=2", "--max_restarts=-1", "--", "true"], "--max_restarts=-1 must be 0 or more"),
    (["--workers=2", "--port_base=0", "--", "true"], "--port_base=0 must be a TCP port, 1..65535"),
    (["--workers=2", "--port_base=70000", "--", "true"], "--port_base=70000 must be a TCP port"),
    (["--workers=2", "--port_base=65535", "--", "true"], "--port_base=65535: only "),
    (["--workers=2", "--grace_s=-1", "--", "true"], "--grace_s=-1 must be 0 or more"),
    (["--workers=2", "--host=no-such-host.invalid", "--", "true"], "--host=no-such-host.invalid"),
    (["--workers=2", "--bogus", "--", "true"], "unrecognized arguments: --bogus"),
    (["--workers=2", "--", "/no/such/command"], "cannot run '/no/such/command'"),
])
def test_bad_usage_exits_2_with_one_line(args, message):
    result = subprocess.run([LAUNCH, *args], capture_output=True, text=True, timeout=20)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("tfdist-launch: error: ") and message in lines[0], lines[0]
    assert result.stdout == ""


@pytest.mark.timeout(30)
def test_help_works_and_tensorflow_is_never_imported():
    result = subprocess.run([LAUNCH, "--help"], capture_output=True, text=True, timeout=20)
    assert result.returncode == 0 and "--workers" in result.stdout, result.stderr
    check = "import sys, tfdist_launch; assert 'tensorflow' not in sys.modules"
    subprocess.run([sys.executable, "-c", check], check=True, timeout=20)
