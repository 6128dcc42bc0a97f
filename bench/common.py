"""Shared helpers for the benchmarks: run tfdist-train in real processes, read
the run summary (the JSON line the chief prints), print ratio tables.

Benchmarks compare configurations side by side in one invocation, because
absolute times on shared 2-core machines mean little; ratios travel better.
"""

from __future__ import annotations

import json
import os
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
