"""Initial values of sharded variables made shard by shard, equal to one
device's draw.

A Keras random initializer (normal, uniform, truncated normal and the
variance-scaling family built on them) draws its whole value with one
stateless Philox op from one seed. TensorFlow's Philox ops are element-wise in
the generator's counter: element `i` of a draw comes from counter group
`i // per` (`per` elements per group, `counters` counter steps per group:
1 for normal and uniform, 256 reserved for truncated normal's rejection
loop). So a slice of the whole draw is the same op on the slice's length with
the counter advanced to the slice's first group. Each device's shard of a
variable is drawn so, as one run per row segment where the shard is not
contiguous, and packed onto the mesh: the shards equal one device's values bit
for bit and no process makes a whole variable.

`per` and `counters` are measured once per (distribution, dtype) against
TensorFlow's own whole draw, together with the arithmetic (`x * stddev +
mean`) on a small non-contiguous shard; where they do not reproduce it, or an
initializer is not element-wise (orthogonal, identity, a user's callable,
zeros), the whole value is made on the host one variable at a time and sliced
(`ShardedInit.made_whole` names the large ones).
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import keras
import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.experimental import dtensor

from tfdist import compat

# A shard whose rows are not contiguous is drawn as one run per row segment;
# beyond this many runs the whole value is drawn once and sliced.
MAX_RUNS = 256

_RAW = {
    "normal": tf.raw_ops.StatelessRandomNormalV2,
    "uniform": tf.raw_ops.StatelessRandomUniformV2,
    "truncated_normal": tf.raw_ops.StatelessTruncatedNormalV2,
}


def blocks(layout, shape: Sequence[int]) -> list:
    """[(offsets, sizes)] of each of this process's devices' shards of a
    tensor of `shape` under `layout`, in `layout.mesh.local_devices()` order."""
    mesh = layout.mesh
    names = list(mesh.dim_names)
    found = []
    for device_id in mesh.local_device_ids():
        where = mesh.device_location(device_id)
        offsets, sizes = [], []
        for dim, axis in zip(shape, layout.sharding_specs):
            if axis == dtensor.UNSHARDED or axis not in names:
                offsets.append(0)
                sizes.append(int(dim))
                continue
            count = mesh.dim_size(axis)
            size = int(dim) // count
            offsets.append(where[names.index(axis)] * size)
            sizes.append(size)
        found.append((tuple(offsets), tuple(sizes)))
    return found


def _finish(kind: str, rnd, dtype, kwargs):
    """TensorFlow's `stateless_*` arithmetic on the raw draw `rnd`
    (tensorflow/python/ops/stateless_random_ops.py)."""
    if kind == "uniform":   # Keras casts the bounds first (keras random.uniform)
        low = tf.cast(kwargs.get("minval", 0.0), dtype)
        high = tf.cast(kwargs.get("maxval", 1.0), dtype)
        return tf.add(rnd * (high - low), low)
    mean = tf.convert_to_tensor(kwargs.get("mean", 0.0), dtype=dtype)
    stddev = tf.convert_to_tensor(kwargs.get("stddev", 1.0), dtype=dtype)
    return tf.add(rnd * stddev, mean)


def _philox(seed):
    """The Philox key, counter and algorithm of a stateless draw from `seed`,
    the counter as two Python ints: a block's runs each advance it on the host,
    not with a chain of eager ops per run (the shards of a column-sharded
    matrix are one run per row)."""
    key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(seed=seed)
    return key, [int(c) for c in counter.numpy()], tf.raw_ops.StatelessRandomGetAlg()


def _draw_range(kind: str, philox, dtype, start: int, length: int, grouping):
    """Elements [start, start + length) of the flat whole draw."""
    per, counters = grouping
    key, (low, high), alg = philox
    group, skip = divmod(start, per)
    advanced = low + group * counters
    if advanced >= 1 << 64:
        raise tf.errors.InvalidArgumentError(None, None, "Philox counter overflow")
    count = -(-(skip + length) // per) * per
    rnd = _RAW[kind](shape=[count], key=key, counter=tf.constant([advanced, high], tf.uint64),
                     alg=alg, dtype=dtype)
    return tf.slice(rnd, [skip], [length])


def _draw_block(kind: str, seed, dtype, shape, offsets, sizes, grouping, kwargs):
    """The block `offsets`/`sizes` of the whole draw of `shape`, or None where
    it would take more than `MAX_RUNS` runs."""
    split = [d for d in range(len(shape)) if sizes[d] < shape[d]]
    if not split:
        flat = _draw_range(kind, _philox(seed), dtype, 0, math.prod(shape), grouping)
        return _finish(kind, tf.reshape(flat, shape), dtype, kwargs)
    first = split[0]
    trailing = math.prod(shape[first + 1:])
    runs = math.prod(shape[:first])
    if runs > MAX_RUNS:
        return None
    run_length = sizes[first] * trailing
    philox = _philox(seed)
    pieces = [_draw_range(kind, philox, dtype,
                          (p * shape[first] + offsets[first]) * trailing, run_length, grouping)
              for p in range(runs)]
    rows = tf.reshape(tf.concat(pieces, 0), [*shape[:first], sizes[first], *shape[first + 1:]])
    begin = [0] * (first + 1) + list(offsets[first + 1:])
    size = [*shape[:first], sizes[first], *sizes[first + 1:]]
    return _finish(kind, tf.slice(rows, begin, size), dtype, kwargs)


@functools.lru_cache(maxsize=None)
def grouping(kind: str, dtype_name: str) -> Optional[tuple]:
    """(elements per Philox group, counter steps per group) for drawing
    `kind` in `dtype`, measured against TensorFlow's whole draw together with
    a non-contiguous block; None if no candidate reproduces it."""
    dtype = tf.as_dtype(dtype_name)
    seed = tf.constant([1234, 5678], tf.int32)
    kwargs = {"minval": -0.7, "maxval": 0.3} if kind == "uniform" else \
        {"mean": 0.25, "stddev": 0.3}
    shape = (3, 5, 12)
    whole = _whole(kind, shape, dtype, seed, kwargs).numpy()
    for per in (4, 2, 1, 8):
        for counters in (1, 2, 4, 256, 128, 512):
            try:
                ok = all(np.array_equal(
                    _draw_block(kind, seed, dtype, shape, offsets, sizes, (per, counters),
                                kwargs).numpy(),
                    whole[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))])
                    for offsets, sizes in (((1, 0, 0), (1, 5, 12)), ((0, 2, 3), (3, 1, 6)),
                                           ((2, 3, 5), (1, 2, 7))))
            except tf.errors.OpError:
                ok = False
            if ok:
                return per, counters
    logging.warning("Cannot draw %s %s initial values shard by shard (TensorFlow's Philox "
                    "layout differs from what tfdist measured); such variables are made whole "
                    "one at a time.", kind, dtype_name)
    return None


def _whole(kind, shape, dtype, seed, kwargs):
    """The whole draw as Keras's TensorFlow backend makes it."""
    if kind == "normal":
        return tf.random.stateless_normal(shape, seed, dtype=dtype, **kwargs)
    if kind == "truncated_normal":
        return tf.random.stateless_truncated_normal(shape, seed, dtype=dtype, **kwargs)
    return tf.random.stateless_uniform(shape, seed, dtype=dtype,
                                       **{k: tf.cast(v, dtype) for k, v in kwargs.items()})


class ShardedInit:
    """Makes the shards of Keras variables' initial values (see the module doc)."""

    def __init__(self, to_host=None):
        self.made_whole: list[tuple[str, int]] = []   # (path, elements) made whole
        # A value made on the mesh already (an optimizer slot's zeros are made
        # "colocated with" their DTensor variable) as a host tensor.
        self._to_host = to_host or (lambda value: value)

    def _host(self, value):
        return self._to_host(value) if dtensor.is_dtensor(value) else value

    def shards(self, initial_value, path: str, shape, dtype, layout) -> list:
        """This process's shards of `initial_value()` (a Keras variable's
        deferred initializer for `shape`) under `layout`, in local-device
        order."""
        shape = tuple(int(d) for d in shape)
        found = blocks(layout, shape)
        kind = _kind(compat.keras_initializer_of(initial_value))
        if kind == "constant":   # zeros, ones, a scalar constant: each shard alone
            initializer = compat.keras_initializer_of(initial_value)
            return [self._host(tf.convert_to_tensor(initializer(sizes, dtype=dtype), dtype=dtype))
                    for _, sizes in found]
        if kind is None:
            return self._sliced(initial_value, path, shape, dtype, found)
        drawn = []

        def draw(kind, original, *args, **kwargs):
            if len(args) > 1 or (args and "shape" in kwargs):
                return original(*args, **kwargs)
            requested = args[0] if args else kwargs.get("shape")
            if requested is None or tuple(int(d) for d in requested) != shape:
                return original(*args, **kwargs)
            kwargs.pop("shape", None)
            want = tf.as_dtype(kwargs.get("dtype") or keras.config.floatx())
            group = grouping(kind, want.name)
            if group is None:
                return original(shape, **kwargs)
            seed = compat.keras_seed_tensor(kwargs.get("seed"))
            parts = [_draw_block(kind, seed, want, shape, offsets, sizes, group, kwargs)
                     for offsets, sizes in found]
            if any(p is None for p in parts):
                return _whole(kind, shape, want, seed, _arithmetic(kind, kwargs))
            drawn.append(kind)
            return tf.stack(parts)

        replacements = {kind: functools.partial(draw, kind) for kind in compat.KERAS_RANDOM_DRAWS}
        with compat.keras_random_draws(replacements):
            value = tf.convert_to_tensor(initial_value(), dtype=dtype)
        local = found[0][1]
        if drawn and tuple(value.shape) == (len(found), *local):
            return tf.unstack(value)
        return self._sliced(lambda: value, path, shape, dtype, found)

    def _sliced(self, initial_value, path, shape, dtype, found) -> list:
        """The whole value, made here, sliced into the shards."""
        value = self._host(tf.convert_to_tensor(initial_value(), dtype=dtype))
        if tuple(value.shape) != shape:
            raise ValueError(f"the initializer of {path} made shape {tuple(value.shape)}, "
                             f"not {shape}")
        size = math.prod(shape)
        if size > 1 << 16:
            self.made_whole.append((path, size))
        return [tf.slice(value, offsets, sizes) for offsets, sizes in found]

    def report(self) -> Optional[str]:
        """One line naming the large variables that were made whole, or None."""
        if not self.made_whole:
            return None
        names = ", ".join(f"{p} ({n:,} elements)" for p, n in self.made_whole[:8])
        more = f" and {len(self.made_whole) - 8} more" if len(self.made_whole) > 8 else ""
        return (f"{len(self.made_whole)} sharded variable(s) were made whole one at a time "
                f"before being split (their initializers are not element-wise random draws): "
                f"{names}{more}")


def _kind(initializer) -> Optional[str]:
    """"random" for Keras's element-wise random initializers (their own
    `__call__`, not a subclass's), "constant" for zeros, ones and a scalar
    constant, else None (made whole)."""
    inits = keras.initializers
    if initializer is None:
        return None
    call = type(initializer).__call__
    if call in (inits.RandomNormal.__call__, inits.RandomUniform.__call__,
                inits.TruncatedNormal.__call__, inits.VarianceScaling.__call__):
        return "random"
    if call in (inits.Zeros.__call__, inits.Ones.__call__):
        return "constant"
    if call is inits.Constant.__call__ and np.ndim(initializer.value) == 0:
        return "constant"
    return None


def _arithmetic(kind, kwargs):
    keys = ("minval", "maxval") if kind == "uniform" else ("mean", "stddev")
    return {k: kwargs[k] for k in keys if k in kwargs}
