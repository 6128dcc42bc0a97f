"""launch/kubernetes/indexed-job.yaml's pods, run as Kubernetes would run them.

Each pod of the Indexed Job is a process in a network namespace of its own
(the two joined by a veth pair, as two nodes) and a UTS namespace whose host
name is the pod's (`<job>-<index>`), with what the kubelet and cluster DNS
would give it, read from the manifest: the container's command and
arguments (the image's /app is this checkout, the /shared volume a
directory), its `env` (values, and the downward API's job-name label),
JOB_COMPLETION_INDEX and HOSTNAME. Cluster DNS is a hosts file both
namespaces read (`ip netns exec` mounts /etc/netns/NS/hosts over
/etc/hosts): a pod's record `<job>-<index>.<service>` is added when the pod
starts, not before.

- Pod 0 starts alone and waits for its peer's name (the line saying so is
  asserted), then pod 1 starts and both train.
- Once a checkpoint is written, pod 1's process is SIGKILLed. The "kubelet"
  restarts every container that exits non-zero, in its own pod (the
  manifest's restartPolicy: OnFailure), within the manifest's backoffLimit
  counted over all pods, as Kubernetes counts it: pod 0 must end non-zero
  within --collective_timeout_s + MARGIN_S of the loss, and the restarted
  pair resume from the checkpoint and finish at exactly --train_steps.

The training flags are the manifest's, with a small model and run appended
(later flags win): what is under test is the pods' environment, names and
restarts, not the cnn. Kubernetes' first restart back-off is 10 s; here 1 s.
Needs root and iproute2; skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml

from tfdist import checkpointing

import netns
from conftest import REPO

MANIFEST = os.path.join(REPO, "launch", "kubernetes", "indexed-job.yaml")
ADDRESSES = ("10.232.0.1", "10.232.0.2")
STEPS, CHECKPOINT_EVERY, COLLECTIVE_TIMEOUT_S = 120, 40, 15
MARGIN_S = 20        # a lost peer's detection and the fault's exit (test_netns.py measures it)
BACK_OFF_S = 1.0
PREFIX = f"tfk{os.getpid()}"

_WHY = netns.why_not(PREFIX) or (None if shutil.which("unshare") else "util-linux's unshare "
                                 "is not installed")
pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(_WHY is not None, reason=str(_WHY))]


def _manifest():
    with open(MANIFEST) as f:
        documents = [d for d in yaml.safe_load_all(f) if d]
    job = next(d for d in documents if d["kind"] == "Job")
    service = next(d for d in documents if d["kind"] == "Service")
    return job, service


class Cluster:
    """The Job's pods in two namespaces, their DNS and their kubelet."""

    def __init__(self, link, directory, data_dir):
        self.job, self.service = _manifest()
        self.link, self.directory, self.data_dir = link, directory, data_dir
        spec = self.job["spec"]
        self.name, self.completions = self.job["metadata"]["name"], spec["completions"]
        self.pod = spec["template"]["spec"]
        self.container = self.pod["containers"][0]
        self.procs, self.starts, self.restarts = {}, {}, 0
        self.hosts = [os.path.join("/etc/netns", ns, "hosts") for ns in link.namespaces]

    def dns_start(self):
        """An empty zone: localhost only, one file (one inode) for both
        namespaces, appended to in place so that both see each record."""
        for path in self.hosts:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(self.hosts[0], "w") as f:
            f.write("127.0.0.1 localhost\n")
        os.link(self.hosts[0], self.hosts[1])

    def dns_add(self, index):
        with open(self.hosts[0], "a") as f:
            f.write(f"{ADDRESSES[index]} {self.name}-{index}.{self.pod['subdomain']}\n")

    def dns_stop(self):
        for path in self.hosts:
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)

    def environment(self, index) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG",)}
        env.update(TF_CPP_MIN_LOG_LEVEL="2", JOB_COMPLETION_INDEX=str(index),
                   HOSTNAME=f"{self.name}-{index}")
        labels = {"batch.kubernetes.io/job-name": self.name, "job-name": self.name}
        for item in self.container.get("env", []):
            if "value" in item:
                env[item["name"]] = item["value"]
            else:   # the downward API: metadata.labels['...']
                path = item["valueFrom"]["fieldRef"]["fieldPath"]
                env[item["name"]] = labels[path.split("'")[1]]
        return env

    def command(self, index) -> list:
        args = [a.replace("/app/", REPO + "/").replace("/shared/", self.directory + "/")
                for a in [*self.container["command"], *self.container.get("args", [])]]
        args[0] = os.path.join(os.path.dirname(sys.executable), args[0])
        small = ["--model=mlp", "--model_width=16", "--model_depth=1", "--global_batch_size=32",
                 f"--train_steps={STEPS}", "--steps_per_loop=10", "--eval_every=0",
                 f"--checkpoint_every={CHECKPOINT_EVERY}", "--keep_checkpoints=100",
                 f"--collective_timeout_s={COLLECTIVE_TIMEOUT_S}", "--jit_compile=off",
                 f"--data_dir={self.data_dir}"]
        # A UTS namespace with the pod's host name, in the pod's network namespace.
        return ["ip", "netns", "exec", self.link.namespaces[index], "unshare", "--uts", "sh",
                "-c", 'hostname "$0" && exec "$@"', f"{self.name}-{index}", *args, *small]

    def start(self, index):
        attempt = self.starts.get(index, 0)
        self.starts[index] = attempt + 1
        out = open(self.path(index, attempt, "out"), "w")
        err = open(self.path(index, attempt, "err"), "w")
        self.procs[index] = subprocess.Popen(self.command(index), cwd=self.directory,
                                             env=self.environment(index), stdout=out, stderr=err)
        out.close(), err.close()

    def path(self, index, attempt, stream):
        return os.path.join(self.directory, f"pod{index}-{attempt}.{stream}")

    def text(self, index, attempt, stream):
        with open(self.path(index, attempt, stream)) as f:
            return f.read()

    def tails(self):
        return "\n".join(f"--- pod {i} attempt {a} stderr:\n{self.text(i, a, 'err')[-2000:]}"
                         for i in self.starts for a in range(self.starts[i]))

    def kubelet(self, deadline) -> dict:
        """Restart (OnFailure) each container that exits non-zero, after the
        back-off, until every pod succeeded, the Job's backoffLimit is
        exceeded, or `deadline`. Returns {index: time of each non-zero exit}."""
        failed_at, restart_at = {}, {}
        while time.monotonic() < deadline:
            done = True
            for index, proc in self.procs.items():
                code, now = proc.poll(), time.monotonic()
                if code == 0:
                    continue
                done = False
                if code is None:
                    continue
                if index not in restart_at:
                    failed_at.setdefault(index, []).append(now)
                    restart_at[index] = now + BACK_OFF_S
                elif now >= restart_at[index]:
                    del restart_at[index]
                    self.restarts += 1
                    if self.restarts > self.job["spec"]["backoffLimit"]:
                        raise AssertionError("the Job exceeded its backoffLimit\n" + self.tails())
                    self.start(index)
            if done:
                return failed_at
            time.sleep(0.05)
        raise AssertionError("the pods did not finish in time\n" + self.tails())

    def kill(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def cluster(prepared_data_dir, tmp_path_factory):
    link = netns.Link(PREFIX, ADDRESSES)
    made = Cluster(link, str(tmp_path_factory.mktemp("k8s_pods")), prepared_data_dir)
    try:
        link.create()
        made.dns_start()
        yield made
    finally:
        made.kill()
        made.dns_stop()
        link.delete()


def _wait_for(condition, seconds, cluster, what):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {seconds} s\n" + cluster.tails()
        assert all(p.poll() is None for p in cluster.procs.values()), \
            f"a pod ended before {what}\n" + cluster.tails()
        time.sleep(0.05)


@pytest.mark.timeout(420)
def test_pods_wait_for_their_peers_names_and_a_killed_pod_restarts_and_resumes(cluster):
    assert cluster.completions == len(ADDRESSES) and cluster.pod["restartPolicy"] == "OnFailure"
    peer = f"{cluster.name}-1.{cluster.pod['subdomain']}"
    cluster.dns_add(0)
    cluster.start(0)
    _wait_for(lambda: f"waiting for {peer} to resolve" in cluster.text(0, 0, "err"), 90,
              cluster, f"line of pod 0 waiting for {peer}")
    cluster.dns_add(1)
    cluster.start(1)
    model_dir = os.path.join(cluster.directory, "runs", "cnn")
    _wait_for(lambda: checkpointing.saved_steps(model_dir), 180, cluster, "checkpoint")
    killed_at = time.monotonic()
    cluster.procs[1].send_signal(signal.SIGKILL)
    failed_at = cluster.kubelet(deadline=time.monotonic() + 150)
    exits = {i: [round(t - killed_at, 1) for t in ts] for i, ts in failed_at.items()}
    print(f"starts per pod {cluster.starts}, restarts {cluster.restarts}, non-zero exits "
          f"(s after the kill) {exits}")
    assert cluster.starts[0] >= 2, "pod 0 was never restarted\n" + cluster.tails()
    assert failed_at[0][0] - killed_at <= COLLECTIVE_TIMEOUT_S + MARGIN_S, cluster.tails()
    first = cluster.text(0, 0, "err")
    faults = [line for line in first.splitlines() if line.startswith("tfdist-train: fault:")]
    assert len(faults) == 1, first[-3000:]
    assert faults[0].startswith(f"tfdist-train: fault: worker 0 ({cluster.name}-0."), faults[0]
    assert f"worker 1 ({peer}:" in faults[0], faults[0]
    last = cluster.starts[0] - 1
    summary = [line for line in cluster.text(0, last, "out").splitlines()
               if line.startswith("{")][-1]
    result = json.loads(summary)
    assert result["steps"] == STEPS and result["workers"] == 2, result
    steps = checkpointing.saved_steps(model_dir)
    assert steps == sorted(steps) and steps[-1] == STEPS, steps
    assert "restored " + os.path.join(model_dir, "checkpoints", "ckpt-") in \
        cluster.text(0, last, "err"), cluster.tails()
