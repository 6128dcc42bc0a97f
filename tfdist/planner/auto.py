"""`--strategy=auto`: run the planner's winner for this model, batch, cluster
and host, planned once and cached.

A plan is keyed by what was planned (`what`: the model's variables, the
global batch, the data, the optimizer, the cluster's size, the budget and
whether lossy choices were allowed) and records where it was made (`where`:
the CPU, TensorFlow's and tfdist's versions). A cached plan whose key
matches is reused where it was made on this kind of host with these
versions; else it is not reused, the log says why, and the run plans again.
On a cluster the chief plans (its trials run on its host) and writes the
plan; the other workers wait for it, bounded, or find it cached. A cluster
over several hosts is planned when `--link_bandwidth` says what the links
between them carry (trials on the chief's host do not measure them), else
refused unless its plan is cached.

Plans live in the cache directory (`TFDIST_CACHE_DIR`, default
~/.cache/tfdist) under plans/KEY.json; on a cluster of several hosts every
worker must see the same directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional

from tfdist import cluster as cluster_lib
from tfdist import strategies
from tfdist.strategies import records
from tfdist.config import RunConfig
from tfdist.errors import UsageError
from tfdist.observe import hardware

# The seconds a worker waits for the chief's plan beyond the search's own bound.
WAIT_MARGIN_S = 300.0
POLL_S = 0.5


@dataclasses.dataclass
class Choice:
    """The plan a run follows: its key, the winner's engine and options."""

    key: str
    path: str
    engine: str
    options: dict
    describe: str
    runner_up: str = ""
    reused: bool = False

    def summary(self) -> dict:
        """For the run summary: what was chosen and whether it was planned now."""
        return {"key": self.key, "chosen": self.describe, "runner_up": self.runner_up,
                "reused": self.reused, "path": self.path}


def cache_path(key: str) -> str:
    return os.path.join(hardware.cache_dir(), "plans", f"{key}.json")


def what_of(config: RunConfig, signature: str, processes: int, hosts: int,
            memory_budget: Optional[int], allow_lossy: bool,
            link_bandwidth: Optional[float] = None) -> dict:
    """What a plan answers: the same `what` gets the same key."""
    data = config.data
    return {"model": signature, "global_batch": config.train.global_batch_size,
            "data": "synthetic" if data.synthetic else data.dataset,
            "shuffle_buffer": None if data.synthetic else data.shuffle_buffer,
            "optimizer": config.optimizer.name,
            "precision": None if allow_lossy else config.train.precision,
            "processes": processes, "hosts": hosts,
            "virtual_devices": config.strategy.virtual_devices,
            "memory_budget": memory_budget, "allow_lossy": allow_lossy,
            **({"link_bandwidth": link_bandwidth} if hosts > 1 else {})}


def where_now() -> dict:
    """Where a plan is made: what its measurements depend on."""
    import tensorflow as tf
    from tfdist.planner.calibrate import tfdist_version
    return {"host": hardware.describe(), "cores": len(os.sched_getaffinity(0)),
            "tensorflow": tf.__version__, "tfdist": tfdist_version()}


def key_of(what: dict) -> str:
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def read(path: str) -> Optional[dict]:
    """The cached plan at `path`, or None (absent or unreadable)."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and {"where", "engine", "options"} <= set(
        record) else None


def write(path: str, record: dict) -> None:
    """Atomically: a waiting worker never reads half a plan."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    os.replace(temporary, path)


def stale_reason(record: dict, where: dict) -> Optional[str]:
    """Why a cached plan may not be reused here, or None."""
    made = record.get("where", {})
    changed = [f"{name} {made.get(name)!r}, here {value!r}" for name, value in where.items()
               if made.get(name) != value]
    return f"it was made with {'; '.join(changed)}" if changed else None


def wait_for(path: str, key: str, where: dict, timeout: float,
             clock: Callable[[], float] = time.monotonic) -> dict:
    """A non-chief worker: the chief's plan once written (and fit for this
    host), or `UsageError` naming the key and the path after `timeout` s."""
    deadline = clock() + timeout
    while True:
        record = read(path)
        if record is not None and stale_reason(record, where) is None:
            return record
        if clock() >= deadline:
            found = f" (the one there: {stale_reason(record, where)})" if record else ""
            raise UsageError(
                f"--strategy=auto: no plan {key} from the chief after {timeout:.0f} s at "
                f"{path}{found}; the chief plans and writes it there (every worker must see "
                "the same TFDIST_CACHE_DIR), or plan ahead with tfdist-plan and run its "
                "flagfile")
        time.sleep(POLL_S)


def choose(config: RunConfig, *, model_fn=None, dataset_fn=None, spec=None,
           layout_rules=None, options: Optional[dict] = None) -> tuple[RunConfig, Choice]:
    """`config` with the plan's winner in place of `--strategy=auto`, and the
    plan followed. The key's model build and the planning run in a process of
    their own (`python -m tfdist.planner.choose`): this one starts no
    TensorFlow before its engine, which multi_worker and dtensor require."""
    from tfdist import config as config_lib
    from tfdist.planner import functions as functions_lib, search as search_lib
    options = dict(options or {})
    request = {"flags": config_lib.as_flags(config), "options": options,
               "functions": functions_lib.records(model_fn, dataset_fn, layout_rules, spec)}
    timeout = options.get("search_seconds", 180.0) + WAIT_MARGIN_S + 120.0
    with tempfile.TemporaryDirectory(prefix="tfdist-auto-") as scratch:
        request_path, out = os.path.join(scratch, "request.json"), os.path.join(scratch, "out")
        with open(request_path, "w") as f:
            json.dump(request, f)
        proc = subprocess.Popen([sys.executable, "-m", "tfdist.planner.choose", request_path,
                                 out], env={**os.environ, "PYTHONPATH": _python_path()},
                                preexec_fn=_die_with_parent)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise UsageError(f"--strategy=auto: the plan took over {timeout:.0f} s; lower "
                             "--search_seconds or plan ahead with tfdist-plan") from None
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        answer = read_answer(out)
    if "error" in answer or proc.returncode != 0:
        raise UsageError(answer.get("error") or f"--strategy=auto: the planning process "
                         f"exited with status {proc.returncode}")
    choice = Choice(**answer)
    return search_lib.apply(config, choice.engine, _typed(choice.options)), choice


def _die_with_parent() -> None:
    """In the planning process: SIGTERM when the training process dies (Linux
    prctl PR_SET_PDEATHSIG), so a killed run leaves no planner behind."""
    import ctypes
    import signal
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def read_answer(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _python_path() -> str:
    """The parent's import path first: a user's model_fn module imports alike."""
    return os.pathsep.join(p for p in [*sys.path, os.environ.get("PYTHONPATH", "")] if p)


def choose_here(config: RunConfig, *, model_fn=None, dataset_fn=None, spec=None,
                layout_rules=None, options: Optional[dict] = None,
                log: Callable[[str], None] = print) -> Choice:
    """The plan `config` follows: cached, made now (chief) or awaited (other
    workers). Runs TensorFlow (the key's model build, the planner)."""
    from tfdist.planner import plan as make_plan
    options = dict(options or {})
    spec_cluster, processes, hosts = _cluster_shape(config)
    options["processes"] = processes
    options["hosts"] = hosts if processes % hosts == 0 else 1
    what = what_of(config, model_signature(config, model_fn, dataset_fn, spec), processes,
                   hosts, options.get("memory_budget"), bool(options.get("allow_lossy")),
                   options.get("link_bandwidth"))
    key = key_of(what)
    path, where = cache_path(key), where_now()
    record = read(path)
    reason = stale_reason(record, where) if record else None
    reused = bool(record) and not reason
    if reused:
        log(f"reusing the plan {key} ({path})")
    elif hosts > 1 and (not options.get("link_bandwidth") or processes % hosts):
        raise _unplannable(key, processes, hosts)   # every worker says so at once
    elif spec_cluster and not spec_cluster.is_chief:
        log(f"waiting for the chief's plan {key} at {path}")
        record = wait_for(path, key, where,
                          options.get("search_seconds", 180.0) + WAIT_MARGIN_S)
    else:
        if reason:
            log(f"the cached plan {key} is not reused: {reason}; planning again")
        log(f"planning {key} for {processes} process(es) (written to {path})")
        base = config.replace(strategy=config.strategy.replace(name=strategies.REFERENCE))
        made = make_plan(base, model_fn=model_fn, dataset_fn=dataset_fn, spec=spec,
                         layout_rules=layout_rules, log=log, launches=_launches(spec_cluster),
                         **options)
        record = {"what": what, "where": where, "engine": made.winner.engine,
                  "options": made.winner.options, "describe": made.winner.describe(),
                  "examples_per_sec": made.winner.measured_rate(),
                  "runner_up": made.runner_up.describe() if made.runner_up else "",
                  "flagfile": made.flagfile()}
        write(path, record)
    return Choice(key=key, path=path, engine=record["engine"], options=record["options"],
                  describe=record.get("describe", record["engine"]),
                  runner_up=record.get("runner_up", ""), reused=reused)


def _launches(spec_cluster) -> tuple:
    """The engines' ways of starting that these processes were started by: a
    TF_CONFIG cluster's workers, or one process."""
    if spec_cluster:
        return (records.WORKERS, records.ONE_OR_WORKERS)
    return (records.ONE_PROCESS, records.ONE_OR_WORKERS)


def _cluster_shape(config: RunConfig) -> tuple:
    """(the cluster or None, its processes, its distinct hosts)."""
    spec_cluster = cluster_lib.resolve(config.strategy.worker_hosts, config.strategy.task_index)
    processes = spec_cluster.num_workers if spec_cluster else 1
    hosts = len({address.rpartition(":")[0] for addresses in
                 (spec_cluster.cluster.values() if spec_cluster else ())
                 for address in addresses}) or 1
    return spec_cluster, processes, hosts


def _unplannable(key: str, processes: int, hosts: int) -> UsageError:
    why = ("give --link_bandwidth (the link between the hosts, e.g. 10gbit): trials on one "
           "host do not measure it" if not processes % hosts else
           f"its {processes} processes are not spread evenly over them")
    return UsageError(f"--strategy=auto cannot plan for a cluster of {hosts} hosts (plan "
                      f"{key}): {why}; or plan with tfdist-plan --plan_workers={processes} "
                      "and run its flagfile on every host")


def _typed(options: dict) -> dict:
    """JSON's lists back to the tuples the configuration declares."""
    from tfdist.planner.search import _fields
    fields = _fields()
    return {name: tuple(value) if isinstance(value, list) and str(
        fields[name][1].type) == "tuple" else value for name, value in options.items()}


def model_signature(config: RunConfig, model_fn, dataset_fn, spec) -> str:
    """The model's variables as a digest, from a build without weight storage
    (nothing is allocated: a model too large for this process still has a key)."""
    from tfdist import models
    from tfdist.data.inputs import of_run as inputs_of_run
    from tfdist.compat import keras_stages
    from tfdist.planner import profile
    inputs = inputs_of_run(config, dataset_fn, spec)
    from tfdist.training.precision import Precision
    with Precision("float32").policy_scope():
        model, _, _ = keras_stages.build_without_storage(
            lambda: inputs.built(model_fn(inputs.spec) if model_fn
                                 else models.build(config.model, inputs.spec)))
    return profile.signature(model)


def train(train_fn: Callable, config: RunConfig, plan_options: Optional[dict], **arguments):
    """`tfdist.train` under `--strategy=auto`: the plan's winner trained
    (`train_fn`, with `arguments`); the plan followed in its summary."""
    from absl import logging
    from tfdist.observe import summary as summary_lib
    chosen, choice = choose(
        config, **{k: arguments[k] for k in ("model_fn", "dataset_fn", "spec", "layout_rules")},
        options=plan_options)
    logging.info("--strategy=auto: runs %s (plan %s%s)%s", choice.describe, choice.key,
                 ", cached" if choice.reused else "",
                 f"; runner-up {choice.runner_up}" if choice.runner_up else "")
    result = train_fn(chosen, **arguments)
    if result.summary:
        result.summary["plan"] = choice.summary()
        if result.is_chief and chosen.train.model_dir:
            summary_lib.write_summary(chosen.train.model_dir, result.summary)
    return result
