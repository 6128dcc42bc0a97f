"""tfdist-train: bad input exits 2 with one line naming the input; a clean
run prints the run summary; Ctrl-C leaves the last checkpoint intact."""

import json
import os
import signal
import subprocess
import time

import pytest
import tensorflow as tf

from tfdist import checkpointing, cluster
from tfdist.errors import UsageError

from common import run_cli_cases
from conftest import BIN, REPO, finish_all, run_cli, start_all, tfdist_train

pytestmark = pytest.mark.integration

# No XLA compile (~3 CPU-seconds a process on AVX-512): these runs are about
# flags and errors; --jit_compile=auto runs in test_demo.py and the
# multi-process equivalence runs (tests/mw_worker.py).
QUICK = ["--model=mlp", "--model_width=8", "--model_depth=1", "--train_steps=2",
         "--steps_per_loop=2", "--global_batch_size=8", "--jit_compile=off"]


@pytest.mark.parametrize("args,message", [
    (["--strategy=bogus"], "--strategy='bogus' is not a registered strategy; valid: default, dtensor, horovod, mirrored, multi_worker"),
    (["--model=bogus"], "--model='bogus' is not a registered model; valid: cnn, mlp, transformer"),
    (["--global_batch_size=0"], "--global_batch_size=0"),
    (["--train_steps=-3"], "--train_steps=-3"),
    (["--train_steps=3", "--epochs=1"], "--train_steps and --epochs: set only one of them"),
    (["--no_such_flag=1"], "no_such_flag"),
    (["stray_argument"], "unexpected arguments 'stray_argument'"),
    (["--optimizer=rmsprop"], "--optimizer"),
    (["--elastic_commit_every=-1"], "--elastic_commit_every"),
    (["--loss=hinge"], "--loss"),
    (["--metrics=accuracy,auc"], "metrics='auc' is not known; valid: accuracy, top5_accuracy"),
    (["--label_smoothing=0.1"], "label_smoothing=0.1 needs loss=categorical_crossentropy"),
    (["--strategy=dtensor", "--mesh=batch:2"], "--mesh='batch:2' must name exactly the axes batch "
                                               "and model"),
    (["--grad_compression=topk", "--topk_fraction=1.5"], "topk_fraction=1.5 must be in (0, 1]"),
    (["--sync_every=4", "--accum_steps=2"], "sync_every=4 (local SGD) with accum_steps=2"),
    (["--grad_compression=zip"], "--grad_compression"),
])
def test_flag_errors_exit_2_before_tensorflow(args, message):
    result = run_cli(args, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("tfdist-train: error: ") and message in lines[0], lines[0]


def _after_start_up_cases(a_file, data_dir):
    """(args, message) of errors that need the engine or the data."""
    return [
        (["--dataset=no_such_dataset", f"--data_dir={data_dir}"],
         "--dataset='no_such_dataset' is not a known TFDS dataset; valid: the bundled "
         "tfdist_shapes, tfdist_tokens"),
        (["--global_batch_size=7", "--strategy=mirrored", f"--data_dir={data_dir}"],
         "--global_batch_size=7 must be divisible by replicas (2) x --accum_steps (1)"),
        ([f"--model_dir={a_file}/run", f"--data_dir={data_dir}"],
         f"--model_dir={a_file}/run is not a writable directory"),
        ([f"--export_dir={a_file}", f"--data_dir={data_dir}"],
         f"--export_dir={a_file} is a file; give a directory"),
        ([f"--data_dir={a_file}"], f"--dataset=tfdist_shapes: cannot"),
        (["--model=transformer", f"--data_dir={data_dir}"],
         "--model=transformer needs a dataset of kind tokens"),
        # A size TensorFlow cannot hold (tests/unit/test_fuzz.py draws such flags).
        ([f"--global_batch_size={2**62}", f"--data_dir={data_dir}",
          f"--model_dir={a_file.parent / 'huge_batch_run'}"],
         f"--global_batch_size={2**62} is larger than the 12000 training examples of "
         "tfdist_shapes"),
        (["--strategy=mirrored", "--elastic", f"--data_dir={data_dir}"],
         "--elastic: --strategy=mirrored cannot change its number of workers during a run; "
         "--strategy=horovod under an elastic horovodrun"),
        # The model's layers are known only once it is built (still before training).
        # (Before the dtensor transformer case: a failed DTensor build leaves Keras
        # state behind in this one process.)
        (["--strategy=mirrored", "--grad_compression=powersgd", "--powersgd_rank=9",
          "--powersgd_min_compression=0",
          f"--data_dir={data_dir}", f"--model_dir={a_file.parent / 'powersgd_run'}"],
         "--powersgd_rank=9 is larger than the smaller dimension (8) of"),
        (["--strategy=dtensor", "--mesh=batch:2,model:1", "--sync_every=2",
          f"--data_dir={data_dir}"],
         "--sync_every=2 needs replicas that each step on their own data and keep state of "
         "their own; --strategy=dtensor has none (engines that do: default, mirrored, "
         "multi_worker, horovod)"),
        (["--strategy=dtensor", "--mesh=batch:2,model:2", f"--data_dir={data_dir}"],
         "--mesh=batch:2,model:2 needs 4 devices but --virtual_devices=2; set "
         "--virtual_devices=4"),
        (["--strategy=dtensor", "--mesh=batch:1,model:2", "--model=transformer",
          "--dataset=tfdist_tokens", "--model_width=12", "--num_heads=3", "--model_depth=1",
          f"--data_dir={data_dir}"],
         "layout rules: variable block0/attn/query/kernel (shape (12, 3, 4), rule "
         "'attn/(query|key|value)/kernel$'): dimension 1 of size 3 is not divisible by mesh "
         "axis model=2"),
    ]


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory, data_dir):
    """The errors found after start-up, one after another in one `tfdist-train`
    process (common.run_cli_cases: each case has its own argv, exit status and
    stderr, and flags reset to their defaults; one TensorFlow start instead of
    one per case), and beside it two clean runs, each a real process of its
    own."""
    root = tmp_path_factory.mktemp("cli_runs")
    a_file = root / "a_file"
    a_file.write_text("not a directory")
    errors = _after_start_up_cases(a_file, data_dir)
    clean = {
        "summary": QUICK + [f"--data_dir={data_dir}", f"--model_dir={root / 'summary_run'}",
                            "--strategy=mirrored"],
        # With a shuffle buffer larger than TensorFlow can hold: capped at
        # the split's size, it runs.
        "loss_and_metrics": [*QUICK, "--strategy=default", f"--data_dir={data_dir}",
                             "--loss=categorical_crossentropy", "--label_smoothing=0.1",
                             "--metrics=accuracy,top5_accuracy,crossentropy",
                             f"--shuffle_buffer={2**63 - 1}"],
    }
    procs = start_all([tfdist_train(args) for args in clean.values()])
    try:
        results = run_cli_cases([QUICK + args for args, _ in errors], timeout=240)
    except BaseException:
        for proc in procs:
            proc.kill()
        raise
    runs = dict(zip(clean, finish_all(procs, timeout=240)))
    return dict(root=root, a_file=a_file, errors=list(zip(errors, results)), **runs)


def test_errors_found_after_start_up_exit_2(cli_runs):
    """Errors that need the engine or the data: each before any training step."""
    assert len(cli_runs["errors"]) == 12
    for (args, message), result in cli_runs["errors"]:
        assert result.returncode == 2, (args, result.stderr[-2000:])
        error_lines = [l for l in result.stderr.splitlines() if "error:" in l]
        assert len(error_lines) == 1 and message in error_lines[0], (args, result.stderr[-2000:])
        assert "Traceback" not in result.stderr
        assert "step 1/" not in result.stderr  # nothing trained
    assert cli_runs["a_file"].read_text() == "not a directory"  # nothing on disk was touched
    assert not os.listdir(cli_runs["root"] / "powersgd_run")   # no run record either
    huge = cli_runs["root"] / "huge_batch_run"
    assert not huge.exists() or not os.listdir(huge)


def test_virtual_devices_after_runtime_start_is_a_usage_error():
    tf.constant(1.0)  # the runtime is up (conftest made 4 logical CPUs)
    with pytest.raises(UsageError, match="--virtual_devices=5: TensorFlow's devices were "
                                         "already initialised"):
        cluster.configure_virtual_cpus(5)
    cluster.configure_virtual_cpus(4)  # the same request again is fine
    assert len(cluster.local_devices(2)) == 2  # fewer: the first ones


def test_run_prints_and_writes_summary(cli_runs):
    result = cli_runs["summary"]
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("strategy", "replicas", "global_batch_size", "steps", "loss", "accuracy",
                "examples_per_sec"):
        assert key in summary
    assert summary["strategy"] == "mirrored" and summary["replicas"] == 2
    assert summary["steps"] == 2 and 0 <= summary["accuracy"] <= 1
    with open(cli_runs["root"] / "summary_run" / "summary.json") as f:
        assert json.load(f) == summary


def test_ctrl_c_keeps_last_checkpoint(tmp_path, data_dir):
    args = ["--model=mlp", "--model_width=32", "--train_steps=100000", "--steps_per_loop=20",
            "--checkpoint_every=20", "--keep_checkpoints=2", "--strategy=default",
            "--shuffle_buffer=1000", "--jit_compile=off",
            f"--data_dir={data_dir}", f"--model_dir={tmp_path}"]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.Popen([os.path.join(BIN, "tfdist-train"), *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(checkpointing.saved_steps(str(tmp_path))) < 2:
            if proc.poll() is not None or time.monotonic() > deadline:
                alive = proc.poll() is None
                proc.kill()   # before reading: a live process's stderr has no end
                stderr = proc.communicate()[1]
                pytest.fail(f"no 2 checkpoints {'in 120 s' if alive else 'before it exited'}: "
                            f"{stderr[-2000:]}")
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr[-2000:]
    assert "interrupted" in stderr
    latest = tf.train.latest_checkpoint(checkpointing.checkpoint_dir(str(tmp_path)))
    reader = tf.train.load_checkpoint(latest)  # complete and readable
    assert any("step" in name for name in reader.get_variable_to_shape_map())


def test_loss_and_metrics_flags(cli_runs):
    result = cli_runs["loss_and_metrics"]
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["loss_function"] == "categorical_crossentropy"
    assert summary["metrics"] == ["accuracy", "top5_accuracy", "crossentropy"]
    for name in summary["metrics"]:
        assert 0 <= summary[name] and 0 <= summary[f"train_{name}"], name
    assert summary["top5_accuracy"] >= summary["accuracy"]
