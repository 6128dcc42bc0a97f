"""tfdist-compare on real runs: two workers and ZeRO-3 match one device, a broken
distributed side diverges, bad input exits 2 before any training (the
divergence measure itself: tests/unit/test_compare.py)."""

import os
import re
import subprocess
import time

import pytest

from conftest import BIN, REPO

COMPARE = os.path.join(BIN, "tfdist-compare")
# Small enough that each training run is mostly TensorFlow start-up.
SMALL = ["--model=mlp", "--model_width=32", "--dataset=tfdist_shapes", "--global_batch_size=64",
         "--virtual_devices=2", "--jit_compile=off"]   # the comparison, not XLA: no compiles


def _run_compare(args, timeout):
    """Run tfdist-compare; past `timeout` SIGTERM it and fail."""
    return _finish_compare(args, _start_compare(args), timeout)


@pytest.mark.integration
@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,message", [
    (["--strategy=mirrored", "--model=mlp"], "missing '--' before the tfdist-train flags"),
    (["--strategy=parameter_server", "--"],
     "--strategy='parameter_server' cannot be compared; valid: mirrored, multi_worker, "
     "horovod, dtensor, pipeline"),
    (["--strategy=mirrored", "--tolerance=0", "--"], "--tolerance=0 must be a number above 0"),
    (["--strategy=mirrored", "--tolerance=-0.5", "--"], "--tolerance=-0.5 must be"),
    (["--strategy=mirrored", "--window=0", "--"], "--window=0 must be at least 1"),
    (["--strategy=multi_worker", "--workers=0", "--"], "--workers=0 must be at least 1"),
    (["--strategy=mirrored", "--workers=2", "--"], "--workers=2 applies to multi_worker"),
    (["--strategy=mirrored", "--", "--model_dir=x"], "--model_dir=x is set by tfdist-compare"),
    (["--strategy=mirrored", "--distributed_flags=--strategy=default", "--"],
     "--distributed_flags: --strategy=default is set by tfdist-compare"),
    (["--strategy=mirrored", "--", "mlp"], "'mlp' is not a flag"),
    (["--tolerance=0.1", "--"], "the following arguments are required: --strategy"),
])
def test_bad_input_exits_2_before_any_run(tmp_path, args, message):
    output_dir = tmp_path / "out"
    started = time.monotonic()
    result = _run_compare([f"--output_dir={output_dir}", *args], timeout=30)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tfdist-compare: error: "), result.stderr
    assert message in lines[0], lines[0]
    assert time.monotonic() - started < 10  # no TensorFlow, no training
    assert not output_dir.exists()


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_failed_run_exits_2_naming_the_run(tmp_path):
    result = _run_compare([f"--output_dir={tmp_path}", "--strategy=mirrored", "--",
                           "--model=bogus"], timeout=50)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [l for l in result.stderr.splitlines() if "error:" in l]
    assert len(errors) == 1 and errors[0].startswith("tfdist-compare: error: run default "
                                                     "failed with exit status 2: "), result.stderr
    # The run's own last stderr line is quoted; its full log is kept.
    assert "tfdist-train: error: --model='bogus' is not a registered model" in errors[0]
    assert (tmp_path / "default.stderr.log").exists()
    assert "run mirrored" not in result.stderr  # stopped at the first failure


def _start_compare(args):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.Popen([COMPARE, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish_compare(args, proc, timeout):
    """Wait for a compare started by `_start_compare`; past `timeout` SIGTERM it
    (it then stops its training run, which lives in its own session) and fail."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"tfdist-compare ran over {timeout}s: {err[-2000:]}")
    finally:
        proc.kill()
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def real_compares(tmp_path_factory, data_dir):
    """The comparisons of real runs, started together (each runs its two
    trainings one after the other, mostly TensorFlow start-up): {name: (args,
    process, output_dir)}; each test waits for its own. Each training run may
    take up to 200 s (--timeout_s; it shares the cores with the other comparisons)."""
    root = tmp_path_factory.mktemp("compares")
    runs = {
        "multi_worker": ["--strategy=multi_worker", "--timeout_s=200", "--", *SMALL,
                         "--train_steps=30", f"--data_dir={data_dir}"],
        "zero3": ["--strategy=dtensor", "--timeout_s=200", "--grad_agreement_every=0",
                  "--distributed_flags=--mesh=batch:2,model:1 --zero_stage=3", "--", *SMALL,
                  "--train_steps=20", f"--data_dir={data_dir}"],
        "broken": ["--strategy=mirrored", "--timeout_s=150", "--grad_agreement_every=0",
                   "--distributed_flags=--learning_rate=0.03", "--", *SMALL,
                   "--train_steps=15", f"--data_dir={data_dir}"],
    }
    started = {}
    for name, args in runs.items():
        args = [f"--output_dir={root / name}", *args]
        started[name] = (args, _start_compare(args), root / name)
    yield started
    for _, proc, _ in started.values():   # not waited for (a test deselected or failed):
        if proc.poll() is None:            # SIGTERM stops its training run too
            proc.terminate()
            try:
                proc.communicate(timeout=30)
            finally:
                proc.kill()


def _max_gap(report):
    return float(re.search(r"largest smoothed relative loss gap (\S+)", report).group(1))


# make slow: three tfdist-compare runs of real engines (~70 CPU-s). make test covers
# them with tests/unit/test_compare.py (divergence, commands), the two process tests
# above and the engines' own equivalences (test_multi_worker.py, test_one_run.py).
@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(500)   # the other comparisons run meanwhile (the fixture)
def test_two_workers_match_default(real_compares):
    args, proc, out = real_compares["multi_worker"]
    result = _finish_compare(args, proc, timeout=460)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("run default: finished" in result.stderr
            and "run multi_worker: finished" in result.stderr)
    report = (out / "report.md").read_text()
    assert report in result.stdout  # printed, too
    assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "PASS: within tolerance" in report
    # The one global order: both workers read the default run's global
    # batches, so the same gradient up to float32 rounding and the smoothed
    # curves agree far inside the 0.1 default (measured ~1e-7 over 30 steps;
    # per-worker shards, other batches at every step, measured 1e-2 and more).
    assert _max_gap(report) < 1e-4, report
    assert "Steps: default 30, multi_worker 30 (2 replicas, 2 worker(s)" in report
    assert re.search(r"## Largest divergence\s+At step \d+ \(mean of the 5 steps", report)
    assert "Hardware: " in report and "cores" in report
    rows = re.findall(r"^\| (\d+) \| (\S+) \| (\S+) \|$", report, re.MULTILINE)
    assert [r for r, _, _ in rows] == ["0", "1"], report
    cosines = [float(v) for _, low, mean in rows for v in (low, mean)]
    assert all(0 < c <= 1 for c in cosines), rows
    assert "over 30 sampled steps" in report
    assert re.search(r"Overall min: 0\.\d+", report)


@pytest.mark.slow   # the same three runs
@pytest.mark.integration
@pytest.mark.timeout(500)
def test_zero3_matches_default(real_compares):
    """ZeRO-3 on a 2-device mesh: the same initial weights (drawn shard by
    shard) and the same global batches as one device, so the curves agree to
    float32 rounding; the broken side below is its control."""
    args, proc, out = real_compares["zero3"]
    result = _finish_compare(args, proc, timeout=460)
    assert result.returncode == 0, result.stderr[-3000:]
    report = (out / "report.md").read_text()
    assert "PASS: within tolerance" in report and _max_gap(report) < 1e-4, report
    assert "Steps: default 20, dtensor 20 (2 replicas" in report
    assert "--zero_stage=3" in report


@pytest.mark.slow   # the same three runs
@pytest.mark.integration
@pytest.mark.timeout(500)
def test_broken_distributed_side_diverges(real_compares):
    """10x the learning rate on the distributed side only: its Adam steps blow
    the loss up (to ~50 by step 3) while the default run stays near 2.5."""
    args, proc, out = real_compares["broken"]
    result = _finish_compare(args, proc, timeout=460)
    assert result.returncode == 1, result.stderr[-3000:]
    report = (out / "report.md").read_text()
    assert "DIVERGED: beyond tolerance" in report and _max_gap(report) > 0.1
    assert "--learning_rate=0.03" in report  # the command lines are in the report
    assert "## Gradient agreement" not in report  # not asked for
    assert (out / "loss_curves.png").exists()
