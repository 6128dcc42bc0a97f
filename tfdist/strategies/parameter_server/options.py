"""The options only `parameter_server` reads (no TensorFlow)."""

from __future__ import annotations

from tfdist.config.options import ENGINE, engine_options, non_negative, option

# --task_type with --worker_hosts/--ps_hosts.
TASK_TYPES = ("worker", "ps", "chief")
# --staleness_lr: how an update's learning rate follows its staleness.
STALENESS_LR = ("divide", "none")


@engine_options("parameter_server")
class ParameterServerOptions:
    ps_hosts: tuple = option(
        (), group=ENGINE,
        help="parameter_server without TF_CONFIG: every parameter server's host:port (with "
             "--worker_hosts, whose first entry is the chief).")
    task_type: str = option(
        "worker", choices=TASK_TYPES, group=ENGINE,
        help="parameter_server with --ps_hosts: this process's list, worker (--worker_hosts; "
             "entry 0 is the chief; chief is the same as worker 0) or ps (--ps_hosts).")
    ps_shard_bytes: int = option(
        256 << 10, lower=0, check=non_negative, group=ENGINE,
        help="parameter_server: split variables over the parameter servers in shards of at "
             "least this many bytes (MinSizePartitioner); 0: never split.")
    staleness_lr: str = option(
        "divide", choices=STALENESS_LR, group=ENGINE, math=True,
        help="parameter_server: divide each update's learning rate by 1 + its staleness (the "
             "other workers' updates that landed since its worker read the weights; "
             "staleness-aware SGD, Zhang et al. 2016); none: every update at the full rate.")
