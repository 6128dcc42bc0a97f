"""Strategy registry: name -> adapter class, imported only when chosen.

Lazy imports keep `--strategy=mirrored` from importing Horovod, and let a
missing optional engine fail with a clear message only when it is asked for.
"""

from __future__ import annotations

import importlib

from tfdist.config import StrategyConfig
from tfdist.errors import UsageError
from tfdist.strategies.base import Strategy

_REGISTRY = {
    "default": "tfdist.strategies.default:DefaultStrategy",
    "mirrored": "tfdist.strategies.mirrored:MirroredStrategy",
    "multi_worker": "tfdist.strategies.multi_worker:MultiWorkerStrategy",
    "horovod": "tfdist.strategies.horovod:HorovodStrategy",
}


def names() -> list[str]:
    return sorted(_REGISTRY)


def check_name(name: str) -> None:
    if name not in _REGISTRY:
        raise UsageError(
            f"--strategy={name!r} is not a registered strategy; valid: {', '.join(names())}")


def create(config: StrategyConfig) -> Strategy:
    """The adapter for `config.name`, not yet set up."""
    check_name(config.name)
    module_name, class_name = _REGISTRY[config.name].split(":")
    return getattr(importlib.import_module(module_name), class_name)(config)


__all__ = ["Strategy", "check_name", "create", "names"]
