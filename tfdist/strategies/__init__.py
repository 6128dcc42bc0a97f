"""The engines: one `Engine` record each (`records.py`), adapters imported
only when chosen, engines of other packages found through the
`tfdist.engines` entry points. Nothing here imports TensorFlow."""

from __future__ import annotations

import functools
import importlib.metadata
import os
from typing import TYPE_CHECKING

from tfdist import cluster
from tfdist.errors import UsageError
from tfdist.registry import Registry
from tfdist.strategies.base import Strategy
from tfdist.strategies.records import (HOROVODRUN, ONE_OR_WORKERS, ONE_PROCESS, PS_CLUSTER,
                                       WORKERS, Engine)
from tfdist.strategies import records as _engines

if TYPE_CHECKING:   # tfdist.config imports the engines' option declarations
    from tfdist.config import StrategyConfig

_WORKERS = functools.partial(cluster.check_workers, required=True)
_WORKERS_IF_ANY = functools.partial(cluster.check_workers, required=False)

REFERENCE = "default"   # the engine every other is compared with (tfdist-compare)
# Not an engine: the planner's choice of one (`tfdist.planner.auto`).
AUTO = "auto"
AUTO_SUMMARY = ("the planner chooses the engine and its options for this model, batch, "
                "cluster and host (the tfdist-plan flags), caches the plan and runs it")
BUILT_IN = (
    Engine("default", "tfdist.strategies.default:DefaultStrategy",
           "one device: the reference every other engine is compared with",
           cost="tfdist.strategies.data_parallel_cost:ONE_DEVICE"),
    Engine("mirrored", "tfdist.strategies.mirrored:MirroredStrategy",
           "data parallel over this process's devices (MirroredStrategy)",
           cost="tfdist.strategies.data_parallel_cost:LOCAL_REPLICAS"),
    Engine("multi_worker", "tfdist.strategies.multi_worker.engine:MultiWorkerStrategy",
           "data parallel over worker processes (MultiWorkerMirroredStrategy over "
           "TF_CONFIG, --worker_hosts or Slurm)", launch=WORKERS, cluster=_WORKERS,
           processes=2, cost="tfdist.strategies.data_parallel_cost:MULTI_WORKER"),
    Engine("horovod", "tfdist.strategies.horovod.engine:HorovodStrategy",
           "data parallel over Horovod ranks under horovodrun (`make horovod` builds it)",
           launch=HOROVODRUN, processes=2, cost="tfdist.strategies.data_parallel_cost:HOROVOD"),
    Engine("dtensor", "tfdist.strategies.dtensor.engine:DTensorStrategy",
           "tensor sharding over a --mesh with ZeRO stages 0-3, in one process or "
           "across workers", launch=ONE_OR_WORKERS, cluster=_WORKERS_IF_ANY,
           cost="tfdist.strategies.dtensor.cost:COST"),
    Engine("parameter_server", "tfdist.strategies.parameter_server.engine:ParameterServerStrategy",
           "asynchronous: workers update variables on parameter servers "
           "(ParameterServerStrategy; `tfdist-launch --workers=N --ps=P`)",
           launch=PS_CLUSTER, synchronous=False, cluster=cluster.check_ps, processes=3),
    Engine("pipeline", "tfdist.strategies.pipeline.engine:PipelineStrategy",
           "the model split into stages over devices or worker processes, micro-batches "
           "on a GPipe, 1F1B or interleaved 1F1B schedule", launch=ONE_OR_WORKERS,
           cluster=_WORKERS_IF_ANY, cost="tfdist.strategies.pipeline.cost:COST"),
)
_REGISTRY = Registry("--strategy", "strategy", {e.name: e for e in BUILT_IN})
unregister = _REGISTRY.unregister


def check_name(name: str) -> None:
    """Raise `UsageError` listing the engines unless `name` is one (or auto)."""
    _load_entry_points()
    if name != AUTO and name not in _REGISTRY.names():
        raise UsageError(f"--strategy={name!r} is not a registered strategy; valid: "
                         f"{', '.join(_REGISTRY.names())}, or {AUTO}")


def register(name: str, entry) -> None:
    """Add engine `name`: an `Engine` record, or its adapter alone (a class or
    "package.module:Class", e.g. from a user's own code)."""
    _REGISTRY.register(name, _engines.of(name, entry))


@functools.lru_cache(maxsize=None)
def _load_entry_points() -> None:
    """Register the engines other installed packages declare (once)."""
    for point in importlib.metadata.entry_points(group=_engines.ENTRY_POINT_GROUP):
        if point.name in _REGISTRY.names():
            continue
        try:
            engine = point.load()
        except Exception as error:   # noqa: BLE001  (a broken plug-in must not stop tfdist)
            raise UsageError(f"engine {point.name!r} of entry point {point.value} cannot be "
                             f"loaded: {type(error).__name__}: {error}") from None
        _REGISTRY.register(point.name, _engines.of(point.name, engine))


def names() -> list[str]:
    _load_entry_points()
    return _REGISTRY.names()


def engines() -> list[Engine]:
    """Every engine's record, built-in first, in declaration order."""
    _load_entry_points()
    return [_REGISTRY.entry(name) for name in _REGISTRY.order()]


def engine(name: str) -> Engine:
    _load_entry_points()
    _REGISTRY.check(name)
    return _REGISTRY.entry(name)


def is_auto(config: StrategyConfig) -> bool:
    """Whether the planner chooses the engine (`--strategy=auto`)."""
    return config.name == AUTO


def check_cluster(config: StrategyConfig) -> None:
    """Raise `UsageError` for a cluster `config.name`'s engine cannot use (no
    TensorFlow; the environment is not changed). `tfdist-train` runs it
    before TensorFlow loads, so a bad TF_CONFIG is one line in a fraction of a
    second instead of after TensorFlow's start-up (about 5 CPU-seconds); the
    engine checks again when set up. Under auto: any cluster of workers."""
    check = _WORKERS_IF_ANY if is_auto(config) else engine(config.name).cluster
    if check is not None:
        check(config, dict(os.environ))


def adapter_class(record: Engine) -> type:
    """The engine's adapter class (its module imported now)."""
    adapter = record.adapter
    if isinstance(adapter, str):
        module_name, _, attribute = adapter.partition(":")
        adapter = getattr(importlib.import_module(module_name), attribute)
    return adapter


def create(config: StrategyConfig) -> Strategy:
    """The adapter for `config.name`, not yet set up."""
    return adapter_class(engine(config.name))(config)


__all__ = ["AUTO", "Engine", "Strategy", "adapter_class", "check_cluster", "check_name", "create", "engine", "engines", "is_auto",
           "names", "register", "unregister"]
