"""The bundled TFDS builders prepare offline, load, shard, repeat, and teach.

Each dataset is prepared once per module run for the loading and content
checks, and once more into a fresh directory to show that preparation is
deterministic down to the bytes of every record file. (Within one process:
preparations in two processes hold the same examples in the same order, but
protobuf may serialize each example's two features in the other order.)
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow_datasets as tfds

from tfdist.data import builders
from tfdist.data.builders import shapes, tokens


def _prepare(name, data_dir):
    builder = tfds.builder(name, data_dir=str(data_dir))
    builder.download_and_prepare()  # no DownloadConfig: defaults must shard
    return builder


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Maps a dataset name to its data_dir, preparing each once per module."""
    data_dirs = {}

    def data_dir(name):
        if name not in data_dirs:
            data_dirs[name] = tmp_path_factory.mktemp(name)
            _prepare(name, data_dirs[name])
        return data_dirs[name]

    return data_dir


def _split_numpy(name, data_dir, split):
    """The whole split as a dict of numpy arrays, in file order."""
    return tfds.as_numpy(
        tfds.load(name, data_dir=str(data_dir), split=split, batch_size=-1,
                  download=False)
    )


def test_bundled_names_are_registered():
    assert builders.BUNDLED == ("tfdist_shapes", "tfdist_tokens")
    assert tfds.builder_cls("tfdist_shapes") is shapes.TfdistShapes
    assert tfds.builder_cls("tfdist_tokens") is tokens.TfdistTokens


@pytest.mark.parametrize("name", builders.BUNDLED)
def test_builder_reloads_prepared_data(prepared, name):
    data_dir = prepared(name)
    builder = tfds.builder(name, data_dir=str(data_dir))
    assert str(builder.info.version) == "1.0.0"
    assert builder.info.splits["train"].num_examples == {
        "tfdist_shapes": 12_000, "tfdist_tokens": 20_000}[name]
    assert builder.info.splits["test"].num_examples == 2_000


@pytest.mark.parametrize("name", builders.BUNDLED)
def test_several_files_per_split(prepared, name):
    data_dir = prepared(name)
    builder = tfds.builder(name, data_dir=str(data_dir))
    for split, minimum in (("train", 4), ("test", 2)):
        files = builder.info.splits[split].filenames
        assert builder.info.splits[split].num_shards == len(files) >= minimum
        assert all((builder.data_path / f).exists() for f in files)


def test_callers_shard_count_wins(tmp_path):
    builder = tfds.builder("tfdist_tokens", data_dir=str(tmp_path))
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(num_shards=2))
    assert builder.info.splits["train"].num_shards == 2


@pytest.mark.parametrize("name", builders.BUNDLED)
def test_preparation_is_deterministic(prepared, name, tmp_path):
    data_dir = prepared(name)
    first = tfds.builder(name, data_dir=str(data_dir)).data_path
    second = _prepare(name, tmp_path).data_path
    files = sorted(p.name for p in first.glob("*.tfrecord*"))
    assert files == sorted(p.name for p in second.glob("*.tfrecord*"))
    for f in files:
        assert (first / f).read_bytes() == (second / f).read_bytes(), f


@pytest.mark.parametrize("name", builders.BUNDLED)
def test_load_supervised(prepared, name):
    data_dir = prepared(name)
    ds = tfds.load(name, data_dir=str(data_dir), split="test",
                   as_supervised=True)
    x, y = next(iter(tfds.as_numpy(ds)))
    if name == "tfdist_shapes":
        assert (x.shape, x.dtype) == ((32, 32, 3), np.uint8)
        assert y.shape == () and 0 <= y < len(shapes.CLASS_NAMES)
    else:
        assert (x.shape, x.dtype) == ((64,), np.int32)
        assert (y.shape, y.dtype) == ((64,), np.int32)


def test_shapes_labels_cover_all_classes(prepared):
    shapes_dir = prepared("tfdist_shapes")
    info = tfds.builder("tfdist_shapes", data_dir=str(prepared)).info
    assert info.features["label"].names == list(shapes.CLASS_NAMES)
    labels = _split_numpy("tfdist_shapes", shapes_dir, "test")["label"]
    assert np.array_equal(np.bincount(labels), [200] * 10)


def _fourier_features(images):
    """Translation- and polarity-invariant features of uint8 images.

    Distance from the background level (median border pixel) makes the figure
    bright whatever its colours; the 2-D Fourier magnitude then drops its
    position.
    """
    gray = images.astype(np.float32).mean(axis=-1)
    border = np.concatenate(
        [gray[:, 0], gray[:, -1], gray[:, :, 0], gray[:, :, -1]], axis=1)
    figure = np.abs(gray - np.median(border, axis=1)[:, None, None])
    spectrum = np.abs(np.fft.rfft2(figure)).reshape(len(images), -1)
    return spectrum / np.linalg.norm(spectrum, axis=1, keepdims=True)


def test_shapes_are_learnable(prepared):
    """Nearest class mean on Fourier features: far above the 10% chance."""
    shapes_dir = prepared("tfdist_shapes")
    train = _split_numpy("tfdist_shapes", shapes_dir, "train[:3000]")
    test = _split_numpy("tfdist_shapes", shapes_dir, "test")
    x_train, x_test = (_fourier_features(s["image"]) for s in (train, test))
    means = np.stack([x_train[train["label"] == k].mean(axis=0)
                      for k in range(len(shapes.CLASS_NAMES))])
    distances = ((x_test[:, None, :] - means[None]) ** 2).sum(axis=-1)
    accuracy = (distances.argmin(axis=1) == test["label"]).mean()
    assert accuracy > 0.8


def test_tokens_follow_a_rule(prepared):
    tokens_dir = prepared("tfdist_tokens")
    info = tfds.builder("tfdist_tokens", data_dir=str(prepared)).info
    assert info.metadata["vocab_size"] == tokens.VOCAB_SIZE == 64
    test = _split_numpy("tfdist_tokens", tokens_dir, "test")
    x, y = test["inputs"], test["targets"]
    assert x.min() >= 0 and max(x.max(), y.max()) < tokens.VOCAB_SIZE
    assert np.array_equal(x[:, 1:], y[:, :-1])
    seq = np.concatenate([x, y[:, -1:]], axis=1).astype(np.int64)
    follows = [
        ((a * seq[:, 1:-1] + b * seq[:, :-2] + c) % tokens.VOCAB_SIZE
         == seq[:, 2:]).all(axis=1)
        for a, b, c in tokens.RULES
    ]
    assert np.any(follows, axis=0).all()


def test_tokens_are_learnable_and_need_context(prepared):
    """Count tables fitted on train predict test's x[t+1] far above the 1/64
    chance, and from (x[t-1], x[t]) far better than from x[t] alone."""
    tokens_dir = prepared("tfdist_tokens")
    train, test = (_split_numpy("tfdist_tokens", tokens_dir, split)
                   for split in ("train", "test"))
    train, test = (np.concatenate([s["inputs"], s["targets"][:, -1:]], axis=1)
                   for s in (train, test))
    vocab = tokens.VOCAB_SIZE

    def accuracy(context):
        counts = np.zeros((vocab * vocab, vocab), dtype=np.int64)
        np.add.at(counts, (context(train).ravel(), train[:, 2:].ravel()), 1)
        return (counts.argmax(axis=1)[context(test)] == test[:, 2:]).mean()

    last_token = accuracy(lambda seq: seq[:, 1:-1].astype(np.int64))
    last_two = accuracy(lambda seq: seq[:, :-2].astype(np.int64) * vocab
                        + seq[:, 1:-1])
    assert last_two > 0.6
    assert last_two > last_token + 0.3
