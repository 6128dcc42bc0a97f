"""tfdist: distributed training of Keras 3 models on TensorFlow.

    import tfdist
    result = tfdist.train(tfdist.RunConfig(...), model_fn=..., dataset_fn=...)
"""

from tfdist.config import (DataConfig, ModelConfig, OptimizerConfig, RunConfig,
                           StrategyConfig, TrainConfig)
from tfdist.errors import ConfigError, UsageError


def train(config, **kwargs):
    """See `tfdist.api.train` (imported lazily: TensorFlow loads on first use)."""
    from tfdist.api import train as _train
    return _train(config, **kwargs)


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


def export(source, export_dir, **kwargs):
    """See `tfdist.api.export`: a RunResult or a model_dir -> model.keras + SavedModel."""
    from tfdist.api import export as _export
    return _export(source, export_dir, **kwargs)


__all__ = ["ConfigError", "DataConfig", "ModelConfig", "OptimizerConfig", "RunConfig",
           "StrategyConfig", "TrainConfig", "UsageError", "export", "load_model", "shard", "train"]
