"""Examples from tensorflow-datasets: any prepared TFDS dataset, or a bundled one.

The bundled builders (`tfdist.data.builders`) generate their data offline and
are prepared on first use; other TFDS datasets are used as prepared in
`data_dir` (or downloaded by TFDS where the network allows).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from tfdist.config import DataConfig
from tfdist.data import builders
from tfdist.data.inputs import Inputs
from tfdist.data.spec import DatasetSpec
from tfdist.errors import UsageError


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


@contextlib.contextmanager
def _prepare_lock(data_dir: str):
    """Serialise preparation between processes sharing `data_dir` (local workers)."""
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, ".tfdist-prepare.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _builder(config: DataConfig):
    try:
        return tfds.builder(config.dataset, data_dir=config.data_dir)
    except tfds.core.registered.DatasetNotFoundError:
        raise UsageError(
            f"--dataset={config.dataset!r} is not a known TFDS dataset; valid: the bundled "
            f"{', '.join(builders.BUNDLED)}, or any TFDS catalog name") from None
    except Exception as error:  # e.g. data_dir is a file, or unreadable
        raise UsageError(f"--dataset={config.dataset}: cannot open it in "
                         f"--data_dir={config.data_dir}: {_first_line(error)}") from None


def _prepare(builder, config: DataConfig):
    """Prepare `builder`'s data if needed; return a builder that sees it.

    Local workers share `data_dir`: one prepares under the lock while the
    others wait, then reopen the builder so its info lists the new splits.
    """
    if builder.is_prepared():
        return builder
    try:
        with _prepare_lock(str(builder.data_dir_root)):
            if not builder.is_prepared():  # another local worker may have done it
                builder.download_and_prepare()
    except Exception as error:
        raise UsageError(
            f"--dataset={config.dataset}: cannot be prepared in --data_dir="
            f"{builder.data_dir_root}: {_first_line(error)} (prepare it there with "
            "`tfds build`, or pick a bundled dataset: "
            f"{', '.join(builders.BUNDLED)})") from None
    return _builder(config)


def _spec(builder) -> DatasetSpec:
    info = builder.info
    if not info.supervised_keys:
        raise UsageError(f"--dataset={builder.name} has no supervised (input, label) keys")
    x_key, y_key = info.supervised_keys[:2]
    x_feature, y_feature = info.features[x_key], info.features[y_key]
    sizes = {name: split.num_examples for name, split in info.splits.items()}
    if isinstance(x_feature, tfds.features.Image) and isinstance(y_feature, tfds.features.ClassLabel):
        kind, num_classes = "image", y_feature.num_classes
    elif np.issubdtype(x_feature.np_dtype, np.integer) and len(x_feature.shape) == 1:
        kind, num_classes = "tokens", getattr(type(builder), "VOCAB_SIZE", None)
        if num_classes is None:
            raise UsageError(f"--dataset={builder.name}: token data needs a vocabulary size "
                             "(a VOCAB_SIZE attribute on its builder)")
    else:
        raise UsageError(
            f"--dataset={builder.name}: inputs {x_key!r} ({type(x_feature).__name__}) are "
            "neither images with class labels nor token sequences")
    return DatasetSpec(name=builder.name, kind=kind, input_shape=tuple(x_feature.shape),
                       num_classes=int(num_classes), train_examples=sizes.get("train"),
                       eval_examples=sizes.get("test"))


def _preprocess(x, y):
    if x.dtype == tf.uint8:
        x = tf.cast(x, tf.float32) / 255.0
    elif x.dtype.is_integer:
        x = tf.cast(x, tf.int32)
    return x, tf.cast(y, tf.int32)


class TfdsInputs(Inputs):
    """A TFDS dataset's `train` and `test` splits, sharded per input pipeline.

    Training input follows `DataConfig.autoshard`: by file (each pipeline
    opens only its files; needs at least as many files as pipelines), by
    example with `tfds.even_splits` (works for any split, where TFDS's own
    input-context sharding refuses small ones), or not at all. Evaluation is
    always split by example, so every test example is counted exactly once.
    """

    def __init__(self, config: DataConfig, *, prepare: bool = True):
        self.config = config
        self.builder = _builder(config)
        if prepare:
            self.builder = _prepare(self.builder, config)
        self.spec = _spec(self.builder)
        for split in ("train", "test"):
            if split not in self.builder.info.splits:
                raise UsageError(f"--dataset={config.dataset} has no {split!r} split; "
                                 f"it has {', '.join(self.builder.info.splits)}")

    def _num_files(self, split: str) -> int:
        return self.builder.info.splits[split].num_shards

    def _subsplit(self, split, num_pipelines, pipeline_id):
        if num_pipelines == 1:
            return split
        return tfds.even_splits(split, n=num_pipelines)[pipeline_id]

    def split_size(self, split, num_pipelines, pipeline_id):
        sub = self._subsplit(split, num_pipelines, pipeline_id)
        return self.builder.info.splits[sub].num_examples

    def _train_sharding(self, pipelines: int) -> str:
        mode, files = self.config.autoshard, self._num_files("train")
        if pipelines == 1:
            return "off"
        if mode == "auto":
            return "file" if files >= pipelines else "data"
        if mode == "file" and files < pipelines:
            raise UsageError(
                f"--autoshard=file: the train split of {self.config.dataset} has {files} "
                f"file(s), fewer than the {pipelines} input pipelines; use --autoshard=data "
                "or auto")
        return mode

    def check_sharding(self, pipelines: int) -> None:
        """Raise `UsageError` now if training input cannot be sharded this way."""
        self._train_sharding(pipelines)

    def examples(self, split, context, *, shuffle_seed=None):
        pipelines, pipeline_id = context.num_input_pipelines, context.input_pipeline_id
        mode = self._train_sharding(pipelines) if split == "train" else "data"
        if mode == "off" and shuffle_seed is not None:
            shuffle_seed += pipeline_id  # every pipeline reads everything, in its own order
        read_config = tfds.ReadConfig(
            shuffle_seed=shuffle_seed, input_context=context if mode == "file" else None)
        ds = self.builder.as_dataset(
            split=self._subsplit(split, pipelines, pipeline_id) if mode == "data" else split,
            as_supervised=True, shuffle_files=shuffle_seed is not None,
            read_config=read_config)
        return ds.map(_preprocess, num_parallel_calls=tf.data.AUTOTUNE)


def load(config: DataConfig, *, model_dir: Optional[str] = None) -> Inputs:
    """The inputs `config` asks for; a `UsageError` if they cannot be had.
    `model_dir` (when set) caches what is derived from the data (a text
    dataset's vocabulary)."""
    if config.synthetic:
        from tfdist.data.synthetic import SyntheticInputs
        return SyntheticInputs(_spec(_builder(config)))
    return TfdsInputs(config)
