"""Strategy registry: name -> adapter class, imported only when chosen."""

from __future__ import annotations

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
})
names = _REGISTRY.names
check_name = _REGISTRY.check
# A new engine: one module with a `Strategy` subclass, and one line above (or
# `tfdist.strategies.register("name", MyStrategy)` from a user's own code).
register = _REGISTRY.register
unregister = _REGISTRY.unregister


def create(config: StrategyConfig) -> Strategy:
    """The adapter for `config.name`, not yet set up."""
    return _REGISTRY.load(config.name)(config)


__all__ = ["Strategy", "check_name", "create", "names", "register",
           "unregister"]
