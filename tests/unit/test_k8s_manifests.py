"""The Kubernetes manifests in launch/kubernetes/ are valid and agree with
themselves and with tfdist.

Every built-in resource is validated against Kubernetes' own schema at
K8S_VERSION (kubernetes-validate, strict: an unknown field is an error), one
schema pass per resource; the TFJob is a Kubeflow CRD whose schema
kubernetes-validate does not ship, so its pod template is validated as a
PodTemplateSpec and its own fields by hand against the Kubeflow v1 API.
The fields that must agree with each other (subdomain and Service, the
TFDIST_JOB_* variables and the Job) are `tfdist.k8s_manifest`'s checks, each
with a mutated copy that must fail in exactly the expected line.
"""

import copy
import os
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from conftest import REPO
from tfdist import k8s_manifest, kubernetes_job

# Kubernetes 1.33: still common on managed clusters, and the manifests use
# nothing newer (the batch.kubernetes.io/job-name label needs 1.27). One of
# the releases kubernetes-validate 1.37.0 ships strict schemas for.
K8S_VERSION = "1.33.0"
INDEXED_JOB = "launch/kubernetes/indexed-job.yaml"
TFJOB = "launch/kubernetes/tfjob.yaml"
MANIFESTS = (INDEXED_JOB, TFJOB)
# Every document of the manifests, and how it is validated.
BUILT_IN = [(INDEXED_JOB, "Service", "tfdist"), (INDEXED_JOB, "Job", "tfdist"),
            (TFJOB, "PodTemplate", "tfdist-cnn-worker")]
# The Kubeflow v1 TFJob API (training-operator, pkg/apis/kubeflow.org/v1).
TFJOB_SPEC = {"runPolicy", "successPolicy", "tfReplicaSpecs", "enableDynamicWorker"}
TFJOB_RUN_POLICY = {"cleanPodPolicy", "ttlSecondsAfterFinished", "activeDeadlineSeconds",
                    "backoffLimit", "schedulingPolicy", "suspend", "managedBy"}
TFJOB_REPLICA_TYPES = {"Chief", "Master", "Worker", "PS", "Evaluator"}
TFJOB_REPLICA_SPEC = {"replicas", "template", "restartPolicy"}
TFJOB_RESTART_POLICIES = {"Always", "OnFailure", "Never", "ExitCode"}


def _load(path):
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def _one(documents, kind):
    (found,) = [doc for doc in documents if doc["kind"] == kind]
    return found


def _worker_template(tfjob):
    """The TFJob's pod template as a document Kubernetes' schemas know."""
    return {"apiVersion": "v1", "kind": "PodTemplate",
            "metadata": {"name": f"{tfjob['metadata']['name']}-worker"},
            "template": tfjob["spec"]["tfReplicaSpecs"]["Worker"]["template"]}


def _built_in_resources():
    found = []
    for path in MANIFESTS:
        for doc in _load(path):
            found.append((path, _worker_template(doc) if doc["kind"] == "TFJob" else doc))
    return found


def _schema_problem(doc):
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        return ".".join(str(p) for p in error.path), error.message
    return None


# -- Kubernetes' schemas ---------------------------------------------------------
def test_every_built_in_resource_passes_strict_validation_against_its_schema():
    passed = []
    for path, doc in _built_in_resources():
        # validate() returns the schema's version only after validating against
        # it; a kind without a schema raises SchemaNotFoundError, which fails here.
        version = kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert version == K8S_VERSION.rsplit(".", 1)[0], (path, doc["kind"])
        passed.append((path, doc["kind"], doc["metadata"]["name"]))
    assert passed == BUILT_IN


def test_the_tfjob_has_no_schema_here_so_it_is_checked_by_hand():
    tfjob = _one(_load(TFJOB), "TFJob")
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(tfjob, K8S_VERSION, strict=True)
    assert _tfjob_problems(tfjob) == []


def _tfjob_problems(tfjob):
    """The TFJob's own fields against the Kubeflow v1 API."""
    spec = tfjob.get("spec", {})
    problems = [f"{key}: {tfjob.get(key)!r}" for key, want in
                (("apiVersion", "kubeflow.org/v1"), ("kind", "TFJob")) if tfjob.get(key) != want]
    problems += [f"spec.{key}: unknown" for key in set(spec) - TFJOB_SPEC]
    problems += [f"spec.runPolicy.{key}: unknown"
                 for key in set(spec.get("runPolicy", {})) - TFJOB_RUN_POLICY]
    if not isinstance(spec.get("runPolicy", {}).get("backoffLimit", 0), int):
        problems.append("spec.runPolicy.backoffLimit: not an integer")
    for kind, replica in spec.get("tfReplicaSpecs", {}).items():
        field = f"spec.tfReplicaSpecs.{kind}"
        problems += [f"{field}: unknown replica type"] if kind not in TFJOB_REPLICA_TYPES else []
        problems += [f"{field}.{key}: unknown" for key in set(replica) - TFJOB_REPLICA_SPEC]
        if not (isinstance(replica.get("replicas", 1), int) and replica.get("replicas", 1) >= 1):
            problems.append(f"{field}.replicas: not a positive integer")
        if replica.get("restartPolicy", "Never") not in TFJOB_RESTART_POLICIES:
            problems.append(f"{field}.restartPolicy: {replica['restartPolicy']!r}")
    return problems


def test_the_tfjob_hand_check_finds_a_wrong_field():
    tfjob = _one(_load(TFJOB), "TFJob")
    broken = copy.deepcopy(tfjob)
    worker = broken["spec"]["tfReplicaSpecs"]["Worker"]
    worker["replica"] = worker.pop("replicas")
    worker["restartPolicy"] = "Sometimes"
    broken["spec"]["runPolicy"]["backofLimit"] = 3
    assert sorted(_tfjob_problems(broken)) == [
        "spec.runPolicy.backofLimit: unknown",
        "spec.tfReplicaSpecs.Worker.replica: unknown",
        "spec.tfReplicaSpecs.Worker.restartPolicy: 'Sometimes'"]


def test_strict_validation_fails_on_an_unknown_field():
    job = copy.deepcopy(_one(_load(INDEXED_JOB), "Job"))
    job["spec"]["template"]["spec"]["containers"][0]["portz"] = [{"containerPort": 2222}]
    path, message = _schema_problem(job)
    assert path == "spec.template.spec.containers.0"
    assert "'portz' was unexpected" in message
    template = _worker_template(copy.deepcopy(_one(_load(TFJOB), "TFJob")))
    template["template"]["spec"]["containers"][0]["volumeMount"] = []
    assert _schema_problem(template)[0] == "template.spec.containers.0"


def test_strict_validation_fails_on_a_wrong_type():
    job = copy.deepcopy(_one(_load(INDEXED_JOB), "Job"))
    job["spec"]["completions"] = "2"
    assert _schema_problem(job) == ("spec.completions", "'2' is not of type 'integer', 'null'")
    service = copy.deepcopy(_one(_load(INDEXED_JOB), "Service"))
    service["spec"]["publishNotReadyAddresses"] = "yes"
    assert _schema_problem(service)[0] == "spec.publishNotReadyAddresses"


# -- tfdist.k8s_manifest ---------------------------------------------------------
def _both():
    """The documents of both manifests and the file of each."""
    documents, files = [], []
    for path in MANIFESTS:
        found = _load(path)
        documents += found
        files += [path] * len(found)
    return documents, files


def test_the_shipped_manifests_agree():
    documents, files = _both()
    assert k8s_manifest.check(documents, files) == []


def test_tfdist_reads_the_shipped_pods_environment_as_the_jobs_cluster():
    """The environment Kubernetes gives pod 1 of the shipped Job (its literal
    variables, the downward API's label, JOB_COMPLETION_INDEX), read by tfdist."""
    job = _one(_load(INDEXED_JOB), "Job")
    environ = {"JOB_COMPLETION_INDEX": "1", "HOSTNAME": "tfdist-1"}
    for item in job["spec"]["template"]["spec"]["containers"][0]["env"]:
        path = item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        environ[item["name"]] = (job["metadata"]["name"]
                                 if path == "metadata.labels['batch.kubernetes.io/job-name']"
                                 else item["value"])
    task = kubernetes_job.task_from_environ(environ)
    assert task.hosts == ["tfdist-0.tfdist:2222", "tfdist-1.tfdist:2222"]
    assert task.address == "tfdist-1.tfdist:2222"


def test_a_service_in_another_file_is_found():
    documents, _ = _both()
    assert k8s_manifest.check(documents, ["service.yaml", "job.yaml", "tfjob.yaml"]) == []
    assert k8s_manifest.check(documents[1:], ["job.yaml", "tfjob.yaml"]) == [
        "job.yaml: Job/tfdist: spec.template.spec.subdomain: 'tfdist' names no Service in "
        "these files; expected the name of the Job's headless Service (none is defined)"]


def _container(documents):
    return _one(documents, "Job")["spec"]["template"]["spec"]["containers"][0]


def _set_env(documents, name, value):
    for item in _container(documents)["env"]:
        if item["name"] == name:
            item["value"] = value


def _rename_subdomain(docs):
    _one(docs, "Job")["spec"]["template"]["spec"]["subdomain"] = "workers"
    _set_env(docs, "TFDIST_JOB_SERVICE", "workers")


def _scale_without_env(docs):
    _one(docs, "Job")["spec"].update(completions=3, parallelism=3)


def _drop_completion_mode(docs):
    del _one(docs, "Job")["spec"]["completionMode"]


def _add_to_args(*words):
    return lambda docs: _container(docs)["args"].extend(words)


def _name_from(path):
    def mutate(docs):
        env = _container(docs)["env"]
        next(e for e in env if e["name"] == "TFDIST_JOB_NAME")["valueFrom"]["fieldRef"][
            "fieldPath"] = path
    return mutate


JOB, SERVICE, CONTAINER = (f"{INDEXED_JOB}: Job/tfdist", f"{INDEXED_JOB}: Service/tfdist",
                           f"{INDEXED_JOB}: Job/tfdist: spec.template.spec.containers[0]")
MUTATIONS = {
    "subdomain renamed": (_rename_subdomain, [
        f"{JOB}: spec.template.spec.subdomain: 'workers' names no Service in these files; "
        "expected the name of the Job's headless Service (here: 'tfdist')"]),
    "selector changed": (lambda docs: _one(docs, "Service")["spec"].update(
        selector={"job-name": "other"}), [
        f"{SERVICE}: spec.selector: job-name=other does not select the pods of Job/tfdist; "
        "expected some of their labels: batch.kubernetes.io/job-name=tfdist, job-name=tfdist"]),
    "selector on a label the pods lack": (lambda docs: _one(docs, "Service")["spec"][
        "selector"].update(app="tfdist"), [
        f"{SERVICE}: spec.selector: batch.kubernetes.io/job-name=tfdist, app=tfdist does not "
        "select the pods of Job/tfdist; expected some of their labels: "
        "batch.kubernetes.io/job-name=tfdist, job-name=tfdist"]),
    "publishNotReadyAddresses removed": (lambda docs: _one(docs, "Service")["spec"].pop(
        "publishNotReadyAddresses"), [
        f"{SERVICE}: spec.publishNotReadyAddresses: missing; expected true (a pod's name must "
        "resolve before the pod is ready: every worker waits for its peers' names)"]),
    "clusterIP removed": (lambda docs: _one(docs, "Service")["spec"].pop("clusterIP"), [
        f"{SERVICE}: spec.clusterIP: missing; expected None (headless: one DNS name per pod)"]),
    "completions changed without the env": (_scale_without_env, [
        f"{CONTAINER}.env[TFDIST_JOB_COMPLETIONS]: '2'; expected '3' (spec.completions)"]),
    "parallelism below completions": (lambda docs: _one(docs, "Job")["spec"].update(
        parallelism=1), [
        f"{JOB}: spec.parallelism: 1; expected 2 (spec.completions): synchronous training "
        "needs every worker at once"]),
    "completionMode removed": (_drop_completion_mode, [
        f"{JOB}: spec.completionMode: missing; expected Indexed (each pod's completion index "
        "is its worker index)"]),
    "service variable differs": (lambda docs: _set_env(docs, "TFDIST_JOB_SERVICE", "other"), [
        f"{CONTAINER}.env[TFDIST_JOB_SERVICE]: 'other'; expected 'tfdist' "
        "(spec.template.spec.subdomain)"]),
    "job name from another label": (_name_from("metadata.labels['app']"), [
        f"{CONTAINER}.env[TFDIST_JOB_NAME].valueFrom: \"metadata.labels['app']\"; expected "
        "fieldRef.fieldPath: metadata.labels['batch.kubernetes.io/job-name'] (the Job's name)"]),
    "service port changed": (lambda docs: _one(docs, "Service")["spec"]["ports"][0].update(
        port=2223), [
        f"{SERVICE}: spec.ports: no port 2222; expected port: 2222 (TFDIST_JOB_PORT of "
        "Job/tfdist)"]),
    "container port changed": (lambda docs: _container(docs)["ports"][0].update(
        containerPort=2223), [
        f"{CONTAINER}.ports: no containerPort 2222; expected containerPort: 2222 "
        "(TFDIST_JOB_PORT)"]),
    "port variable changed": (lambda docs: _set_env(docs, "TFDIST_JOB_PORT", "2223"), [
        f"{CONTAINER}.ports: no containerPort 2223; expected containerPort: 2223 "
        "(TFDIST_JOB_PORT)",
        f"{SERVICE}: spec.ports: no port 2223; expected port: 2223 (TFDIST_JOB_PORT of "
        "Job/tfdist)"]),
    "port variable not a port": (lambda docs: _set_env(docs, "TFDIST_JOB_PORT", "http"), [
        f"{CONTAINER}.env[TFDIST_JOB_PORT]: 'http'; expected a port, an integer in 1-65535 "
        "(default 2222)"]),
    "a host list added": (_add_to_args("--worker_hosts=tfdist-0.tfdist:2222",
                                       "--task_index=0"), [
        f"{CONTAINER}.args: passes --task_index, --worker_hosts; expected no host list: "
        "tfdist composes the cluster from the Job's variables"]),
    "a failed pod not restarted": (lambda docs: _one(docs, "Job")["spec"]["template"][
        "spec"].update(restartPolicy="Never"), [
        f"{JOB}: spec.template.spec.restartPolicy: 'Never'; expected OnFailure (a failed "
        "worker restarts in its pod, with its name, and its peers with it)"]),
    "no restart allowed": (lambda docs: _one(docs, "Job")["spec"].update(backoffLimit=0), [
        f"{JOB}: spec.backoffLimit: 0; expected at least 2 (a lost worker restarts, and so "
        "does each peer)"]),
    "tfjob container renamed": (lambda docs: _one(docs, "TFJob")["spec"]["tfReplicaSpecs"][
        "Worker"]["template"]["spec"]["containers"][0].update(name="trainer"), [
        f"{TFJOB}: TFJob/tfdist-cnn: spec.tfReplicaSpecs.Worker.template.spec.containers: no "
        "container named 'tensorflow'; expected one (the operator trains in it)"]),
    "tfjob port renamed": (lambda docs: _one(docs, "TFJob")["spec"]["tfReplicaSpecs"][
        "Worker"]["template"]["spec"]["containers"][0]["ports"][0].update(name="grpc"), [
        f"{TFJOB}: TFJob/tfdist-cnn: spec.tfReplicaSpecs.Worker.template.spec.containers[0]"
        ".ports: no port named 'tfjob-port'; expected one (the operator writes its "
        "containerPort into TF_CONFIG)"]),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_each_cross_field_check_finds_its_mutation(mutation):
    mutate, expected = MUTATIONS[mutation]
    documents, files = _both()
    broken = copy.deepcopy(documents)
    mutate(broken)
    assert broken != documents
    assert k8s_manifest.check(broken, files) == expected


# -- the command line -------------------------------------------------------------
def _run_cli(*paths):
    return subprocess.run([sys.executable, "-m", "tfdist.k8s_manifest", *paths], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_the_command_line_passes_the_shipped_manifests():
    done = _run_cli(*MANIFESTS)
    assert (done.returncode, done.stdout.splitlines(), done.stderr) == (
        0, [f"{path}: ok" for path in MANIFESTS], "")


def test_the_command_line_exits_2_with_one_line_on_a_broken_file(tmp_path):
    documents = _load(INDEXED_JOB)
    del _one(documents, "Service")["spec"]["publishNotReadyAddresses"]
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump_all(documents))
    done = _run_cli(str(broken))
    assert done.returncode == 2
    assert done.stdout.splitlines() == [
        f"{broken}: Service/tfdist: spec.publishNotReadyAddresses: missing; expected true (a "
        "pod's name must resolve before the pod is ready: every worker waits for its peers' "
        "names)"]
