"""Every command in the docs runs (`make doctest`).

Each ```sh and ```python block of README.md, CONTRIBUTING.md and docs/ runs
as a user would type it, from a fresh directory per page in which the
repository's configs/, launch/, examples/, bench/ and tests/ sit at those
relative paths and the installed console scripts are on PATH. Blocks of one
page share that directory and run in order (a page may train, then export).
Runs are kept small visibly, not through a hidden switch: every
`tfdist-train` command gets `--train_steps=2` as its last flag (later flags
win), and a Python block's `train_steps=N` becomes `train_steps=2`.

A block preceded by `<!-- doctest: skip: REASON -->` needs what a plain
CPU machine lacks (horovodrun, Slurm, two hosts, a GPU, root, minutes of
benchmark); it is reported as skipped with its reason (`pytest -rs`).
Output examples are ```text or ```json blocks and are not run.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import BIN, REPO

RUN_LANGUAGES = {"sh": "sh", "bash": "sh", "python": "python"}
SKIP = re.compile(r"<!--\s*doctest:\s*skip:\s*(.+?)\s*-->")
FENCE = re.compile(r"^```(\S*)\s*$")
LINKED = ("configs", "launch", "examples", "bench", "tests")
STEPS = "--train_steps=2"
BLOCK_TIMEOUT_S = 300


def doc_files() -> list[str]:
    """README.md, CONTRIBUTING.md and every page under docs/ (repo-relative)."""
    found = [name for name in ("README.md", "CONTRIBUTING.md")
             if os.path.exists(os.path.join(REPO, name))]
    for root, _, files in sorted(os.walk(os.path.join(REPO, "docs"))):
        found += sorted(os.path.relpath(os.path.join(root, f), REPO) for f in files
                        if f.endswith(".md"))
    return found


def blocks(path: str) -> list[tuple[int, str, str, str]]:
    """(line, language, code, skip reason or "") of each fenced block to run."""
    lines = open(os.path.join(REPO, path), encoding="utf-8").read().splitlines()
    out, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        start, language = i, match.group(1)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        skip = SKIP.search(before)
        if language in RUN_LANGUAGES:
            out.append((start + 1, RUN_LANGUAGES[language], "\n".join(lines[start + 1:end]),
                        skip.group(1) if skip else ""))
        i = end + 1
    return out


def small_shell(code: str) -> str:
    """`code` with `--train_steps=2` ending every tfdist-train command (a
    command ends at a shell operator, a comment or the end of its line;
    backslash continuations are joined first)."""
    joined = re.sub(r"\s*\\\n\s*", " ", code)

    def shrink(line: str) -> str:
        if "tfdist-train" not in line:
            return line
        parts = re.split(r"(\s+(?:&&|\|\||;|\||#).*$)", line, maxsplit=1)
        command, rest = parts[0], "".join(parts[1:])
        command = re.sub(r"\s--train_steps=\S+", "", command)
        return f"{command} {STEPS}{rest}"

    return "\n".join(shrink(line) for line in joined.splitlines())


def small_python(code: str) -> str:
    return re.sub(r"\btrain_steps\s*=\s*\d+", "train_steps=2", code)


def _page_dir(tmp_path_factory, worker_id, path: str) -> str:
    """The page's working directory, one per page for the whole run (the
    xdist workers' bases are under the run's)."""
    root = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        root = root.parent
    directory = os.path.join(str(root), "docs", path.replace(os.sep, "_"))
    if not os.path.isdir(directory):
        os.makedirs(directory, exist_ok=True)
        for name in LINKED:
            if os.path.exists(os.path.join(REPO, name)):
                os.symlink(os.path.join(REPO, name), os.path.join(directory, name))
    return directory


# One test per page, its blocks run in the page's order in one directory (a
# block reads what the blocks before it wrote): xdist distributes pages, not
# blocks. (pytest-xdist 3.8's `--dist loadgroup` did not keep a page's blocks
# on one worker here: its group suffix never reached the workers' node ids.)
PAGES = [pytest.param(path, id=path) for path in doc_files()
         if any(not skip for _, _, _, skip in blocks(path))]
SKIPPED = [pytest.param(path, line, skip, id=f"{path}:{line}")
           for path in doc_files() for line, _, _, skip in blocks(path) if skip]


@pytest.mark.timeout(1800)   # a page's blocks, one after another
@pytest.mark.parametrize("path", PAGES)
def test_the_page_runs(tmp_path_factory, worker_id, data_dir, path):
    """Every block of the page not marked skip, in order."""
    cwd = _page_dir(tmp_path_factory, worker_id, path)
    env = {**os.environ, "PATH": BIN + os.pathsep + os.environ.get("PATH", ""),
           "TF_CPP_MIN_LOG_LEVEL": "2", "TFDS_DATA_DIR": data_dir,
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    for line, language, code, skip in blocks(path):
        if skip:
            continue
        if language == "sh":
            command = ["bash", "-euo", "pipefail", "-c", small_shell(code)]
        else:
            command = [sys.executable, "-c", small_python(code)]
        result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                                timeout=BLOCK_TIMEOUT_S)
        assert result.returncode == 0, (
            f"{path}:{line} exited {result.returncode}\n--- ran:\n{command[-1]}\n--- stderr "
            f"(end):\n{result.stderr[-3000:]}\n--- stdout (end):\n{result.stdout[-1500:]}")


@pytest.mark.parametrize("path,line,skip", SKIPPED)
def test_a_skipped_block_says_why(path, line, skip):
    """Listed by `-rs` with its reason."""
    pytest.skip(f"{path}:{line}: {skip}")


def test_the_doc_shrinking_is_what_it_says():
    """The two rewrites, on the shapes the docs use."""
    assert small_shell("tfdist-train --flagfile=configs/demo.cfg") == \
        f"tfdist-train --flagfile=configs/demo.cfg {STEPS}"
    assert small_shell("tfdist-launch --workers=2 -- tfdist-train \\\n    --model=mlp  # two") \
        == f"tfdist-launch --workers=2 -- tfdist-train --model=mlp {STEPS}  # two"
    assert small_shell("tfdist-train --train_steps=80 --x=1 && ls runs") == \
        f"tfdist-train --x=1 {STEPS} && ls runs"
    assert small_shell("ls runs") == "ls runs"
    assert small_python("TrainConfig(train_steps=200, seed=1)") == \
        "TrainConfig(train_steps=2, seed=1)"
    shutil.which("bash") or pytest.fail("bash is needed to run the docs' shell blocks")
