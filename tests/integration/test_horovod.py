"""horovod: real ranks under `horovodrun --gloo`, each test with a hard time limit.

`make test` builds Horovod beside the other tests (the first test here waits
for the build) and sets TFDIST_REQUIRE_HOROVOD=1, so there a missing Horovod
fails these tests instead of skipping them.
"""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tfdist import checkpointing

from common import (IMAGE_SPEC, PREDICTION_TOLERANCE, assert_variables_equal,
                    assert_weights_close, mw_config, run_config, train_from)
from conftest import BIN, REPO
from test_nonfinite import BATCH as NAN_BATCH, STEPS as NAN_STEPS

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", autouse=True)
def horovod_installed():
    """Checked when the first test runs, not at collection: `make test` builds
    Horovod beside the other tests, and tests/conftest.py waits for that build
    before this module's first test."""
    importlib.invalidate_caches()
    if importlib.util.find_spec("horovod") is None:
        if os.environ.get("TFDIST_REQUIRE_HOROVOD") == "1":
            pytest.fail("Horovod is required here (TFDIST_REQUIRE_HOROVOD=1): run `make horovod`")
        pytest.skip("Horovod not built (make horovod)")


HOROVODRUN = [os.path.join(BIN, "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo"]
TRAIN = os.path.join(BIN, "tfdist-train")


class _Background:
    """Runs started ahead of the tests that check them, so that they overlap
    other runs: a run is mostly TensorFlow start-up and ranks waiting on each
    other, and two horovodruns at once take less time on 2 cores than one
    after the other (measured: the first mw_worker.py horovodrun and the
    custom script's, ~45 s at once against ~60 s in turn). Each run keeps its
    own bound (`timeout` seconds from its start); a test's `result` waits at
    most that long. The tests that find ranks by process (dead rank, SIGTERM,
    elastic) first wait for all of these (`finish_all`)."""

    def __init__(self):
        self.procs, self.results = {}, {}

    def start(self, name, command, *, env=None, timeout=200):
        proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True,
                                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})})
        self.procs[name] = (proc, time.monotonic() + timeout)

    def result(self, name):
        """The CompletedProcess of run `name` (waited for, bounded)."""
        if name not in self.results:
            proc, deadline = self.procs.pop(name)
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            finally:
                proc.kill()
            self.results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        return self.results[name]

    def finish_all(self):
        for name in list(self.procs):
            self.result(name)

    def stop_all(self):
        """Runs whose test did not run (deselected): terminated, then killed."""
        for proc, _ in self.procs.values():
            proc.terminate()
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
        self.procs.clear()


@pytest.fixture(scope="module")
def background():
    runs = _Background()
    yield runs
    runs.stop_all()


CUSTOM_SCRIPT_COMMAND = [*HOROVODRUN, sys.executable,
                         os.path.join(REPO, "examples", "custom_script.py"), "--strategy=horovod",
                         "--examples=2048", "--train_steps=120", "--global_batch_size=64"]


def _checkpoint_args(data_dir, model_dir):
    return ["--strategy=horovod", "--model=mlp", "--model_width=16", "--model_depth=1",
            "--global_batch_size=32", "--train_steps=20", "--steps_per_loop=10",
            "--grad_compression=fp16", f"--data_dir={data_dir}", f"--model_dir={model_dir}"]


# The planner's trial of a Horovod candidate, as its search starts one
# (`trials.run`: horovodrun with its ranks), on a tiny synthetic mlp.
PLANNER_TRIAL = """
import dataclasses, json, sys
from tfdist.planner import trials
flags = ["--strategy=horovod", "--virtual_devices=1", "--model=mlp", "--model_width=16",
         "--model_depth=1", "--synthetic", "--global_batch_size=32", "--train_steps=20",
         "--steps_per_loop=10"]
result = trials.run([flags], processes=2, timeout=150, work_dir=sys.argv[1])
print(json.dumps(dataclasses.asdict(result)))
"""


@pytest.fixture(scope="module")
def early_runs(background, tmp_path_factory, data_dir):
    """Started beside the first mw_worker.py horovodrun: the custom script's
    horovodrun, the checkpoint test's and a planner trial's. Returns the
    checkpoint's model_dir."""
    model_dir = str(tmp_path_factory.mktemp("hvd_checkpoint") / "run")
    background.start("custom_script", CUSTOM_SCRIPT_COMMAND, timeout=200)
    background.start("checkpoint", [*HOROVODRUN, TRAIN, *_checkpoint_args(data_dir, model_dir)],
                     timeout=240)
    background.start("planner_trial", [sys.executable, "-c", PLANNER_TRIAL,
                                       str(tmp_path_factory.mktemp("hvd_trial"))], timeout=200)
    return {"checkpoint_model_dir": model_dir}


# -- The mw_worker.py runs (tests/hvd_driver.py: several in one horovodrun) ----------
# A horovodrun is the expensive unit (seconds of TensorFlow start-up per rank),
# so the runs of tests/mw_worker.py that the equivalence, Keras task, exact
# resume and --on_nonfinite tests below check share two horovodruns: each
# run is still a whole `tfdist.train` on 2 real ranks (a fresh engine, model,
# optimizer and data pipeline; Horovod stays initialised between them, see
# the driver), one after the other in the same rank processes. The second
# horovodrun holds the runs that need the first's results (a resume from its
# checkpoint, in fresh processes) or that end the ranks (--on_nonfinite=stop).

# The exact-resume runs (the input position, not the step's arithmetic; all
# three at the same setting): no XLA compile per run.
SHUFFLED = dict(data={"shuffle_buffer": 512}, steps_per_loop=2, checkpoint_every=4,
                jit_compile="off")
POWERSGD = {**SHUFFLED, "grad_compression": "powersgd", "powersgd_rank": 2,
            "powersgd_min_compression": 0}
TASK_CASES = ["multilabel", "tokens_ignore_class"]
NONFINITE_MODES = ["stop", "skip", "rollback"]
_LINE = re.compile(r"\[(\d+)\]<(stdout|stderr)>:(.*)")


def _run_driver(tmp_path, jobs, timeout=200):
    """Run `jobs` ({name: (initial weights, steps, mw_worker.py overrides)}), in
    order, under one horovodrun of tests/hvd_driver.py. Returns {name:
    (CompletedProcess of that job alone, its directory)}: its output is its own
    lines of either rank (plus horovodrun's own lines while it was the last to
    start), its returncode 0 if both ranks finished it, else horovodrun's."""
    listed = []
    for name, (initial, steps, overrides) in jobs.items():
        out_dir = tmp_path / name
        out_dir.mkdir()
        np.savez(out_dir / "initial.npz", *initial)
        listed.append([name, str(out_dir), str(steps), json.dumps(overrides)])
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run([*HOROVODRUN, sys.executable, "tests/hvd_driver.py",
                             json.dumps(listed)], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=timeout)
    lines = {name: {"stdout": [], "stderr": []} for name in jobs}
    ended = {name: set() for name in jobs}
    for stream in ("stdout", "stderr"):
        current, last = {}, None   # rank -> its job; the job a rank began last
        for line in getattr(result, stream).splitlines():
            match = _LINE.match(line)
            if match:
                rank, text = int(match.group(1)), match.group(3)
                if text.startswith("hvd_driver: begin "):
                    current[rank] = last = text.split()[-1]
                elif text.startswith("hvd_driver: end "):
                    ended[text.split()[-1]].add(rank)
                job = current.get(rank)
            else:
                job = last
            if job is not None:
                lines[job][stream].append(line)
    results = {}
    for name in jobs:
        finished = ended[name] == {0, 1}
        assert finished or result.returncode != 0, (name, result.stderr[-3000:])
        out, err = ("\n".join(lines[name][stream]) + "\n" for stream in ("stdout", "stderr"))
        if not lines[name]["stderr"]:   # it never began: an earlier job failed
            out, err = result.stdout, result.stderr
        results[name] = (subprocess.CompletedProcess(
            name, 0 if finished else result.returncode, out, err), tmp_path / name)
    return results


def _weights(out_dir, index):
    return list(np.load(out_dir / f"weights-{index}.npz").values())


def _nan_job(initial, out_dir, mode):
    """test_nonfinite_cluster.run_nan_workers's run: the NaN data under `mode`,
    a checkpoint every 4 steps into OUT_DIR/run."""
    return (initial, NAN_STEPS, {"nan": True, "on_nonfinite": mode, "steps_per_loop": 4,
                                 "checkpoint_every": 4, "model_dir": str(out_dir / "run"),
                                 "global_batch_size": NAN_BATCH, "jit_compile": "off"})


CNN = {"name": "cnn", "width": 4, "depth": 1}


def _cnn_config(**train):
    import dataclasses
    config = mw_config("default", 10, **train)
    return config.replace(model=dataclasses.replace(config.model, **CNN))


@pytest.fixture(scope="module")
def cnn_initial():
    from tfdist import models
    return models.build(_cnn_config().model, IMAGE_SPEC).get_weights()


@pytest.fixture(scope="module")
def mw_initial():
    """Initial weights of tests/mw_worker.py's model (mw_config's mlp)."""
    from tfdist import models
    return models.build(mw_config("horovod").model, IMAGE_SPEC).get_weights()


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, mw_initial, cnn_initial, early_runs):
    """The runs that need nothing else, in one horovodrun (beside early_runs)."""
    from test_tasks import CASES, TASK_TRAIN
    tmp_path = tmp_path_factory.mktemp("hvd_first")
    jobs = {
        "plain": (mw_initial, 10, {"jit_compile": "auto"}),
        # XLA (--jit_compile=auto) in "plain" and "every_feature"; the
        # reduction variants without its compiles (seconds of CPU a rank).
        "bucketed": (mw_initial, 10, {"reduce_bucket_mb": 0.001, "jit_compile": "off"}),
        "accumulating": (mw_initial, 10, {"accum_steps": 4, "jit_compile": "off"}),
        "every_feature": (mw_initial, 10, {"accum_steps": 2, "grad_compression": "fp16",
                                           "precision": "mixed_bfloat16", "jit_compile": "auto"}),
        **{f"task_{case}": (CASES[case][0](None).get_weights(), 10,
                            {"task": case, **TASK_TRAIN})
           for case in TASK_CASES},
        **{f"nan_{mode}": _nan_job(mw_initial, tmp_path / f"nan_{mode}", mode)
           for mode in ("skip", "rollback")},
        # Compression and local SGD under Horovod (hvd.allgather, per-rank state):
        # every entry sent, or weights averaged after every SGD step, is plain
        # synchronous training; rank-2 PowerSGD and 5 local steps are not.
        "topk_every_entry": (mw_initial, 10, {"grad_compression": "topk", "topk_fraction": 1.0,
                                              "jit_compile": "off"}),
        "local_every_step": (mw_initial, 10, {"sync_every": 1, "jit_compile": "off"}),
        # The cnn's BatchNorm over both ranks' batches (Horovod's all-reduce).
        "batch_norm_synced": (cnn_initial, 10, {"model": CNN, "sync_batchnorm": True,
                                                "jit_compile": "off"}),
        "local_every_5": (mw_initial, 10, {"sync_every": 5, "jit_compile": "off"}),
        # PowerSGD's exact resume in fresh ranks: each rank restores its own
        # error feedback and Q (second_run's "powersgd_resumed").
        "powersgd_straight": (mw_initial, 12, POWERSGD),
        "powersgd_first": (mw_initial, 8, {**POWERSGD,
                                           "model_dir": str(tmp_path / "powersgd_first" / "run")}),
        "resume_straight": (mw_initial, 12, SHUFFLED),
        "resume_first": (mw_initial, 8, {**SHUFFLED,
                                         "model_dir": str(tmp_path / "resume_first" / "run")}),
    }
    return _run_driver(tmp_path, jobs)


@pytest.fixture(scope="module")
def second_run(tmp_path_factory, mw_initial, first_run, without_horovodrun):
    """In fresh rank processes: the resume from first_run's checkpoint at
    step 8, then --on_nonfinite=stop (it ends the ranks, so it is last).
    Beside it: the single-process runs of without_horovodrun."""
    tmp_path = tmp_path_factory.mktemp("hvd_second")
    model_dir = str(first_run["resume_first"][1] / "run")
    powersgd_dir = str(first_run["powersgd_first"][1] / "run")
    jobs = {"resume_resumed": (mw_initial, 12, {**SHUFFLED, "model_dir": model_dir}),
            "powersgd_resumed": (mw_initial, 12, {**POWERSGD, "model_dir": powersgd_dir}),
            "nan_stop": _nan_job(mw_initial, tmp_path / "nan_stop", "stop")}
    return _run_driver(tmp_path, jobs)


@pytest.fixture(scope="module")
def single_device(mw_initial):
    """One device, the same global batches: what the 2 ranks must match."""
    return train_from(mw_config("default", 10), mw_initial).model.get_weights()


def _assert_ranks_match_single_device(run, single, initial):
    """assert_match_single_device (test_multi_worker.py), the one-device run shared."""
    result, out_dir = run
    assert result.returncode == 0, result.stderr[-3000:]
    workers = [_weights(out_dir, i) for i in (0, 1)]
    for a, b in zip(*workers):
        np.testing.assert_array_equal(a, b)  # the processes are identical, bit for bit
    assert max(np.abs(w - i).max() for w, i in zip(workers[0], initial)) > 1e-3
    assert_weights_close(workers[0], single, rtol=1e-4, atol=1e-6)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", TASK_CASES)
def test_two_ranks_train_keras_losses_and_metrics_like_one_device(first_run, case):
    """test_tasks.check_case_workers on the shared run."""
    from test_tasks import check_case_workers

    result, out_dir = first_run[f"task_{case}"]
    assert result.returncode == 0, result.stderr[-3000:]
    check_case_workers(out_dir, case)


@pytest.mark.timeout(240)
def test_a_planner_trial_of_horovod_runs_its_ranks_under_horovodrun(background, early_runs):
    """The planner's search measures a Horovod candidate as its users start
    it: both ranks' records (rate, each rank's peak) come back; the peak is
    the anonymous one (no cgroup), well below a resident set that counts
    TensorFlow's libraries."""
    result = background.result("planner_trial")
    assert result.returncode == 0, result.stderr[-3000:]
    trial = json.loads(result.stdout.strip().splitlines()[-1])
    assert trial["ok"], trial["reason"]
    assert len(trial["peaks"]) == 2 and trial["runs"][0]["examples_per_sec"] > 0
    record = trial["runs"][0]
    assert record["peak_measured_as"] == "anonymous"
    assert record["peak_bytes"] < record["peak_rss_bytes"] - 200 * 2**20


@pytest.mark.timeout(240)
def test_custom_absl_script_under_horovodrun(background, early_runs):
    result = background.result("custom_script")   # CUSTOM_SCRIPT_COMMAND
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = [json.loads(line[line.index("{"):]) for line in result.stdout.splitlines()
                 if "{" in line and '"strategy"' in line]
    assert len(summaries) == 1, result.stdout[-2000:]   # the chief (rank 0) prints it
    assert summaries[0]["strategy"] == "horovod" and summaries[0]["replicas"] == 2
    assert summaries[0]["auc"] > 0.85


@pytest.mark.timeout(400)
def test_resumed_ranks_read_exactly_the_batches_of_an_uninterrupted_run(first_run, second_run,
                                                                        mw_initial):
    """test_multi_worker.check_exact_resume on the shared runs: 12 steps
    stopped at 8 (first horovodrun) and resumed in fresh processes (second)
    equal 12 straight steps (shuffled data, fixed seed)."""
    (straight_run, straight_dir), (first, first_dir) = (first_run["resume_straight"],
                                                       first_run["resume_first"])
    resumed, resumed_dir = second_run["resume_resumed"]
    for result in (straight_run, first, resumed):
        assert result.returncode == 0, result.stderr[-3000:]
    model_dir = str(first_dir / "run")
    assert checkpointing.saved_steps(model_dir)[-1] == 12
    positions = sorted(os.listdir(os.path.join(checkpointing.checkpoint_dir(model_dir), "input")))
    assert len(positions) == 1 and positions[0].startswith("global-"), positions
    assert "fresh permutation" not in resumed.stderr
    straight = _weights(straight_dir, 0)
    assert_weights_close(_weights(resumed_dir, 0), straight, rtol=0, atol=1e-6)
    assert max(np.abs(w - i).max() for w, i in zip(straight, mw_initial)) > 1e-3


@pytest.mark.timeout(240)
def test_two_ranks_match_single_process(first_run, single_device, mw_initial):
    _assert_ranks_match_single_device(first_run["plain"], single_device, mw_initial)


@pytest.mark.timeout(240)
def test_two_ranks_with_bucketed_reductions_match_single_process(first_run, single_device,
                                                                 mw_initial):
    _assert_ranks_match_single_device(first_run["bucketed"], single_device, mw_initial)


@pytest.mark.timeout(240)
def test_two_ranks_accumulating_match_one_big_batch(first_run, single_device, mw_initial):
    _assert_ranks_match_single_device(first_run["accumulating"], single_device, mw_initial)


@pytest.mark.timeout(240)
def test_synchronised_batch_norm_over_ranks_matches_one_device(first_run, cnn_initial):
    """--sync_batchnorm under Horovod: weights and moving statistics match one
    device on the global batch (tolerance: test_equivalence's SYNC_TOLERANCE);
    the control: per-rank statistics would be more than 10x the tolerance away."""
    result, out_dir = first_run["batch_norm_synced"]
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [_weights(out_dir, i) for i in (0, 1)]
    for a, b in zip(*ranks):
        np.testing.assert_array_equal(a, b)
    one = train_from(_cnn_config(), cnn_initial).model.get_weights()
    for index, (a, b) in enumerate(zip(ranks[0], one)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"variable {index}")
    # Ranks that kept their own statistics would train as one device in 2
    # micro-batches does (test_equivalence): that is far outside the tolerance.
    local = train_from(_cnn_config(accum_steps=2), cnn_initial).model.get_weights()
    assert max(np.abs(a - b).max() for a, b in zip(local, one)) > 10 * max(
        1e-6 + 1e-5 * np.abs(b).max() for b in one)


@pytest.mark.timeout(240)
def test_every_feature_at_once_keeps_ranks_identical(first_run, mw_initial):
    result, out_dir = first_run["every_feature"]
    assert result.returncode == 0, result.stderr[-3000:]
    workers = [_weights(out_dir, i) for i in (0, 1)]
    for a, b in zip(*workers):
        np.testing.assert_array_equal(a, b)
    assert all(np.isfinite(w).all() for w in workers[0])
    assert any(not np.array_equal(w, i) for w, i in zip(workers[0], mw_initial))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["topk_every_entry", "local_every_step"])
def test_two_ranks_top_k_of_every_entry_and_local_sgd_every_step_match_single_process(
        first_run, single_device, mw_initial, name):
    _assert_ranks_match_single_device(first_run[name], single_device, mw_initial)


@pytest.mark.timeout(240)
def test_two_ranks_local_sgd_agree_at_the_average_and_differ_from_plain(first_run,
                                                                        single_device):
    result, out_dir = first_run["local_every_5"]
    assert result.returncode == 0, result.stderr[-3000:]
    workers = [_weights(out_dir, i) for i in (0, 1)]
    for a, b in zip(*workers):
        np.testing.assert_array_equal(a, b)
    assert max(np.abs(w - s).max() for w, s in zip(workers[0], single_device)) > 1e-4


@pytest.mark.timeout(240)
def test_powersgd_ranks_resume_their_own_state_exactly(first_run, second_run, mw_initial):
    """8 steps, then 4 more in fresh rank processes (each restores its own
    error feedback and Q from beside the checkpoint) == 12 straight. Control
    (in process, tests/integration/test_compression.py): without the saved state a resume differs."""
    for name in ("powersgd_straight", "powersgd_resumed"):
        assert first_run.get(name, second_run.get(name))[0].returncode == 0, name
    straight_dir, resumed_dir = first_run["powersgd_straight"][1], second_run["powersgd_resumed"][1]
    for rank in (0, 1):
        assert_weights_close(_weights(resumed_dir, rank), _weights(straight_dir, rank), rtol=0,
                             atol=1e-6)
    assert "restored the per-replica state of step 8" in second_run["powersgd_resumed"][0].stderr
    assert max(np.abs(w - i).max()
               for w, i in zip(_weights(straight_dir, 0), mw_initial)) > 1e-3


SINGLE_RANK_ARGS = ["--strategy=horovod", "--model=mlp", "--model_width=8", "--train_steps=2",
                    "--steps_per_loop=2", "--global_batch_size=8"]
ELASTIC_ALONE_ARGS = ["--strategy=horovod", "--elastic", "--model=mlp", "--model_width=8",
                      "--train_steps=4", "--steps_per_loop=2", "--global_batch_size=8"]


@pytest.fixture(scope="module")
def without_horovodrun(background, early_runs, tmp_path_factory, data_dir):
    """The single-process tfdist-train runs of the next three tests, started
    together (each is mostly TensorFlow start-up) once the checkpoint test's
    run has prepared data_dir. Returns their names."""
    background.result("checkpoint")   # the first to use data_dir: it prepares the dataset
    fake = tmp_path_factory.mktemp("fake") / "horovod"   # a Horovod that does not import
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('No module named horovod (test)')\n")
    train = [os.path.join(BIN, "tfdist-train")]
    background.start("single_rank", [*train, *SINGLE_RANK_ARGS, f"--data_dir={data_dir}"],
                     timeout=120)
    background.start("elastic_alone", [*train, *ELASTIC_ALONE_ARGS, f"--data_dir={data_dir}"],
                     timeout=120)
    background.start("elastic_fixed", [*train, *ELASTIC_ALONE_ARGS, f"--data_dir={data_dir}"],
                     env={"HOROVOD_RANK": "0"}, timeout=120)
    background.start("not_installed", [*train, "--strategy=horovod", "--model=mlp",
                                       "--train_steps=1"],
                     env={"PYTHONPATH": str(fake.parent)}, timeout=60)
    return background


@pytest.mark.timeout(240)
def test_without_horovodrun_it_is_a_single_rank(without_horovodrun):
    result = without_horovodrun.result("single_rank")
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["strategy"] == "horovod" and summary["replicas"] == 1
    assert summary["steps"] == 2


@pytest.mark.timeout(240)
def test_elastic_without_horovodrun_is_one_rank_and_needs_an_elastic_horovodrun(
        without_horovodrun):
    """--elastic alone trains as one rank (committing every loop); under a
    horovodrun with a fixed -np (HOROVOD_RANK set, no HOROVOD_ELASTIC) it is a
    one-line error before training."""
    alone, fixed = (without_horovodrun.result(name) for name in ("elastic_alone", "elastic_fixed"))
    assert alone.returncode == 0, alone.stderr[-2000:]
    summary = json.loads(alone.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 4 and summary["replicas"] == 1
    assert "elastic (commit every loop)" in alone.stderr
    assert fixed.returncode == 2, fixed.stderr[-2000:]
    errors = [line for line in fixed.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--elastic needs an elastic horovodrun" in errors[0]
    assert "Traceback" not in fixed.stderr


@pytest.mark.timeout(240)
def test_without_horovod_says_how_to_build_it(without_horovodrun):
    result = without_horovodrun.result("not_installed")
    assert result.returncode == 2
    errors = [l for l in result.stderr.splitlines() if "error:" in l]
    assert len(errors) == 1 and "Horovod is not installed" in errors[0]
    assert "make horovod" in errors[0]


@pytest.mark.timeout(120)
def test_build_script_reuses_what_is_built():
    result = subprocess.run([os.path.join(REPO, "launch", "build_horovod.sh"),
                             os.path.dirname(BIN)], capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "already installed" in result.stdout + result.stderr
    assert "nothing to do" in result.stdout + result.stderr


@pytest.mark.timeout(300)
def test_horovod_checkpoint_restores_under_default_and_mirrored(background, early_runs, data_dir):
    import tfdist

    model_dir = early_runs["checkpoint_model_dir"]
    result = background.result("checkpoint")   # HOROVODRUN tfdist-train _checkpoint_args
    assert result.returncode == 0, result.stderr[-3000:]
    assert checkpointing.saved_steps(model_dir) == [20]
    assert sorted(os.listdir(model_dir)) == ["checkpoints", "run.cfg", "run.json", "summary.json",
                                           "tensorboard"]
    with open(os.path.join(model_dir, "summary.json")) as f:
        summary = json.load(f)
    # fp16 gradients on the wire: half of the float32 parameter bytes.
    assert summary["grad_compression"] == "fp16" and summary["replicas"] == 2
    parameters = (32 * 32 * 3 + 1) * 16 + (16 + 1) * 10
    assert summary["bytes_reduced_per_update"] == parameters * 2
    probe = np.random.default_rng(3).uniform(size=(8, 32, 32, 3)).astype(np.float32)
    predictions, weights = [], []
    for strategy in ("default", "mirrored"):
        config = run_config(strategy, steps=20, batch=32, model_dir=model_dir, width=16)
        config = config.replace(data=tfdist.DataConfig(data_dir=data_dir))
        restored = tfdist.train(config)
        assert restored.summary["steps"] == 20  # restored at the final step: nothing retrained
        predictions.append(restored.model.predict(probe, verbose=0))
        weights.append(restored.model.get_weights())
    assert_variables_equal(weights[0], weights[1])  # both restored the same bytes
    # Computed under two strategies (another device split): float32 tolerance.
    np.testing.assert_allclose(predictions[0], predictions[1], **PREDICTION_TOLERANCE)


# A dead or preempted rank is about processes and checkpoints, not the step's
# arithmetic: no XLA compile there (seconds of CPU a rank). The XLA-compiled
# step runs under horovodrun in the mw_worker.py runs (--jit_compile=auto),
# the checkpoint test's and the elastic test's.
NO_XLA = ["--jit_compile=off"]


def _training_pids():
    """{rank: pid} of the Python processes running tfdist-train as a Horovod rank."""
    found = {}
    pids = subprocess.run(["pgrep", "-f", f"{TRAIN} --strategy=horovod"],
                          capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv0 = f.read().split(b"\0")[0]
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        except OSError:
            continue  # already gone
        if b"python" in os.path.basename(argv0) and b"HOROVOD_RANK" in env:
            found[int(env[b"HOROVOD_RANK"])] = int(pid)
    return found


def _assert_no_rank_left(within_s=1.0):
    """No rank process is left within `within_s` seconds (polled: done as soon as true)."""
    deadline = time.monotonic() + within_s
    while (pids := _training_pids()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pids == {}, pids


def _rank_pid(rank):
    pids = _training_pids()
    assert sorted(pids) == [0, 1], pids
    return pids[rank]


@pytest.mark.timeout(180)
def test_dead_rank_ends_the_job(tmp_path, data_dir, background):
    background.finish_all()   # no other rank of this module's runs may be about
    args = ["--strategy=horovod", "--model=mlp", "--train_steps=1000000", "--steps_per_loop=10",
            "--global_batch_size=32", f"--data_dir={data_dir}", "--log_every=10", *NO_XLA]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "HOROVOD_GLOO_TIMEOUT_SECONDS": "20"}
    proc = subprocess.Popen([*HOROVODRUN, TRAIN, *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:  # wait until training is under way
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, "training never started"
            if "step 10/" in line:
                break
        os.kill(_rank_pid(1), signal.SIGKILL)
        proc.communicate(timeout=60)  # bounded: a hang fails the test
    finally:
        proc.kill()
    assert proc.returncode != 0
    _assert_no_rank_left()


# make slow: two horovodruns (~32 CPU-s); make test: test_reliability.py's SIGTERM to one
# process and to a launcher's worker (the agreed step, 143, the rerun).
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_to_one_rank_saves_one_step_on_both_and_a_rerun_finishes(tmp_path, data_dir,
                                                                         background):
    """A rank is preempted: both ranks agree (a collective), save the same step,
    exit 143; horovodrun ends; running it again finishes at the requested step."""
    background.finish_all()
    from test_reliability import _preempted_steps

    model_dir = str(tmp_path / "run")
    args = ["--strategy=horovod", "--model=mlp", "--model_width=32", "--global_batch_size=32",
            "--steps_per_loop=10", "--checkpoint_every=20", "--keep_checkpoints=100",
            "--train_steps=100", f"--data_dir={data_dir}", f"--model_dir={model_dir}",
            "--preemption_grace_s=20", "--shuffle_buffer=1000", *NO_XLA]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.Popen([*HOROVODRUN, TRAIN, *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 150
        while not checkpointing.saved_steps(model_dir):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.2)
        found = subprocess.run(["pgrep", "-f", "--", f"--model_dir={model_dir} "],
                               capture_output=True, text=True).stdout.split()
        ranks = [pid for pid in found   # python .../tfdist-train: not horovodrun or its shells
                 if open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[1].endswith(
                     b"tfdist-train")]
        assert len(ranks) == 2, found
        os.kill(int(sorted(ranks, key=int)[-1]), signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    steps = _preempted_steps(out + err)
    assert len(steps) == 2 and steps[0] == steps[1], (out + err)[-3000:]
    assert steps[0] in checkpointing.saved_steps(model_dir)
    rerun = subprocess.run([*HOROVODRUN, TRAIN, *args], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=200)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    saved = checkpointing.saved_steps(model_dir)
    assert saved == sorted(set(saved)) and saved[-1] == 100


def _elastic_horovodrun(tmp_path, *, cooldown_s=None):
    """horovodrun for an elastic job of at most 2 ranks on this machine.

    The machine is named twice (localhost and 127.0.0.1, one slot each):
    Horovod blacklists the whole host of a failed rank, so with one name
    (localhost:2) killing a rank would end the job. A cooldown lets the
    blacklisted name come back, and a new rank start there."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    command = [os.path.join(BIN, "horovodrun"), "--gloo", "-np", "2", "--min-np", "1",
               "--max-np", "2", "--host-discovery-script", str(discover),
               "--network-interface", "lo"]   # else elastic mode wants two real hosts
    if cooldown_s:
        command += ["--blacklist-cooldown-range", str(cooldown_s), str(cooldown_s + 1)]
    return command


def _throttle_until_replaced(pid, old_pids, timeout):
    """Slow `pid` down (SIGSTOP 0.4 s, SIGCONT 0.1 s) until a rank process not
    in `old_pids` has loaded Horovod's library (then it waits in hvd.init)."""
    deadline = time.monotonic() + timeout
    try:
        while not _replacement_loaded(old_pids):
            assert time.monotonic() < deadline, f"no replacement rank within {timeout}s"
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.4)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.1)
    finally:
        os.kill(pid, signal.SIGCONT)


def _replacement_loaded(old_pids) -> bool:
    # By command line: an elastic rank learns its rank only in hvd.init.
    pids = subprocess.run(["pgrep", "-f", f"{TRAIN} --strategy=horovod"],
                          capture_output=True, text=True).stdout.split()
    for pid in set(map(int, pids)) - set(old_pids):
        try:
            with open(f"/proc/{pid}/maps", "rb") as f:
                if b"horovod" in f.read():
                    return True
        except OSError:
            pass
    return False


@pytest.mark.timeout(300)
def test_elastic_survives_a_killed_rank_and_takes_it_back(tmp_path, data_dir, background):
    """2 ranks; SIGKILL rank 1 mid-run: rank 0 rolls back to its last commit,
    goes on alone, takes a new rank back when the host returns (after the
    blacklist cooldown), and the run ends at the requested step."""
    background.finish_all()
    steps, commit_every = 600, 20
    model_dir = str(tmp_path / "run")
    args = ["--strategy=horovod", "--elastic", f"--elastic_commit_every={commit_every}",
            "--model=mlp", "--model_width=16", "--model_depth=1", "--global_batch_size=32",
            f"--train_steps={steps}", "--steps_per_loop=50", "--log_every=50",
            "--checkpoint_every=200", "--shuffle_buffer=1000", f"--data_dir={data_dir}",
            f"--model_dir={model_dir}", *NO_XLA]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.Popen([*_elastic_horovodrun(tmp_path, cooldown_s=1), TRAIN, *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines = []
    try:
        deadline = time.monotonic() + 150
        while not any(f"step 100/{steps}" in line for line in lines):
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(lines)[-3000:]
            lines.append(line)
        survivor, victim = _rank_pid(0), _rank_pid(1)
        os.kill(victim, signal.SIGKILL)
        # Rank 0 goes on alone. On a loaded machine the replacement rank's
        # TensorFlow import can outlast all of rank 0's remaining steps, and
        # the run would end before it joins: from its regroup until the
        # replacement has loaded Horovod, rank 0 runs at a fifth of its speed
        # (stopped 0.4 s of every 0.5 s; it must keep answering Horovod's
        # driver, which starts the replacement only after notifying it).
        while not any("now 1 replica(s)" in line for line in lines):
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(lines)[-3000:]
            lines.append(line)
        _throttle_until_replaced(survivor, {survivor, victim}, timeout=120)
        out, _ = proc.communicate(timeout=200)   # bounded: a hang fails the test
    finally:
        proc.kill()
    output = "".join(lines) + out
    assert proc.returncode == 0, output[-4000:]
    regrouped = [(int(n), int(s)) for n, s in re.findall(
        r"now (\d) replica\(s\) \(global batch 32 = .*?; going on from step (\d+)", output)]
    # Rank 0 alone from its last commit, then both again (the new rank 1 starts
    # from the state rank 0 broadcasts).
    assert [n for n, _ in regrouped][:2] == [1, 2], output[-4000:]
    assert all(step % commit_every == 0 and step < steps for _, step in regrouped), regrouped
    summaries = [json.loads(line[line.index("{"):]) for line in output.splitlines()
                 if '"strategy": "horovod"' in line]
    assert len(summaries) == 1, output[-3000:]   # the chief's
    assert summaries[0]["steps"] == steps and summaries[0]["replicas"] == 2
    assert summaries[0]["elastic_reforms"] == len(regrouped)
    assert np.isfinite(summaries[0]["loss"])
    assert checkpointing.saved_steps(model_dir)[-1] == steps
    _assert_no_rank_left()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", NONFINITE_MODES)
def test_on_nonfinite_under_two_ranks(first_run, second_run, mode):
    """--on_nonfinite with a NaN at one step (tests/integration/test_nonfinite_cluster.py,
    there under multi_worker): stop ends both ranks with one line naming the
    step; skip and rollback finish with both ranks identical."""
    from test_nonfinite_cluster import check_rollback, check_skip, check_stop

    result, out_dir = (second_run if mode == "stop" else first_run)[f"nan_{mode}"]
    initial = list(np.load(out_dir / "initial.npz").values())
    finished = []
    for index in (0, 1):
        weights, summary = out_dir / f"weights-{index}.npz", out_dir / f"summary-{index}.json"
        finished.append(None if not weights.exists() else (
            list(np.load(weights).values()), json.loads(summary.read_text())))
    model_dir = str(out_dir / "run")
    if mode == "stop":
        check_stop(result, model_dir, finished, "rank")
    elif mode == "skip":
        check_skip(result, finished, initial)
    else:
        check_rollback(result, model_dir, finished)
