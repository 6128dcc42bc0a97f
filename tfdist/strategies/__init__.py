"""Strategy registry: name -> adapter class, imported only when chosen."""

from __future__ import annotations

import functools
import os

from tfdist import cluster
from tfdist.config import StrategyConfig
from tfdist.registry import Registry
from tfdist.strategies.base import Strategy

_REGISTRY = Registry("--strategy", "strategy", {
    "default": "tfdist.strategies.default:DefaultStrategy",
    "mirrored": "tfdist.strategies.mirrored:MirroredStrategy",
    "multi_worker": "tfdist.strategies.multi_worker:MultiWorkerStrategy",
    "horovod": "tfdist.strategies.horovod:HorovodStrategy",
    "dtensor": "tfdist.strategies.dtensor:DTensorStrategy",
    "parameter_server": "tfdist.strategies.parameter_server:ParameterServerStrategy",
    "pipeline": "tfdist.strategies.pipeline:PipelineStrategy",
})
names = _REGISTRY.names
check_name = _REGISTRY.check
# A new engine: one module with a `Strategy` subclass, and one line above (or
# `tfdist.strategies.register("name", MyStrategy)` from a user's own code).
register = _REGISTRY.register
unregister = _REGISTRY.unregister


# The engines whose cluster comes from TF_CONFIG (or host flags, or Slurm), with
# its plain-Python check: `tfdist-train` runs it before TensorFlow loads, so a
# bad TF_CONFIG is one line in a fraction of a second instead of after
# TensorFlow's start-up (about 5 CPU-seconds). The engine checks again when set up.
_CLUSTER_CHECKS = {
    "multi_worker": functools.partial(cluster.check_workers, required=True),
    "dtensor": functools.partial(cluster.check_workers, required=False),
    "parameter_server": cluster.check_ps,
    "pipeline": functools.partial(cluster.check_workers, required=False),
}


def check_cluster(config: StrategyConfig) -> None:
    """Raise `UsageError` for a cluster `config.name`'s engine cannot use (no
    TensorFlow; the environment is not changed)."""
    check = _CLUSTER_CHECKS.get(config.name)
    if check is not None:
        check(config, dict(os.environ))


def create(config: StrategyConfig) -> Strategy:
    """The adapter for `config.name`, not yet set up."""
    return _REGISTRY.load(config.name)(config)


__all__ = ["Strategy", "check_cluster", "check_name", "create", "names", "register",
           "unregister"]
