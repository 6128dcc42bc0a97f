"""tfdist: distributed training of Keras 3 models on TensorFlow.

    import tfdist
    result = tfdist.train(tfdist.RunConfig(...), model_fn=..., dataset_fn=...)
"""

from tfdist import compat as _compat

_compat.defer_keras_matplotlib()   # before anything imports Keras: 0.4 CPU-s a process

from tfdist.training import xla_cache as _xla_cache

_xla_cache.configure()   # before TensorFlow's runtime starts: XLA executables shared on this host

from tfdist.config import (DataConfig, ModelConfig, OptimizerConfig, RunConfig,
                           StrategyConfig, TrainConfig)
from tfdist.errors import ConfigError, UsageError


def train(config, **kwargs):
    """See `tfdist.api.train` (imported lazily: TensorFlow loads on first use)."""
    from tfdist.api import train as _train
    return _train(config, **kwargs)


def plan(config, **kwargs):
    """See `tfdist.planner.plan` (what `tfdist-plan` runs): the engine and
    options for `config`'s model, data and batch on this host, measured."""
    from tfdist.planner import plan as _plan
    return _plan(config, **kwargs)


def shard(dataset, context):
    """This input pipeline's share of `dataset`, by example (for `dataset_fn`s)."""
    from tfdist.data.function_inputs import shard as _shard
    return _shard(dataset, context)


def load_model(path, **kwargs):
    """`keras.saving.load_model` with the bundled builders' layers registered."""
    import keras

    from tfdist import models
    models.register_layers()
    return keras.saving.load_model(path, **kwargs)


def describe_layouts(config, **kwargs):
    """See `tfdist.api.describe_layouts` (what `--print_layouts` prints): each
    variable's layout on `config.strategy.mesh` and its per-device bytes."""
    from tfdist.api import describe_layouts as _describe_layouts
    return _describe_layouts(config, **kwargs)


def layout_rows(config, **kwargs):
    """See `tfdist.api.layout_rows`: `describe_layouts` as a list of dicts."""
    from tfdist.api import layout_rows as _layout_rows
    return _layout_rows(config, **kwargs)


def export(source, export_dir, **kwargs):
    """See `tfdist.api.export`: a RunResult or a model_dir -> model.keras + SavedModel."""
    from tfdist.api import export as _export
    return _export(source, export_dir, **kwargs)


__all__ = ["ConfigError", "DataConfig", "ModelConfig", "OptimizerConfig", "RunConfig",
           "StrategyConfig", "TrainConfig", "UsageError", "describe_layouts", "export",
           "layout_rows", "load_model", "plan", "shard", "train"]
