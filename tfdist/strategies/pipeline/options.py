"""The options only `pipeline` reads (no TensorFlow)."""

from __future__ import annotations

from tfdist.config.options import ENGINE, engine_options, option, positive
from tfdist.errors import ConfigError

PIPELINE_SCHEDULES = ("1f1b", "gpipe")   # tfdist.pipeline.schedule.SCHEDULES


def _layer_names(name, value):
    if isinstance(value, str) or not all(isinstance(n, str) and n for n in value):
        raise ConfigError(f"{name}={value!r} must be a tuple of layer names, e.g. ('block_2',)")


@engine_options("pipeline")
class PipelineOptions:
    pipeline_stages: int = option(
        2, lower=1, check=positive, tunable=(2, 4), group=ENGINE,
        help="pipeline: split the model into this many stages, one per device (with more "
             "devices, a multiple of S: devices/S pipeline replicas); the split is balanced "
             "by FLOPs over the model's blocks unless --pipeline_split names where stages "
             "begin.")
    pipeline_schedule: str = option(
        "1f1b", choices=PIPELINE_SCHEDULES, tunable=PIPELINE_SCHEDULES, group=ENGINE,
        help="pipeline: the order of each stage's forward and backward passes over the "
             "--microbatches: 1f1b (one forward, one backward in turn: each stage holds at "
             "most S micro-batches' activations) or gpipe (every forward, then every "
             "backward: M).")
    pipeline_chunks: int = option(
        1, lower=1, check=positive, tunable=(1, 2), group=ENGINE,
        help="pipeline: the model chunks each device (process) of a pipeline runs: the model "
             "is split into S x v stages, stage s on device s mod S, and 1F1B becomes "
             "interleaved 1F1B (--microbatches a multiple of S): the ideal bubble shrinks "
             "from (S-1)/(M+S-1) to (S-1)/(vM+S-1), at v times the boundary transfers.")
    pipeline_split: tuple = option(
        (), check=_layer_names, group=ENGINE,
        help="pipeline: the layer names where stages 2..S begin (S-1 names, in model order; "
             "S x v stages and S x v - 1 names with --pipeline_chunks=v; "
             "each must begin a block, where one tensor crosses); default: balanced by "
             "FLOPs.")
    pipeline_gather: bool = option(
        True, group=ENGINE,
        help="pipeline across processes: at the end of training the chief gathers every "
             "stage's weights (not their optimizer slots, which the last checkpoint holds) "
             "for RunResult.model and --export_dir, unless they would not fit its memory "
             "limit; --nopipeline_gather: nothing ever holds the whole model (export the "
             "last checkpoint with tfdist-export on a machine with the memory).")
