"""`--strategy=auto`: run the planner's winner for this model, batch, cluster
and host, planned once and cached.

A plan is keyed by what was planned (`what`: the model's variables, the
global batch, the data, the optimizer, the cluster's size, the budget and
whether lossy choices were allowed) and records where it was made (`where`:
the CPU, TensorFlow's and tfdist's versions). A cached plan whose key
matches is reused where it was made on this kind of host with these
versions; else it is not reused, the log says why, and the run plans again.
On a cluster the chief plans (its trials run on its host) and writes the
plan; the other workers wait for it, or find it cached. Waiting is bounded
by progress, not by a total: a plan's first measurements on a host (its
engines' runtimes and probes, cached) take minutes beyond the search's own
seconds, so a waiter gives up when the planner has reported nothing new
for longer than its longest single measurement (`silence_bound`). A cluster
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
import threading
import time
from typing import Callable, Optional

from tfdist import cluster as cluster_lib
from tfdist import strategies
from tfdist.strategies import records
from tfdist.config import RunConfig
from tfdist.errors import UsageError
from tfdist.observe import hardware

# The seconds a worker waits for the chief's plan beyond the search's own
# bound, however long the chief's progress goes on.
WAIT_MARGIN_S = 300.0
POLL_S = 0.5
# Beyond the longest process a plan starts: stopping it (up to 20 s) and the
# planner's own work between two progress lines (building, tracing the model).
SILENCE_MARGIN_S = 120.0


def silence_bound(options: dict) -> float:
    """The longest a planning process goes without a progress line: its
    longest measurement (a probe's or a trial's bound, or a calibration
    run's, half the search's seconds) and SILENCE_MARGIN_S."""
    from tfdist.planner.trials import LONGEST_S
    return max(LONGEST_S, options.get("search_seconds", 180.0) / 2) + SILENCE_MARGIN_S


def progress_of(path: str) -> str:
    """Where the chief planning the plan at `path` writes its latest line."""
    return path + ".progress"


def _note(paths: list, line: str) -> None:
    """`line` as the latest progress in each of `paths` (best effort)."""
    for path in paths:
        try:
            write_text(path, line)
        except OSError:
            pass


def _stamp(path: str) -> Optional[int]:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _last_line(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


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
    write_text(path, json.dumps(record, indent=1, sort_keys=True))


def write_text(path: str, text: str) -> None:
    """Atomically; each thread through a temporary file of its own (the
    planner logs from the threads that run its probes)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(temporary, "w") as f:
        f.write(text)
    os.replace(temporary, path)


def stale_reason(record: dict, where: dict) -> Optional[str]:
    """Why a cached plan may not be reused here, or None."""
    made = record.get("where", {})
    changed = [f"{name} {made.get(name)!r}, here {value!r}" for name, value in where.items()
               if made.get(name) != value]
    return f"it was made with {'; '.join(changed)}" if changed else None


def wait_for(path: str, key: str, where: dict, timeout: float,
             clock: Callable[[], float] = time.monotonic, silence: Optional[float] = None,
             beat: Callable[[], None] = lambda: None) -> dict:
    """A non-chief worker: the chief's plan once written (and fit for this
    host), or `UsageError` naming the key and the path after `timeout` s,
    or, while the chief reports progress (`progress_of(path)`), `silence` s
    after its last new line. `beat()` on each look (this waiter's own
    progress)."""
    deadline = clock() + timeout
    progress = progress_of(path)
    seen = _stamp(progress)
    while True:
        record = read(path)
        if record is not None and stale_reason(record, where) is None:
            return record
        stamp = _stamp(progress)
        if stamp != seen:
            seen = stamp
            if silence and stamp is not None:   # a new line, not the file's removal
                deadline = max(deadline, clock() + silence)
        if clock() >= deadline:
            found = f" (the one there: {stale_reason(record, where)})" if record else ""
            last = _last_line(progress) if seen else ""
            raise UsageError(
                f"--strategy=auto: no plan {key} from the chief after {timeout:.0f} s at "
                f"{path}{found}" + (f" (the chief's last progress: {last!r})" if last else "")
                + "; the chief plans and writes it there (every worker must see "
                "the same TFDIST_CACHE_DIR), or plan ahead with tfdist-plan and run its "
                "flagfile")
        beat()
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
    with tempfile.TemporaryDirectory(prefix="tfdist-auto-") as scratch:
        request_path, out = os.path.join(scratch, "request.json"), os.path.join(scratch, "out")
        request["progress"] = os.path.join(scratch, "progress")
        with open(request_path, "w") as f:
            json.dump(request, f)
        proc = subprocess.Popen([sys.executable, "-m", "tfdist.planner.choose", request_path,
                                 out], env={**os.environ, "PYTHONPATH": _python_path()},
                                preexec_fn=_die_with_parent)
        try:
            wait_while_progressing(proc, request["progress"], silence_bound(options))
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


def wait_while_progressing(proc, progress: str, silence: float,
                           clock: Callable[[], float] = time.monotonic) -> None:
    """Wait for the planning process `proc` while it reports progress (a new
    line in `progress`): `UsageError` after `silence` s without one."""
    seen, since = _stamp(progress), clock()
    while proc.poll() is None:
        stamp = _stamp(progress)
        if stamp != seen:
            seen, since = stamp, clock()
        elif clock() - since > silence:
            last = _last_line(progress)
            raise UsageError(
                f"--strategy=auto: the planner reported no progress for {silence:.0f} s"
                + (f" after {last!r}" if last else "") + "; plan ahead with tfdist-plan "
                "(it prints each measurement) and run its flagfile")
        time.sleep(POLL_S)


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


class _Progress:
    """A planning process's log: each line also the latest progress in each
    of `paths` (the parent's file; beside the plan while planning)."""

    def __init__(self, log: Callable[[str], None], path: Optional[str]):
        self.said, self.paths = log, [path] if path else []

    def __call__(self, line: str) -> None:
        self.said(line)
        _note(self.paths, line)

    def beat(self) -> None:
        for path in self.paths:
            if os.path.exists(path):
                os.utime(path)


def choose_here(config: RunConfig, *, model_fn=None, dataset_fn=None, spec=None,
                layout_rules=None, options: Optional[dict] = None,
                log: Callable[[str], None] = print, progress: Optional[str] = None) -> Choice:
    """The plan `config` follows: cached, made now (chief) or awaited (other
    workers). Runs TensorFlow (the key's model build, the planner). Each
    line logged is the latest progress in `progress` (if given) and, while
    this process plans, beside the plan (`progress_of`) for the waiters."""
    options, log = dict(options or {}), _Progress(log, progress)
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
                          options.get("search_seconds", 180.0) + WAIT_MARGIN_S,
                          silence=silence_bound(options), beat=log.beat)
    else:
        if reason:
            log(f"the cached plan {key} is not reused: {reason}; planning again")
        record = _plan_and_write(
            config, dict(model_fn=model_fn, dataset_fn=dataset_fn, spec=spec,
                         layout_rules=layout_rules), options, (key, path, what, where),
            _launches(spec_cluster), log)
    return Choice(key=key, path=path, engine=record["engine"], options=record["options"],
                  describe=record.get("describe", record["engine"]),
                  runner_up=record.get("runner_up", ""), reused=reused)


def _plan_and_write(config: RunConfig, functions: dict, options: dict, plan_id: tuple,
                    launches: tuple, log: _Progress) -> dict:
    """Plan now and write the plan's record at its path; meanwhile each line
    is the latest progress beside it, for the workers that wait."""
    from tfdist.planner import plan as make_plan
    key, path, what, where = plan_id
    processes = options["processes"]
    log.paths.append(progress_of(path))
    try:
        log(f"planning {key} for {processes} process(es) (written to {path})")
        base = config.replace(strategy=config.strategy.replace(name=strategies.REFERENCE))
        made = make_plan(base, log=log, launches=launches, **functions, **options)
        record = {"what": what, "where": where, "engine": made.winner.engine,
                  "options": made.winner.options, "describe": made.winner.describe(),
                  "examples_per_sec": made.winner.measured_rate(),
                  "runner_up": made.runner_up.describe() if made.runner_up else "",
                  "flagfile": made.flagfile()}
        write(path, record)
        return record
    finally:
        log.paths.pop()
        _remove(progress_of(path))


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


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
