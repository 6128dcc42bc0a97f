"""A Kubernetes Indexed Job as a TF_CONFIG cluster, from the pod's environment.

Plain Python, no TensorFlow: like TF_CONFIG and Slurm (`tfdist.cluster`), a
bad description fails in one line before TensorFlow starts.

In an Indexed Job every pod gets `JOB_COMPLETION_INDEX` from Kubernetes and
the host name `<job>-<index>`; with the pod template's `subdomain` naming a
headless Service, cluster DNS gives each pod the name `<job>-<index>.<service>`
(in the pod's namespace, which its resolver searches). The manifest
(`launch/kubernetes/indexed-job.yaml`) tells tfdist the rest in its own
variables, which `python -m tfdist.k8s_manifest` checks against the Job:

    TFDIST_JOB_COMPLETIONS  the Job's spec.completions (the number of workers)
    TFDIST_JOB_NAME         the Job's name (the downward API's job-name label)
    TFDIST_JOB_SERVICE      the headless Service: the pod template's subdomain
    TFDIST_JOB_PORT         the workers' port (default 2222)

Setting TFDIST_JOB_COMPLETIONS is what asks for the cluster: a pod of an
Indexed Job without it is one process, as before.

A pod's DNS record appears only once the pod exists (and, unless the Service
publishes not-ready addresses, once it is ready), and CoreDNS caches a name
that did not resolve for up to 30 s. So each worker waits, polling, until
every peer's name resolves, for up to TFDIST_PEER_WAIT_S seconds (default
180: past the negative cache and the slowest pod's image pull on a warm
node), logging once which name it waits for; a name that never resolves is
an error naming it and what to check.
"""

from __future__ import annotations

import dataclasses
import re
import socket
import time
from typing import Callable, Optional

from tfdist import tf_config
from tfdist.errors import UsageError

COMPLETIONS, NAME, SERVICE, PORT = ("TFDIST_JOB_COMPLETIONS", "TFDIST_JOB_NAME",
                                    "TFDIST_JOB_SERVICE", "TFDIST_JOB_PORT")
INDEX = "JOB_COMPLETION_INDEX"
WAIT_ENV = "TFDIST_PEER_WAIT_S"
DEFAULT_PORT, DEFAULT_WAIT_S, POLL_S = 2222, 180.0, 1.0
# RFC 1123 labels, as Kubernetes requires of Job and Service names.
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


@dataclasses.dataclass(frozen=True)
class JobTask:
    """This pod's place in its Indexed Job."""

    job: str
    service: str
    completions: int
    index: int
    port: int

    @property
    def hosts(self) -> list[str]:
        """Every worker's address, in index order."""
        return [f"{self.job}-{i}.{self.service}:{self.port}" for i in range(self.completions)]

    @property
    def address(self) -> str:
        return self.hosts[self.index]

    def tf_config(self) -> str:
        return tf_config.compose({"worker": self.hosts}, "worker", self.index)

    def describe(self) -> str:
        return f"Kubernetes Indexed Job {self.job!r}, pod {self.index} of {self.completions}"


def task_from_environ(environ) -> Optional[JobTask]:
    """This pod's task, or None when TFDIST_JOB_COMPLETIONS is not set."""
    if not environ.get(COMPLETIONS):
        return None
    completions = _integer(environ, COMPLETIONS, low=1)
    if not environ.get(INDEX):
        raise UsageError(f"{COMPLETIONS}={completions} asks for an Indexed Job's cluster, but "
                         f"{INDEX} is not set: the Job needs completionMode: Indexed "
                         "(launch/kubernetes/indexed-job.yaml), or set TF_CONFIG yourself")
    index = _integer(environ, INDEX, low=0)
    if index >= completions:
        raise UsageError(f"{INDEX}={index} is out of range for {COMPLETIONS}={completions} "
                         f"(valid: 0-{completions - 1}); {COMPLETIONS} must be the Job's "
                         "spec.completions")
    job = _name(environ, NAME, _job_from_hostname(environ, index))
    service = _name(environ, SERVICE, None)
    port = _integer(environ, PORT, low=1, high=65535) if environ.get(PORT) else DEFAULT_PORT
    return JobTask(job=job, service=service, completions=completions, index=index, port=port)


def _integer(environ, variable: str, low: int, high: Optional[int] = None) -> int:
    text = environ[variable].strip()
    valid = f"an integer >= {low}" if high is None else f"an integer in {low}-{high}"
    if not (text.isascii() and text.isdigit()) or int(text) < low or (
            high is not None and int(text) > high):
        raise UsageError(f"{variable}={environ[variable]!r}: expected {valid}")
    return int(text)


def _job_from_hostname(environ, index: int) -> Optional[str]:
    """The Job's name from the pod's host name `<job>-<index>`, if it has that form."""
    host = environ.get("HOSTNAME") or socket.gethostname()
    suffix = f"-{index}"
    return host[:-len(suffix)] if host.endswith(suffix) and len(host) > len(suffix) else None


def _name(environ, variable: str, fallback: Optional[str]) -> str:
    value = environ.get(variable, "").strip() or fallback
    if not value:
        raise UsageError(f"{variable} is not set: set it in the pod's environment "
                         "(launch/kubernetes/indexed-job.yaml shows how)")
    if len(value) > 63 or not _LABEL.fullmatch(value):
        raise UsageError(f"{variable}={value!r}: expected a Kubernetes name (lower-case "
                         "letters, digits and '-', at most 63 characters)")
    return value


def wait_for_peers(task: JobTask, environ, log: Callable[[str], None] = print,
                   resolve: Optional[Callable[[str], object]] = None,
                   clock: Callable[[], float] = time.monotonic,
                   sleep: Callable[[float], None] = time.sleep) -> None:
    """Return once every worker's name resolves; UsageError naming the first
    that did not within TFDIST_PEER_WAIT_S seconds."""
    limit = DEFAULT_WAIT_S
    if environ.get(WAIT_ENV):
        try:
            limit = float(environ[WAIT_ENV])
        except ValueError:
            raise UsageError(f"{WAIT_ENV}={environ[WAIT_ENV]!r}: expected seconds, "
                             f"e.g. {WAIT_ENV}={int(DEFAULT_WAIT_S)}") from None
    deadline = clock() + limit
    waiting = [address.rpartition(":")[0] for address in task.hosts]
    announced = None
    while waiting:
        name = waiting[0]
        if _resolves(name, resolve):
            waiting.pop(0)
            continue
        if clock() >= deadline:
            raise UsageError(
                f"{task.describe()}: the name {name} did not resolve within {limit:.0f} s "
                f"({WAIT_ENV}); check that the Service {task.service!r} exists, is headless "
                "with publishNotReadyAddresses: true, selects the Job's pods, and is the pod "
                f"template's subdomain, and that pod {name.split('.')[0]} was created")
        if announced != name:
            log(f"{task.describe()}: waiting for {name} to resolve (up to {limit:.0f} s)")
            announced = name
        sleep(POLL_S)


def _resolves(name: str, resolve) -> bool:
    try:
        return bool((resolve or socket.getaddrinfo)(name, None))
    except (OSError, UnicodeError):
        return False
