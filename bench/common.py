"""Shared helpers for the benchmarks: run tfdist-train in real processes, read
the run summary (the JSON line the chief prints), print ratio tables.

Benchmarks compare configurations side by side in one invocation, because
absolute times on shared 2-core machines mean little; ratios travel better.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys

BIN = os.path.dirname(sys.executable)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(BIN, "tfdist-train")
LAUNCH = os.path.join(BIN, "tfdist-launch")
HOROVODRUN = os.path.join(BIN, "horovodrun")

# Model shapes: an FFN-heavy MLP and the small Transformer decoder.
MODELS = {
    "mlp": ["--model=mlp", "--model_width=1024", "--model_depth=3", "--dataset=tfdist_shapes"],
    "transformer": ["--model=transformer", "--model_width=128", "--model_depth=2",
                    "--dataset=tfdist_tokens"],
}


def summary(command: list[str], timeout: float = 900) -> dict:
    """Run `command`; return the run summary JSON the chief printed."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=timeout)
    if result.returncode != 0:
        sys.exit(f"benchmark run failed ({' '.join(command)}):\n{result.stderr[-3000:]}")
    for line in reversed(result.stdout.splitlines()):
        start = line.find("{")
        if start >= 0:
            return json.loads(line[start:])
    sys.exit(f"no run summary in the output of {' '.join(command)}")


def table(rows: list[list], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    line = lambda r: "  ".join(str(x).rjust(w) for x, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def markdown_table(rows: list[list], header: list[str]) -> str:
    lines = ["| " + " | ".join(map(str, header)) + " |",
             "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


RESULTS = os.path.join(REPO, "bench", "results")
# The order sections appear in the collected report.
SECTIONS = ("vs_fit", "features", "scaling", "horovod_vs_multi_worker", "dtensor")


def versions_line() -> str:
    """TensorFlow, Keras and Python versions, without importing TensorFlow."""
    from importlib import metadata
    found = []
    for dist in ("tensorflow-cpu", "tensorflow", "keras"):
        try:
            found.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(found + [f"Python {platform.python_version()}"])


def hardware_header() -> str:
    sys.path.insert(0, REPO)
    from tfdist.observe import hardware
    return (f"Hardware: {hardware.describe()}  \nSoftware: {versions_line()}")


def write_section(name: str, title: str, body: str) -> str:
    """Write `bench/results/<name>.md` (with the hardware it ran on) and rebuild
    `bench/results/report.md` from every section present; return the section."""
    os.makedirs(RESULTS, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = f"## {title}\n\nMeasured {stamp}.  \n{hardware_header()}\n\n{body}\n"
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
        f.write(section)
    parts = [f"# tfdist benchmark report\n\n{hardware_header()}\n\nEach section names the "
             "machine it ran on; sections measured on another machine say so.\n"]
    for other in SECTIONS:
        path = os.path.join(RESULTS, f"{other}.md")
        if os.path.exists(path):
            with open(path) as f:
                parts.append(f.read())
    tmp = os.path.join(RESULTS, f".report.md.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write("\n".join(parts))
    os.replace(tmp, os.path.join(RESULTS, "report.md"))
    return section


def print_row(row: list, header: list[str]) -> None:
    """One result line as soon as it is measured (benchmarks take minutes)."""
    print("  ".join(f"{h}={v}" for h, v in zip(header, row)), flush=True)
