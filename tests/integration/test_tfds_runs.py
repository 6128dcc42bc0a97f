"""TFDS datasets through `tfdist-train`: the test builders' mnist and imdb
layouts train, and a dataset that cannot be had offline fails at once (in
fresh processes, where the builders' code is not importable: TFDS reads the
files). In-process: tests/unit/test_tfds.py."""

import json
import os
import time

import pytest

from conftest import run_clis


def _summary(result):
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _error_line(result):
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return lines[0]


@pytest.mark.slow   # ~35 CPU-s; make test: tests/unit/test_tfds.py (layouts, text, offline)
@pytest.mark.integration
def test_cli_trains_mnist_and_imdb_layouts_and_fails_fast_offline(tfds_dir, tmp_path):
    common = [f"--data_dir={tfds_dir}", "--strategy=default", "--global_batch_size=32",
              "--learning_rate=0.003", "--jit_compile=off"]   # data layouts, not XLA
    model_dir = tmp_path / "imdb_run"
    imdb = common + ["--dataset=tfdist_test_imdb", "--model=transformer", "--model_width=32",
                     "--model_depth=1", "--sequence_length=32", "--vocab_size=200",
                     "--train_steps=100", f"--model_dir={model_dir}"]
    empty = tmp_path / "empty"
    empty.mkdir()
    start = time.monotonic()
    mlp, cnn, text, unsupervised, offline = run_clis([
        common + ["--dataset=tfdist_test_mnist", "--model=mlp", "--model_width=64",
                  "--model_depth=1", "--train_steps=120"],
        common + ["--dataset=tfdist_test_mnist", "--model=cnn", "--model_width=16",
                  "--model_depth=1", "--image_size=16", "--train_steps=100"],
        imdb,
        [f"--data_dir={tfds_dir}", "--dataset=tfdist_test_unsupervised"],
        [f"--data_dir={empty}", "--dataset=mnist"],
    ], timeout=240)

    assert _error_line(offline) == (
        f"tfdist-train: error: --dataset=mnist is not prepared in --data_dir={empty} and "
        "cannot be downloaded here (no network): on a machine with network run "
        f"`tfds build mnist --data_dir={empty}` and copy {empty} here")
    assert os.listdir(empty) == []
    assert _error_line(unsupervised).startswith(
        "tfdist-train: error: --dataset=tfdist_test_unsupervised has no supervised (input, "
        "label) keys")

    accuracies = {name: _summary(r).get("accuracy") for name, r in
                  (("mlp", mlp), ("cnn", cnn), ("text", text))}
    summary = _summary(mlp)
    assert summary["dataset"] == "tfdist_test_mnist" and summary["steps"] == 120
    assert summary["accuracy"] >= 0.8, summary  # 10 classes: chance is 0.1
    summary = _summary(cnn)
    assert summary["model"] == "cnn" and summary["accuracy"] >= 0.8, summary

    summary = _summary(text)
    assert summary["accuracy"] >= 0.75, summary  # 2 classes: chance is 0.5
    vocabulary = model_dir / "vocabulary" / "tfdist_test_imdb-200.txt"
    assert "written to " + str(vocabulary) in text.stderr
    before = os.stat(vocabulary)

    # Resumed (at its last step): the cached vocabulary is read, not adapted again,
    # and the restored model evaluates as well on the same token ids.
    (again,) = run_clis([imdb], timeout=180)
    assert f"tokens from {vocabulary}" in again.stderr and "adapting" not in again.stderr
    # (A run resumed at its last step trains no step, so its summary has test_loss
    # but no "accuracy": compare the loss.)
    assert _summary(again)["test_loss"] == pytest.approx(summary["test_loss"], rel=1e-4)
    after = os.stat(vocabulary)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    print(f"CLI runs: {time.monotonic() - start:.1f} s; test accuracy {accuracies}")
