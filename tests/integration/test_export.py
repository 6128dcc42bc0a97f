"""Export for serving: `--export_dir` after training and `tfdist-export` from a
checkpoint; the exports reload with Keras and with `tf.saved_model.load` and
predict what the trained weights predict."""

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist import exporting, models
from tfdist.checkpointing import checkpoint_dir
from tfdist.data import tfds_inputs

from conftest import BIN, run_all, run_clis

TINY = {"mlp": ["--model=mlp", "--model_width=16", "--model_depth=1"],
        "cnn": ["--model=cnn", "--model_width=4", "--model_depth=1"]}


def _checkpoint_model(model_dir):
    """The run's model rebuilt from its record, with its latest checkpoint."""
    config, spec, _ = exporting.read_run_record(model_dir)
    model = models.build(config.model, spec)
    tf.train.Checkpoint(model=model).read(
        tf.train.latest_checkpoint(checkpoint_dir(model_dir))).expect_partial()
    return model, config


def _test_images(config, n=16):
    inputs = tfds_inputs.load(config.data)
    x, _ = next(iter(inputs.examples("test", tf.distribute.InputContext()).batch(n)))
    return x


# The same weights and the same graph: within 1e-6 (the SavedModel's graph may
# fuse bias and activation into the matmul, a last-bit difference).
EXPORT_TOLERANCE = dict(rtol=1e-6, atol=1e-6)


def _assert_export_predicts(export_dir, x, expected):
    reloaded = keras.saving.load_model(os.path.join(export_dir, "model.keras"))
    np.testing.assert_allclose(reloaded.predict(x, verbose=0), expected, **EXPORT_TOLERANCE)
    served = tf.saved_model.load(os.path.join(export_dir, "saved_model"))
    np.testing.assert_allclose(served.serve(x).numpy(), expected, **EXPORT_TOLERANCE)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_cli_export_and_tfdist_export(tmp_path, data_dir):
    """mirrored (mlp), dtensor with tensor-sharded weights (mlp) and a cnn: the
    chief's export holds the full trained weights (compared with the
    checkpoint restored into a plain model), and tfdist-export of the same
    checkpoint writes the same model."""
    runs = {
        "mirrored_mlp": ["--strategy=mirrored", *TINY["mlp"]],
        "dtensor_mlp": ["--strategy=dtensor", "--mesh=batch:1,model:2", *TINY["mlp"]],
        "default_cnn": ["--strategy=default", *TINY["cnn"]],
    }
    common = ["--train_steps=6", "--steps_per_loop=3", "--global_batch_size=16",
              "--jit_compile=off", f"--data_dir={data_dir}"]   # export, not XLA
    results = run_clis([[*args, *common, f"--model_dir={tmp_path / name}",
                         f"--export_dir={tmp_path / name / 'export'}"]
                        for name, args in runs.items()], timeout=240)
    for name, result in zip(runs, results):
        assert result.returncode == 0, (name, result.stderr[-3000:])
        summary = json.loads(result.stdout.strip().splitlines()[-1])
        assert summary["export"]["keras"] == str(tmp_path / name / "export" / "model.keras")
    # Two fresh processes at once (each is mostly TensorFlow start-up): tfdist-export
    # of the dtensor run, and tfdist.load_model of the cnn's export, which
    # registers the cnn's own layers.
    exported, fresh = run_all([
        [os.path.join(BIN, "tfdist-export"), f"--model_dir={tmp_path / 'dtensor_mlp'}",
         f"--export_dir={tmp_path / 'again'}"],
        [os.path.join(BIN, "python"), "-c",
         "import sys, tfdist; print(tfdist.load_model(sys.argv[1]).name)",
         str(tmp_path / "default_cnn" / "export" / "model.keras")]], timeout=120)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert fresh.returncode == 0 and fresh.stdout.split()[-1] == "cnn", fresh.stderr[-2000:]
    for name in runs:
        model, config = _checkpoint_model(str(tmp_path / name))
        x = _test_images(config.replace(data=config.data.replace(data_dir=data_dir)))
        expected = model.predict(x, verbose=0)
        _assert_export_predicts(str(tmp_path / name / "export"), x, expected)
        if name == "dtensor_mlp":
            _assert_export_predicts(str(tmp_path / "again"), x, expected)


def test_tfdist_export_bad_input_is_one_line(tmp_path):
    cases = [([f"--model_dir={tmp_path}", f"--export_dir={tmp_path / 'e'}"], "has no run.json"),
             ([f"--model_dir={tmp_path}"], "needs --model_dir")]
    results = run_all([[os.path.join(BIN, "tfdist-export"), *args] for args, _ in cases],
                      timeout=120)
    for (args, message), result in zip(cases, results):
        assert result.returncode == 2, (args, result.stderr[-2000:])
        errors = [line for line in result.stderr.splitlines() if ": error:" in line]
        assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]
    assert not (tmp_path / "e").exists()

