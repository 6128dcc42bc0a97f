"""Gradient compression: cast gradients to 16 bits for the cross-replica sum.

Halves the bytes every update moves between replicas (the cost that grows
with model size and workers), at the price of rounding each replica's
gradient to fp16 (10-bit mantissa, overflow above 65504) or bf16 (7-bit
mantissa, fp32's range). Gradients are cast back to the variables' dtype
before the optimizer sees them. Works under every strategy because it wraps
the adapter's one reduction; under Horovod it is the same cast Horovod's own
`Compression.fp16` does.
"""

from __future__ import annotations

import tensorflow as tf

_DTYPES = {"none": None, "fp16": tf.float16, "bf16": tf.bfloat16}


class GradientCompression:
    def __init__(self, name: str = "none"):  # validated by TrainConfig
        self.name = name
        self.dtype = _DTYPES[name]

    def compress(self, grads):
        if self.dtype is None:
            return list(grads)
        return [tf.cast(g, self.dtype) if g.dtype.is_floating else g for g in grads]

    def decompress(self, grads, variables):
        if self.dtype is None:
            return list(grads)
        return [tf.cast(g, v.dtype) for g, v in zip(grads, variables)]

    def bytes_per_update(self, variables) -> int:
        """Bytes of gradients one replica contributes to each update's reduction."""
        total = 0
        for v in variables:
            dtype = tf.as_dtype(v.dtype)
            size = (self.dtype or dtype).size if dtype.is_floating else dtype.size
            total += int(tf.reduce_prod(v.shape)) * size
        return total
