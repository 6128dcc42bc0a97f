"""tfdist-plan and tfdist.plan for real: calibration and trial processes,
the memory model against each trial's measured peak, the winner's flagfile
run by tfdist-train, and a budget too small (exit 2, one line). `slow`:
each plan starts 6-10 processes (about half a minute on 2 cores; the
engines' runtimes and dtensor's probes are measured once per session, in
its shared cache, by the first: about 5 minutes more on 2 cores)."""

import json
import os
import subprocess

import pytest

from conftest import BIN, REPO, run_cli

GiB, MiB = 2**30, 2**20
# The memory rule: within 15% where the predicted bytes above the process's
# runtime are at least 1 GiB, else within 150 MiB (a small model's peak is
# mostly TensorFlow's own, whose run-to-run spread is tens of MiB).
SMALL_MIB = 150


def _within_rule(predicted_gib, measured_gib, runtime_bytes):
    above = predicted_gib * GiB - runtime_bytes
    allowed = 0.15 * predicted_gib * GiB if above >= GiB else SMALL_MIB * MiB
    return abs(predicted_gib - measured_gib) * GiB <= allowed


def _plan(args, cwd, timeout=600):
    return subprocess.run([os.path.join(BIN, "tfdist-plan"), *args], cwd=cwd,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(1260)   # the session's first plan also measures the host (477 s in all, Zen 4)
def test_a_users_subclassed_model_is_planned_by_measurement(tmp_path):
    """The Python API on a model and data tfdist did not build: trials of
    each engine, the winner the fastest measured, every tried candidate's
    predicted peak within the memory rule of its measured peak."""
    script = os.path.join(REPO, "tests", "plan_user_model.py")
    done = subprocess.run([os.path.join(BIN, "python"), script, "4", "150"], cwd=tmp_path,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
                          capture_output=True, text=True, timeout=1200)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PLAN ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    plan = json.loads(lines[-1][len("PLAN "):])
    # One device's candidates are measured by the calibration runs themselves
    # (their peak only where the run was its process's first): a trial each.
    tried = [r for r in plan["rows"]
             if r["status"] in ("chosen", "tried", "measured in calibration")]
    assert len(tried) >= 3, plan["rows"][:6]
    assert len({r["candidate"].split()[0] for r in tried}) >= 3   # engines, not variants
    chosen = [r for r in tried if r["status"] == "chosen"]
    assert chosen == [max(tried, key=lambda r: r["measured_examples_per_sec"])]
    for row in tried:
        if row["measured_gib"] is not None or row["measured_by"] != "calibration":
            assert _within_rule(row["predicted_gib"], row["measured_gib"],
                                plan["runtime"][row["candidate"]]), row
    # A subclassed model has no graph to split: no pipeline candidate, and why.
    assert not any(r["candidate"].startswith("pipeline") for r in plan["rows"])
    assert all(isinstance(reason, str) for reason in plan["splits"].values())


@pytest.mark.integration
@pytest.mark.slow
def test_the_winner_is_a_flagfile_tfdist_train_runs(tmp_path, prepared_data_dir):
    run = [f"--data_dir={prepared_data_dir}", "--model=mlp", "--model_width=64",
           "--global_batch_size=64"]
    planned = _plan([*run, "--plan_trials=2", "--search_seconds=120",
                     f"--plan_file={tmp_path / 'plan.cfg'}", "--explain"], tmp_path)
    assert planned.returncode == 0, planned.stderr[-3000:] + planned.stdout[-2000:]
    chose = [line for line in planned.stdout.splitlines() if " chose " in line]
    assert len(chose) == 1 and "wrote" in chose[0], planned.stdout[-2000:]
    assert "time per step, predicted" in planned.stdout        # --explain
    flags = (tmp_path / "plan.cfg").read_text().split()
    engine = next(f.split("=", 1)[1] for f in flags if f.startswith("--strategy="))
    assert chose[0].split(" chose ")[1].startswith(engine)
    trained = run_cli([f"--flagfile={tmp_path / 'plan.cfg'}", "--train_steps=4",
                       "--steps_per_loop=2"], cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    summary = json.loads(trained.stdout.strip().splitlines()[-1])
    assert summary["strategy"] == engine
    for name in ("precision", "global_batch_size"):
        assert f"--{name}={summary[name]}" in flags


@pytest.mark.integration
@pytest.mark.slow
def test_a_budget_no_candidate_fits_exits_2_in_one_line(tmp_path, prepared_data_dir):
    planned = _plan([f"--data_dir={prepared_data_dir}", "--model=mlp", "--model_width=64",
                     "--global_batch_size=64", "--memory_budget=64M",
                     f"--plan_file={tmp_path / 'plan.cfg'}"], tmp_path)
    assert planned.returncode == 2, planned.stderr[-3000:]
    errors = [line for line in planned.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--memory_budget=" in errors[0] and "MiB more" in errors[0], \
        planned.stderr[-2000:]
    assert not (tmp_path / "plan.cfg").exists()


def _summary(stdout):
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_strategy_auto_plans_once_reuses_the_plan_on_one_host_and_a_cluster_and_replans(
        tmp_path, prepared_data_dir):
    """tfdist-train --strategy=auto: the first run plans and runs the winner,
    the same run again (another length, another directory) reuses the plan,
    a cluster's workers each take the plan made for its size, and a plan made
    by another tfdist is not reused (the log says why) but made again."""
    from tfdist.planner import auto
    run = [f"--data_dir={prepared_data_dir}", "--strategy=auto", "--model=mlp",
           "--model_width=48", "--global_batch_size=64", "--steps_per_loop=2",
           "--plan_trials=2", "--search_seconds=90"]
    first = run_cli([*run, "--train_steps=4", f"--model_dir={tmp_path / 'a'}"], timeout=400)
    assert first.returncode == 0, first.stderr[-3000:]
    summary = _summary(first.stdout)
    plan = summary["plan"]
    assert not plan["reused"] and f"planning {plan['key']}" in first.stderr
    assert summary["strategy"] == plan["chosen"].split()[0] and summary["steps"] == 4
    record = auto.read(plan["path"])
    assert record["describe"] == plan["chosen"] and record["flagfile"]
    with open(tmp_path / "a" / "summary.json") as f:
        assert json.load(f)["plan"] == plan

    again = run_cli([*run, "--train_steps=2", f"--model_dir={tmp_path / 'b'}"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert _summary(again.stdout)["plan"] == {**plan, "reused": True}
    assert "calibration" not in again.stderr and f"reusing the plan {plan['key']}" in again.stderr

    # The plan for two processes, as a chief would have written it: every worker takes it.
    what = {**record["what"], "processes": 2}
    two = auto.cache_path(auto.key_of(what))
    auto.write(two, {**record, "what": what, "engine": "multi_worker",
                     "options": {"jit_compile": "off"}, "describe": "multi_worker"})
    launched = subprocess.run(
        [os.path.join(BIN, "tfdist-launch"), "--workers=2", "--", os.path.join(BIN, "tfdist-train"),
         *run, "--train_steps=2"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert launched.stderr.count("reusing the plan") == 2     # both workers
    cluster = _summary(launched.stdout.replace("[worker 0] ", ""))
    assert cluster["strategy"] == "multi_worker" and cluster["workers"] == 2

    auto.write(plan["path"], {**record, "where": {**record["where"], "tfdist": "0.0.9"}})
    stale = run_cli([*run, "--train_steps=2", f"--model_dir={tmp_path / 'c'}"], timeout=400)
    assert stale.returncode == 0, stale.stderr[-3000:]
    assert f"the cached plan {plan['key']} is not reused: it was made with tfdist '0.0.9'" \
        in stale.stderr and "planning again" in stale.stderr
    assert not _summary(stale.stdout)["plan"]["reused"]
    assert auto.read(plan["path"])["where"]["tfdist"] != "0.0.9"   # written anew
