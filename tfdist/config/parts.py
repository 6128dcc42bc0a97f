"""The model, data and optimizer parts of the run configuration."""

from __future__ import annotations

from typing import Optional

from tfdist.config.options import (INT_MAX, check_fields, finite_non_negative, finite_positive,
                                   non_negative, one_of, option, part, positive)
from tfdist.errors import ConfigError

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
AUTOSHARD = ("global", "auto", "file", "data", "off")
LR_SCALING = ("none", "linear", "sqrt")
LR_DECAY = ("constant", "cosine")
DATA = "model and data"


@part
class ModelConfig:
    """Which registered model builder to use, and its size knobs."""

    name: str = option("cnn", flag="model", registry="model", group=DATA, math=True,
                       help="Model builder: mlp, cnn, transformer.")
    width: int = option(
        32, flag="model_width", lower=1, upper=INT_MAX, check=positive, group=DATA, math=True,
        help="Hidden units (mlp), base channels (cnn), model dim (transformer).")
    depth: int = option(
        2, flag="model_depth", lower=1, upper=INT_MAX, check=positive, group=DATA, math=True,
        help="Hidden layers (mlp), residual blocks per stage (cnn), blocks (transformer).")
    num_heads: int = option(4, lower=1, check=positive, group=DATA, math=True,
                            help="Attention heads (transformer).")
    recompute: bool = option(
        False, tunable=(False, True), group="precision and speed",
        help="Gradient checkpointing: recompute the activations of each block (cnn, "
             "transformer) in the backward pass instead of keeping them.")

    def __post_init__(self):
        check_fields(self)


def _dataset(name, value):
    if not value:
        raise ConfigError(f"{name}='' must name a TFDS dataset, e.g. tfdist_shapes")
    if any(c.isspace() or not c.isprintable() for c in value):
        raise ConfigError(f"{name}={value!r} is not a TFDS dataset name (no spaces or "
                          "control characters), e.g. tfdist_shapes or mnist:3.0.1")


@part
class DataConfig:
    """Where examples come from."""

    dataset: str = option(
        "tfdist_shapes", check=_dataset, group=DATA, math=True,
        help="TFDS dataset name: the bundled tfdist_shapes (images) or tfdist_tokens (token "
             "sequences), prepared offline on first use, or any TFDS dataset prepared in "
             "--data_dir.")
    data_dir: Optional[str] = option(
        None, group=DATA,
        help="TFDS data directory (default: $TFDS_DATA_DIR or ~/tensorflow_datasets).")
    synthetic: bool = option(
        False, group=DATA, math=True,
        help="Feed random tensors of the dataset's shapes (benchmarking; no eval).")
    shuffle_buffer: int = option(10_000, lower=1, check=positive, group=DATA, math=True,
                                 help="Examples in the shuffle buffer.")
    # The last four read less per worker but give batches that depend on the
    # number of workers.
    autoshard: str = option(
        "global", choices=AUTOSHARD, group=DATA, math=True,
        help="How training input is split across workers: global (every worker reads every "
             "example in one seeded order and keeps its rows of each global batch: the same "
             "batches on every engine and worker count, and checkpoints resume under any of "
             "them), file (each reads its own files), data (each reads its own examples), off "
             "(each reads all, shuffled differently), auto (file when the split has enough "
             "files, else data).")
    image_size: Optional[int] = option(
        None, lower=1, check=positive, group=DATA, math=True,
        help="Resize a TFDS image dataset's images to this height and width (needed when "
             "they differ in size).")
    vocab_size: int = option(
        20_000, lower=2, check=positive, group=DATA, math=True,
        help="Text datasets: the most tokens kept by the TextVectorization vocabulary adapted "
             "on the train split.")
    sequence_length: int = option(256, lower=1, check=positive, group=DATA, math=True,
                                  help="Text datasets: tokens per example (padded or cut).")

    def __post_init__(self):
        check_fields(self)


def _momentum(name, value):
    if not 0 <= value < 1:
        raise ConfigError(f"{name}={value!r} must be in [0, 1)")


@part
class OptimizerConfig:
    """The optimizer and its learning-rate schedule."""

    name: str = option("adam", flag="optimizer", choices=OPTIMIZERS, group="training",
                       check=lambda _, value: one_of("optimizer", value, OPTIMIZERS),
                       math=True, help="Optimizer.")
    learning_rate: float = option(1e-3, lower=0.0, check=finite_positive, group="training",
                                  math=True, help="Learning rate.")
    momentum: float = option(0.9, check=_momentum, group="training", math=True,
                             help="Momentum (optimizer=momentum).")
    weight_decay: float = option(1e-4, check=finite_non_negative, group="training", math=True,
                                 help="Weight decay (optimizer=adamw).")
    lr_scaling: str = option(
        "none", choices=LR_SCALING, group="training", math=True,
        help="Scale --learning_rate (tuned at --base_batch_size) to the global batch: linear "
             "(lr x global/base) or sqrt (lr x sqrt(global/base)).")
    base_batch_size: int = option(
        128, lower=1, check=positive, group="training", math=True,
        help="The batch size --learning_rate was tuned for (--lr_scaling).")
    warmup_steps: int = option(
        0, lower=0, check=non_negative, group="training", math=True,
        help="Linear learning-rate warm-up from 0 over this many steps.")
    lr_decay: str = option(
        "constant", choices=LR_DECAY, group="training", math=True,
        help="After warm-up: constant, or cosine decay to 0 at the last step.")
    clip_grad_norm: Optional[float] = option(
        None, lower=0.0, check=finite_positive, group="training", math=True,
        help="Clip the global norm of the (cross-replica summed) gradient.")

    def __post_init__(self):
        check_fields(self)

