"""tfdist-compare: the divergence measure on synthetic curves and the commands it
runs (the command on real runs: tests/integration/test_compare_runs.py)."""

import os

import numpy as np
import pytest

from tfdist import compare


def _curve(values, start=1, every=1):
    return {start + i * every: float(v) for i, v in enumerate(values)}


# -- unit: the divergence measure ---------------------------------------------
def test_identical_curves_do_not_diverge():
    loss = _curve(np.linspace(2.3, 0.5, 30))
    result = compare.divergence(loss, dict(loss))
    assert result.max_relative_gap == 0.0 and not result.diverged
    assert result.window == compare.DEFAULT_WINDOW
    assert list(result.smooth_steps) == list(range(5, 31))  # full windows only


def test_moving_average_is_a_trailing_mean_over_full_windows():
    np.testing.assert_allclose(compare.moving_average(np.array([1.0, 2, 3, 4, 5]), 2),
                               [1.5, 2.5, 3.5, 4.5])
    np.testing.assert_allclose(compare.moving_average(np.array([1.0, 2, 3]), 3), [2.0])


def test_smoothing_removes_per_step_noise_but_not_a_trend():
    trend = np.linspace(2.3, 1.0, 40)
    noise = 0.3 * np.array([1, -1] * 20)  # batch-to-batch noise, mean zero over 2 steps
    default, noisy = _curve(trend), _curve(trend + noise)
    assert compare.divergence(default, noisy, window=1, tolerance=0.1).diverged
    smoothed = compare.divergence(default, noisy, window=2, tolerance=0.1)
    assert smoothed.max_relative_gap < 1e-12 and not smoothed.diverged
    drifting = _curve(trend * np.linspace(1.0, 1.3, 40) + noise)  # 30% off by the end
    result = compare.divergence(default, drifting, window=2, tolerance=0.1)
    assert result.diverged and result.smooth_steps[result.worst] == 40


def test_curves_sampled_at_different_steps_are_aligned():
    default = _curve(np.arange(1.0, 31.0))                  # steps 1..30: loss = step
    every_other = _curve(np.arange(2.0, 31.0, 2), start=2, every=2)  # steps 2, 4, ..., 30
    steps, a, b = compare.align(default, every_other)
    assert list(steps) == list(range(2, 31, 2))
    np.testing.assert_array_equal(a, b)
    # Offset grids meet on the sparser one, read off the other by interpolation.
    odd = _curve(np.arange(1.0, 30.0, 2), start=1, every=2)  # steps 1, 3, ..., 29
    steps, a, b = compare.align(every_other, odd)
    assert steps[0] == 2 and steps[-1] == 28
    np.testing.assert_allclose(a, b)
    assert compare.divergence(default, every_other, window=3).max_relative_gap < 1e-12
    with pytest.raises(ValueError, match="do not overlap"):
        compare.align(_curve([1.0, 2.0]), _curve([1.0, 2.0], start=10))


def test_tolerance_edge_passes_and_just_above_diverges():
    default, distributed = _curve([2.0] * 10), _curve([2.25] * 10)  # gap exactly 0.125
    assert compare.divergence(default, distributed, tolerance=0.125).max_relative_gap == 0.125
    assert not compare.divergence(default, distributed, tolerance=0.125).diverged
    assert compare.divergence(default, distributed, tolerance=0.1249).diverged


def test_gap_near_zero_loss_is_relative_to_a_floor_not_to_the_loss():
    """Batch-order noise of fixed size at a loss near zero: relative to the
    loss it would be huge; relative to a quarter of the first loss it is small.
    A real divergence (the other curve stuck high) still fails."""
    steps = range(1, 41)
    default = {s: 2.0 * 0.9 ** s for s in steps}             # 1.8 -> 0.03
    noisy = {s: v + 0.02 * (-1) ** s for s, v in default.items()}
    assert not compare.divergence(default, noisy, window=1, tolerance=0.1).diverged
    stuck = {s: max(v, 1.0) for s, v in default.items()}
    assert compare.divergence(default, stuck, window=1, tolerance=0.1).diverged


def test_non_finite_loss_always_diverges():
    default = _curve(np.linspace(2.3, 1.0, 20))
    broken = {**default, 12: float("nan")}
    result = compare.divergence(default, broken, tolerance=1e9)
    assert result.diverged and result.max_relative_gap == float("inf")
    assert 12 <= result.smooth_steps[result.worst] < 12 + result.window


def test_window_longer_than_the_curve_uses_all_points():
    result = compare.divergence(_curve([2.0, 2.2, 2.4]), _curve([2.0, 2.2, 2.4]), window=5)
    assert result.window == 3 and len(result.relative_gap) == 1


def test_agreement_table_per_replica():
    scalars = {"loss": _curve([1.0]), "grad_agreement_min": _curve([0.2, 0.5]),
               "grad_agreement_replica_0": _curve([0.9, 0.7]),
               "grad_agreement_replica_1": _curve([0.2, 0.6])}
    table = compare.agreement_table(scalars)
    assert list(table) == [0, 1]
    assert table[0] == pytest.approx((0.7, 0.8, 2)) and table[1] == pytest.approx((0.2, 0.4, 2))


def test_commands_put_the_compared_flags_after_the_shared_ones(tmp_path):
    """A shared --flagfile (configs/demo.cfg sets --strategy=mirrored) must not
    override the strategy of either run: absl keeps the last value."""
    opts, shared = compare.parse_args([
        "--strategy=multi_worker", f"--output_dir={tmp_path}", "--grad_agreement_every=5",
        "--distributed_flags=--lr_scaling=linear --learning_rate=0.01", "--",
        "--flagfile=configs/demo.cfg", "--train_steps=40"])
    runs = compare.commands(opts, shared)
    assert list(runs) == ["default", "multi_worker"]
    default, distributed = runs["default"], runs["multi_worker"]
    assert os.path.basename(default[0]) == "tfdist-train"
    assert default[1:] == ["--flagfile=configs/demo.cfg", "--train_steps=40",
                           "--strategy=default", f"--model_dir={tmp_path}/default",
                           "--log_every=1", "--grad_agreement_every=0"]
    assert os.path.basename(distributed[0]) == "tfdist-launch"
    assert distributed[1:3] == ["--workers=2", "--"]
    assert distributed[4:] == ["--flagfile=configs/demo.cfg", "--train_steps=40",
                               "--strategy=multi_worker", f"--model_dir={tmp_path}/multi_worker",
                               "--log_every=1", "--grad_agreement_every=5",
                               "--lr_scaling=linear", "--learning_rate=0.01"]


def test_output_dir_of_someone_else_is_never_cleared(tmp_path):
    (tmp_path / "default").mkdir()
    (tmp_path / "default" / "checkpoint").write_text("precious")
    with pytest.raises(compare.UsageError, match="was not written by tfdist-compare"):
        compare.prepare_output(str(tmp_path), ["default", "mirrored"])
    assert (tmp_path / "default" / "checkpoint").read_text() == "precious"
    ours = tmp_path / "ours"
    compare.prepare_output(str(ours), ["default", "mirrored"])
    (ours / "default").mkdir()
    (ours / "default" / "checkpoint").write_text("an earlier comparison's")
    compare.prepare_output(str(ours), ["default", "mirrored"])  # replaced: a run would resume
    assert not (ours / "default").exists()


# -- the command ----------------------------------------------------------------


def test_a_launcher_is_this_environments_else_the_paths_else_a_usage_error(tmp_path, monkeypatch):
    """tfdist-compare and the planner's trials find tfdist-launch, tfdist-train
    and horovodrun the same way (`records.executable`)."""
    from tfdist.errors import UsageError
    from tfdist.strategies import records
    env_bin, path_bin = tmp_path / "venv" / "bin", tmp_path / "path"
    env_bin.mkdir(parents=True)
    path_bin.mkdir()
    monkeypatch.setattr(compare.sys, "executable", str(env_bin / "python"))
    monkeypatch.setenv("PATH", str(path_bin))
    with pytest.raises(UsageError, match="cannot find tfdist-launch next to .*; reinstall"):
        records.executable("tfdist-launch", "reinstall tfdist")
    for folder in (path_bin, env_bin):   # the PATH's, then this environment's first
        tool = folder / "tfdist-launch"
        tool.write_text("#!/bin/sh\n")
        tool.chmod(0o755)
        assert records.executable("tfdist-launch", "") == str(tool)
    (env_bin / "tfdist-launch").chmod(0o644)   # not executable: not this environment's
    assert records.executable("tfdist-launch", "") == str(path_bin / "tfdist-launch")
