"""The house rules that code review alone would let slip (DESIGN.md), checked
on the source: private upstream names only in tfdist/compat/, no engine-name
compares outside the engines, short functions in the training loop. Each
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
MAX_TRAINING_FUNCTION_LINES = 50


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


def long_functions(path, text, limit=MAX_TRAINING_FUNCTION_LINES):
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


def test_training_functions_are_short():
    found = [f for path, text in _sources("tfdist/training/*.py")
             for f in long_functions(path, text)]
    assert found == []
    sample = "def long():\n" + "    x = 1\n" * MAX_TRAINING_FUNCTION_LINES
    assert long_functions("sample.py", sample)
