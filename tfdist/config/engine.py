"""The engine's part of the run configuration: which engine runs the
replicas, the cluster it runs on, and (inherited) the options each engine
declares beside its adapter (`tfdist/strategies/<engine>/options.py`)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from tfdist.config.options import (ENGINE, INT_MAX, check_fields, engine_options, non_negative,
                                   option, part, positive, seconds)
from tfdist.errors import ConfigError
from tfdist.strategies.dtensor.options import DTensorOptions
from tfdist.strategies.horovod.options import HorovodOptions
from tfdist.strategies.multi_worker.options import COLLECTIVES, MultiWorkerOptions
from tfdist.strategies.parameter_server.options import TASK_TYPES, ParameterServerOptions
from tfdist.strategies.pipeline.options import PIPELINE_SCHEDULES, PipelineOptions

PROCESSES = ("multi_worker", "parameter_server", "dtensor", "pipeline")
ZERO_STAGES = (0, 1, 2, 3)


def _zero_stage(name, value):
    if value not in ZERO_STAGES:
        raise ConfigError(f"{name}={value!r} is not a ZeRO stage; valid: "
                          f"{', '.join(map(str, ZERO_STAGES))}")


@dataclasses.dataclass(frozen=True)
class _EngineAndCluster:
    """The options every engine shares: which engine, the devices, the cluster."""

    name: str = option(
        "mirrored", flag="strategy", registry="strategy", group=ENGINE,
        tunable=("default", "mirrored", "dtensor", "pipeline"),
        help="Scale-out engine. Each engine and what it is:")
    # None: leave the devices of a process that may already have started
    # TensorFlow alone; tfdist-train's default is 2 (0 on its command line: None).
    virtual_devices: Optional[int] = option(
        None, lower=0, check=positive, cli_default=2, cli_none=0, group=ENGINE,
        help="On a host without GPUs, split the CPU into this many logical devices so "
             "multi-device strategies run for real; 0 leaves the devices as they are.")
    collective_timeout_s: float = option(
        60.0, lower=1.0, check=seconds, group="faults",
        help="multi_worker: a collective that has not completed in this many seconds (e.g. a "
             "dead or never-started peer) fails the run.")
    worker_hosts: tuple = option(
        (), engines=PROCESSES, group=ENGINE,
        help="multi_worker without TF_CONFIG: every worker's host:port, in order (the same "
             "list on every host); TF_CONFIG is written from it.")
    task_index: Optional[int] = option(
        None, lower=0, upper=INT_MAX, check=non_negative, engines=PROCESSES, group=ENGINE,
        help="multi_worker: this host's index in --worker_hosts; parameter_server: its index "
             "in the list --task_type names.")


@engine_options("dtensor", "pipeline")
class _ZeroOptions:
    """ZeRO: training state split over data-parallel replicas, on the engines
    that offer it (`strategies.capabilities.ZeroStages`)."""

    zero_stage: int = option(
        0, choices=ZERO_STAGES, check=_zero_stage, tunable=ZERO_STAGES, group=ENGINE,
        help="dtensor: what is also split over the mesh's batch axis (ZeRO). 0: nothing "
             "(each variable, gradient and optimizer slot is split by its layout rule only); "
             "1: optimizer slots; 2: slots and gradients (reduce-scattered out of the "
             "backward pass); 3: slots, gradients and the variables themselves, each layer's "
             "gathered just before it computes and again in the backward pass (FSDP; one "
             "more forward pass per step). Per-device bytes of parameters + gradients + "
             "optimizer state fall towards 1/(batch x model) of one device's. pipeline "
             "across processes: 1 splits each stage's optimizer slots over its R pipeline "
             "replicas (each updates the variables whose slots it holds, then the replicas "
             "share the updated weights).")


# The engines' own options come after the shared ones (dataclass fields follow
# the bases in reverse order), keyword-only.
@part
class StrategyConfig(PipelineOptions, HorovodOptions, DTensorOptions, _ZeroOptions,
                     ParameterServerOptions, MultiWorkerOptions, _EngineAndCluster):
    """Which engine runs the replicas, on which cluster, with its options."""

    def __post_init__(self):
        check_fields(self)
