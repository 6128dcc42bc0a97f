"""A Kubernetes Indexed Job's pod as a cluster (tfdist/kubernetes_job.py): the
cluster composed from the pod's environment, its bad input in one line, and
the bounded wait for the peers' DNS names."""

import json
import socket

import pytest

from tfdist import cluster, kubernetes_job
from tfdist.errors import UsageError

POD = {"TFDIST_JOB_COMPLETIONS": "3", "JOB_COMPLETION_INDEX": "1", "TFDIST_JOB_NAME": "train",
       "TFDIST_JOB_SERVICE": "workers", "HOSTNAME": "train-1"}


def test_the_cluster_is_every_pod_of_the_job_by_its_service_name():
    task = kubernetes_job.task_from_environ(POD)
    assert task.hosts == ["train-0.workers:2222", "train-1.workers:2222",
                          "train-2.workers:2222"]
    assert json.loads(task.tf_config()) == {
        "cluster": {"worker": task.hosts}, "task": {"type": "worker", "index": 1}}
    other_port = kubernetes_job.task_from_environ({**POD, "TFDIST_JOB_PORT": "40000"})
    assert other_port.address == "train-1.workers:40000"


def test_the_job_name_defaults_to_the_pods_host_name_less_its_index():
    pod = {k: v for k, v in POD.items() if k != "TFDIST_JOB_NAME"}
    assert kubernetes_job.task_from_environ(pod).job == "train"
    assert kubernetes_job.task_from_environ({**pod, "HOSTNAME": "train-17-1"}).job == "train-17"
    with pytest.raises(UsageError, match="TFDIST_JOB_NAME is not set"):
        kubernetes_job.task_from_environ({**pod, "HOSTNAME": "laptop"})


def test_a_pod_without_tfdists_variables_is_one_process():
    assert kubernetes_job.task_from_environ({"JOB_COMPLETION_INDEX": "0"}) is None
    assert kubernetes_job.task_from_environ({}) is None


@pytest.mark.parametrize("change,message", [
    ({"JOB_COMPLETION_INDEX": ""}, "JOB_COMPLETION_INDEX is not set: the Job needs "
                                   "completionMode: Indexed"),
    ({"JOB_COMPLETION_INDEX": "3"}, "JOB_COMPLETION_INDEX=3 is out of range for "
                                    "TFDIST_JOB_COMPLETIONS=3 (valid: 0-2)"),
    ({"TFDIST_JOB_COMPLETIONS": "two"}, "TFDIST_JOB_COMPLETIONS='two': expected an integer >= 1"),
    ({"TFDIST_JOB_COMPLETIONS": "0"}, "TFDIST_JOB_COMPLETIONS='0': expected an integer >= 1"),
    ({"TFDIST_JOB_PORT": "70000"}, "TFDIST_JOB_PORT='70000': expected an integer in 1-65535"),
    ({"TFDIST_JOB_SERVICE": ""}, "TFDIST_JOB_SERVICE is not set"),
    ({"TFDIST_JOB_SERVICE": "Workers_A"}, "TFDIST_JOB_SERVICE='Workers_A': expected a "
                                          "Kubernetes name"),
])
def test_bad_job_variables_are_one_line_naming_the_variable(change, message):
    with pytest.raises(UsageError) as error:
        kubernetes_job.task_from_environ({**POD, **change})
    assert message in str(error.value) and "\n" not in str(error.value)


class _Dns:
    """Cluster DNS in a test: each name resolves from its time on; a fake clock
    that the wait's sleeps advance."""

    def __init__(self, appears: dict):
        self.appears, self.now, self.asked = appears, 0.0, []

    def resolve(self, name, port):
        self.asked.append((self.now, name))
        if self.now < self.appears.get(name, float("inf")):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.1", 0))]

    def sleep(self, seconds):
        self.now += seconds


def _wait(dns, environ=POD):
    lines = []
    kubernetes_job.wait_for_peers(kubernetes_job.task_from_environ(environ), environ,
                                  log=lines.append, resolve=dns.resolve,
                                  clock=lambda: dns.now, sleep=dns.sleep)
    return lines


def test_the_wait_outlasts_dns_negative_caching_and_says_once_what_it_waits_for():
    """A peer whose record appears 45 s in (a late pod, or a name CoreDNS
    cached as missing for its 30 s) is waited for, polled each second, with
    one line for it; names already there cost no wait."""
    dns = _Dns({"train-0.workers": 0, "train-1.workers": 0, "train-2.workers": 45})
    lines = _wait(dns)
    assert dns.now == 45
    assert lines == ["Kubernetes Indexed Job 'train', pod 1 of 3: waiting for train-2.workers "
                     "to resolve (up to 180 s)"]
    polls = [t for t, name in dns.asked if name == "train-2.workers"]
    assert polls == [float(t) for t in range(46)]   # every second, not a busy loop
    assert _wait(_Dns({f"train-{i}.workers": 0 for i in range(3)})) == []   # the control


def test_a_name_that_never_resolves_ends_the_wait_in_one_line_naming_it():
    dns = _Dns({"train-0.workers": 0, "train-1.workers": 0})
    with pytest.raises(UsageError) as error:
        _wait(dns, {**POD, "TFDIST_PEER_WAIT_S": "20"})
    assert dns.now == 20
    message = str(error.value)
    assert "the name train-2.workers did not resolve within 20 s (TFDIST_PEER_WAIT_S)" in message
    assert "publishNotReadyAddresses: true" in message and "\n" not in message
    with pytest.raises(UsageError, match="TFDIST_PEER_WAIT_S='soon': expected seconds"):
        _wait(dns, {**POD, "TFDIST_PEER_WAIT_S": "soon"})


def _local_dns(monkeypatch, addresses: dict):
    """Names of `addresses` resolve to those addresses (the system resolver for others)."""
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        return real(addresses.get(host, host), *args, **kwargs)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def test_cluster_resolve_writes_the_jobs_tf_config(monkeypatch):
    pod = {**POD, "TFDIST_JOB_COMPLETIONS": "2", "JOB_COMPLETION_INDEX": "0",
           "TFDIST_PEER_WAIT_S": "5"}
    _local_dns(monkeypatch, {"train-0.workers": "127.0.0.1", "train-1.workers": "127.0.0.2"})
    environ = dict(pod)
    spec = cluster.resolve(environ=environ)
    assert spec.num_workers == 2 and spec.is_chief and spec.address == "train-0.workers:2222"
    assert json.loads(environ["TF_CONFIG"])["cluster"]["worker"][1] == "train-1.workers:2222"
    # A TF_CONFIG already there (the operator's) is used as it is.
    environ = {**pod, "TF_CONFIG": json.dumps({"cluster": {"worker": ["localhost:2222"]},
                                               "task": {"type": "worker", "index": 0}})}
    assert cluster.resolve(environ=environ).cluster == {"worker": ["localhost:2222"]}


def test_a_name_resolving_to_another_machine_is_named(monkeypatch):
    """The control of the test above: the same pod whose own name is not this
    machine's (a wrong JOB_COMPLETION_INDEX, another Job's name)."""
    pod = {**POD, "TFDIST_JOB_COMPLETIONS": "2", "JOB_COMPLETION_INDEX": "0",
           "TFDIST_PEER_WAIT_S": "5"}
    _local_dns(monkeypatch, {"train-0.workers": "192.0.2.7", "train-1.workers": "127.0.0.1"})
    with pytest.raises(UsageError, match="its name train-0.workers resolves, but not to an "
                                         "address of this pod"):
        cluster.resolve(environ=dict(pod))
