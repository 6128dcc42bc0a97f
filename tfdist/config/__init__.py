"""Run configuration: frozen dataclasses, each field declared once and
checked on construction (`tfdist/config/options.py`).

This package knows nothing about absl flags or TensorFlow state, so the
Python API (`tfdist.train(RunConfig(...))`) and the CLI share one source of
truth. Every check quotes the bad value and says what would be valid; the app
turns `ConfigError` into a one-line message and exit status 2.
"""

from __future__ import annotations

import dataclasses

from tfdist.config.engine import (COLLECTIVES, PIPELINE_SCHEDULES, TASK_TYPES, ZERO_STAGES,
                                  StrategyConfig)
from tfdist.config.options import (GROUPS, INT_MAX, PARTS, SECONDS_MAX, SEED_MAX, Option,
                                   declaration, flag_name)
from tfdist.config.parts import (AUTOSHARD, LR_DECAY, LR_SCALING, OPTIMIZERS, DataConfig,
                                 ModelConfig, OptimizerConfig)
from tfdist.config.train import (DEFAULT_TRAIN_STEPS, GRAD_COMPRESSION, JIT_COMPILE, LOSSES,
                                 METRICS, ON_NONFINITE, PRECISIONS, TrainConfig)
from tfdist.errors import ConfigError, UsageError


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything one training run needs."""

    strategy: StrategyConfig = dataclasses.field(default_factory=StrategyConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    train: TrainConfig = dataclasses.field(
        default_factory=lambda: TrainConfig(train_steps=DEFAULT_TRAIN_STEPS))

    def replace(self, **parts) -> "RunConfig":
        """Copy with some parts swapped, e.g.
        `cfg.replace(train=cfg.train.replace(train_steps=200))`."""
        return dataclasses.replace(self, **parts)


# RunConfig's parts by attribute, in declaration order.
PART_NAMES = {"strategy": StrategyConfig, "model": ModelConfig, "data": DataConfig,
              "optimizer": OptimizerConfig, "train": TrainConfig}


def options():
    """Every declared option: (part name, field) pairs in declaration order."""
    return [(name, field) for name, cls in PART_NAMES.items()
            for field in dataclasses.fields(cls)]


def _flag_value(field: dataclasses.Field, value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def as_flags(config: RunConfig) -> list[str]:
    """`config` as tfdist-train flags (`--name=value`), every option spelled
    out, so the run replays the same under later defaults. An option left
    unset (None) is omitted, or given its declared command-line stand-in for
    None (`virtual_devices`: 0)."""
    out = []
    for part, field in options():
        value = getattr(getattr(config, part), field.name)
        if value is None:
            value = declaration(field).cli_none
            if value is None:
                continue
        out.append(f"--{flag_name(field)}={_flag_value(field, value)}")
    return out


def flagfile(config: RunConfig) -> str:
    """`config` as a flagfile (`tfdist-train --flagfile=FILE` replays it)."""
    return "".join(line + "\n" for line in as_flags(config))


__all__ = ["AUTOSHARD", "COLLECTIVES", "ConfigError", "DEFAULT_TRAIN_STEPS", "DataConfig",
           "GRAD_COMPRESSION", "GROUPS", "INT_MAX", "JIT_COMPILE", "LOSSES", "LR_DECAY",
           "LR_SCALING", "METRICS", "ModelConfig", "ON_NONFINITE", "OPTIMIZERS", "Option",
           "OptimizerConfig", "PARTS", "PART_NAMES", "PIPELINE_SCHEDULES", "PRECISIONS",
           "RunConfig", "SECONDS_MAX", "SEED_MAX", "StrategyConfig", "TASK_TYPES",
           "TrainConfig", "UsageError", "ZERO_STAGES", "as_flags", "declaration", "flag_name",
           "flagfile", "options"]
