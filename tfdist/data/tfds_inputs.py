"""Examples from tensorflow-datasets: any prepared TFDS dataset, or a bundled one.

The bundled builders (`tfdist.data.builders`) generate their data offline and
are prepared on first use; other TFDS datasets are used as prepared in
`data_dir` (also when their builder code is not importable here: TFDS reads
them from their files), or downloaded by TFDS where the network allows. With
no network a dataset that is not prepared fails at once with what to do.

Any dataset with `supervised_keys` (input, label) of one of these layouts:
  image: an `Image` input and a `ClassLabel`: float32 in [0, 1], resized to
         `image_size` x `image_size` when that is set (required when the
         stored images differ in size);
  text:  a `Text` input and a `ClassLabel`: int32 token ids of a vocabulary
         adapted on the train split (`tfdist.data.text`);
  tokens: an integer sequence (bundled builders with a `VOCAB_SIZE`).
Evaluation reads the `test` split, else `validation`, else there is none.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import socket
import threading
import urllib.parse
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds
from absl import logging

from tfdist.config import DataConfig
from tfdist.data import builders
from tfdist.data import text as text_lib
from tfdist.data.builders.offline import OfflineBuilder
from tfdist.data.inputs import Inputs, plain
from tfdist.data.spec import DatasetSpec
from tfdist.errors import UsageError, first_line

# Where TFDS downloads catalog datasets from (and the host the probe tries).
DOWNLOAD_HOST, DOWNLOAD_PORT = "storage.googleapis.com", 443
PROBE_TIMEOUT = 3.0  # seconds
EVAL_SPLITS = ("test", "validation")  # the first present is evaluated


def _probe_address() -> tuple:
    """(host, port) a download would connect to first: the HTTPS proxy if set."""
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        proxy = os.environ.get(var)
        if proxy:
            parts = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
            if parts.hostname:
                try:
                    port = parts.port
                except ValueError:
                    port = None
                return parts.hostname, port or (443 if parts.scheme == "https" else 80)
    return DOWNLOAD_HOST, DOWNLOAD_PORT


def network_reachable(timeout: float = PROBE_TIMEOUT) -> bool:
    """Whether a TCP connection to TFDS's download host (or the HTTPS proxy)
    opens within `timeout` seconds, name resolution included."""
    host, port = _probe_address()
    result = []

    def connect():
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(True)
        except OSError:
            result.append(False)

    # A thread bounds the name lookup too, which socket timeouts do not cover.
    thread = threading.Thread(target=connect, name="tfdist-network-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(result and result[0])


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


def _q(path) -> str:
    """`path` quoted for the shell, a newline shown as \\n: the message stays one line."""
    return shlex.quote(str(path)).replace("\n", "\\n")


def _builder(config: DataConfig):
    try:
        return tfds.builder(config.dataset, data_dir=config.data_dir)
    except tfds.core.registered.DatasetNotFoundError:
        raise UsageError(
            f"--dataset={config.dataset!r} is not a known TFDS dataset; valid: the bundled "
            f"{', '.join(builders.BUNDLED)}, any TFDS catalog name, or a dataset prepared in "
            f"--data_dir={_q(config.data_dir or tfds.core.constants.DATA_DIR)}") from None
    except Exception as error:  # e.g. data_dir is a file, or unreadable
        raise UsageError(f"--dataset={_q(config.dataset)}: cannot open it in "
                         f"--data_dir={_q(config.data_dir)}: {first_line(error)}") from None


def _prepare(builder, config: DataConfig):
    """Prepare `builder`'s data if needed; return a builder that sees it.

    Bundled builders generate their data here. Others download: when the
    network is unreachable that fails at once with what to do instead (TFDS
    itself would retry for minutes). Local workers share `data_dir`: one
    prepares under the lock while the others wait, then reopen the builder so
    its info lists the new splits.
    """
    if builder.is_prepared():
        # Opened while another local worker was still preparing it: its info
        # was read then and lists no splits; reopen to read the finished one
        # (found under Slurm: a task failed "has no 'train' split").
        return builder if builder.info.splits else _builder(config)
    data_dir = str(builder.data_dir_root)
    quoted = _q(data_dir)
    bundled = isinstance(builder, OfflineBuilder)
    if not bundled and not network_reachable():
        raise UsageError(
            f"--dataset={config.dataset} is not prepared in --data_dir={quoted} and cannot "
            "be downloaded here (no network): on a machine with network run "
            f"`tfds build {config.dataset} --data_dir={quoted}` and copy {quoted} here")
    try:
        with _prepare_lock(data_dir):
            if not builder.is_prepared():  # another local worker may have done it
                logging.info("%s --dataset=%s into --data_dir=%s (once; TFDS may take a while)",
                             "Generating" if bundled else "Downloading and preparing",
                             config.dataset, data_dir)
                builder.download_and_prepare()
    except Exception as error:
        raise UsageError(
            f"--dataset={config.dataset}: cannot be prepared in --data_dir="
            f"{quoted}: {first_line(error)} (prepare it there with "
            "`tfds build`, or pick a bundled dataset: "
            f"{', '.join(builders.BUNDLED)})") from None
    return _builder(config)


def _layout(builder):
    """(kind, x_key, y_key, x_feature, y_feature) of a supervised dataset."""
    info = builder.info
    if not info.supervised_keys:
        raise UsageError(f"--dataset={builder.name} has no supervised (input, label) keys; "
                         "valid: a dataset whose TFDS info names its supervised_keys")
    x_key, y_key = info.supervised_keys[:2]
    if not isinstance(x_key, str) or not isinstance(y_key, str):
        raise UsageError(f"--dataset={builder.name}: supervised_keys {info.supervised_keys} "
                         "are nested; valid: one input feature and one label feature")
    x_feature, y_feature = info.features[x_key], info.features[y_key]
    class_label = isinstance(y_feature, tfds.features.ClassLabel)
    if isinstance(x_feature, tfds.features.Image) and class_label:
        kind = "image"
    elif isinstance(x_feature, tfds.features.Text) and class_label:
        kind = "text"
    elif np.issubdtype(x_feature.np_dtype, np.integer) and len(x_feature.shape) == 1:
        kind = "tokens"
    else:
        raise UsageError(
            f"--dataset={builder.name}: inputs {x_key!r} ({type(x_feature).__name__}) with "
            f"labels {y_key!r} ({type(y_feature).__name__}) are none of: images with class "
            "labels, texts with class labels, token sequences")
    return kind, x_key, y_key, x_feature, y_feature


def _image_shape(builder, x_feature, config: DataConfig) -> tuple:
    height, width, channels = x_feature.shape
    if channels is None:
        raise UsageError(f"--dataset={builder.name}: images with an unknown number of "
                         "channels are not supported; valid: a fixed channel count")
    if config.image_size:
        return (config.image_size, config.image_size, channels)
    if height is None or width is None:
        raise UsageError(
            f"--dataset={builder.name} has images of varying size ({height or '?'} x "
            f"{width or '?'}); pass --image_size=N to resize them to N x N")
    return (height, width, channels)


def _eval_split(builder) -> Optional[str]:
    return next((s for s in EVAL_SPLITS if s in builder.info.splits), None)


def _spec(builder, config: DataConfig, *, vocab_size: Optional[int] = None) -> DatasetSpec:
    """The dataset's spec after preprocessing; `vocab_size` for text (default:
    `config.vocab_size`, the most the vocabulary can hold)."""
    kind, _, _, x_feature, y_feature = _layout(builder)
    sizes = {name: split.num_examples for name, split in builder.info.splits.items()}
    if kind == "image":
        input_shape, num_classes = _image_shape(builder, x_feature, config), y_feature.num_classes
    elif kind == "text":
        input_shape, num_classes = (config.sequence_length,), y_feature.num_classes
        vocab_size = vocab_size or config.vocab_size
    else:
        input_shape = tuple(x_feature.shape)
        num_classes = getattr(type(builder), "VOCAB_SIZE", None)
        if num_classes is None:
            raise UsageError(f"--dataset={builder.name}: token data needs a vocabulary size "
                             "(a VOCAB_SIZE attribute on its builder)")
    eval_split = _eval_split(builder)
    return DatasetSpec(name=builder.name, kind=kind, input_shape=tuple(input_shape),
                       num_classes=int(num_classes), train_examples=sizes.get("train"),
                       eval_examples=sizes.get(eval_split) if eval_split else None,
                       vocab_size=vocab_size if kind == "text" else None)


def _labels(y):
    return tf.cast(y, tf.int32)


def _image_preprocess(image_size: Optional[int]):
    def preprocess(x, y):
        if x.dtype == tf.uint8:
            x = tf.cast(x, tf.float32) / 255.0
        elif x.dtype == tf.uint16:
            x = tf.cast(x, tf.float32) / 65535.0
        else:
            x = tf.cast(x, tf.float32)
        if image_size:
            x = tf.image.resize(x, (image_size, image_size))
        return x, _labels(y)
    return preprocess


def _tokens_preprocess(x, y):
    return tf.cast(x, tf.int32), tf.cast(y, tf.int32)


class TfdsInputs(Inputs):
    """A TFDS dataset's `train` split and evaluation split (`test`, else
    `validation`), sharded per input pipeline.

    Training input follows `DataConfig.autoshard`: by file (each pipeline
    opens only its files; needs at least as many files as pipelines), by
    example with `tfds.even_splits` (works for any split, where TFDS's own
    input-context sharding refuses small ones), or not at all. Evaluation is
    always split by example, so every test example is counted exactly once.
    Callers name the evaluation split "test" whichever split it is.
    """

    def __init__(self, config: DataConfig, *, prepare: bool = True,
                 model_dir: Optional[str] = None):
        self.config = config
        self.builder = _builder(config)
        if prepare:
            self.builder = _prepare(self.builder, config)
        splits = self.builder.info.splits
        kind = _layout(self.builder)[0]
        if "train" not in splits:
            raise UsageError(f"--dataset={config.dataset} has no 'train' split; "
                             f"it has {', '.join(splits) or 'none'}")
        self.eval_split = _eval_split(self.builder)
        self.has_eval = self.eval_split is not None
        if not self.has_eval:
            logging.warning("--dataset=%s has no %s split (it has %s): training without "
                            "evaluation", config.dataset, " or ".join(map(repr, EVAL_SPLITS)),
                            ", ".join(splits))
        self.vectorizer = None
        if kind == "text":
            self.vectorizer = self._vectorizer(model_dir)
        self.spec = _spec(self.builder, config,
                          vocab_size=self.vectorizer.vocab_size if self.vectorizer else None)
        if kind == "image":
            self._preprocess = _image_preprocess(config.image_size)
        elif kind == "text":
            vectorize = self.vectorizer
            self._preprocess = lambda x, y: (vectorize(x), _labels(y))
        else:
            self._preprocess = _tokens_preprocess

    def _vectorizer(self, model_dir: Optional[str]) -> text_lib.Vectorizer:
        config = self.config
        if config.vocab_size < 3:
            raise UsageError(f"--vocab_size={config.vocab_size} is too small for text; valid: "
                             "3 or more (padding, out-of-vocabulary and at least one token)")

        def train_texts():  # in file order, so every worker adapts the same
            return self.builder.as_dataset(split="train", as_supervised=True,
                                           shuffle_files=False).map(plain(lambda x, y: x))

        cache = text_lib.vocabulary_path(model_dir, config.dataset, config.vocab_size) \
            if model_dir else None
        vocabulary = text_lib.load_or_adapt(train_texts, config.vocab_size, cache_path=cache)
        return text_lib.Vectorizer(vocabulary, config.sequence_length)

    def _split_name(self, split: str) -> str:
        return self.eval_split if split == "test" and self.eval_split else split

    def _num_files(self, split: str) -> int:
        return self.builder.info.splits[self._split_name(split)].num_shards

    def _subsplit(self, split, num_pipelines, pipeline_id):
        split = self._split_name(split)
        if num_pipelines == 1:
            return split
        return tfds.even_splits(split, n=num_pipelines)[pipeline_id]

    def split_size(self, split, num_pipelines, pipeline_id):
        sub = self._subsplit(split, num_pipelines, pipeline_id)
        return self.builder.info.splits[sub].num_examples

    def _train_sharding(self, pipelines: int) -> str:
        mode, files = self.config.autoshard, self._num_files("train")
        if pipelines == 1 or mode == "global":   # global: every pipeline reads everything
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
            split=self._subsplit(split, pipelines, pipeline_id) if mode == "data"
            else self._split_name(split),
            as_supervised=True, shuffle_files=shuffle_seed is not None,
            read_config=read_config)
        return ds.map(plain(self._preprocess), num_parallel_calls=tf.data.AUTOTUNE)

    def undecoded_examples(self, split, context):
        """Images as their stored (encoded) bytes, decoded by `decode`: the
        global order's shuffle buffer holds the bytes, and each pipeline
        decodes only its own rows of each global batch."""
        kind, x_key, _, x_feature, _ = _layout(self.builder)
        if kind != "image":
            return super().undecoded_examples(split, context)
        ds = self.builder.as_dataset(split=self._split_name(split), as_supervised=True,
                                     shuffle_files=False,
                                     decoders={x_key: tfds.decode.SkipDecoding()})
        preprocess = self._preprocess
        return ds, lambda x, y: preprocess(x_feature.decode_example(x), y)


def load(config: DataConfig, *, model_dir: Optional[str] = None) -> Inputs:
    """The inputs `config` asks for; a `UsageError` if they cannot be had.
    `model_dir` (when set) caches what is derived from the data (a text
    dataset's vocabulary)."""
    if config.synthetic:
        from tfdist.data.synthetic import SyntheticInputs
        return SyntheticInputs(_spec(_builder(config), config))
    return TfdsInputs(config, model_dir=model_dir)
