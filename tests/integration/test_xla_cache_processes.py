"""XLA executables shared between processes (tfdist/training/xla_cache.py),
in real processes: TensorFlow reads its cache flags once per process."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.integration

# One XLA-compiled function of `size`, run in a fresh process as a tfdist run
# does: the cache started before, published after. Prints its output and the
# entries it compiled (the files in its private directory that it did not
# link from the shared one).
_PROCESS = r"""
import json, os, sys
import tfdist
from tfdist.training import xla_cache
import tensorflow as tf
cache = xla_cache.start()
linked = set(os.listdir(cache.private)) if cache else set()
size = int(sys.argv[1])
f = tf.function(lambda x: tf.nn.relu(tf.matmul(x, x) - 1.0), jit_compile=True)
out = f(tf.reshape(tf.range(size * size, dtype=tf.float32) / 7.0, (size, size)))
compiled = sorted(set(os.listdir(cache.private)) - linked) if cache else None
xla_cache.publish()
print(json.dumps({"out": out.numpy().tolist(), "compiled": compiled}))
"""


def _run(size, env):
    result = subprocess.run([sys.executable, "-c", _PROCESS, str(size)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_second_process_runs_the_first_ones_executable_and_computes_the_same(tmp_path):
    env = {**os.environ, "TFDIST_CACHE_DIR": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "2",
           "TFDIST_XLA_CACHE": "1"}   # on whatever the CPU
    env.pop("TF_XLA_FLAGS", None)
    first = _run(8, env)
    assert first["compiled"], first
    second = _run(8, env)
    assert second["compiled"] == [] and second["out"] == first["out"]
    # The controls: another program compiles; with sharing off nothing is shared.
    assert _run(9, env)["compiled"]
    shared = [os.path.join(root, name) for root, _, names in os.walk(tmp_path / "xla")
              for name in names]
    off = _run(10, {**env, "TFDIST_XLA_CACHE": "0"})
    assert off["compiled"] is None and off["out"]
    assert shared == [os.path.join(root, name) for root, _, names in os.walk(tmp_path / "xla")
                      for name in names]
