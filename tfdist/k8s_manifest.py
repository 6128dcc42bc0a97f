"""Checks the fields of tfdist's Kubernetes manifests that must agree with
each other, which no schema can: `launch/kubernetes/indexed-job.yaml` and
`launch/kubernetes/tfjob.yaml`, or a user's copies.

    python -m tfdist.k8s_manifest FILE...

prints each problem on one line (the file, the resource as Kind/name, the
field, and what would be valid) and exits 2, or prints `FILE: ok` for each
file and exits 0. The files are read together: a Job's Service may be in
another file. Plain Python; PyYAML reads the files (the `test` extra pins it).

An Indexed Job (a Job with `completionMode: Indexed` or a container setting
TFDIST_JOB_COMPLETIONS) is checked as tfdist reads it (`tfdist.kubernetes_job`):
its pod template's `subdomain` names a Service in the files that is headless,
publishes not-ready addresses and selects the Job's pods; TFDIST_JOB_COMPLETIONS
is `spec.completions` and `parallelism` is too; TFDIST_JOB_SERVICE is the
subdomain; TFDIST_JOB_NAME is the Job's name; TFDIST_JOB_PORT (default 2222)
is a containerPort and a port of the Service; no container also passes a
host list (`--worker_hosts`, `--task_index`); and a failed worker restarts in
its pod (`restartPolicy: OnFailure`, `backoffLimit` at least 2: one loss
restarts the lost worker and its peers). A Kubeflow TFJob's Worker
replica needs a container named `tensorflow` with a port named `tfjob-port`.
"""

from __future__ import annotations

import re
import sys
from typing import NamedTuple, Optional

from tfdist.kubernetes_job import COMPLETIONS, DEFAULT_PORT, NAME, PORT, SERVICE

PROG = "tfdist.k8s_manifest"
# Kubernetes labels every pod of a Job with the Job's name under both keys
# (the second since 1.27), besides the template's own labels.
JOB_NAME_LABELS = ("batch.kubernetes.io/job-name", "job-name")
HOST_FLAGS = re.compile(r"(?<![\w-])--?(worker_hosts|task_index)\b")
TFJOB_CONTAINER, TFJOB_PORT_NAME = "tensorflow", "tfjob-port"
POD = "spec.template.spec"


class Resource(NamedTuple):
    """One document of a manifest and the file it came from."""

    file: str
    body: dict

    @property
    def kind(self) -> str:
        return str(self.body.get("kind", ""))

    @property
    def name(self) -> str:
        return str(_at(self.body, "metadata", "name") or "")

    def problem(self, field: str, text: str) -> str:
        return f"{self.file}: {self.kind}/{self.name}: {field}: {text}"


def _at(value, *keys):
    """value[k1][k2]..., or None where a level is missing or not a mapping."""
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _show(value) -> str:
    return "missing" if value is None else repr(value)


def check(documents: list[dict], files: Optional[list[str]] = None) -> list[str]:
    """One line per problem in `documents` (read together), empty when they
    agree; `files[i]` names where `documents[i]` came from."""
    if files is None:
        files = [f"document {i + 1}" for i in range(len(documents))]
    if len(files) != len(documents):
        raise ValueError(f"{len(documents)} documents but {len(files)} file names")
    problems, resources = [], []
    for i, (file, body) in enumerate(zip(files, documents)):
        if isinstance(body, dict):
            resources.append(Resource(file, body))
        else:
            problems.append(f"{file}: document {i + 1}: not a mapping; expected a "
                            "Kubernetes object (apiVersion, kind, metadata, ...)")
    services = [r for r in resources if r.kind == "Service"]
    for resource in resources:
        if _is_tfdist_job(resource):
            problems += _check_job(resource, services)
        elif resource.kind == "TFJob":
            problems += _check_tfjob(resource)
    return list(dict.fromkeys(problems))   # a Service shared by two Jobs: once


def _is_tfdist_job(resource: Resource) -> bool:
    if resource.kind != "Job":
        return False
    return (_at(resource.body, "spec", "completionMode") == "Indexed"
            or any(COMPLETIONS in _env(c) for _, c in _containers(resource)))


def _containers(resource: Resource, pod_path=("spec", "template", "spec")):
    containers = _at(resource.body, *pod_path, "containers")
    return [(i, c) for i, c in enumerate(containers or []) if isinstance(c, dict)]


def _env(container: dict) -> dict:
    """Each variable's literal value; "valueFrom" stands for any other source."""
    found = {}
    for item in container.get("env") or []:
        if isinstance(item, dict) and "name" in item:
            found[item["name"]] = ("valueFrom" if "valueFrom" in item
                                   else str(item.get("value", "")))
    return found


def _check_job(job: Resource, services: list[Resource]) -> list[str]:
    spec = _at(job.body, "spec") or {}
    problems = []
    if spec.get("completionMode") != "Indexed":
        problems.append(job.problem("spec.completionMode", f"{_show(spec.get('completionMode'))}; "
                                    "expected Indexed (each pod's completion index is its "
                                    "worker index)"))
    completions = spec.get("completions")
    if completions is None:
        problems.append(job.problem("spec.completions", "missing; expected the number of "
                                    "workers (an Indexed Job needs it)"))
    elif spec.get("parallelism") not in (None, completions):
        problems.append(job.problem("spec.parallelism", f"{spec['parallelism']!r}; expected "
                                    f"{completions!r} (spec.completions): synchronous "
                                    "training needs every worker at once"))
    problems += _check_restarts(job, spec)
    subdomain = _at(spec, "template", "spec", "subdomain")
    service = _find_service(job, subdomain, services, problems)
    containers = _tfdist_containers(job)
    if not containers:
        problems.append(job.problem(f"{POD}.containers", "missing; expected tfdist's container"))
    for i, container in containers:
        port = _check_env(job, i, container, completions, subdomain, problems)
        problems += _check_ports(job, i, container, port, service)
        problems += _host_flags(job, i, container)
    if service is not None:
        problems += _check_service(service, job)
    return problems


def _check_restarts(job: Resource, spec: dict) -> list[str]:
    """A lost worker ends its peers too (non-zero), and all must start again
    together: each container restarts in its pod (OnFailure), and the Job's
    backoffLimit, which counts the restarts of all pods, allows at least the
    two of one loss."""
    problems, policy = [], _at(spec, "template", "spec", "restartPolicy")
    if policy != "OnFailure":
        problems.append(job.problem(f"{POD}.restartPolicy", f"{_show(policy)}; expected "
                                    "OnFailure (a failed worker restarts in its pod, with its "
                                    "name, and its peers with it)"))
    limit = spec.get("backoffLimit", 6)   # Kubernetes' default
    if not isinstance(limit, int) or limit < 2:
        problems.append(job.problem("spec.backoffLimit", f"{limit!r}; expected at least 2 (a "
                                    "lost worker restarts, and so does each peer)"))
    return problems


def _tfdist_containers(job: Resource) -> list:
    """The containers that set tfdist's variables, or else the first one (whose
    missing variables are then the problems)."""
    containers = _containers(job)
    return [(i, c) for i, c in containers
            if set(_env(c)) & {COMPLETIONS, NAME, SERVICE, PORT}] or containers[:1]


def _find_service(job: Resource, subdomain, services: list[Resource],
                  problems: list[str]) -> Optional[Resource]:
    field = f"{POD}.subdomain"
    if not subdomain:
        problems.append(job.problem(field, "missing; expected the name of a headless "
                                    "Service in these files (it gives each pod its DNS name)"))
        return None
    namespace = _at(job.body, "metadata", "namespace")
    for service in services:
        theirs = _at(service.body, "metadata", "namespace")
        if service.name == subdomain and (not namespace or not theirs or namespace == theirs):
            return service
    names = ", ".join(repr(s.name) for s in services)
    problems.append(job.problem(field, f"{subdomain!r} names no Service in these files; "
                                f"expected the name of the Job's headless Service "
                                f"({'here: ' + names if names else 'none is defined'})"))
    return None


def _check_env(job: Resource, i: int, container: dict, completions, subdomain,
               problems: list[str]) -> Optional[int]:
    """The TFDIST_JOB_* variables against the Job; the port tfdist will use,
    or None when TFDIST_JOB_PORT is not a port."""
    env, field = _env(container), f"{POD}.containers[{i}].env"
    if completions is not None and env.get(COMPLETIONS) != str(completions):
        problems.append(job.problem(f"{field}[{COMPLETIONS}]", f"{_show(env.get(COMPLETIONS))}; "
                                    f"expected {str(completions)!r} (spec.completions)"))
    if subdomain and env.get(SERVICE) != subdomain:
        problems.append(job.problem(f"{field}[{SERVICE}]", f"{_show(env.get(SERVICE))}; "
                                    f"expected {subdomain!r} ({POD}.subdomain)"))
    if env.get(NAME) == "valueFrom":
        path = _name_field_path(container)
        if path not in [f"metadata.labels['{label}']" for label in JOB_NAME_LABELS]:
            problems.append(job.problem(f"{field}[{NAME}].valueFrom", f"{_show(path)}; expected "
                                        f"fieldRef.fieldPath: metadata.labels"
                                        f"['{JOB_NAME_LABELS[0]}'] (the Job's name)"))
    elif NAME in env and env[NAME] != job.name:
        problems.append(job.problem(f"{field}[{NAME}]", f"{env[NAME]!r}; expected {job.name!r} "
                                    "(metadata.name)"))
    text = env.get(PORT, str(DEFAULT_PORT))
    if text.isascii() and text.isdigit() and 1 <= int(text) <= 65535:
        return int(text)
    problems.append(job.problem(f"{field}[{PORT}]", f"{text!r}; expected a port, an "
                                f"integer in 1-65535 (default {DEFAULT_PORT})"))
    return None


def _name_field_path(container: dict):
    for item in container.get("env") or []:
        if isinstance(item, dict) and item.get("name") == NAME:
            return _at(item, "valueFrom", "fieldRef", "fieldPath")
    return None


def _check_ports(job: Resource, i: int, container: dict, port: Optional[int],
                 service: Optional[Resource]) -> list[str]:
    if port is None:
        return []
    problems = []
    declared = [p.get("containerPort") for p in container.get("ports") or []
                if isinstance(p, dict)]
    if port not in declared:
        problems.append(job.problem(f"{POD}.containers[{i}].ports", f"no containerPort {port}; "
                                    f"expected containerPort: {port} ({PORT})"))
    if service is not None:
        offered = [p.get("port") for p in _at(service.body, "spec", "ports") or []
                   if isinstance(p, dict)]
        if port not in offered:
            problems.append(service.problem("spec.ports", f"no port {port}; expected port: "
                                            f"{port} ({PORT} of Job/{job.name})"))
    return problems


def _host_flags(job: Resource, i: int, container: dict) -> list[str]:
    problems = []
    for key in ("command", "args"):
        words = container.get(key) or []
        flags = sorted({m.group(1) for w in words if isinstance(w, str)
                        for m in HOST_FLAGS.finditer(w)})
        if flags:
            problems.append(job.problem(
                f"{POD}.containers[{i}].{key}", f"passes {', '.join('--' + f for f in flags)}; "
                "expected no host list: tfdist composes the cluster from the Job's variables"))
    return problems


def _check_service(service: Resource, job: Resource) -> list[str]:
    spec = _at(service.body, "spec") or {}
    problems = []
    if spec.get("clusterIP") != "None":
        problems.append(service.problem("spec.clusterIP", f"{_show(spec.get('clusterIP'))}; "
                                        "expected None (headless: one DNS name per pod)"))
    if spec.get("publishNotReadyAddresses") is not True:
        problems.append(service.problem(
            "spec.publishNotReadyAddresses", f"{_show(spec.get('publishNotReadyAddresses'))}; "
            "expected true (a pod's name must resolve before the pod is ready: every worker "
            "waits for its peers' names)"))
    labels = {**(_at(job.body, "spec", "template", "metadata", "labels") or {}),
              **{label: job.name for label in JOB_NAME_LABELS}}
    selector = spec.get("selector")
    if not selector or not isinstance(selector, dict) or any(
            labels.get(k) != v for k, v in selector.items()):
        shown = ", ".join(f"{k}={v}" for k, v in selector.items()) if isinstance(
            selector, dict) and selector else "missing"
        problems.append(service.problem(
            "spec.selector", f"{shown} does not select the pods of Job/{job.name}; expected "
            f"some of their labels: {', '.join(f'{k}={v}' for k, v in sorted(labels.items()))}"))
    return problems


def _check_tfjob(tfjob: Resource) -> list[str]:
    field = "spec.tfReplicaSpecs.Worker"
    if not isinstance(_at(tfjob.body, "spec", "tfReplicaSpecs", "Worker"), dict):
        return [tfjob.problem(field, "missing; expected the workers' replica spec "
                              "(replicas, restartPolicy, template)")]
    pod = ("spec", "tfReplicaSpecs", "Worker", "template", "spec")
    named = [(i, c) for i, c in _containers(tfjob, pod) if c.get("name") == TFJOB_CONTAINER]
    if not named:
        return [tfjob.problem(f"{field}.template.spec.containers", f"no container named "
                              f"{TFJOB_CONTAINER!r}; expected one (the operator trains in it)")]
    i, container = named[0]
    if not any(isinstance(p, dict) and p.get("name") == TFJOB_PORT_NAME
               for p in container.get("ports") or []):
        return [tfjob.problem(f"{field}.template.spec.containers[{i}].ports",
                              f"no port named {TFJOB_PORT_NAME!r}; expected one (the "
                              "operator writes its containerPort into TF_CONFIG)")]
    return []


def load(path: str) -> list:
    """The YAML documents of `path` (empty ones left out)."""
    import yaml
    with open(path, encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def main(argv=None) -> int:
    paths = sys.argv[1:] if argv is None else list(argv)
    if paths in (["-h"], ["--help"]):
        print(f"usage: python -m {PROG} FILE...\n\n{__doc__.strip()}")
        return 0
    if not paths or any(p.startswith("-") for p in paths):
        print(f"usage: python -m {PROG} FILE...", file=sys.stderr)
        return 2
    try:
        import yaml
    except ImportError:
        print(f"{PROG}: error: PyYAML is not installed (pip install PyYAML, or tfdist[test])",
              file=sys.stderr)
        return 2
    documents, files = [], []
    for path in paths:
        try:
            found = load(path)
        except (OSError, UnicodeError, yaml.YAMLError) as error:
            print(f"{PROG}: error: {path}: {' '.join(str(error).split())}", file=sys.stderr)
            return 2
        documents += found
        files += [path] * len(found)
    problems = check(documents, files)
    for line in problems or [f"{path}: ok" for path in paths]:
        print(line)
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
