"""The engine's part of the run configuration: which engine runs the
replicas, and the options of the engines that read them."""

from __future__ import annotations

from typing import Optional

from tfdist import sharding
from tfdist.config.options import (INT_MAX, check_fields, non_negative, option, part,
                                   positive, seconds)
from tfdist.errors import ConfigError, UsageError

COLLECTIVES = ("auto", "ring", "nccl")
# --task_type with --worker_hosts/--ps_hosts (parameter_server).
TASK_TYPES = ("worker", "ps", "chief")
ZERO_STAGES = (0, 1, 2, 3)
PIPELINE_SCHEDULES = ("1f1b", "gpipe")   # tfdist.pipeline.schedule.SCHEDULES
ENGINE = "engine and cluster"
PROCESSES = ("multi_worker", "parameter_server", "dtensor", "pipeline")


def _zero_stage(name, value):
    if value not in ZERO_STAGES:
        raise ConfigError(f"{name}={value!r} is not a ZeRO stage; valid: "
                          f"{', '.join(map(str, ZERO_STAGES))}")


def _mesh(name, value):
    try:
        sharding.parse_mesh(value)
    except UsageError as error:
        raise ConfigError(str(error)) from None


def _layer_names(name, value):
    if isinstance(value, str) or not all(isinstance(n, str) and n for n in value):
        raise ConfigError(f"{name}={value!r} must be a tuple of layer names, e.g. ('block_2',)")


@part
class StrategyConfig:
    """Which engine runs the replicas and how it is set up."""

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
    collective: str = option(
        "auto", choices=COLLECTIVES, engines=("multi_worker",), group=ENGINE,
        help="multi_worker collective implementation (CommunicationOptions).")
    collective_timeout_s: float = option(
        60.0, lower=1.0, check=seconds, group="faults",
        help="multi_worker: a collective that has not completed in this many seconds (e.g. a "
             "dead or never-started peer) fails the run.")
    bytes_per_pack: int = option(
        0, lower=0, check=non_negative, engines=("multi_worker",), group=ENGINE,
        help="multi_worker: pack gradients into all-reduces of about this many bytes (0: "
             "TensorFlow's default).")
    # Alternative to TF_CONFIG (as in TensorFlow Model Garden): this host's
    # index in a comma-separated host:port list.
    worker_hosts: tuple = option(
        (), engines=PROCESSES, group=ENGINE,
        help="multi_worker without TF_CONFIG: every worker's host:port, in order (the same "
             "list on every host); TF_CONFIG is written from it.")
    task_index: Optional[int] = option(
        None, lower=0, upper=INT_MAX, check=non_negative, engines=PROCESSES, group=ENGINE,
        help="multi_worker: this host's index in --worker_hosts; parameter_server: its index "
             "in the list --task_type names.")
    ps_hosts: tuple = option(
        (), engines=("parameter_server",), group=ENGINE,
        help="parameter_server without TF_CONFIG: every parameter server's host:port (with "
             "--worker_hosts, whose first entry is the chief).")
    task_type: str = option(
        "worker", choices=TASK_TYPES, engines=("parameter_server",), group=ENGINE,
        help="parameter_server with --ps_hosts: this process's list, worker (--worker_hosts; "
             "entry 0 is the chief; chief is the same as worker 0) or ps (--ps_hosts).")
    ps_shard_bytes: int = option(
        256 << 10, lower=0, check=non_negative, engines=("parameter_server",), group=ENGINE,
        help="parameter_server: split variables over the parameter servers in shards of at "
             "least this many bytes (MinSizePartitioner); 0: never split.")
    mesh: str = option(
        "batch:1,model:2", check=_mesh, engines=("dtensor",), group=ENGINE,
        help="dtensor: the device mesh, batch:B,model:M (B-way data parallel x M-way tensor "
             "sharding; B*M devices, e.g. --virtual_devices=B*M on a CPU host).")
    zero_stage: int = option(
        0, choices=ZERO_STAGES, check=_zero_stage, engines=("dtensor",), tunable=ZERO_STAGES,
        group=ENGINE,
        help="dtensor: what is also split over the mesh's batch axis (ZeRO). 0: nothing "
             "(each variable, gradient and optimizer slot is split by its layout rule only); "
             "1: optimizer slots; 2: slots and gradients (reduce-scattered out of the "
             "backward pass); 3: slots, gradients and the variables themselves, each layer's "
             "gathered just before it computes and again in the backward pass (FSDP; one "
             "more forward pass per step). Per-device bytes of parameters + gradients + "
             "optimizer state fall towards 1/(batch x model) of one device's.")
    shard_optimizer_state: bool = option(
        False, engines=("dtensor",), group=ENGINE,
        help="dtensor: the older name of --zero_stage=1 (split optimizer slots over the "
             "batch axis); with a higher --zero_stage, which includes it, the higher stage "
             "applies.")
    elastic: bool = option(
        False, engines=("horovod",), group="faults",
        help="horovod under an elastic horovodrun (--min-np/--max-np "
             "--host-discovery-script): keep the training state in Horovod's elastic state; "
             "when a rank dies the others roll back to the last commit and continue, and "
             "ranks that join start from it. Other strategies: an error.")
    elastic_commit_every: int = option(
        0, lower=0, check=non_negative, engines=("horovod",), group="faults",
        help="--elastic: commit the training state (to host memory) every N steps, the most "
             "a rank's death loses; 0: at the end of every loop (every --steps_per_loop "
             "steps).")
    pipeline_stages: int = option(
        2, lower=1, check=positive, engines=("pipeline",), tunable=(2, 4), group=ENGINE,
        help="pipeline: split the model into this many stages, one per device (with more "
             "devices, a multiple of S: devices/S pipeline replicas); the split is balanced "
             "by FLOPs over the model's blocks unless --pipeline_split names where stages "
             "begin.")
    pipeline_schedule: str = option(
        "1f1b", choices=PIPELINE_SCHEDULES, engines=("pipeline",), tunable=PIPELINE_SCHEDULES,
        group=ENGINE,
        help="pipeline: the order of each stage's forward and backward passes over the "
             "--microbatches: 1f1b (one forward, one backward in turn: each stage holds at "
             "most S micro-batches' activations) or gpipe (every forward, then every "
             "backward: M).")
    pipeline_split: tuple = option(
        (), check=_layer_names, engines=("pipeline",), group=ENGINE,
        help="pipeline: the layer names where stages 2..S begin (S-1 names, in model order; "
             "each must begin a block, where one tensor crosses); default: balanced by "
             "FLOPs.")

    def __post_init__(self):
        check_fields(self)

    @property
    def zero(self) -> int:
        """The ZeRO stage in effect (`shard_optimizer_state` is stage 1)."""
        return max(self.zero_stage, 1 if self.shard_optimizer_state else 0)
