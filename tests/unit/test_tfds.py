"""Any TFDS dataset with supervised_keys: images (any size, grayscale), text
(a vocabulary adapted on train, cached in model_dir), evaluation on test or
validation, and a one-line error at once for what cannot be had offline.

The datasets are small builders in the exact feature layouts of `mnist` and
`imdb_reviews` (tests/tfds_fixtures.py), prepared here; the CLI runs read them
in fresh processes where their code is not importable (TFDS reads the files).
"""

import os
import socket
import time

import numpy as np
import pytest
import tensorflow as tf

import tfds_fixtures
from tfdist import models
from tfdist.config import DataConfig, ModelConfig
from tfdist.data import text as text_lib
from tfdist.data import tfds_inputs
from tfdist.data.spec import DatasetSpec
from tfdist.errors import UsageError
from tfdist.models import transformer

ONE = tf.distribute.InputContext()  # one input pipeline


def _inputs(tfds_dir, dataset, model_dir=None, **data):
    return tfds_inputs.load(DataConfig(dataset=dataset, data_dir=tfds_dir, **data),
                            model_dir=model_dir)


def _first(inputs, split="train"):
    return next(iter(inputs.examples(split, ONE)))


# -- images -----------------------------------------------------------------

def test_mnist_layout_gives_float_grayscale_images_and_int32_labels(tfds_dir):
    inputs = _inputs(tfds_dir, "tfdist_test_mnist")
    assert inputs.spec == DatasetSpec(name="tfdist_test_mnist", kind="image",
                                      input_shape=(28, 28, 1), num_classes=10,
                                      train_examples=600, eval_examples=200)
    x, y = _first(inputs)
    assert x.dtype == tf.float32 and x.shape == (28, 28, 1) and y.dtype == tf.int32
    assert 0.0 <= float(tf.reduce_min(x)) and float(tf.reduce_max(x)) <= 1.0
    assert float(tf.reduce_max(x)) > 0.5  # a digit is drawn


@pytest.mark.parametrize("dataset,image_size", [("tfdist_test_mnist", None),
                                                ("tfdist_test_varied", 24)])
def test_the_global_order_decodes_each_pipelines_rows_into_the_same_batches(
        tfds_dir, monkeypatch, dataset, image_size):
    """Each pipeline shuffles the stored (encoded) images and decodes only its
    own rows: the global batches are those of decoding every example first
    (the same decode and preprocessing ops on the same bytes: bit for bit)."""
    from tfdist.data import inputs as inputs_lib
    inputs = _inputs(tfds_dir, dataset, image_size=image_size)
    _, decode = inputs.undecoded_examples("train", ONE)
    assert decode is not None

    def global_batches(pipelines):
        fn = inputs_lib.train_dataset_fn(inputs, global_batch_size=8, seed=5,
                                         shuffle_buffer=16)
        parts = [next(iter(fn(tf.distribute.InputContext(pipelines, i, pipelines))))
                 for i in range(pipelines)]
        return [np.concatenate([p[k].numpy() for p in parts]) for k in (0, 1)]

    deferred = {n: global_batches(n) for n in (1, 2)}
    monkeypatch.setattr(tfds_inputs.TfdsInputs, "undecoded_examples",
                        inputs_lib.Inputs.undecoded_examples)
    decoded_first = global_batches(1)
    for n in (1, 2):
        for got, want in zip(deferred[n], decoded_first):
            np.testing.assert_array_equal(got, want)
    assert decoded_first[0].dtype == np.float32 and decoded_first[0].shape[0] == 8


def test_image_size_resizes_and_the_spec_says_so(tfds_dir):
    inputs = _inputs(tfds_dir, "tfdist_test_mnist", image_size=16)
    assert inputs.spec.input_shape == (16, 16, 1)
    x, _ = _first(inputs, "test")
    assert x.shape == (16, 16, 1) and x.dtype == tf.float32


def test_images_of_varying_size_need_image_size(tfds_dir):
    with pytest.raises(UsageError, match=r"^--dataset=tfdist_test_varied has images of varying "
                                         r"size \(\? x \?\); pass --image_size=N to resize"):
        _inputs(tfds_dir, "tfdist_test_varied")
    inputs = _inputs(tfds_dir, "tfdist_test_varied", image_size=24)
    assert inputs.spec.input_shape == (24, 24, 3)
    shapes = {tuple(x.shape) for x, _ in inputs.examples("train", ONE)}
    assert shapes == {(24, 24, 3)}


@pytest.mark.parametrize("name,input_shape", [("mlp", (28, 28, 1)), ("cnn", (28, 28, 1)),
                                              ("cnn", (16, 16, 1))])
def test_image_builders_take_grayscale(name, input_shape):
    spec = DatasetSpec("gray", "image", input_shape, 10)
    model = models.build(ModelConfig(name=name, width=8, depth=1), spec)
    assert model(np.zeros((2, *input_shape), "float32")).shape == (2, 10)


# -- splits and layouts -----------------------------------------------------

def test_validation_split_is_evaluated_when_there_is_no_test_split(tfds_dir):
    inputs = _inputs(tfds_dir, "tfdist_test_validation")
    assert inputs.has_eval and inputs.eval_split == "validation"
    assert inputs.spec.eval_examples == 40
    assert inputs.split_size("test", 1, 0) == 40
    assert inputs.split_size("test", 2, 1) == 20
    assert sum(1 for _ in inputs.examples("test", ONE)) == 40


def test_no_evaluation_split_trains_without_evaluation(tfds_dir):
    inputs = _inputs(tfds_dir, "tfdist_test_train_only")
    assert not inputs.has_eval and inputs.spec.eval_examples is None


def test_dataset_without_supervised_keys_is_a_usage_error(tfds_dir):
    with pytest.raises(UsageError, match="^--dataset=tfdist_test_unsupervised has no "
                                         r"supervised \(input, label\) keys"):
        _inputs(tfds_dir, "tfdist_test_unsupervised")


# -- text -------------------------------------------------------------------

def test_text_gives_token_ids_of_a_vocabulary_cached_in_model_dir(tfds_dir, tmp_path,
                                                                   monkeypatch):
    inputs = _inputs(tfds_dir, "tfdist_test_imdb", model_dir=str(tmp_path), vocab_size=40,
                     sequence_length=16)
    spec = inputs.spec
    path = tmp_path / "vocabulary" / "tfdist_test_imdb-40.txt"
    vocabulary = path.read_text(encoding="utf-8").split("\n")
    assert vocabulary[:2] == ["", "[UNK]"] and len(vocabulary) == 40
    assert (spec.kind, spec.input_shape, spec.num_classes, spec.vocab_size) == \
        ("text", (16,), 2, 40)
    assert (spec.train_examples, spec.eval_examples) == (600, 200)
    for x, y in inputs.examples("test", ONE).take(20):
        assert x.dtype == tf.int32 and x.shape == (16,) and y.dtype == tf.int32
        assert 0 <= int(tf.reduce_min(x)) and int(tf.reduce_max(x)) < 40
    full = text_lib.adapt(inputs.builder.as_dataset(split="train", as_supervised=True).map(
        lambda x, y: x), 1000)
    assert vocabulary == full[:40]  # the most frequent words

    # A second run reuses the cache (same token ids) without adapting again.
    def no_adapt(*args, **kwargs):
        raise AssertionError("adapted again")
    monkeypatch.setattr(text_lib, "adapt", no_adapt)
    reused = _inputs(tfds_dir, "tfdist_test_imdb", model_dir=str(tmp_path), vocab_size=40,
                     sequence_length=16)
    assert reused.vectorizer.vocabulary == vocabulary
    x, _ = _first(reused)
    assert x.numpy().tolist() == _first(inputs)[0].numpy().tolist()

    path.write_text("not\na vocabulary", encoding="utf-8")
    with pytest.raises(UsageError, match="is not a vocabulary of at most --vocab_size=40"):
        _inputs(tfds_dir, "tfdist_test_imdb", model_dir=str(tmp_path), vocab_size=40)


def test_text_without_model_dir_adapts_deterministically(tfds_dir):
    a = _inputs(tfds_dir, "tfdist_test_imdb", vocab_size=1000, sequence_length=8)
    b = _inputs(tfds_dir, "tfdist_test_imdb", vocab_size=1000, sequence_length=8)
    assert a.vectorizer.vocabulary == b.vectorizer.vocabulary
    # fewer distinct words than --vocab_size: the spec counts the real ids
    assert a.spec.vocab_size == len(a.vectorizer.vocabulary) < 1000
    words = len(set(tfds_fixtures.POSITIVE + tfds_fixtures.NEGATIVE + tfds_fixtures.FILLER))
    assert a.spec.vocab_size == words + 2
    ids = text_lib.Vectorizer(a.vectorizer.vocabulary, 8)(tf.constant("Great, GREAT film!"))
    great = a.vectorizer.vocabulary.index("great")
    assert ids.numpy().tolist() == [great, great, a.vectorizer.vocabulary.index("film"),
                                    0, 0, 0, 0, 0]
    with pytest.raises(UsageError, match="--vocab_size=2 is too small"):
        _inputs(tfds_dir, "tfdist_test_imdb", vocab_size=2)


def test_vocabulary_file_round_trips_any_token(tmp_path):
    vocabulary = ["", "[UNK]", "café", "a\x85b", "c\u2028d", "e\rf", "日本"]
    path = str(tmp_path / "v" / "x-10.txt")
    text_lib.write_vocabulary(path, vocabulary)
    assert text_lib.read_vocabulary(path, 10) == vocabulary
    assert os.listdir(tmp_path / "v") == ["x-10.txt"]  # no temporary left
    assert text_lib.vocabulary_path("/m", "imdb_reviews/plain_text", 5) == \
        "/m/vocabulary/imdb_reviews_plain_text-5.txt"


def test_transformer_classifies_text_without_a_causal_mask():
    spec = DatasetSpec("t", "text", (12,), 3, vocab_size=50)
    model = models.build(ModelConfig(name="transformer", width=16, depth=2, num_heads=2), spec)
    tokens = np.array([[5, 6, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0],
                       [5, 6, 7, 8, 9, 0, 0, 0, 0, 0, 0, 0]], "int32")
    logits = model(tokens)
    assert logits.shape == (2, 3) and logits.dtype == "float32"
    assert [model.get_layer(f"block{i}").causal for i in range(2)] == [False, False]
    # Non-causal: a later position changes an earlier one's output (causal: not).
    x = np.random.default_rng(0).normal(size=(1, 6, 16)).astype("float32")
    changed = x.copy()
    changed[0, 5] = -changed[0, 5]
    for causal in (False, True):
        block = transformer.DecoderBlock(16, 2, causal=causal)
        moved = np.abs(block(changed)[0, 0] - block(x)[0, 0]).max()
        assert (moved > 1e-4) == (not causal), (causal, moved)
    # An all-padding text pools to zeros, not NaN.
    assert np.isfinite(model(np.zeros((1, 12), "int32"))).all()
    tokens_model = models.build(ModelConfig(name="transformer", width=16, depth=1, num_heads=2),
                                DatasetSpec("k", "tokens", (12,), 50))
    assert tokens_model.get_layer("block0").causal
    assert tokens_model.output_shape == (None, 12, 50)
    config = transformer.DecoderBlock(16, 2, causal=False, name="b").get_config()
    assert transformer.DecoderBlock.from_config(config).causal is False


def test_image_models_refuse_text_naming_the_transformer():
    spec = DatasetSpec("imdb_reviews", "text", (32,), 2, vocab_size=100)
    with pytest.raises(UsageError, match=r"--model=mlp needs a dataset of kind image.*text: "
                                         r"a text dataset such as imdb_reviews with transformer"):
        models.check_compatible(ModelConfig(name="mlp"), spec)


def test_synthetic_text_spec_without_adapting(tfds_dir):
    inputs = _inputs(tfds_dir, "tfdist_test_imdb", synthetic=True, vocab_size=77,
                     sequence_length=9)
    assert (inputs.spec.kind, inputs.spec.input_shape, inputs.spec.vocab_size) == \
        ("text", (9,), 77)


# -- preparing: offline fails fast ------------------------------------------

def test_not_prepared_and_offline_fails_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(tfds_inputs, "network_reachable", lambda *a, **k: False)
    with pytest.raises(UsageError) as error:
        _inputs(str(tmp_path), "tfdist_test_train_only")
    assert str(error.value) == (
        f"--dataset=tfdist_test_train_only is not prepared in --data_dir={tmp_path} and cannot "
        "be downloaded here (no network): on a machine with network run `tfds build "
        f"tfdist_test_train_only --data_dir={tmp_path}` and copy {tmp_path} here")
    assert os.listdir(tmp_path) == []  # nothing written


def test_not_prepared_and_online_lets_tfds_download(tmp_path, monkeypatch):
    logged = []
    monkeypatch.setattr(tfds_inputs, "network_reachable", lambda *a, **k: True)
    monkeypatch.setattr(tfds_inputs.logging, "info", lambda fmt, *a: logged.append(fmt % a))
    inputs = _inputs(str(tmp_path), "tfdist_test_train_only")
    assert inputs.spec.train_examples == 100
    assert [line for line in logged if line.startswith(
        f"Downloading and preparing --dataset=tfdist_test_train_only into --data_dir={tmp_path}")]


def test_a_builder_opened_while_another_worker_prepared_the_data_is_reopened(tmp_path,
                                                                             monkeypatch):
    # Workers sharing a fresh data_dir: this one opened its builder before
    # another finished preparing (its info lists no splits), and checks after.
    monkeypatch.setattr(tfds_inputs, "network_reachable", lambda *a, **k: True)
    config = DataConfig(dataset="tfdist_test_train_only", data_dir=str(tmp_path))
    stale = tfds_inputs._builder(config)
    assert not stale.info.splits   # the control: what was read before the data existed
    tfds_inputs._builder(config).download_and_prepare()   # the other worker
    assert stale.is_prepared()
    assert "train" in tfds_inputs._prepare(stale, config).info.splits


def test_network_probe(monkeypatch):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        monkeypatch.setattr(tfds_inputs, "DOWNLOAD_HOST", "127.0.0.1")
        monkeypatch.setattr(tfds_inputs, "DOWNLOAD_PORT", server.getsockname()[1])
        for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.delenv(var, raising=False)
        assert tfds_inputs.network_reachable(timeout=3)
        port = server.getsockname()[1]
    start = time.monotonic()
    monkeypatch.setattr(tfds_inputs, "DOWNLOAD_PORT", port)  # closed now
    assert not tfds_inputs.network_reachable(timeout=3)
    monkeypatch.setenv("https_proxy", "http://proxy.invalid:3128")
    assert tfds_inputs._probe_address() == ("proxy.invalid", 3128)
    assert not tfds_inputs.network_reachable(timeout=3)
    assert time.monotonic() - start < 7


# -- the CLI, in fresh processes that cannot import the builders ------------

