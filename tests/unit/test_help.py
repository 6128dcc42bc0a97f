"""`--help` of every console script: tfdist's flags grouped by concern, each
with its default and valid values, on stdout with exit status 0.

The group table is checked in process (a new flag without a group fails
here); each console script runs once as a subprocess (no TensorFlow, so each
takes a fraction of a second).
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest
from absl import flags

from tfdist import compare, errors
from tfdist import flags as tfdist_flags
from tfdist import help as tfdist_help
from tfdist.observe import peak

from conftest import BIN, REPO

GROUPS = ["engine and cluster", "model and data", "training", "precision and speed",
          "slow network", "faults",
          "output"]
_HEADER = re.compile(r"^([a-z][a-z ]*):$")   # "engine and cluster:"
_ENTRY = re.compile(r"^  --(?:\[no\])?(\w+)")
ABSL = {"absl": ["flagfile", "helpfull"]}   # the two absl flags every help ends with


def _run(*args, cwd=REPO):
    env = {**os.environ, "COLUMNS": "100"}
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    return subprocess.run(list(args), capture_output=True, text=True, timeout=60, cwd=cwd,
                          env=env)


def _groups(text: str) -> dict:
    """{group title: [flag names]} of a grouped help text, in order."""
    groups, title = {}, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            title = header[1]
            groups[title] = []
        elif title is not None and _ENTRY.match(line):
            groups[title].append(_ENTRY.match(line)[1])
    return groups


def _tfdist_flag_names():
    return [f.name for f in flags.FLAGS.get_flags_for_module(tfdist_flags.__name__)]


# -- the group table ------------------------------------------------------------
def test_every_tfdist_flag_is_in_exactly_one_group():
    assert list(tfdist_flags.HELP_GROUPS) == [*GROUPS, tfdist_flags.PLAN_GROUP]
    listed = [name for names in tfdist_flags.HELP_GROUPS.values() for name in names]
    assert len(listed) == len(set(listed)), "a flag is in two groups"
    assert sorted(listed) == sorted(_tfdist_flag_names())
    assert tfdist_help.ungrouped() == []


def test_a_new_flag_without_a_group_is_caught_and_still_shown():
    flags.DEFINE_integer("brand_new_knob", 3, "A flag someone forgot to group.",
                         module_name=tfdist_flags.__name__)
    try:
        assert tfdist_help.ungrouped() == ["brand_new_knob"]
        text = tfdist_help.program_help("tfdist-train")
        assert _groups(text)[tfdist_help.OTHER_GROUP] == ["brand_new_knob"]
    finally:
        delattr(flags.FLAGS, "brand_new_knob")
    assert tfdist_help.ungrouped() == []


# -- the rendered text ------------------------------------------------------------
@pytest.fixture(scope="module")
def train_help():
    """Rendered for a 101-column terminal (help wraps to the terminal's width;
    an xdist worker has none, and 80 columns would wrap the longest entries)."""
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "101"
    try:
        return tfdist_help.program_help("tfdist-train", description="Train.")
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous


def test_help_lists_each_flag_once_under_its_group(train_help):
    assert _groups(train_help) == {**{title: list(names) for title, names in
                                      tfdist_flags.HELP_GROUPS.items()}, **ABSL}


@pytest.mark.parametrize("entry", [
    "--strategy={default,dtensor,horovod,mirrored,multi_worker,parameter_server,pipeline}  "
    "[default: mirrored]",
    "--model={cnn,mlp,transformer}  [default: cnn]",
    "--optimizer={sgd,momentum,adam,adamw}  [default: adam]",
    "--virtual_devices=N  [default: 2; an integer >= 0]",
    "--model_width=N  [default: 32; an integer in [1, 2^63-1]]",
    "--label_smoothing=X  [default: 0.0; a number in [0.0, 0.999]]",
    "--momentum=X  [default: 0.9; a number]",
    "--train_steps=N  [default: unset; an integer >= 1]",
    "--metrics=A,B,...  [default: accuracy; a comma-separated list]",
    "--[no]checkpoint_input  [default: true]",
    "--mesh=TEXT  [default: batch:1,model:2]",
])
def test_entries_give_default_and_valid_values(train_help, entry):
    # an entry longer than the width goes on over its next line, indented
    assert f"\n  {entry}\n" in train_help.replace("\n      [", "  [")


def test_every_entry_has_a_default_and_its_help_text(train_help):
    lines = train_help.split("\nabsl:\n")[0].splitlines()
    for i, line in enumerate(lines):
        if _ENTRY.match(line):
            assert "[default: " in line + lines[i + 1], line
    flat = " ".join(train_help.split())
    from tfdist import strategies
    for engine in strategies.engines():   # --strategy's help is each engine's own summary
        assert f" {engine.name}: {engine.summary}." in flat, engine.name
    assert "<sgd|momentum|adam|adamw>" not in train_help   # absl's enum prefix, shown above


# -- the console scripts ------------------------------------------------------------
@pytest.fixture(scope="module")
def train_run():
    """`tfdist-train --help` once, with Python's import log on stderr."""
    return _run(sys.executable, "-X", "importtime", os.path.join(BIN, "tfdist-train"), "--help")


def test_tfdist_train_help_is_grouped_on_stdout_without_tensorflow(train_run):
    assert train_run.returncode == 0, train_run.stderr[-2000:]
    assert train_run.stdout.startswith("usage: tfdist-train [--flag=value ...]\n")
    # The planner's group too: --strategy=auto reads it.
    assert list(_groups(train_run.stdout)) == GROUPS + [tfdist_flags.PLAN_GROUP, "absl"]
    assert "Try --helpfull" not in train_run.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in train_run.stderr.splitlines()
                if line.startswith("import time:")]
    assert "tfdist.flags" in imported and "absl.flags" in imported
    assert not [m for m in imported if m.split(".")[0] in ("tensorflow", "keras")], imported
    assert [line for line in train_run.stderr.splitlines()
            if not line.startswith("import time:")] == []


@pytest.mark.parametrize("alias", ["-h", "-?", "--helpshort"])
def test_help_aliases_print_the_same(train_run, alias):
    result = _run(os.path.join(BIN, "tfdist-train"), alias)
    assert (result.returncode, result.stdout, result.stderr) == (0, train_run.stdout, "")


def test_helpfull_is_absls_full_list_with_status_0():
    result = _run(os.path.join(BIN, "tfdist-train"), "--helpfull")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    for module in ("tfdist.flags:", "absl.flags:", "absl.logging:"):
        assert f"\n{module}\n" in result.stdout
    assert "--flagfile" in result.stdout and "--[no]synthetic" in result.stdout


def test_tfdist_export_help_shows_the_flags_it_reads():
    result = _run(os.path.join(BIN, "tfdist-export"), "--help")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout.startswith("usage: tfdist-export --model_dir=DIR --export_dir=DIR\n")
    assert _groups(result.stdout) == {"output": ["model_dir", "export_dir"], **ABSL}


def test_a_user_script_shows_tfdist_groups_then_its_own(tmp_path):
    script = tmp_path / "my_train.py"
    script.write_text(textwrap.dedent('''\
        """Trains my model on my data."""
        from absl import flags
        from tfdist import app

        flags.DEFINE_integer("examples", 4096, "Examples to generate.", lower_bound=1)
        flags.DEFINE_enum("kind", "a", ["a", "b"], "Which kind.")

        if __name__ == "__main__":
            app.run(lambda argv: print("main ran"))
        '''))
    result = _run(sys.executable, str(script), "-h", cwd=tmp_path)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout.startswith("usage: my_train.py [--flag=value ...]\n\n"
                                    "Trains my model on my data.\n")
    groups = _groups(result.stdout)
    assert list(groups) == GROUPS + [tfdist_flags.PLAN_GROUP, tfdist_help.SCRIPT_GROUP, "absl"]
    assert groups[tfdist_help.SCRIPT_GROUP] == ["examples", "kind"]
    assert "  --examples=N  [default: 4096; an integer >= 1]\n" in result.stdout
    assert "  --kind={a,b}  [default: a]\n" in result.stdout
    assert "main ran" not in result.stdout


@pytest.mark.parametrize("script, groups, expected", [
    ("tfdist-launch", ["cluster", "memory", "faults"],
     ["--workers N", "[required; an integer >= 1]", "[default: 0; an integer >= 0]",
      "[default: localhost]", "Exit status:"]),
    ("tfdist-compare", ["runs", "verdict", "output"],
     ["--strategy {mirrored,multi_worker,horovod,dtensor,pipeline}", "horovod [default: 2]",
      "[default: 0.1; a number > 0]", "Exit status:"]),
    ("tfdist-peak", ["measurement"],
     ["[default: float32,bfloat16,float16]", "[default: false]"]),
])
def test_argparse_scripts_group_their_options(script, groups, expected):
    result = _run(os.path.join(BIN, script), "--help")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    titles = [m[1] for m in map(_HEADER.match, result.stdout.splitlines()) if m]
    assert titles == ["options"] + groups, titles
    flat = " ".join(result.stdout.split())
    for text in expected:
        assert text in flat, text
    # every option but -h says its default or that it is required
    options = re.findall(r"^  (--\w+)", result.stdout, re.M)
    assert options and all(
        re.search(re.escape(o) + r"\b.*?\[(default|required)", flat) for o in options)


# -- one UsageError, one line --------------------------------------------------------
def test_compare_uses_the_one_usage_error():
    assert compare.UsageError is errors.UsageError
    with pytest.raises(errors.UsageError, match="missing '--'"):
        compare.parse_args(["--strategy=mirrored"])


def test_peak_command_line_mistakes_are_one_line_and_status_2(capsys):
    for argv in (["--bogus"], ["--dtype=float64"]):
        with pytest.raises(SystemExit) as exit_info:
            peak.main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("tfdist-peak: error: "), err
