"""The pipeline engine with its stages in processes: one
tfdist-launch cluster of 4 workers (tests/integration/test_pipeline.py has the engine in
one process, and the tolerance rules)."""

import contextlib
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tfdist import models   # (tests/common.py imports tfdist before TensorFlow too)

from common import (IMAGE_SPEC, PREDICTION_TOLERANCE, PROBE, assert_weights_close, mw_config,
                    train_from)
from test_nonfinite import nan_dataset_fn
from common import HUB_TOKENS, hub_causal_lm, hub_dataset_fn
from conftest import BIN, REPO

pytestmark = pytest.mark.integration


# Two runs in one cluster (tests/mw_worker.py's list mode: one TensorFlow
# start-up per worker): S=2 stages x R=2 pipeline replicas under 1F1B with
# Adam and clipping, and the cnn (BatchNorm) on S=4 stages under GPipe in
# bf16. Each worker updates only its stage (its gradients summed with the same
# stage's other replica, clipped by the whole model's norm summed over all
# workers), holds only its stage's weights and optimizer slots, and the chief
# gathers the other stages' weights (not their slots) from their owners when
# training ends: the weights, and each slot where its worker holds it, equal
# the same micro-batches accumulated on one device within tests/integration/test_pipeline.py's
# tolerance, and the BatchNorm statistics every worker ends with are its stage
# owner's (the owners contribute S x theirs to the sum over all N workers, the
# others zeros, and the trainer divides by N).
PROCESS_RUNS = {
    # The clip bites: a worker clipping by its own stage's norm instead ended
    # 1e-2 away from one device (tried), far outside the tolerance.
    # Each process builds only its stages' weights, and the second replica's
    # workers start from other weights ("skewed"): only each stage's first
    # worker's, sent to the stage's other replica, give one device's result.
    # Interleaved: the model's 4 stages over each replica's 2 workers, stages
    # 0 and 2 on the first, 1 and 3 on the second; boundaries go both ways
    # between the two (stage 1's output back to the first worker).
    "2 stages x 2 chunks x 2 replicas, interleaved 1f1b, adam, clip": {
        "strategy": {"pipeline_stages": 2, "pipeline_chunks": 2}, "skewed": True,
        "model": {"depth": 4},
        "optimizer": {"name": "adam", "learning_rate": 0.01, "clip_grad_norm": 0.1},
        # two loops: the stages are shared only once, at the end
        "steps_per_loop": 2},
    # R=1: with R pipeline replicas BatchNorm would normalise over other
    # micro-batches than one device's (each replica's share of the batch).
    # The middle stages receive and send in both directions. bf16: boundary
    # tensors travel as float32 (TensorFlow's collectives take no bfloat16),
    # exactly, so with the same micro-batches as one device nothing changes.
    "cnn, 4 stages, gpipe, bf16": {
        "strategy": {"pipeline_stages": 4, "pipeline_schedule": "gpipe"},
        "model": {"name": "cnn", "depth": 1}, "accum_steps": 2, "precision": "mixed_bfloat16"},
    # Checkpoints across processes, in parts: at each save every worker writes
    # the variables and slots it holds (a stage's second replica nothing) and
    # the chief merges the parts into one checkpoint; with --nopipeline_gather
    # nothing gathers the model, not even at the end. The next run restores
    # in place (each worker reads only what it holds), trains on to step 6 —
    # the same weights as 6 steps in one go on one device (the input
    # positions are restored too) — and exports the chief's whole model,
    # gathered at the end.
    # Its model_fn fails where variables have no storage, so the model cannot
    # be built without it: every process builds it whole (the control of
    # `test_each_process_makes_storage_for_its_stage_only`); the next run
    # builds by stage and resumes from its checkpoint.
    "2 stages x 2 replicas, checkpoint every 2 steps": {
        "strategy": {"pipeline_stages": 2, "pipeline_gather": False}, "steps_per_loop": 2,
        "checkpoint_every": 2, "model_dir": "checkpointed", "whole_build": True},
    "the same, resumed at step 4 to step 6, exported": {
        "strategy": {"pipeline_stages": 2}, "steps_per_loop": 2, "checkpoint_every": 2,
        "model_dir": "checkpointed", "train_steps": 6, "export_dir": "exported",
        "starts_as": "2 stages x 2 replicas, checkpoint every 2 steps"},
    # --on_nonfinite=rollback: step 7's loss is NaN (tests/integration/test_nonfinite.py's
    # data); every worker restores its part of the step-4 checkpoint in
    # place and goes on past the batch, as one device does.
    # keras-hub's Gemma (3 decoder blocks), interleaved: 4 stages, 2 per
    # worker of each replica; its tied token embedding is on the first and
    # the last (the tokens' embedding on stage 0, the logits on stage 3, on
    # the replica's two workers); its gradients are summed over all 4
    # workers, the others' over each stage's 2. Clipped by the whole model's
    # norm, the shared weight counted once.
    "keras-hub gemma, 2 stages x 2 chunks x 2 replicas": {
        "strategy": {"pipeline_stages": 2, "pipeline_chunks": 2}, "hub": ["gemma", 3],
        "accum_steps": 2, "steps_per_loop": 2, "optimizer": {"clip_grad_norm": 0.5}},
    # Under --zero_stage=1 too: each of a stage's 2 replicas holds the Adam
    # slots of its half of the stage's variables, writes them into the
    # checkpoint and reads them back.
    "2 stages x 2 replicas, a NaN loss rolled back": {
        "strategy": {"pipeline_stages": 2, "zero_stage": 1}, "steps_per_loop": 4,
        "checkpoint_every": 4, "model_dir": "rolled_back", "train_steps": 12, "nan": True,
        "on_nonfinite": "rollback", "optimizer": {"name": "adam", "learning_rate": 0.01}},
    # ZeRO-1 within each stage's replica group: each replica updates the
    # variables whose Adam slots it holds (about half the stage's) from the
    # stage's summed, clipped gradients, and the stage's replicas then share
    # the updated weights; with micro-batches accumulated, in bf16. With R=2
    # a replica's micro-batches are other rows than one device's, and bf16
    # rounds each micro-batch's gradient, so these two are compared with each
    # other: ZeRO-1 changes where the slots live, not one bit of the result.
    "2 stages x 2 replicas, zero1, adam, clip, bf16": {
        "strategy": {"pipeline_stages": 2, "zero_stage": 1}, "skewed": True,
        "optimizer": {"name": "adam", "learning_rate": 0.01, "clip_grad_norm": 0.1},
        "accum_steps": 2, "precision": "mixed_bfloat16", "steps_per_loop": 2,
        "same_as": "2 stages x 2 replicas, adam, clip, bf16"},
    "2 stages x 2 replicas, adam, clip, bf16": {
        "strategy": {"pipeline_stages": 2}, "skewed": True,
        "optimizer": {"name": "adam", "learning_rate": 0.01, "clip_grad_norm": 0.1},
        "accum_steps": 2, "precision": "mixed_bfloat16", "steps_per_loop": 2,
        "same_as": "2 stages x 2 replicas, zero1, adam, clip, bf16",
        "initial_of": "2 stages x 2 replicas, zero1, adam, clip, bf16"},
}


# Two clusters: `make test` runs the first (interleaved 1F1B, the cnn under
# GPipe in bf16, checkpoints in parts and their resume, ZeRO-1 against the
# same run without it); `make slow` the second, whose behaviours faster tests
# in `make test` cover: keras-hub Gemma's tied embedding across processes
# (test_pipeline.py pipelines Gemma in one process, its tied gradients summed
# across stages) and a NaN rolled back under ZeRO-1 (test_nonfinite.py's
# rollback, test_nonfinite_cluster.py's workers, ZeRO-1 here). Each run's
# checks are in its cluster's tier.
SLOW_RUNS = {"keras-hub gemma, 2 stages x 2 chunks x 2 replicas",
             "2 stages x 2 replicas, a NaN loss rolled back"}


def _tier(name):
    return pytest.param(name, marks=pytest.mark.slow) if name in SLOW_RUNS else name


class _Clusters:
    """The runs' results by name; the first lookup of a run starts its
    tier's cluster (the runs a tier's runs start from are in that tier). A
    cluster that failed fails its tier's other tests without running again,
    as a failed module fixture does."""

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory, self.found, self.failed = tmp_path_factory, {}, {}

    def tier(self, slow):
        names = [name for name in PROCESS_RUNS if (name in SLOW_RUNS) == slow]
        if slow in self.failed:
            raise self.failed[slow]
        if names[0] not in self.found:
            try:
                self.found.update(_cluster(self.tmp_path_factory, names))
            except BaseException as error:
                self.failed[slow] = error
                raise
        return {name: self.found[name] for name in names}

    def __getitem__(self, name):
        return self.tier(name in SLOW_RUNS)[name]


@pytest.fixture(scope="module")
def process_runs(tmp_path_factory):
    return _Clusters(tmp_path_factory)


def _cluster(tmp_path_factory, names):
    directory = tmp_path_factory.mktemp("pipeline_processes")
    runs, initials = [], {}
    for k, name in enumerate(names):
        overrides = PROCESS_RUNS[name]
        model = dataclasses.replace(mw_config("default").model,
                                    **{"depth": 3, **overrides.get("model", {})})
        os.makedirs(directory / str(k))
        if "hub" in overrides:
            import keras
            keras.utils.set_random_seed(5)
            initials[name] = hub_causal_lm(*overrides["hub"]).get_weights()
        elif "initial_of" in overrides:   # the same initial weights as that run
            initials[name] = initials[overrides["initial_of"]]
        else:
            initials[name] = models.build(model, IMAGE_SPEC).get_weights()
        np.savez(directory / str(k) / "initial.npz", *initials[name])
        if "starts_as" in overrides:   # not from its own initial weights: the checkpoint's
            initials[name] = initials[overrides["starts_as"]]
        runs.append({"accum_steps": overrides.get("accum_steps", 4),
                     "steps_per_loop": overrides.get("steps_per_loop", 5),
                     "optimizer": overrides.get("optimizer", {}),
                     "precision": overrides.get("precision", "float32"),
                     "model": dataclasses.asdict(model),
                     "strategy": {"collective_timeout_s": 60, **overrides["strategy"]},
                     **{key: str(directory / overrides[key])
                        for key in ("model_dir", "export_dir") if key in overrides},
                     **{key: overrides[key] for key in ("train_steps", "checkpoint_every",
                                                        "skewed", "nan", "on_nonfinite", "hub",
                                                        "whole_build")
                        if key in overrides}})
    result = subprocess.run(
        [os.path.join(BIN, "tfdist-launch"), "--workers=4", "--", sys.executable,
         "tests/mw_worker.py", str(directory), "pipeline", "4", json.dumps(runs)],
        cwd=REPO, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}, capture_output=True,
        text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    found = {}
    for k, name in enumerate(names):
        with open(directory / str(k) / "summary-0.json") as f:
            summary = json.load(f)
        made, stages_model = [], []
        for w in range(4):
            with open(directory / str(k) / f"made-{w}.json") as f:
                made.append(json.load(f))
            path = directory / str(k) / f"stages_model-{w}.json"
            with open(path) if path.exists() else contextlib.nullcontext() as f:
                stages_model.append(json.load(f) if f else None)
        found[name] = ([list(np.load(directory / str(k) / f"{kind}-{w}.npz").values())
                        for w in range(4) for kind in ("weights", "optimizer")],
                       initials[name], {**runs[k], "made": made, "stages_model": stages_model},
                       summary)
    return found


@pytest.mark.parametrize("slow", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["first cluster", "second cluster"])
def test_each_process_makes_storage_for_its_stage_only(process_runs, slow):
    """Storage made for trainable variables (counted by a variable creator
    under tfdist's, in each worker) is the worker's own stage's, in every
    process of every run: no process makes, or receives at build, another
    stage's weights (the chief gathers them at the end only, where it holds
    the whole model, and builds a copy to export). Worker 0 (stage 0) made what
    worker S (stage 0 of replica 1) holds. The control: a model_fn that fails
    where variables have no storage makes every process build the model
    whole (as in one process), and the same check finds it made in each."""
    for name, (saved, initial, run, summary) in process_runs.tier(slow).items():
        made = [m["trainable_made"] for m in run["made"]]
        held = [m["trainable_held"] for m in run["made"]]
        stages, whole = run["strategy"]["pipeline_stages"], run["made"][0]["trainable_total"]
        # the chief holds the whole model at the end where it gathered it
        assert (held[0] == whole) == run["strategy"].get("pipeline_gather", True), (name, held)
        if run.get("whole_build"):   # the control
            assert made == [whole] * 4 and max(held[1:]) < whole, (name, made, held)
            continue
        if "export_dir" in run:   # the chief builds the model to export from its whole one
            made[0] -= whole
        assert 0 < made[0] < whole, (name, made, held)
        if stages < 4:
            assert made[0] == held[stages], (name, made, held)
        for w in range(1, 4):
            assert made[w] == held[w] < whole, (name, w, made, held)


@pytest.mark.parametrize("name", [_tier(name) for name, run in PROCESS_RUNS.items()
                                  if "hub" not in run and "same_as" not in run])
def test_stages_in_processes_equal_accumulation_on_one_device(process_runs, name, tmp_path):
    saved, initial, run, summary = process_runs[name]
    workers, slots = saved[0::2], saved[1::2]
    stages = run["strategy"]["pipeline_stages"]
    # Each worker holds its stage only: the other stages' weights and slots
    # are freed (empty), its own equal every other holder's bit for bit (the
    # workers of a stage apply the same summed gradients). The chief holds
    # every weight, gathered from the owners at the end (the control: the
    # same check of "freed" on its weights finds nothing freed), unless
    # --nopipeline_gather, and only its own stage's slots. The stages' sets
    # are disjoint, the same for every replica of a stage, and cover the model.
    gathered = run["strategy"].get("pipeline_gather", True)
    assert all(a.size for a in workers[0]) == gathered
    weights, whole_slots = _held_anywhere(workers), _held_anywhere(slots)
    per_variable = any(a.ndim for a in whole_slots)   # not only the step and learning rate
    assert all(a.size for a in slots[0]) != per_variable   # the slots are never gathered
    whole = weights + whole_slots
    held = []
    for w in range(1, len(workers)):
        arrays = workers[w] + slots[w]
        mine = {k for k, a in enumerate(arrays) if a.size}
        assert 0 < len([k for k in mine if k < len(workers[w])]) < len(workers[w]), w
        for k in set(range(len(arrays))) - mine:
            assert arrays[k].shape == (0,), (w, k)
        held.append(mine)
    if run["strategy"].get("zero_stage"):
        held = _slots_split_between_replicas(held, len(workers[0]), len(whole), stages)
    by_stage = {w % stages: mine for w, mine in zip(range(1, len(workers)), held)}
    for w, mine in zip(range(1, len(workers)), held):
        assert mine == by_stage[w % stages]
    everywhere = set.intersection(*held)   # scalars, BatchNorm statistics
    others = [by_stage[s] - everywhere for s in range(1, stages)]
    assert all(a.isdisjoint(b) for i, a in enumerate(others) for b in others[i + 1:])
    if 0 in by_stage:   # stage 0 of replica 1: what the other stages do not hold
        assert by_stage[0] - everywhere == set(range(len(whole))) - everywhere - set().union(
            *others)
    # Without XLA, as the pipeline runs (`auto` would compile the reference,
    # and XLA on CPU computes bf16 matmuls in float32).
    config = mw_config("default", run.get("train_steps", 4), accum_steps=run["accum_steps"],
                       precision=run["precision"], jit_compile="off")
    config = config.replace(model=config.model.replace(**run["model"]),
                            optimizer=config.optimizer.replace(**run["optimizer"]))
    if "on_nonfinite" in run:
        config = config.replace(train=config.train.replace(
            on_nonfinite=run["on_nonfinite"], checkpoint_every=run["checkpoint_every"],
            steps_per_loop=run["steps_per_loop"], model_dir=str(tmp_path / "single")))
    single = train_from(config, initial, **({"dataset_fn": nan_dataset_fn} if run.get("nan")
                                            else {}))
    if "on_nonfinite" in run:
        assert summary["rollbacks"] == single.summary["rollbacks"] == 1
    # Evaluation runs through the stages (the last counts): the chief's test
    # loss and accuracy are one device's on the same weights (within the
    # weights' tolerance; bf16 logits round to 3 significant digits).
    np.testing.assert_allclose(summary["test_loss"], single.summary["test_loss"], rtol=2e-3)
    assert abs(summary["accuracy"] - single.summary["accuracy"]) <= 1 / 96
    assert max(np.abs(w - i).max() for w, i in zip(weights, initial)) > 1e-3
    trainable = {id(v) for v in single.model.trainable_weights}
    flags = [id(v) in trainable for v in single.model.weights]
    assert not any(flags[k] for k in everywhere if k < len(flags))   # no weight held by all
    expected = single.model.get_weights()
    assert_weights_close([w for w, t in zip(weights, flags) if t],
                         [w for w, t in zip(expected, flags) if t], atol=1e-5)
    for got, want, is_trainable in zip(weights, expected, flags):
        if not is_trainable:
            # BatchNorm statistics: the same updates as on one device (the
            # cnn's moving means start at 0: a share counted S times or not at
            # all is off by the whole update)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The optimizer's state: every stage's slots as one device's (Adam's
    # second moments are squares of gradients: relative).
    expected_slots = [v.numpy() for v in single.optimizer.variables]
    assert len(whole_slots) == len(expected_slots)
    assert len(expected_slots) > 2 or run["optimizer"].get("name") != "adam"
    for got, want in zip(whole_slots, expected_slots):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    if "export_dir" in run:   # the chief's whole model
        import keras
        exported = keras.saving.load_model(os.path.join(run["export_dir"], "model.keras"))
        for got, want in zip(exported.get_weights(), workers[0]):
            np.testing.assert_array_equal(got, want)


def test_checkpoints_are_merged_from_parts_and_nothing_gathers_the_model(process_runs):
    """--nopipeline_gather: no process held the whole model at any time (the
    chief ends with its stage's weights only; the control: the resumed run's
    chief, which gathered at the end, holds them all), yet the last
    checkpoint, merged from the workers' parts, holds every weight bit for bit
    as the workers held it, and every slot whole; no part is left behind."""
    import tensorflow as tf
    saved, _, run, _ = process_runs["2 stages x 2 replicas, checkpoint every 2 steps"]
    workers = saved[0::2]
    assert not all(a.size for a in workers[0])
    resumed = process_runs["the same, resumed at step 4 to step 6, exported"][0]
    assert all(a.size for a in resumed[0])
    directory = os.path.join(run["model_dir"], "checkpoints")
    assert not [name for name in os.listdir(directory) if name.startswith(".parts")]
    model = models.build(dataclasses.replace(mw_config("default").model, **run["model"]),
                         IMAGE_SPEC)
    path = os.path.join(directory, "ckpt-4")
    tf.train.Checkpoint(model=model).read(path).expect_partial()
    for got, want in zip(model.get_weights(), _held_anywhere(workers)):
        np.testing.assert_array_equal(got, want)
    reader = tf.train.load_checkpoint(path)
    slots = [key for key in reader.get_variable_to_shape_map() if "_variables/" in key]
    assert slots and all(reader.get_variable_to_shape_map()[key] for key in slots)


def test_where_no_process_holds_the_model_every_worker_predicts_through_the_stages(
        process_runs):
    """--nopipeline_gather: every worker's RunResult.model is a StagesModel
    whose predict runs the stages as a pipeline (batches of 6 rows, the last
    padded): all four workers get the same outputs, those of the last
    checkpoint's model in one process. Where the chief gathered the model
    (the control), its RunResult.model is the plain Keras model, and each
    other worker's predict says in one line where the model is."""
    import tensorflow as tf
    _, _, run, _ = process_runs["2 stages x 2 replicas, checkpoint every 2 steps"]
    outputs = [np.array(outcome["predictions"]) for outcome in run["stages_model"]]
    assert outputs[0].shape == (len(PROBE), IMAGE_SPEC.num_classes)
    for other in outputs[1:]:
        np.testing.assert_array_equal(other, outputs[0])
    model = models.build(dataclasses.replace(mw_config("default").model, **run["model"]),
                         IMAGE_SPEC)
    tf.train.Checkpoint(model=model).read(
        os.path.join(run["model_dir"], "checkpoints", "ckpt-4")).expect_partial()
    np.testing.assert_allclose(outputs[0], model.predict(PROBE, verbose=0),
                               **PREDICTION_TOLERANCE)
    for outcome in run["stages_model"]:   # a Keras file needs the whole model: one line
        assert "\n" not in outcome["save_refusal"]
        assert "holds its pipeline stages only; export the run's last checkpoint with " \
            "tfdist-export" in outcome["save_refusal"], outcome["save_refusal"]
    _, _, gathered, _ = process_runs["the same, resumed at step 4 to step 6, exported"]
    assert gathered["stages_model"][0] is None   # the chief's whole Keras model
    for outcome in gathered["stages_model"][1:]:
        assert "\n" not in outcome["refusal"]
        assert "holds its pipeline stages only; the chief holds the whole trained model" in \
            outcome["refusal"], outcome


def test_zero1_moves_the_slots_and_changes_no_bit_of_the_training(process_runs):
    """--zero_stage=1 (S=2 x R=2, Adam, clipping, accumulation, bf16) against
    the same run without it: every worker's weights and every slot (from a
    worker holding it) bit for bit. Where the slots live: each
    stage's split between its two replicas, disjoint and neither empty, where
    without ZeRO-1 both hold all of them (the control)."""
    zero, _, _, zero_summary = process_runs["2 stages x 2 replicas, zero1, adam, clip, bf16"]
    plain, _, _, plain_summary = process_runs["2 stages x 2 replicas, adam, clip, bf16"]
    assert (zero_summary["zero_stage"], plain_summary["zero_stage"]) == (1, 0)
    for w in range(4):   # weights (another stage's: freed, empty)
        for got, want in zip(zero[2 * w], plain[2 * w]):
            np.testing.assert_array_equal(got, want)
    for got, want in zip(_held_anywhere(zero[1::2]), _held_anywhere(plain[1::2])):
        np.testing.assert_array_equal(got, want)   # every slot, from a worker holding it

    def slots(saved, w):
        return {k for k, a in enumerate(saved[2 * w + 1]) if a.size}

    everywhere = slots(zero, 1) & slots(zero, 3)   # the step, the learning rate
    assert slots(plain, 1) == slots(plain, 3)      # stage 1's replicas (workers 1 and 3)
    first, second = slots(zero, 1) - everywhere, slots(zero, 3) - everywhere
    assert first and second and first.isdisjoint(second), (first, second)
    assert first | second == slots(plain, 1) - everywhere
    # Stage 0's second replica (worker 2; the first is the chief, whole at the end)
    assert everywhere < slots(zero, 2) < slots(plain, 2)


def _held_anywhere(arrays_of_workers) -> list:
    """Each array from the workers holding it (not freed: non-empty); every
    holder's copy is the same bit for bit, and every array is held somewhere."""
    whole = []
    for k, copies in enumerate(zip(*arrays_of_workers)):
        held = [a for a in copies if a.size]
        assert held, f"array {k} is held by no worker"
        for a in held[1:]:
            np.testing.assert_array_equal(a, held[0])
        whole.append(held[0])
    return whole


def _slots_split_between_replicas(held, weights, total, stages):
    """Under --zero_stage=1, what workers 1..N-1 would hold without it
    (`held`: their sets of indices into the weights + slots, the first
    `weights` of them weights): each stage's weights are on all its replicas
    and its slots split between them, disjoint and none empty. A stage whose
    other replica is the chief (its weights whole at the end) holds a strict part of the
    stage's slots (those no other stage holds); the chief's share is not
    among `held`."""
    workers = list(range(1, len(held) + 1))
    held = dict(zip(workers, held))
    slots = {w: {k for k in held[w] if k >= weights} for w in workers}
    everywhere = set.intersection(*slots.values())   # the step, the learning rate
    parts = {w: slots[w] - everywhere for w in workers}
    assert all(parts.values()), parts
    whole = {}
    for w in workers:
        partners = [v for v in workers if v != w and v % stages == w % stages]
        for v in partners:
            assert parts[w].isdisjoint(parts[v]), (w, v, parts)
        whole[w] = held[w].union(*(parts[v] for v in partners))
    for w in workers:
        if w % stages == 0:   # the chief's stage
            others = set().union(*(whole[v] for v in workers if v % stages))
            stage_slots = set(range(weights, total)) - everywhere - others
            assert parts[w] < stage_slots, (w, parts[w], stage_slots)
            whole[w] = held[w] | stage_slots
    return [whole[w] for w in workers]


@pytest.mark.slow   # the second cluster's
def test_a_layer_shared_by_two_stages_stays_one_across_processes(process_runs):
    """keras-hub's Gemma on 2 stages x 2 chunks x 2 replicas (interleaved):
    every worker holds the tied token embedding (stage 0's on the first
    worker of a replica, stage 3's on the second) and ends with the same
    values (its gradients summed over the 4 workers), the other weights are
    held by their stages only, and the chief's model equals the same
    micro-batches accumulated on one device."""
    import tfdist
    saved, initial, run, summary = process_runs[
        "keras-hub gemma, 2 stages x 2 chunks x 2 replicas"]
    workers = saved[0::2]
    assert summary["grad_norm"] > 0.5   # the clip bites
    assert summary["stage_layers"][0][0] == summary["stage_layers"][3][-1] == "token_embedding"
    embedding = 0   # the first weight: token_embedding/embeddings
    assert workers[0][embedding].shape == initial[embedding].shape
    for w in range(1, 4):
        np.testing.assert_array_equal(workers[w][embedding], workers[0][embedding])
    # Worker 2 runs stages 0 and 2 (of replica 1), worker 1 stages 1 and 3:
    # each holds its stages' weights only (the others freed: empty); the
    # embedding is on both.
    held = [{k for k, a in enumerate(workers[w]) if a.size} for w in (2, 1)]
    assert held[0] | held[1] == set(range(len(initial)))
    assert held[0] & held[1] == {embedding}, held

    def model_fn(spec):
        model = hub_causal_lm(*run["hub"])
        model.set_weights(initial)
        return model

    config = mw_config("default", 4, accum_steps=run["accum_steps"], jit_compile="off")
    config = config.replace(optimizer=config.optimizer.replace(**run["optimizer"]))
    single = tfdist.train(config, model_fn=model_fn, dataset_fn=hub_dataset_fn, spec=HUB_TOKENS)
    assert np.abs(workers[0][embedding] - initial[embedding]).max() > 1e-3
    assert_weights_close(workers[0], single.model.get_weights(), atol=1e-5)
