"""The house rules that code review alone would let slip (DESIGN.md), checked
on the source: private upstream names only in tfdist/compat/, no engine-name
compares outside the engines, short files and functions, the training
loop and the engines meeting only at their contract (docs/design.md). Each
check is also run on a sample that breaks it, so it is shown able to fail."""

import ast
import glob
import os
import re

from conftest import REPO
from tfdist import strategies

PRIVATE_UPSTREAM = re.compile(
    r"tensorflow\.python|keras\.src|tf\.__internal__"
    r"|(?:getattr|hasattr|setattr)\([^,]+,\s*[\"']_(?!tfdist_)[a-z]")   # _tfdist_*: ours
ENGINE_NAMES = "|".join(strategies.names())   # the registry's, pipeline included
ENGINE_COMPARE = re.compile(rf"(==|!=|\bin)\s*\(?[\"']({ENGINE_NAMES})[\"']"
                            rf"|[\"']({ENGINE_NAMES})[\"']\s*(==|!=)")
MAX_FUNCTION_LINES = 50
MAX_FILE_LINES = 500
CONTRACT = ("tfdist.strategies.base", "tfdist.strategies.capabilities")


def _sources(*patterns):
    for pattern in patterns:
        for path in sorted(glob.glob(os.path.join(REPO, pattern), recursive=True)):
            with open(path) as f:
                yield os.path.relpath(path, REPO), f.read()


def private_upstream_uses(path, text):
    return [f"{path}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
            if PRIVATE_UPSTREAM.search(line) and not line.lstrip().startswith("#")]


def engine_name_compares(path, text):
    return [f"{path}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
            if ENGINE_COMPARE.search(line)]


def long_functions(path, text, limit=MAX_FUNCTION_LINES):
    return [f"{path}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
            for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit]


def test_private_upstream_names_only_in_compat():
    found = [use for path, text in _sources("tfdist/**/*.py", "launch/**/*.py")
             if not path.startswith(os.path.join("tfdist", "compat") + os.sep)
             for use in private_upstream_uses(path, text)]
    assert found == []
    # Control: the check sees each kind of use.
    sample = ("from tensorflow.python.checkpoint import x\nimport keras.src.losses\n"
              "tf.__internal__.distribute.ShardedVariable\n"
              "hasattr(owner, '_initialize')\ngetattr(v, \"_value\", v)\n")
    assert len(private_upstream_uses("sample.py", sample)) == 5


def test_no_engine_name_compares_outside_the_engines():
    found = [use for path, text in _sources("tfdist/**/*.py")
             if not path.startswith(os.path.join("tfdist", "strategies"))
             for use in engine_name_compares(path, text)]
    assert found == []
    sample = ('if config.strategy.name == "dtensor":\n'
              'ok = values["strategy"] == "parameter_server"\n'
              'if name in ("horovod", "mirrored"):\n'
              'if config.strategy.name != "pipeline":\n')
    assert len(engine_name_compares("sample.py", sample)) == 4


def test_units_are_short():
    """No file over 500 lines, no function over 50, in tfdist/ and launch/."""
    sources = list(_sources("tfdist/**/*.py", "launch/**/*.py"))
    assert [f for path, text in sources for f in long_functions(path, text)] == []
    assert [path for path, text in sources if text.count("\n") > MAX_FILE_LINES] == []
    sample = "def long():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    assert long_functions("sample.py", sample)


def cross_imports(path, text):
    """Imports between the engines and the training loop (anywhere in the
    file, function-local ones included) other than the contract: the
    adapter interface and the capabilities, which `training/` may import."""
    here = path.replace(os.sep, "/")
    other = ("tfdist.training" if here.startswith("tfdist/strategies/") else
             "tfdist.strategies" if here.startswith("tfdist/training/") else None)
    found = []
    for node in ast.walk(ast.parse(text)):
        names = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                 [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        for name in names:
            if other and name.startswith(other) and name not in CONTRACT:
                found.append(f"{path}:{node.lineno}: {name}")
    return found


def test_the_training_loop_and_the_engines_meet_only_at_the_contract():
    found = [use for path, text in _sources("tfdist/training/*.py", "tfdist/strategies/**/*.py")
             for use in cross_imports(path, text)]
    assert found == []
    sample = "def f():\n    from tfdist.training.trainer import LocalGradients\n"
    assert cross_imports(os.path.join("tfdist", "strategies", "x.py"), sample)
    assert not cross_imports(os.path.join("tfdist", "training", "x.py"),
                             "from tfdist.strategies.capabilities import capability\n")
    assert cross_imports(os.path.join("tfdist", "training", "x.py"),
                         "from tfdist.strategies.pipeline import engine\n")
