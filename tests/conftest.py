"""Shared test set-up.

Virtual CPU devices must exist before TensorFlow's runtime starts, so the
whole in-process suite runs on 4 logical CPUs configured here, first:
mirrored runs use the first 2 (`virtual_devices=2`), DTensor meshes all 4.
"""

import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfdist import cluster  # noqa: E402

cluster.configure_virtual_cpus(4)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """One TFDS data_dir for the session: bundled datasets are prepared once."""
    return str(tmp_path_factory.mktemp("tfds"))


def run_cli(args, *, timeout=300, env=None, cwd=REPO):
    """Run `tfdist-train ARGS` in a fresh process; return CompletedProcess."""
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    return subprocess.run([os.path.join(BIN, "tfdist-train"), *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def run_clis(arg_lists, *, timeout=300, envs=None):
    """Run several `tfdist-train` invocations at once (each is mostly TensorFlow
    start-up, so they overlap well); return their CompletedProcess in order.
    `envs`: extra environment variables for each invocation."""
    envs = envs or [{}] * len(arg_lists)
    procs = [subprocess.Popen([os.path.join(BIN, "tfdist-train"), *args], cwd=REPO,
                              env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **env},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for args, env in zip(arg_lists, envs)]
    results = []
    for args, proc in zip(arg_lists, procs):
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            proc.kill()
        results.append(subprocess.CompletedProcess(args, proc.returncode, out, err))
    return results


def pytest_configure(config):
    config.addinivalue_line("markers", "integration: starts real processes (slower)")
