"""Model builder registry: name -> `build(model_config, spec) -> keras.Model`.

Builders are created inside the strategy's scope by the caller. Every model
ends in a float32 logits layer (mixed precision keeps the output and the
loss in float32).
"""

from __future__ import annotations

from tfdist.config import ModelConfig
from tfdist.data.spec import DatasetSpec
from tfdist.errors import UsageError
from tfdist.registry import Registry

_REGISTRY = Registry("--model", "model", {
    "mlp": "tfdist.models.mlp",
    "cnn": "tfdist.models.cnn",
    "transformer": "tfdist.models.transformer",
})
names = _REGISTRY.names
check_name = _REGISTRY.check
_module = _REGISTRY.load


def check_compatible(config: ModelConfig, spec: DatasetSpec) -> None:
    """Raise `UsageError` if builder `config.name` cannot train on `spec`."""
    kinds = _module(config.name).DATA_KINDS
    if spec.kind not in kinds:
        raise UsageError(
            f"--model={config.name} needs a dataset of kind {'/'.join(kinds)}, but "
            f"--dataset={spec.name} is {spec.kind} data; pick a matching model or dataset "
            "(image: tfdist_shapes or an image dataset with mlp or cnn; tokens: tfdist_tokens "
            "with transformer; text: a text dataset such as imdb_reviews with transformer)")


def build(config: ModelConfig, spec: DatasetSpec) -> "keras.Model":  # noqa: F821
    check_compatible(config, spec)
    return _module(config.name).build(config, spec)



def layout_rules(config: ModelConfig) -> list:
    """The builder's DTensor layout rules: [(regex over variable path, spec)]."""
    return list(_module(config.name).layout_rules(config))


def register_layers() -> None:
    """Import every builder, registering their custom layers with Keras, so a
    `model.keras` exported from a bundled builder loads with
    `keras.saving.load_model` (or use `tfdist.load_model`)."""
    for name in names():
        _module(name)
