"""The "does it fit" proof at the suite's scale (bench/fits.py runs it full size).

A model whose one-process training needs more memory than a per-process cap
fails in one process under that cap (the launcher's one-line out-of-memory
message), and trains under ZeRO-3 on four processes, each under the same cap,
to the weights an uncapped process reaches from the same checkpoint. At this
scale TensorFlow's own ~0.64 GiB per process dominates, so the model's float32
state (0.87 GiB) is not 1.3x the cap as in the benchmark (4.26 GiB against
3.25 GiB, a 286M-parameter mlp): the test proves the mechanics — cgroup caps,
shard-by-shard initialisation and restore, the per-layer gathers, the collective
gather picked for a 1-D mesh in a fresh process — not the full-size margin.
"""

import importlib.util
import os

import pytest

from test_dtensor import ADAM_BOUND

# bench/fits.py, loaded by path: bench/ has a common.py of its own.
_SPEC = importlib.util.spec_from_file_location("bench_fits", os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "fits.py"))
fits = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(fits)

# 59M parameters: 0.87 GiB of float32 state with Adam. Measured (AVX-512 EPYC):
# one process from the snapshot peaks at 2.0 GiB, each of four at 1.13-1.15 GiB
# against the cap's 1.37 GiB. Eight layers, not sixteen narrower ones: DTensor's
# compile of the 4-process step grows with the layer count (80 s for the whole
# test against 108 s for 2048 x 16, whose four peaked at 1.2 GiB).
WIDTH, DEPTH = 2880, 8
CAP = "1400M"


@pytest.mark.integration
def test_four_capped_processes_train_what_one_capped_process_cannot(tmp_path):
    results = fits.prove(str(tmp_path), WIDTH, DEPTH, CAP, ["batch:4,model:1"], steps=2,
                         timeout=400, log=lambda line: None)
    cap = fits.parse_size(CAP)
    # The control: one process under the cap is stopped, with one line naming
    # the worker and the cap.
    single = results["single_capped"]
    assert single["rc"] != 0
    assert "worker 0" in single["line"] and "out of memory" in single["line"], single["line"]
    assert f"--worker_memory={CAP}" in single["line"], single["line"]
    four = results["batch:4,model:1"]
    assert four["rc"] == 0, four["line"]
    assert len(four["peaks"]) == 4 and max(four["peaks"]) < cap, four["peaks"]
    # The weights match the uncapped process's (the tolerance rules of
    # tests/test_dtensor.py: Adam's bound everywhere, at most 0.1% outside 1e-5).
    assert four["moved"] > 1e-4, "training moved the weights, so agreement means something"
    assert four["largest"] <= ADAM_BOUND
    assert four["outside"] <= max(2, four["elements"] // 1000), four
