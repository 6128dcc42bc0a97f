"""`--strategy=auto`'s cached plans, in one process: what the key covers,
a plan made elsewhere is not reused (and says why), a waiting worker takes
the chief's plan once written or fails in one line, and `auto` is a valid
--strategy that is not an engine. The whole path (plan, reuse, a cluster):
tests/integration/test_plan.py."""

import glob
import os
import subprocess
import sys
import threading
import time

import keras
import pytest

from tfdist import strategies
from tfdist.errors import UsageError
from tfdist.planner import auto, profile
from common import run_config

WHERE = {"host": "AMD EPYC x2 cores; AVX2", "cores": 2, "tensorflow": "2.21.0",
         "tfdist": "0.1.0"}


def _what(config=None, signature="Functional-abc", processes=1, budget=None, lossy=False):
    return auto.what_of(config or run_config(batch=32), signature, processes, 1, budget, lossy)


def test_the_key_covers_the_model_batch_cluster_budget_and_lossy():
    base = auto.key_of(_what())
    assert auto.key_of(_what()) == base                                   # stable
    changed = [_what(signature="Functional-abd"), _what(config=run_config(batch=64)),
               _what(processes=2), _what(budget=2**30), _what(lossy=True),
               _what(config=run_config(batch=32, optimizer="adam"))]
    keys = {auto.key_of(what) for what in changed}
    assert base not in keys and len(keys) == len(changed)
    # What the search chooses is not in the key: the same run asked under
    # another engine or step count reuses the plan.
    other = run_config(batch=32, steps=999)
    other = other.replace(strategy=other.strategy.replace(name="dtensor"))
    assert auto.key_of(_what(config=other)) == base


def test_the_signature_is_the_variables_not_their_names():
    """Keras numbers auto-named layers by how many the process built before:
    the key of a model built twice stays the same; another shape changes it."""
    def build(width):
        inputs = keras.Input((8,))
        return keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(width)(inputs)))
    first, second = build(4), build(4)
    assert first.weights[0].path != second.weights[0].path    # the control: names differ
    assert profile.signature(first) == profile.signature(second)
    assert profile.signature(build(5)) != profile.signature(first)


def test_a_plan_made_elsewhere_is_not_reused_and_says_why():
    record = {"where": dict(WHERE), "engine": "default", "options": {}}
    assert auto.stale_reason(record, WHERE) is None
    for name, value in (("tfdist", "0.2.0"), ("host", "Intel Xeon x2 cores; AMX"),
                        ("tensorflow", "2.22.0")):
        reason = auto.stale_reason(record, {**WHERE, name: value})
        assert reason and name in reason and repr(value) in reason, reason


def test_a_waiting_worker_takes_the_chiefs_plan_once_written(tmp_path):
    path = str(tmp_path / "plans" / "k.json")
    record = {"where": WHERE, "engine": "multi_worker", "options": {"jit_compile": "on"}}
    writer = threading.Timer(0.3, auto.write, args=(path, record))
    writer.start()
    try:
        assert auto.wait_for(path, "k", WHERE, timeout=30)["engine"] == "multi_worker"
    finally:
        writer.cancel()


def test_a_worker_that_waits_in_vain_fails_in_one_line_naming_the_key_and_path(tmp_path):
    path = str(tmp_path / "plans" / "k.json")
    ticks = iter(range(0, 1000, 5))
    with pytest.raises(UsageError) as error:
        auto.wait_for(path, "k", WHERE, timeout=12, clock=lambda: next(ticks))
    message = str(error.value)
    assert "\n" not in message and "k" in message and path in message
    assert "TFDIST_CACHE_DIR" in message and "tfdist-plan" in message
    # A plan from another tfdist there is named too, and still not taken.
    auto.write(path, {"where": {**WHERE, "tfdist": "0.0.9"}, "engine": "default",
                      "options": {}})
    ticks = iter(range(0, 1000, 5))
    with pytest.raises(UsageError, match="0.0.9"):
        auto.wait_for(path, "k", WHERE, timeout=12, clock=lambda: next(ticks))


def test_a_worker_waits_while_the_chief_reports_progress_then_no_longer(tmp_path):
    """A chief's first plan on a host measures the host for minutes beyond
    the search's bound: a waiting worker keeps waiting while the chief's
    progress beside the plan changes, and fails `silence` s after its last
    line, quoting it. The control: the same wait without progress fails at
    `timeout`."""
    path = str(tmp_path / "plans" / "k.json")
    progress = auto.progress_of(path)
    now = [0.0]

    def clock():   # each look: 5 s; the chief writes a line at every look until 60 s
        now[0] += 5
        if now[0] <= 60:
            auto.write_text(progress, f"probe {int(now[0])}")
            os.utime(progress, ns=(int(now[0] * 1e9),) * 2)
        return now[0]
    beats = []
    with pytest.raises(UsageError) as error:
        auto.wait_for(path, "k", WHERE, timeout=12, clock=clock, silence=30,
                      beat=lambda: beats.append(now[0]))
    assert 90 <= now[0] <= 100, now[0]    # the last line (60 s) + 30 s silence
    assert "the chief's last progress: 'probe 60'" in str(error.value)
    assert beats and "\n" not in str(error.value)
    now[0] = 1000.0      # the control: no new line
    with pytest.raises(UsageError):
        auto.wait_for(path, "k", WHERE, timeout=12, clock=lambda: now.__setitem__(
            0, now[0] + 5) or now[0], silence=30)
    assert now[0] - 1000.0 <= 20


def test_progress_written_from_two_threads_at_once_is_always_one_whole_line(tmp_path):
    """The planner logs from the threads that run its probes: each write
    goes through a temporary file of its own, so none fails and the file
    always holds one whole line."""
    path = str(tmp_path / "plans" / "k.json.progress")
    failures, lines = [], [f"probe {i}/20: " + "x" * 200 for i in range(2)]

    def write(line):
        for _ in range(300):
            try:
                auto.write_text(path, line)
            except OSError as error:
                failures.append(error)
    threads = [threading.Thread(target=write, args=(line,)) for line in lines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures and open(path).read() in lines


def test_the_planning_process_is_waited_for_while_it_reports_progress(tmp_path):
    """`--strategy=auto` waits for its planning process as long as each
    line follows the last within the bound, however long the whole takes,
    and stops waiting once it falls silent (the control)."""
    progress = str(tmp_path / "progress")
    writer = ("import os, sys, time\n"
              "for i in range(int(sys.argv[2])):\n"
              "    open(sys.argv[1], 'w').write(f'line {i}'); time.sleep(0.4)\n"
              "time.sleep(float(sys.argv[3]))\n")
    busy = subprocess.Popen([sys.executable, "-c", writer, progress, "8", "0"])
    started = time.monotonic()
    auto.wait_while_progressing(busy, progress, silence=1.5)
    assert busy.returncode == 0 and time.monotonic() - started > 2.5   # longer than the bound
    silent = subprocess.Popen([sys.executable, "-c", writer, progress, "2", "60"])
    try:
        with pytest.raises(UsageError, match="no progress for 2 s after 'line 1'"):
            auto.wait_while_progressing(silent, progress, silence=1.5)
        assert silent.poll() is None     # the caller stops it
    finally:
        silent.kill()
        silent.wait()


def test_the_chief_writes_its_progress_beside_the_plan_while_planning(tmp_path, monkeypatch):
    """Each line of the chief's planning is the latest progress beside the
    plan (what the waiting workers watch) and in the parent's file; the file
    beside the plan is gone once the plan is written."""
    from tfdist import planner
    monkeypatch.setenv("TFDIST_CACHE_DIR", str(tmp_path))
    seen = []

    class Made:
        class winner:
            engine, options = "default", {}
            describe = staticmethod(lambda: "default")
            measured_rate = staticmethod(lambda: 1.0)
        runner_up = None
        flagfile = staticmethod(lambda: "")

    def fake_plan(config, log, **options):
        log("probe 1/20")
        seen.extend(open(p).read() for p in glob.glob(str(tmp_path / "plans" / "*.progress")))
        return Made
    monkeypatch.setattr(planner, "plan", fake_plan)
    parent = str(tmp_path / "parent")
    choice = auto.choose_here(run_config(batch=32), log=lambda line: None, progress=parent)
    assert seen == ["probe 1/20"]
    assert not os.path.exists(auto.progress_of(choice.path)) and os.path.exists(choice.path)
    assert open(parent).read() == "probe 1/20"


def test_auto_is_a_strategy_but_not_an_engine():
    strategies.check_name("auto")
    assert "auto" not in strategies.names()
    with pytest.raises(UsageError, match=r"valid: .*multi_worker.*, or auto"):
        strategies.check_name("bogus")


def test_json_lists_come_back_as_the_tuples_the_configuration_declares():
    assert auto._typed({"pipeline_split": ["a", "b"], "zero_stage": 1}) == {
        "pipeline_split": ("a", "b"), "zero_stage": 1}


def test_a_cluster_over_several_hosts_is_refused_in_one_line_before_any_trial(
        tmp_path, monkeypatch):
    """Trials on one host cannot measure the links between hosts: with no
    cached plan every worker stops at once, naming what to do instead."""
    import json
    monkeypatch.setenv("TFDIST_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"worker": ["localhost:12345", "otherhost:12345"]},
        "task": {"type": "worker", "index": 0}}))
    config = run_config(batch=32).replace(strategy=run_config().strategy.replace(name="auto"))
    with pytest.raises(UsageError) as error:
        auto.choose_here(config, log=lambda line: None)
    message = str(error.value)
    assert "\n" not in message and "2 hosts" in message
    assert "tfdist-plan --plan_workers=2" in message and "--link_bandwidth" in message


def test_a_cluster_over_several_hosts_is_planned_for_them_given_the_link(tmp_path, monkeypatch):
    """With --link_bandwidth the chief plans for the cluster's hosts and that
    link, and the plan's key depends on the link (the control: another rate,
    another key)."""
    import json
    from tfdist import planner
    monkeypatch.setenv("TFDIST_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"worker": ["localhost:12345", "otherhost:12345"]},
        "task": {"type": "worker", "index": 0}}))
    asked = []

    class Made:
        class winner:
            engine, options = "multi_worker", {"virtual_devices": 1}

            @staticmethod
            def describe():
                return "multi_worker"

            @staticmethod
            def measured_rate():
                return 1.0
        runner_up = None

        @staticmethod
        def flagfile():
            return ""

    def fake_plan(config, **options):
        asked.append(options)
        return Made
    monkeypatch.setattr(planner, "plan", fake_plan)
    config = run_config(batch=32).replace(strategy=run_config().strategy.replace(name="auto"))
    keys = [auto.choose_here(config, options={"link_bandwidth": rate},
                             log=lambda line: None).key for rate in (12.5e6, 1.25e9)]
    assert [(a["hosts"], a["processes"], a["link_bandwidth"]) for a in asked] == [
        (2, 2, 12.5e6), (2, 2, 1.25e9)]
    assert keys[0] != keys[1]

