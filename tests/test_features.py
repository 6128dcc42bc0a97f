"""Trainer features under the in-process strategies: accumulation, compression."""

import numpy as np
import pytest

from tfdist import models

from common import IMAGE_SPEC, assert_weights_close, run_config, train_from


@pytest.mark.parametrize("strategy", ["default", "mirrored"])
def test_accumulated_micro_batches_match_one_big_batch(strategy):
    big = run_config(strategy, optimizer="adam", learning_rate=0.001, batch=64)
    initial = models.build(big.model, IMAGE_SPEC).get_weights()
    one = train_from(big, initial)
    four = train_from(run_config(strategy, optimizer="adam", learning_rate=0.001, batch=64,
                                 accum_steps=4), initial)
    assert_weights_close(four.model.get_weights(), one.model.get_weights())


@pytest.mark.parametrize("strategy", ["default", "mirrored"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_compressed_gradients_stay_close_and_halve_the_bytes(strategy, dtype):
    """Documented tolerance: after 5 SGD steps, weights within 1e-3 absolute
    (fp16) / 1e-2 (bf16) of uncompressed training; the 16-bit rounding of each
    replica's gradient is the only difference."""
    base = run_config(strategy, learning_rate=0.1)
    initial = models.build(base.model, IMAGE_SPEC).get_weights()
    plain = train_from(base, initial)
    squeezed = train_from(run_config(strategy, learning_rate=0.1, grad_compression=dtype),
                          initial)
    assert (squeezed.summary["bytes_reduced_per_update"] * 2
            == plain.summary["bytes_reduced_per_update"])
    tolerance = {"fp16": 1e-3, "bf16": 1e-2}[dtype]
    diffs = [np.abs(a - b).max() for a, b in zip(squeezed.model.get_weights(),
                                                  plain.model.get_weights())]
    assert max(diffs) < tolerance
    assert max(diffs) > 0  # the rounding really happened
