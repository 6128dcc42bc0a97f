"""Your own absl script (examples/custom_script.py) and the flags it shares with tfdist."""

import json
import os
import subprocess
import sys

import pytest
from absl import flags
from absl.testing import flagsaver

import tfdist
from tfdist import flags as tfdist_flags

from conftest import BIN, REPO

SCRIPT = os.path.join(REPO, "examples", "custom_script.py")
ARGS = ["--examples=2048", "--train_steps=120", "--global_batch_size=64"]


def _run(command, timeout=200):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _summary(stdout):
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


def test_flag_defaults_are_the_python_api_defaults():
    """One source of defaults: `tfdist-train` with no flags describes the same
    run as `tfdist.RunConfig()`, except the documented --virtual_devices."""
    with flagsaver.flagsaver():
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["tfdist-train"])
        cli = tfdist_flags.run_config()
    api = tfdist.RunConfig()
    assert cli == api.replace(strategy=api.strategy.replace(
        virtual_devices=tfdist_flags.CLI_VIRTUAL_DEVICES))


@pytest.mark.parametrize("order", ["user_first", "tfdist_first"])
def test_flag_name_clash_is_one_line_exit_2(tmp_path, order):
    mine = 'flags.DEFINE_float("learning_rate", 0.1, "my own")\n'
    theirs = "from tfdist import flags as tfdist_flags\n"
    script = tmp_path / "clash.py"
    script.write_text("from absl import flags\n" + (mine + theirs if order == "user_first"
                                                    else theirs + mine))
    result = _run([sys.executable, str(script)], timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--learning_rate is defined twice" in lines[0], lines
    assert "tfdist.flags" in lines[0] and "clash.py" in lines[0] and "rename yours" in lines[0]


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_custom_script_alone_and_under_tfdist_launch(tmp_path):
    alone = subprocess.Popen([sys.executable, SCRIPT, "--strategy=default", *ARGS,
                              f"--export_dir={tmp_path / 'export'}"], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    launched = _run([os.path.join(BIN, "tfdist-launch"), "--workers=2", "--", sys.executable,
                     SCRIPT, "--strategy=multi_worker", *ARGS])
    out, err = alone.communicate(timeout=200)
    assert alone.returncode == 0, err[-3000:]
    assert launched.returncode == 0, launched.stderr[-3000:]
    one, two = _summary(out), _summary(launched.stdout.replace("[worker 0] ", ""))
    assert one["strategy"] == "default" and two["strategy"] == "multi_worker"
    assert two["workers"] == 2 and two["steps"] == 120
    for summary in (one, two):
        assert summary["metrics"] == ["auc", "binary_accuracy"]
        assert summary["loss_function"] == "binary_crossentropy"
        assert summary["auc"] > 0.85, summary   # the rule is learnable: chance is 0.5
    assert os.path.exists(one["export"]["keras"])


def test_custom_script_bad_flag_value_is_one_line(tmp_path):
    result = _run([sys.executable, SCRIPT, "--strategy=default", "--accum_steps=3",
                   "--global_batch_size=64"], timeout=120)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if ": error:" in line]
    assert len(errors) == 1 and "--global_batch_size=64" in errors[0], result.stderr[-2000:]
