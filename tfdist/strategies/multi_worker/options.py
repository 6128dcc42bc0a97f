"""The options only `multi_worker` reads (no TensorFlow)."""

from __future__ import annotations

from tfdist.config.options import ENGINE, engine_options, non_negative, option

COLLECTIVES = ("auto", "ring", "nccl")


@engine_options("multi_worker")
class MultiWorkerOptions:
    collective: str = option(
        "auto", choices=COLLECTIVES, group=ENGINE,
        help="multi_worker collective implementation (CommunicationOptions).")
    bytes_per_pack: int = option(
        0, lower=0, check=non_negative, group=ENGINE,
        help="multi_worker: pack gradients into all-reduces of about this many bytes (0: "
             "TensorFlow's default).")
