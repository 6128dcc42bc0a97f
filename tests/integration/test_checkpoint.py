"""Checkpoints restore across strategies; a resumed run ends at the requested step."""

import json
import os
import re

import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist import checkpointing, models

from common import (IMAGE_SPEC, PREDICTION_TOLERANCE, PROBE, assert_variables_equal,
                    assert_weights_close, image_dataset_fn, run_config)



def _train(config):
    return tfdist.train(config, model_fn=lambda spec: models.build(config.model, spec),
                        dataset_fn=image_dataset_fn, spec=IMAGE_SPEC)


@pytest.mark.parametrize("writer,reader", [("mirrored", "default"), ("default", "mirrored")])
def test_checkpoint_restores_under_another_strategy(tmp_path, writer, reader):
    cnn = dict(model="cnn", width=4, depth=1, optimizer="adam", learning_rate=0.01)
    written = _train(run_config(writer, steps=4, model_dir=str(tmp_path), **cnn))
    expected = written.model.predict(PROBE, verbose=0)
    # Same requested step count: the reader restores step 4 and trains no further.
    read = _train(run_config(reader, steps=4, model_dir=str(tmp_path), seed=99, **cnn))
    assert read.summary["steps"] == 4
    # A restore copies bytes: every variable (weights, BatchNorm statistics,
    # Adam's step counter and moments) is bit-identical to what was saved.
    assert_variables_equal(read.model.variables, written.model.variables)
    assert int(read.optimizer.iterations.numpy()) == 4
    assert_variables_equal(read.optimizer.variables, written.optimizer.variables)
    # Predictions are *computed* under another strategy (another device split
    # and kernel), so their last float bits may differ (6e-8 seen on an AVX2
    # EPYC): equal within float32 reordering error, not bit for bit.
    np.testing.assert_allclose(read.model.predict(PROBE, verbose=0), expected,
                               **PREDICTION_TOLERANCE)


def test_resume_continues_from_saved_step(tmp_path):
    first = _train(run_config("mirrored", steps=6, steps_per_loop=2, checkpoint_every=2,
                              model_dir=str(tmp_path)))
    assert first.summary["steps"] == 6
    assert checkpointing.saved_steps(str(tmp_path)) == [2, 4, 6]
    resumed = _train(run_config("mirrored", steps=10, steps_per_loop=2, checkpoint_every=2,
                                model_dir=str(tmp_path)))
    assert resumed.summary["steps"] == 10
    assert checkpointing.saved_steps(str(tmp_path)) == [6, 8, 10]
    # It continued from step 6's weights, not from a fresh initialisation:
    fresh = _train(run_config("mirrored", steps=4, steps_per_loop=2))
    assert not np.allclose(resumed.model.predict(PROBE, verbose=0),
                           fresh.model.predict(PROBE, verbose=0), atol=1e-4)


def _damage(model_dir, step, how):
    prefix = f"{checkpointing.checkpoint_dir(model_dir)}/ckpt-{step}"
    if how == "truncated":
        data = f"{prefix}.data-00000-of-00001"
        with open(data, "r+b") as f:
            f.truncate(os.path.getsize(data) // 2)
    elif how == "corrupted":
        with open(f"{prefix}.index", "r+b") as f:
            f.seek(0)
            f.write(b"\xff" * 64)
    else:   # the index file itself is garbage: checkpoints are found by their files
        with open(f"{checkpointing.checkpoint_dir(model_dir)}/checkpoint", "w") as f:
            f.write("model_checkpoint_path: \x00garbage {{{")


@pytest.mark.parametrize("how", ["truncated", "corrupted", "index"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, how, caplog):
    """A truncated or corrupted newest checkpoint: restore warns, takes the
    previous one, and the run still ends at the requested step with the
    damaged checkpoint rewritten."""
    model_dir = str(tmp_path)
    mlp = dict(model="mlp", width=8, depth=1, steps_per_loop=10, checkpoint_every=10)
    first = _train(run_config("default", steps=20, model_dir=model_dir, **mlp))
    assert checkpointing.saved_steps(model_dir) == [10, 20]
    _damage(model_dir, 20, how)
    resumed = _train(run_config("default", steps=30, model_dir=model_dir, **mlp))
    assert resumed.summary["steps"] == 30
    warnings = [r.getMessage() for r in caplog.records if "cannot be read" in r.getMessage()]
    if how == "index":   # a garbage index loses no checkpoint: they are found by their files
        assert not warnings
    else:
        assert len(warnings) == 1 and "ckpt-20 cannot be read" in warnings[0], warnings
        assert warnings[0].endswith("falling back to " + os.path.join(
            checkpointing.checkpoint_dir(model_dir), "ckpt-10"))
    assert checkpointing.saved_steps(model_dir) == [10, 20, 30]
    for step in (10, 20, 30):   # every kept checkpoint is readable again
        tf.train.load_checkpoint(f"{checkpointing.checkpoint_dir(model_dir)}/ckpt-{step}")
    del first


def test_no_readable_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    model_dir = str(tmp_path)
    mlp = dict(model="mlp", width=8, depth=1, steps_per_loop=10, checkpoint_every=10)
    _train(run_config("default", steps=10, model_dir=model_dir, **mlp))
    _damage(model_dir, 10, "truncated")
    with pytest.raises(tfdist.UsageError, match="none of its 1 checkpoint"):
        _train(run_config("default", steps=20, model_dir=model_dir, **mlp))


def _input_positions(model_dir):
    return sorted(os.listdir(os.path.join(checkpointing.checkpoint_dir(model_dir), "input")))


def _sharded(config, autoshard="auto", **data):
    """`config` with per-pipeline sharding (the iterator-state position)."""
    return config.replace(data=config.data.replace(autoshard=autoshard, **data))


@pytest.mark.parametrize("strategy,order", [("default", "global"), ("mirrored", "global"),
                                            ("mirrored", "auto")])
def test_resumed_run_reads_exactly_the_batches_of_an_uninterrupted_one(tmp_path, strategy,
                                                                        order):
    """Interrupted at step 8 (a run that ends there) and resumed to 12 equals
    12 uninterrupted steps: the input position is part of the checkpoint
    (the global order's examples read, or each pipeline's iterator state).
    The same strategy computes both in the same order, so the one difference
    possible is the data; 1e-6 is far below what one other batch changes
    (checked below: a resume without the saved input position is off by more)."""
    common = dict(steps_per_loop=2, checkpoint_every=4, learning_rate=0.05, batch=64,
                  keep_checkpoints=2)

    def config(**kwargs):
        return _sharded(run_config(strategy, **common, **kwargs), order)

    straight = _train(config(steps=12))
    first_dir, second_dir = str(tmp_path / "a"), str(tmp_path / "b")
    for model_dir in (first_dir, second_dir):
        _train(config(steps=8, model_dir=model_dir))
    # The position was saved next to checkpoints 4 and 8.
    [position] = _input_positions(first_dir)
    assert position.startswith("global-") if order == "global" else \
        position.endswith("-pipeline-0-of-1")
    resumed = _train(config(steps=12, model_dir=first_dir))
    assert resumed.summary["steps"] == 12
    assert_weights_close(resumed.model.variables, straight.model.variables, rtol=0, atol=1e-6)
    # Positions are kept for the checkpoints kept (--keep_checkpoints=2), no more.
    assert checkpointing.saved_steps(first_dir) == [8, 12]
    kept = os.listdir(os.path.join(checkpointing.checkpoint_dir(first_dir), "input", position))
    steps = {int(m.group(1)) for m in map(re.compile(r"ckpt-(\d+)\.(json|index)$").match, kept)
             if m}
    assert sorted(steps) == [8, 12], kept
    # Without the position it draws a fresh permutation: other batches, other weights.
    import shutil
    shutil.rmtree(os.path.join(checkpointing.checkpoint_dir(second_dir), "input"))
    fresh = _train(config(steps=12, model_dir=second_dir))
    differences = [np.max(np.abs(np.asarray(a) - np.asarray(b)))
                   for a, b in zip(fresh.model.variables, straight.model.variables)]
    assert max(differences) > 1e-4, differences


def test_input_position_of_other_input_settings_is_not_restored(tmp_path, caplog):
    """Another shuffle buffer is another order: its run must not restore the
    position saved by this one (a fresh permutation, with a warning). Another
    global batch size is the same order: the run goes on from the examples
    read, in its own batches."""
    model_dir = str(tmp_path)
    _train(run_config("default", steps=4, batch=32, checkpoint_every=4, model_dir=model_dir))
    with caplog.at_level("WARNING"):
        resumed = _train(run_config("default", steps=6, batch=64, steps_per_loop=2,
                                    model_dir=model_dir))
    assert resumed.summary["steps"] == 6
    assert "fresh permutation" not in caplog.text
    # It went on from the 4 x 32 examples read: two more steps of 64 make 256.
    [position] = _input_positions(model_dir)
    with open(os.path.join(checkpointing.checkpoint_dir(model_dir), "input", position,
                           "ckpt-6.json")) as f:
        assert json.load(f)["examples"] == 4 * 32 + 2 * 64
    caplog.clear()
    with caplog.at_level("WARNING"):
        resumed = _train(_sharded(run_config("default", steps=8, batch=64, steps_per_loop=2,
                                             model_dir=model_dir), "global", shuffle_buffer=7))
    assert resumed.summary["steps"] == 8
    assert "no input position of this data and shuffle buffer was saved at step 6" \
        in caplog.text
    assert len(_input_positions(model_dir)) == 2


def test_input_that_cannot_be_checkpointed_resumes_with_a_fresh_permutation(tmp_path, caplog):
    """A generator-backed dataset has no savable position: checkpoints still
    save, with one warning, and the resumed run reads a fresh permutation."""
    def generator_dataset_fn(split, context):
        plain = image_dataset_fn(split, context)
        return tf.data.Dataset.from_generator(lambda: plain.as_numpy_iterator(),
                                              output_signature=plain.element_spec)

    def train(steps):   # per-pipeline sharding: its position is the iterator's state
        config = _sharded(run_config("default", steps=steps, steps_per_loop=2,
                                     checkpoint_every=2, model_dir=str(tmp_path)))
        return tfdist.train(config, model_fn=lambda spec: models.build(config.model, spec),
                            dataset_fn=generator_dataset_fn, spec=IMAGE_SPEC)

    with caplog.at_level("WARNING"):
        train(4)
        assert caplog.text.count("cannot save the input position") == 1
        resumed = train(6)
    assert resumed.summary["steps"] == 6
    assert checkpointing.saved_steps(str(tmp_path)) == [2, 4, 6]
    assert "no input position was saved at step 4" in caplog.text


def test_dtensor_resumes_at_its_input_position(tmp_path, caplog):
    """DTensor's iterator cannot be saved, but the global order's position is
    the examples read: resumed at step 4, it equals 6 uninterrupted steps."""
    model_dir = str(tmp_path)
    common = dict(steps_per_loop=2, learning_rate=0.05, batch=64)
    straight = _train(run_config("dtensor", steps=6, **common))
    _train(run_config("dtensor", steps=4, checkpoint_every=2, model_dir=model_dir, **common))
    with caplog.at_level("WARNING"):
        resumed = _train(run_config("dtensor", steps=6, model_dir=model_dir, **common))
    assert resumed.summary["steps"] == 6
    assert "fresh permutation" not in caplog.text
    assert_weights_close(resumed.model.variables, straight.model.variables, rtol=0, atol=1e-6)
    # Per-pipeline sharding has no position DTensor can save: it says so.
    caplog.clear()
    with caplog.at_level("WARNING"):
        _train(_sharded(run_config("dtensor", steps=8, model_dir=model_dir, **common)))
    assert "--strategy=dtensor cannot checkpoint its input iterator" in caplog.text


def test_nocheckpoint_input_saves_no_position(tmp_path, caplog):
    model_dir = str(tmp_path)
    _train(run_config("mirrored", steps=4, checkpoint_every=2, steps_per_loop=2,
                      model_dir=model_dir, checkpoint_input=False))
    assert not os.path.exists(os.path.join(checkpointing.checkpoint_dir(model_dir), "input"))
    with caplog.at_level("WARNING"):
        resumed = _train(run_config("mirrored", steps=6, steps_per_loop=2, model_dir=model_dir,
                                    checkpoint_input=False))
    assert resumed.summary["steps"] == 6
    assert "--nocheckpoint_input; reading a fresh permutation" in caplog.text


def test_a_run_that_drew_a_fresh_permutation_resumes_exactly_afterwards(tmp_path, caplog):
    """Resumed once without a saved position (a fresh permutation from step
    4), a run saves the positions of that permutation: stopped again at 8 and
    resumed, it equals the run that went from 4 to 12 in one go."""
    import shutil
    common = dict(steps_per_loop=2, checkpoint_every=4, batch=64)
    runs = {}
    for name, stops in (("once", [12]), ("twice", [8, 12])):
        model_dir = str(tmp_path / name)
        _train(run_config("default", steps=4, model_dir=model_dir, **common))
        shutil.rmtree(os.path.join(checkpointing.checkpoint_dir(model_dir), "input"))
        for steps in stops:
            caplog.clear()
            with caplog.at_level("WARNING"):
                runs[name] = _train(run_config("default", steps=steps, model_dir=model_dir,
                                               **common))
        # Only the resume at step 4 had no position.
        assert ("fresh permutation" in caplog.text) == (name == "once")
    assert_weights_close(runs["twice"].model.variables, runs["once"].model.variables,
                         rtol=0, atol=1e-6)


def test_pruning_tolerates_a_file_another_process_removed_first(tmp_path):
    """Every process writes and prunes the same global input position: a file
    another process removed between the listing and the removal is no error."""
    for step in (2, 4, 6):
        (tmp_path / f"ckpt-{step}.json").write_text("{}")

    def remove_twice(step):   # as if another process got there first
        os.remove(tmp_path / f"ckpt-{step}.json")
        os.remove(tmp_path / f"ckpt-{step}.json")

    checkpointing._prune(str(tmp_path), r"ckpt-(\d+)\.json", 1, remove_twice)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-6.json"]


# -- a checkpoint written and read in parts (tfdist/checkpoint_parts.py) ------------
# In one process, as worker 0 of 1: the pipeline's clusters
# (tests/integration/test_pipeline_processes.py) write and read them across processes.

class _OneWorker:
    worker_index, is_chief = 0, True

    @staticmethod
    def any_worker(flag):
        return flag

    @staticmethod
    def describe_process():
        return "worker 0/1 chief"


def _parts(checkpointer, model, keeps=lambda variable, owner: True):
    from tfdist.checkpoint_parts import CheckpointParts
    pairs = [(v, v) for v in model.trainable_variables]
    return CheckpointParts(_OneWorker, checkpointer.checkpoint, pairs=lambda: pairs,
                           writer=lambda variable, owner: 0, keeps=keeps)


def _parts_checkpointer(directory, model, optimizer, keeps=lambda variable, owner: True):
    checkpointer = checkpointing.Checkpointer(str(directory), keep=2, is_chief=True,
                                              model=model, optimizer=optimizer)
    parts = _parts(checkpointer, model, keeps)
    assert parts.prepare()
    checkpointer.parts = parts
    return checkpointer


def _model_and_adam():
    import keras
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                              keras.layers.BatchNormalization(), keras.layers.Dense(2)])
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    for k, variable in enumerate([*model.variables, *optimizer.variables]):
        variable.assign(tf.fill(variable.shape, tf.cast(k + 1, variable.dtype)))
    return model, optimizer


def test_a_checkpoint_in_parts_is_the_checkpoint_written_whole(tmp_path):
    """The merged parts hold every key of a whole `tf.train.Checkpoint.write` of
    the same state, with the same values and object graph, and restore in
    place; a variable this process does not keep is left as it is."""
    model, optimizer = _model_and_adam()
    checkpointer = _parts_checkpointer(tmp_path / "parts", model, optimizer)
    written = checkpointer.save(3)
    whole = tf.train.Checkpoint(model=model, optimizer=optimizer).write(str(tmp_path / "whole"))
    a, b = tf.train.load_checkpoint(written), tf.train.load_checkpoint(whole)
    assert a.get_variable_to_shape_map() == b.get_variable_to_shape_map()
    for key in b.get_variable_to_shape_map():
        np.testing.assert_array_equal(a.get_tensor(key), b.get_tensor(key))
    assert not [name for name in os.listdir(tmp_path / "parts") if name.startswith(".parts")]
    saved = [v.numpy() for v in [*model.variables, *optimizer.variables]]
    kept = model.trainable_variables[0]
    for variable in [*model.variables, *optimizer.variables]:
        variable.assign(tf.zeros(variable.shape, variable.dtype))
    reader = _parts_checkpointer(tmp_path / "parts", model, optimizer,
                                 keeps=lambda variable, owner: variable is not kept)
    assert reader.restore_latest() == written
    for variable, value in zip([*model.variables, *optimizer.variables], saved):
        if variable is kept:
            assert not variable.numpy().any()   # not this process's: not read
        else:
            np.testing.assert_array_equal(variable.numpy(), value)


def test_a_part_that_cannot_be_written_fails_the_save_and_keeps_the_previous(tmp_path):
    model, optimizer = _model_and_adam()
    checkpointer = _parts_checkpointer(tmp_path, model, optimizer)
    checkpointer.save(2)
    os.makedirs(tmp_path / ".parts-ckpt-4" / "worker-0.index")   # not removable as a file
    with pytest.raises(checkpointing.CheckpointWriteError,
                       match=r"worker 0/1 chief: cannot write its part of checkpoint .*ckpt-4"
                             r".*the previous checkpoints are intact"):
        checkpointer.save(4)
    assert checkpointer.latest.endswith("ckpt-2") and not tf.io.gfile.glob(
        str(tmp_path / "ckpt-4.*"))
    # A checkpoint of another model (a shape that differs) is not read: the
    # restore says which key differs (the log) and finds nothing readable.
    import keras
    wider = keras.Sequential([keras.Input((3,)), keras.layers.Dense(5),
                              keras.layers.BatchNormalization(), keras.layers.Dense(2)])
    wider_optimizer = keras.optimizers.Adam()
    wider_optimizer.build(wider.trainable_variables)
    with pytest.raises(tfdist.errors.UsageError, match="none of its 1 checkpoint"):
        _parts_checkpointer(tmp_path, wider, wider_optimizer).restore_latest()


def test_a_checkpoint_holding_more_than_variables_is_not_written_in_parts(tmp_path):
    """A lookup table saves its keys and values, not a variable's value: the
    checkpoint is then written whole (`prepare` says no), as before."""
    model, optimizer = _model_and_adam()
    table = tf.lookup.experimental.MutableHashTable(tf.string, tf.int64, default_value=-1)
    checkpointer = checkpointing.Checkpointer(str(tmp_path), keep=2, is_chief=True,
                                              model=model, optimizer=optimizer, table=table)
    assert not _parts(checkpointer, model).prepare()
    plain = checkpointing.Checkpointer(str(tmp_path), keep=2, is_chief=True,
                                       model=model, optimizer=optimizer)
    assert _parts(plain, model).prepare()   # the control: without the table

