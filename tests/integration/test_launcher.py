"""tfdist-launch: TF_CONFIG per worker, prefixed output, fail-fast with every
worker gone, restarts, signal forwarding, ports in use skipped, bad usage exit 2,
--network: the cluster's own loopback-only network namespace (as root, as
an unprivileged user, refused by the kernel), and --worker_memory: a memory
cgroup per worker, whose OOM kill is named and whose groups are removed.

Workers are tiny `python -c` scripts (no TensorFlow), so each test takes about a
second. Workers hand their pids to the test through files in tmp_path, so the
test can check by pid that the launcher really ended them.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

import tfdist_launch
from conftest import BIN, REPO

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
def test_a_worker_refusing_its_input_is_not_restarted_and_exits_2(tmp_path):
    """Exit status 2 is bad input (tfdist-train's one-line error before it
    trains): a restart would fail the same way, so the launcher stops, exits
    2 and keeps its restarts (the control: any other failure is restarted,
    test_restarts_are_bounded)."""
    result, _ = launch(["--workers=2", "--max_restarts=2"], "sys.exit(2 if IDX else 0)",
                       tmp_path)
    assert result.returncode == 2, result.stderr
    assert "restarting" not in result.stderr
    assert last_line(result.stderr) == ("tfdist-launch: failed: worker 1 exited with status 2 "
                                        "(bad input, as its error says; not restarted); all "
                                        "workers stopped")


@pytest.mark.timeout(30)
def test_port_base_skips_a_port_in_use(tmp_path):
    with socket.socket() as held:
        held.bind(("localhost", 0))
        taken = held.getsockname()[1]
        # This host's network: in a private one the port would be free.
        result, _ = launch(["--workers=2", f"--port_base={taken}", "--network=host"],
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
    (["--workers=2", "--network=bogus", "--", "true"],
     "argument --network: invalid choice: 'bogus' (choose from 'auto', 'private', 'host')"),
    (["--workers=2", "--host=0.0.0.0", "--network=private", "--", "true"],
     "--network=private: cannot confine the cluster: --host=0.0.0.0 is not a loopback address "
     "(0.0.0.0); use --host=localhost or --network=host"),
    (["--workers=2", "--worker_memory=2GB", "--", "true"],
     "--worker_memory=2GB is not a size: use an integer number of bytes with an optional K, M or "
     "G suffix (powers of 1024)"),
    (["--workers=2", "--worker_memory=512", "--", "true"],
     "--worker_memory=512 is 512 bytes, too little to run a process; give at least 1M (did you "
     "mean 512M?)"),
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




# -- --network: a private network namespace with only loopback -------------------
# Each worker says which network it has, then listens on its TF_CONFIG port on
# every interface (as TensorFlow's server does) until the test has probed it.
LISTENS = """
    ifs = [l.split(":")[0].strip() for l in open("/proc/self/net/dev").read().splitlines()[2:]]
    print("network", os.environ["TFDIST_NETWORK"], ",".join(ifs), flush=True)
    import socket
    port = int(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"][IDX].rpartition(":")[2])
    server = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    mark(f"listening{IDX}")
    wait_for("probed")
"""
CLUSTER_LINE = re.compile(r"^tfdist-launch: (warning: )?cluster: (.*?); (.*)$")


def cluster_line(line):
    """(warning?, [(role, index, address)], the rest) of the launcher's start-up line."""
    found = CLUSTER_LINE.match(line.rstrip("\n"))
    assert found, line
    tasks = [(role, int(index), address) for role, index, address in
             (task.split(" ") for task in found[2].split(", "))]
    return bool(found[1]), tasks, found[3]


def answers(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return True
    except OSError:
        return False


def networks(stdout):
    """{worker index: (TFDIST_NETWORK, its interfaces)} from the workers' lines."""
    found = re.findall(r"^\[worker (\d)\] network (\w+) (\S+)$", stdout, re.M)
    return {int(i): (network, interfaces.split(",")) for i, network, interfaces in found}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("network", ["auto", "host"])
def test_network_confines_the_cluster_or_shares_this_hosts(tmp_path, network):
    """auto (the default): the launcher and its workers have a network namespace
    of their own with loopback only, whose ports this namespace cannot reach;
    host: they share this host's network."""
    proc = subprocess.Popen([LAUNCH, "--workers=2", f"--network={network}", "--",
                             *worker_cmd(LISTENS, tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        warning, tasks, rest = cluster_line(proc.stderr.readline())   # its first line
        while not all((tmp_path / f"listening{i}").exists() for i in (0, 1)):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.02)
        ports = [int(address.rpartition(":")[2]) for _, _, address in tasks]
        reached = [answers(port) for port in ports]
        own_namespace = os.readlink(f"/proc/{proc.pid}/ns/net") != os.readlink("/proc/self/ns/net")
        (tmp_path / "probed").write_text("")
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert [(role, index) for role, index, _ in tasks] == [("worker", 0), ("worker", 1)]
    assert all(address.startswith("localhost:") for _, _, address in tasks), tasks
    if network == "auto" and warning:
        pytest.skip(f"this machine cannot confine a cluster: {rest}")
    seen = networks(out)
    assert sorted(seen) == [0, 1], out
    if network == "auto":
        assert not warning and rest == ("confined to a private network namespace (loopback "
                                        "only: unreachable from other hosts)"), rest
        assert own_namespace and reached == [False, False], (own_namespace, reached)
        assert all(found == ("private", ["lo"]) for found in seen.values()), seen
    else:
        assert not warning and rest == (
            "on this host's network (--network=host): TensorFlow's gRPC servers listen on ports "
            f"{ports[0]}, {ports[1]} of every interface, unauthenticated (see "
            'docs/guides/clusters.md, "What a cluster exposes")'), rest
        assert not own_namespace and reached == [True, True], (own_namespace, reached)
        assert all(net == "host" and len(ifs) > 1 for net, ifs in seen.values()), seen


@pytest.mark.timeout(30)
def test_a_non_loopback_host_is_not_confined_and_says_so(tmp_path):
    result, _ = launch(["--workers=2", "--host=0.0.0.0"], "print('ran', flush=True)", tmp_path)
    assert result.returncode == 0, result.stderr
    warning, tasks, rest = cluster_line(result.stderr.splitlines()[0])
    ports = [address.rpartition(":")[2] for _, _, address in tasks]
    assert warning and rest == (
        f"reachable from the network: TensorFlow's gRPC servers listen on ports {ports[0]}, "
        f"{ports[1]} of every interface, unauthenticated (see docs/guides/clusters.md, "
        "\"What a cluster exposes\"); not "
        "confined: --host=0.0.0.0 is not a loopback address (0.0.0.0)"), rest


def _python_for_nobody():
    """A Python interpreter that user nobody can run, also from a process of its own
    (as the launcher runs its workers), or None."""
    check = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'pass'], check=True)"
    for python in (os.path.realpath(sys.executable), shutil.which("python3", path="/usr/bin")):
        if python and subprocess.run(AS_NOBODY + [python, "-c", check],
                                     capture_output=True, timeout=20).returncode == 0:
            return python
    return None


AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
SLEEPS = ("import json, os, time; idx = json.loads(os.environ['TF_CONFIG'])['task']['index']; "
          "ifs = [l.split(':')[0].strip() for l in open('/proc/self/net/dev').readlines()[2:]]; "
          "print('pid', os.getpid(), os.getuid(), os.environ['TFDIST_NETWORK'], ','.join(ifs), "
          "flush=True); time.sleep(600)")


def _readable_copy_of_the_launcher() -> str:
    """The launcher package copied where `nobody` can read it: the checkout
    may sit in a directory private to its owner (a `mktemp -d` clone)."""
    import tempfile
    root = tempfile.mkdtemp(prefix="tfdist-launch-nobody-")
    os.chmod(root, 0o755)
    launcher = os.path.join(root, "tfdist_launch")
    shutil.copytree(os.path.join(REPO, "launch", "tfdist_launch"), launcher,
                    ignore=shutil.ignore_patterns("__pycache__"))
    for directory, _, files in os.walk(root):
        os.chmod(directory, 0o755)
        for name in files:
            os.chmod(os.path.join(directory, name), 0o644)
    return launcher


@pytest.mark.timeout(40)
def test_an_unprivileged_user_gets_a_user_namespace_and_sigterm_still_stops_all():
    """As `nobody`: the launcher makes a user namespace owning the network one
    (where the kernel allows it); the workers keep nobody's uid and no
    privileges, and SIGTERM from outside stops every one of them."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run the launcher as nobody")
    python = _python_for_nobody()
    if python is None:
        pytest.skip("no Python interpreter here that user nobody may run")
    launcher = _readable_copy_of_the_launcher()   # the package, run as a directory
    proc = subprocess.Popen(AS_NOBODY + [python, "-I", launcher, "--workers=2", "--grace_s=5",
                                         "--", python, "-c", SLEEPS],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
    try:
        lines = [proc.stdout.readline() for _ in (0, 1)]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
        shutil.rmtree(os.path.dirname(launcher), ignore_errors=True)
    warning, _, rest = cluster_line(err.splitlines()[0])
    if warning:
        pytest.skip(f"this kernel refuses unprivileged user namespaces: {rest}")
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert rest.startswith("confined to a private network namespace"), rest
    workers = [line.split()[2:] for line in lines]   # after "[worker i]"
    assert all(w[0] == "pid" and w[2:] == ["65534", "private", "lo"] for w in workers), lines
    assert all(gone(int(w[1])) for w in workers), lines


REFUSED = ("echo 0 > /proc/sys/user/max_user_namespaces && "
           'exec setpriv --bounding-set=-all --inh-caps=-all "$@"')


@pytest.mark.timeout(30)
def test_a_kernel_that_refuses_namespaces_gets_a_warning_or_exit_2_with_private(tmp_path):
    """No capabilities and no user namespaces allowed (nested in a user
    namespace of the test's own whose limit is 0): auto warns in one line
    naming the exposed ports and why, and runs; --network=private exits 2."""
    base = ["unshare", "--user", "--map-root-user", "sh", "-c", REFUSED, "sh"]
    if shutil.which("setpriv") is None or subprocess.run(
            base + ["true"], capture_output=True, timeout=20).returncode != 0:
        pytest.skip("cannot build a user namespace without capabilities here (util-linux "
                    "unshare and setpriv, unprivileged user namespaces)")
    auto = subprocess.run(base + [LAUNCH, "--workers=2", "--", *worker_cmd("pass", tmp_path)],
                          capture_output=True, text=True, timeout=20)
    private = subprocess.run(base + [LAUNCH, "--workers=2", "--network=private", "--", "true"],
                             capture_output=True, text=True, timeout=20)
    assert auto.returncode == 0, auto.stderr
    warning, tasks, rest = cluster_line(auto.stderr.splitlines()[0])
    ports = ", ".join(address.rpartition(":")[2] for _, _, address in tasks)
    refusal = ("unshare(CLONE_NEWNET): Operation not permitted (needs root), and the kernel "
               "refuses an unprivileged user namespace: unshare(CLONE_NEWUSER|CLONE_NEWNET): ")
    assert warning and rest.startswith(
        f"reachable from the network: TensorFlow's gRPC servers listen on ports {ports} of every "
        f"interface, unauthenticated (see docs/guides/clusters.md, \"What a cluster exposes\"); "
        f"not confined: {refusal}"), rest
    assert private.returncode == 2 and private.stdout == "", private.stderr
    [line] = private.stderr.splitlines()
    assert line.startswith(f"tfdist-launch: error: --network=private: cannot confine the "
                           f"cluster: {refusal}") and line.endswith("; use --network=host"), line


# -- --worker_memory: each process in a memory cgroup of its own -----------------
@pytest.mark.parametrize("text,size", [
    ("2G", 2 << 30), ("1500M", 1500 << 20), ("4096k", 4 << 20), ("1m", 1 << 20),
    ("1048576", 1 << 20), (" 3G ", 3 << 30)])
def test_worker_memory_sizes_are_powers_of_1024(text, size):
    assert tfdist_launch.parse_memory(text) == size


@pytest.mark.parametrize("text,message", [
    ("1.5G", "is not a size"), ("2GB", "is not a size"), ("-1M", "is not a size"),
    ("", "is not a size"), ("1T", "is not a size"), ("0", "is 0 bytes, too little"),
    ("1023K", "is 1047552 bytes, too little to run a process; give at least 1M"),
    ("99999999999G", "is more than any kernel can cap")])
def test_worker_memory_bad_sizes_name_the_flag(text, message):
    with pytest.raises(tfdist_launch.UsageError) as error:
        tfdist_launch.parse_memory(text)
    assert str(error.value).startswith(f"--worker_memory={text} {message}"), error.value


def _own_cgroup_v2_path():
    """This process's path in the cgroup v2 hierarchy (the launcher starts in the same), or None."""
    with open("/proc/self/cgroup") as f:
        return next((line.split(":", 2)[2] for line in f.read().splitlines()
                     if line.startswith("0::")), None)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("root", ["missing", "v2_without_memory"])
def test_worker_memory_without_usable_cgroups_exits_2_before_any_worker(tmp_path, root):
    """TFDIST_CGROUP_ROOT points at a directory with no cgroups, or at a cgroup v2
    tree whose controllers do not include memory: one line naming the flag and
    why, exit 2, no worker started, nothing made under that root."""
    fake = tmp_path / "cgroup"
    reason = f"no cgroup v2 hierarchy and no cgroup v1 memory hierarchy holding this process " \
             f"under {fake} (TFDIST_CGROUP_ROOT)"
    v2_path = _own_cgroup_v2_path()
    if root == "v2_without_memory":
        if v2_path is None:
            pytest.skip("this process has no cgroup v2 path to imitate")
        own = fake / v2_path.lstrip("/")
        own.mkdir(parents=True)
        (own / "cgroup.controllers").write_text("cpu io pids\n")
        reason = (f"the memory controller is not available in the launcher's cgroup "
                  f"{os.path.normpath(own)} (it offers: cpu io pids)")
    before = sorted(fake.rglob("*")) if fake.exists() else []
    result = subprocess.run([LAUNCH, "--workers=2", "--worker_memory=64M", "--",
                             *worker_cmd("mark(f'started{IDX}')", tmp_path)],
                            capture_output=True, text=True, timeout=20,
                            env={**os.environ, "TFDIST_CGROUP_ROOT": str(fake)})
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.splitlines() == [
        f"tfdist-launch: error: --worker_memory=64M: cannot cap each process's memory: {reason}"]
    assert not list(tmp_path.glob("started*"))
    assert (sorted(fake.rglob("*")) if fake.exists() else []) == before


# Worker 1 allocates (and so touches) 192M once worker 0 is up; worker 0 waits
# for worker 1 to finish. Each first says which memory cgroup it started in.
HOG_MB = 192
MEMORY_HOG = f"""
    lines = [line.split(":", 2) for line in open("/proc/self/cgroup").read().splitlines()]
    v1 = [path for _, controllers, path in lines if "memory" in controllers.split(",")]
    v2 = [path for _, controllers, path in lines if not controllers]
    where = ("memory", v1[0]) if v1 else ("", v2[0])
    print("cgroup", os.environ["TFDIST_WORKER_MEMORY"], *where, flush=True)
    if IDX == 0:
        mark("up"); wait_for("done")
    else:
        wait_for("up")
        hog = b"x" * ({HOG_MB} << 20)
        mark("done")
"""


def _run_capped(cap, tmp_path):
    """Launch 2 MEMORY_HOG workers under --worker_memory=cap: (CompletedProcess,
    the launcher's pid, {worker: (TFDIST_WORKER_MEMORY, cgroup directory)})."""
    tmp_path.mkdir()
    proc = subprocess.Popen([LAUNCH, "--workers=2", f"--worker_memory={cap}", "--grace_s=5",
                             "--", *worker_cmd(MEMORY_HOG, tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if result.returncode == 2 and "cannot cap each process's memory" in err:
        pytest.skip(f"no memory cgroups here: {err.strip()}")
    found = re.findall(r"^\[worker (\d)\] cgroup (\d+) (\w*) (\S+)$", out, re.M)
    groups = {int(i): (int(limit), os.path.join("/sys/fs/cgroup", hierarchy, path.lstrip("/")))
              for i, limit, hierarchy, path in found}
    return result, proc.pid, groups


@pytest.mark.timeout(60)   # integration: the module's pytestmark
def test_worker_memory_oom_kill_is_named_with_the_cap_and_its_cgroups_removed(tmp_path):
    """Under --worker_memory=64M worker 1's 192M kills it (the kernel's OOM
    killer, counted by its cgroup): one line names it and the cap, worker 0 is
    stopped, and no cgroup the launcher made is left. Under 512M the same run
    succeeds: the cap is what killed it."""
    killed, pid, groups = _run_capped("64M", tmp_path / "capped")
    assert killed.returncode == 1, killed.stderr
    assert f"--worker_memory=64M: each process in a memory cgroup of its own, capped at " \
           f"{64 << 20} bytes" in killed.stderr.splitlines()[0], killed.stderr
    assert sorted(groups) == [0, 1], killed.stdout
    for index, (limit, group) in groups.items():   # in its own cgroup from the start
        assert limit == 64 << 20
        assert group.endswith(f"/tfdist-launch-{pid}/worker-{index}"), group
        assert not os.path.exists(os.path.dirname(group)), group   # removed, leaves and all
    final = last_line(killed.stderr)
    assert final.startswith("tfdist-launch: failed: worker 1 was killed by signal SIGKILL: out "
                            "of memory before its first progress line, killed by the kernel's "
                            "OOM killer at its --worker_memory=64M cap"), final
    assert gone(read_pid(tmp_path / "capped", "up"))

    ran, pid, groups = _run_capped("512M", tmp_path / "roomy")
    assert ran.returncode == 0, ran.stderr
    assert "out of memory" not in ran.stderr and (tmp_path / "roomy" / "done").exists()
    assert {limit for limit, _ in groups.values()} == {512 << 20}
    assert not any(os.path.exists(os.path.dirname(group)) for _, group in groups.values())
