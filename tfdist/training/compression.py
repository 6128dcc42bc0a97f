"""Gradient compression: how one update's gradients cross the replicas.

Every replica holds its share of the global gradient (`Trainer`'s scaling:
the shares add up to it); an exchange turns the shares into their sum on
every replica.

- `none`, `fp16`, `bf16` (`Cast`): gradients cast to 16 bits for the one
  cross-replica sum and back after: half the bytes, each replica's share
  rounded (fp16: 10-bit mantissa, overflow above 65504; bf16: 7-bit mantissa,
  fp32's range). Stateless; under Horovod the same cast as its
  `Compression.fp16`; works under every engine.
- `powersgd` (`PowerSGD`, Vogels et al. 2019): each matrix's sum sent as
  rank-r factors P [n, r] and Q [m, r] (a tensor of more than 2 dimensions
  as the most nearly square matrix, `matrices.matrix_shape`) in two all-reduces,
  with error feedback and Q warm-started from the last update; a matrix its
  factors would not make `min_compression` times smaller is summed whole.
- `topk` (`TopK`, deep gradient compression, Lin et al. 2018): each replica
  sends the largest `fraction` of each matrix's entries (values and indices,
  all-gathered), keeps the rest as error feedback, and with momentum SGD
  accumulates momentum locally (momentum correction and factor masking).

1-D tensors (biases, norms' scales) are small: the stateful exchanges send
them uncompressed, in the all-reduce that also carries the step's counters.
The error feedback and PowerSGD's Q are per replica (`ReplicaLocalState`):
every process saves its replicas' copies beside each checkpoint
(`checkpointing.ReplicaState`), so a resumed run continues exactly. With
accumulation the exchange happens once per update, on the summed micro-batches.
"""

from __future__ import annotations

import math
import weakref
from typing import Callable, Optional

import keras
import tensorflow as tf
from absl import logging

from tfdist.errors import UsageError
from tfdist.matrices import matrix_shape
from tfdist.strategies.capabilities import (ElasticMembership, ReplicaLocalState,
                                            capability, require)
from tfdist.training import batchnorm, optimizers

CASTS = {"none": None, "fp16": tf.float16, "bf16": tf.bfloat16}
STATEFUL = ("powersgd", "topk")

# Deep gradient compression's warm-up: the density falls exponentially in
# four equal stages (25%, 6.25%, 1.56%, 0.39%) before reaching the target.
WARMUP_STAGES = 4
WARMUP_START = 0.25


class Cast:
    """none/fp16/bf16: the trainer's one reduction, in another dtype."""

    stateful = False
    state_variables = ()

    def boundaries(self) -> list:
        """Global steps at which a loop must end because the exchange changes
        there (top-k's warm-up stages); its loops are traced per `loop_key`."""
        return []

    def loop_key(self, step: int):
        """What the exchange's trace depends on for a loop from global `step`."""
        return None

    def __init__(self, name: str = "none"):
        self.name = name
        self.dtype = CASTS[name]

    def compress(self, grads):
        if self.dtype is None:
            return list(grads)
        return [tf.cast(g, self.dtype) if g.dtype.is_floating else g for g in grads]

    def decompress(self, grads, variables):
        if self.dtype is None:
            return list(grads)
        return [tf.cast(g, v.dtype) for g, v in zip(grads, variables)]

    def bytes_per_update(self, variables) -> int:
        """Bytes of gradients one replica contributes to each update's exchange."""
        total = 0
        for v in variables:
            dtype = tf.as_dtype(v.dtype)
            size = (self.dtype or dtype).size if dtype.is_floating else dtype.size
            total += _elements(v) * size
        return total


def _elements(variable) -> int:
    return int(math.prod(variable.shape))


def bytes_of(variable) -> int:
    return _elements(variable) * tf.as_dtype(variable.dtype).size


def _name(variable) -> str:
    return getattr(variable, "path", None) or variable.name


class StatefulExchange:
    """Base of the exchanges that keep per-replica state (see module doc).

    `build(state)` makes the state with the engine's `ReplicaLocalState`
    (eagerly, before the step is traced); `exchange` runs in replica context.
    """

    stateful = True
    name = ""
    boundaries = Cast.boundaries
    loop_key = Cast.loop_key

    def __init__(self, variables):
        self.variables = list(variables)
        self.compressed = [i for i, v in enumerate(self.variables) if matrix_shape(v.shape)]
        self.dense = [i for i, v in enumerate(self.variables) if not matrix_shape(v.shape)]
        self.state_variables: list = []

    def bytes_per_update(self, variables) -> int:
        del variables
        return self._compressed_bytes() + sum(
            _elements(self.variables[i]) * tf.as_dtype(self.variables[i].dtype).size
            for i in self.dense)

    def _compressed_bytes(self) -> int:
        raise NotImplementedError

    def exchange(self, grads, extra, counters, *, replicas: int, reduce: Callable,
                 gather: Callable):
        """(the summed `grads`, the summed `extra` (sent uncompressed), the
        summed `counters`). `reduce` is the adapter's all-reduce (one call,
        one reduction), `gather` its all-gather."""
        raise NotImplementedError

    @staticmethod
    def _keep_if(finite, new, old):
        """`new` where the step was finite, else `old`: a skipped non-finite step
        (--on_nonfinite=skip) must not poison the error feedback."""
        return tf.where(finite, new, old)


class PowerSGD(StatefulExchange):
    """Rank-`rank` PowerSGD with error feedback and warm start (module doc).

    Per replica i and matrix: M_i = g_i + e_i; P = sum_i M_i Q (all-reduce);
    P^ = an orthonormal basis of P's columns (a Householder QR: float32
    Gram-Schmidt loses orthogonality, and a full-rank approximation must be
    exact); Q = sum_i M_i^T P^ (all-reduce); the sum is P^ Q^T, and
    e_i = M_i - P^ Q^T / R (the shares of the error add up to sum M - P^ Q^T,
    PowerSGD's error of the mean, in the trainer's units of a sum). Q is kept
    for the next update (warm start). At rank = min(n, m) P^ P^T is the
    projection onto the column space of sum M, so the sum is exact.

    With `warmup_updates` W, the first W global steps sum the gradients
    uncompressed (PyTorch's `start_powerSGD_iter`: low-rank updates from the
    first step slow early training down); a loop ends at step W, and each
    phase is its own trace.
    """

    name = "powersgd"

    def __init__(self, variables, rank: int, seed: int, *, warmup_updates: int = 0,
                 min_compression: float = 0.0):
        super().__init__(variables)
        self.rank, self.seed, self.warmup_updates = rank, seed, warmup_updates
        self._compressing = not warmup_updates
        # A matrix whose factors would not be `min_compression` times smaller
        # than it is summed whole (PyTorch's min_compression_rate).
        small = [i for i in self.compressed
                 if math.prod(matrix_shape(self.variables[i].shape))
                 < min_compression * rank * sum(matrix_shape(self.variables[i].shape))]
        if small and len(small) == len(self.compressed):
            raise UsageError(
                f"--grad_compression=powersgd --powersgd_rank={rank} compresses none of the "
                f"model's matrices: none is {min_compression:g}x larger than its rank-{rank} "
                "factors (--powersgd_min_compression); use a lower --powersgd_rank or "
                "--powersgd_min_compression")
        self.compressed = [i for i in self.compressed if i not in small]
        self.dense = sorted(self.dense + small)
        for i in self.compressed:
            n, m = matrix_shape(self.variables[i].shape)
            if rank > min(n, m):
                raise UsageError(
                    f"--powersgd_rank={rank} is larger than the smaller dimension "
                    f"({min(n, m)}) of {_name(self.variables[i])} "
                    f"{list(self.variables[i].shape)} (as a {n}x{m} matrix); use "
                    f"--powersgd_rank <= {min(n, m)}")

    def _compressed_bytes(self) -> int:
        return sum(sum(matrix_shape(self.variables[i].shape)) * self.rank *
                   tf.as_dtype(self.variables[i].dtype).size for i in self.compressed)

    def boundaries(self) -> list:
        return [self.warmup_updates] if self.warmup_updates else []

    def loop_key(self, step: int):
        self._compressing = step >= self.warmup_updates
        return self._compressing

    def build(self, state) -> None:
        self.errors, self.qs = {}, {}
        for i in self.compressed:
            variable = self.variables[i]
            n, m = matrix_shape(variable.shape)
            dtype = tf.as_dtype(variable.dtype)
            self.errors[i] = state.replica_variable(
                tf.zeros([n, m], dtype), name=f"powersgd_error_{i}")
            # The same initial Q on every replica (a seeded stateless draw):
            # sum_i M_i Q needs one Q.
            self.qs[i] = state.replica_variable(
                tf.random.stateless_normal([m, self.rank], seed=[self.seed, i], dtype=dtype),
                name=f"powersgd_q_{i}")
        self.state_variables = [v for i in self.compressed for v in (self.errors[i], self.qs[i])]

    def exchange(self, grads, extra, counters, *, replicas, reduce, gather):
        del gather
        if not self._compressing:   # the warm-up: one plain sum
            summed = reduce(list(grads) + list(extra) + [counters])
            return summed[:len(grads)], summed[len(grads):-1], summed[-1]
        matrices = {i: tf.reshape(grads[i], matrix_shape(self.variables[i].shape)) +
                    self.errors[i].read_value() for i in self.compressed}
        qs = {i: self.qs[i].read_value() for i in self.compressed}
        ps = [tf.matmul(matrices[i], qs[i]) for i in self.compressed]
        dense = [grads[i] for i in self.dense]
        first = reduce(ps + dense + list(extra) + [counters])
        ps, first = first[:len(ps)], first[len(ps):]
        dense, first = first[:len(dense)], first[len(dense):]
        extra, counters = first[:-1], first[-1]
        bases = [tf.linalg.qr(p, full_matrices=False)[0] for p in ps]
        new_qs = reduce([tf.matmul(matrices[i], basis, transpose_a=True)
                         for i, basis in zip(self.compressed, bases)])
        finite = tf.reduce_all(tf.math.is_finite(counters))
        out = list(grads)
        updates = []
        for i, basis, q in zip(self.compressed, bases, new_qs):
            approx = tf.matmul(basis, q, transpose_b=True)
            error = matrices[i] - approx / tf.cast(replicas, approx.dtype)
            updates.append(self.errors[i].assign(
                self._keep_if(finite, error, self.errors[i].read_value())))
            updates.append(self.qs[i].assign(self._keep_if(finite, q, qs[i])))
            out[i] = tf.reshape(approx, self.variables[i].shape)
        for i, value in zip(self.dense, dense):
            out[i] = value
        with tf.control_dependencies(updates):
            out = [tf.identity(g) for g in out]
        return out, list(extra), counters


class TopK(StatefulExchange):
    """Top-k sparsification with error feedback (deep gradient compression).

    Per replica and matrix: v += g (or, with `momentum` m > 0, u = m u + g,
    v += u: momentum correction); the k = ceil(fraction x size) entries of v
    largest in magnitude are sent (values and flat indices, every matrix's in
    one all-gather) and v (and u: factor masking) are zeroed there; what is
    not sent stays in v for later updates. Every replica adds up the gathered
    entries (duplicates add), so all hold the same sparse sum. With
    `warmup_updates` W, the density falls from 25% in four equal stages of
    global steps (DGC's exponential warm-up) to `fraction` at step W; loops
    end at the stages' boundaries and are traced per stage, so every count
    sent is a constant of its trace (an all-gather of tensors whose size is
    known only at run time failed across processes: "Shape mismatch in the
    collective instance"). At fraction 1 every entry is sent and the sum is exact.

    The momentum the optimizer would have applied moves here (`move_momentum`):
    DGC assumes momentum SGD. Under Adam (or any optimizer without a plain
    momentum) there is no momentum correction: plain error feedback, and the
    optimizer's moments see the sparse sum.
    """

    name = "topk"

    def __init__(self, variables, fraction: float, *, warmup_updates: int = 0,
                 momentum: float = 0.0):
        super().__init__(variables)
        self.fraction, self.warmup_updates, self.momentum = fraction, warmup_updates, momentum
        self.sizes = [_elements(self.variables[i]) for i in self.compressed]
        if any(size >= 2 ** 31 for size in self.sizes):
            raise UsageError("--grad_compression=topk sends int32 indices: a tensor of "
                             f"{max(self.sizes)} entries is too large")

        self._density = self.density_at(0)

    def k(self, size: int, density: float = None) -> int:
        return max(1, min(size, math.ceil(size * (density or self.fraction))))

    def density_at(self, step: int) -> float:
        """The share sent at global `step` (DGC's warm-up, then `fraction`)."""
        if step >= self.warmup_updates:
            return self.fraction
        stage = step * WARMUP_STAGES // self.warmup_updates
        return max(self.fraction, WARMUP_START ** (stage + 1))

    def boundaries(self) -> list:
        return sorted({math.ceil(stage * self.warmup_updates / WARMUP_STAGES)
                       for stage in range(1, WARMUP_STAGES + 1)} - {0}) \
            if self.warmup_updates else []

    def loop_key(self, step: int):
        self._density = self.density_at(step)
        return self._density

    def _compressed_bytes(self) -> int:
        return sum(self.k(size) * 8 for size in self.sizes)   # fp32 value + int32 index

    def build(self, state) -> None:
        self.accumulated, self.velocity = {}, {}
        for i, size in zip(self.compressed, self.sizes):
            self.accumulated[i] = state.replica_variable(tf.zeros([size], tf.float32),
                                                         name=f"topk_error_{i}")
            if self.momentum:
                self.velocity[i] = state.replica_variable(tf.zeros([size], tf.float32),
                                                          name=f"topk_momentum_{i}")
        self.state_variables = [*self.accumulated.values(), *self.velocity.values()]

    def exchange(self, grads, extra, counters, *, replicas, reduce, gather):
        dense = reduce([grads[i] for i in self.dense] + list(extra) + [counters])
        dense, extra, counters = dense[:len(self.dense)], dense[len(self.dense):-1], dense[-1]
        finite = tf.reduce_all(tf.math.is_finite(counters))
        values, indices, states, offset = [], [], [], 0
        for i, size in zip(self.compressed, self.sizes):
            k = self.k(size, self._density)
            g = tf.cast(tf.reshape(grads[i], [-1]), tf.float32)
            velocity = None
            if self.momentum:
                velocity = self.momentum * self.velocity[i].read_value() + g
                accumulated = self.accumulated[i].read_value() + velocity
            else:
                accumulated = self.accumulated[i].read_value() + g
            _, top = tf.math.top_k(tf.abs(accumulated), k=k, sorted=False)
            values.append(tf.gather(accumulated, top))
            indices.append(top + offset)
            states.append((i, top, accumulated, velocity))
            offset += size
        # One all-gather: [values..., indices as float32 bit patterns...].
        sent = tf.concat([tf.concat(values, 0),
                          tf.bitcast(tf.concat(indices, 0), tf.float32)], 0)
        gathered = tf.reshape(gather(sent), [replicas, 2, -1])
        all_values = tf.reshape(gathered[:, 0], [-1])
        all_indices = tf.reshape(tf.bitcast(gathered[:, 1], tf.int32), [-1, 1])
        summed = tf.scatter_nd(all_indices, all_values, [offset])
        updates = []
        for i, top, accumulated, velocity in states:
            mask = tf.reshape(top, [-1, 1])
            left = tf.tensor_scatter_nd_update(accumulated, mask, tf.zeros_like(top, tf.float32))
            updates.append(self.accumulated[i].assign(
                self._keep_if(finite, left, self.accumulated[i].read_value())))
            if velocity is not None:
                masked = tf.tensor_scatter_nd_update(velocity, mask,
                                                     tf.zeros_like(top, tf.float32))
                updates.append(self.velocity[i].assign(
                    self._keep_if(finite, masked, self.velocity[i].read_value())))
        out = list(grads)
        for i, part in zip(self.compressed, tf.split(summed, self.sizes)):
            out[i] = tf.cast(tf.reshape(part, self.variables[i].shape), grads[i].dtype)
        for i, value in zip(self.dense, dense):
            out[i] = value
        with tf.control_dependencies(updates):
            out = [tf.identity(g) for g in out]
        return out, list(extra), counters


# Optimizers whose momentum top-k's momentum correction took over (DGC applies
# momentum before sparsifying; the optimizer then steps without it).
_MOVED_MOMENTUM: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def move_momentum(name: str, optimizer) -> Optional[str]:
    """Before `optimizer` is built, under `--grad_compression=topk`: a plain
    momentum SGD's momentum moves into the exchange (momentum correction);
    its `momentum` becomes 0. Returns a line for the log, or None."""
    inner = optimizers.inner(optimizer)
    if name != "topk" or not isinstance(inner, keras.optimizers.SGD) or not inner.momentum:
        return None
    if inner.nesterov:
        return ("--grad_compression=topk: Nesterov momentum stays in the optimizer (no "
                "momentum correction, plain error feedback)")
    _MOVED_MOMENTUM[inner] = float(inner.momentum)
    inner.momentum = 0.0
    return (f"--grad_compression=topk: momentum {_MOVED_MOMENTUM[inner]:g} is applied before "
            "sparsification (DGC's momentum correction); the optimizer steps without it")


def prepare_optimizer(train_config, optimizer_name: str, optimizer, model, log: bool) -> None:
    """Before `optimizer` is built: top-k's momentum correction
    (`move_momentum`), and where `log`, what it moved and
    `accuracy_warning`."""
    moved = move_momentum(train_config.grad_compression, optimizer)
    costly = accuracy_warning(train_config, optimizer_name, model)
    if log and moved:
        logging.info("%s", moved)
    if log and costly:
        logging.warning("%s", costly)


def accuracy_warning(train_config, optimizer_name: str, model) -> Optional[str]:
    """A line where the run's compression is known to cost accuracy with its
    optimizer and model (bench/compression_accuracy.py), else None."""
    if (train_config.grad_compression != "topk" or optimizer_name == "momentum"
            or not batchnorm.layers(model)):
        return None
    return (f"--grad_compression=topk with --optimizer={optimizer_name} on a model with "
            "BatchNorm: its moving statistics lag the weights (the demo's cnn under Adam: "
            "0.884 test accuracy against 0.988 uncompressed, its weights 0.994 with the "
            "statistics re-estimated); with --optimizer=momentum top-k was within 1 point "
            "of uncompressed (bench/compression_accuracy.py)")


def create(train_config, variables, optimizer):
    """The exchange `train_config.grad_compression` names, for `variables`."""
    tc = train_config
    if tc.grad_compression == "powersgd":
        return PowerSGD(variables, tc.powersgd_rank, tc.seed,
                        warmup_updates=tc.compression_warmup_steps,
                        min_compression=tc.powersgd_min_compression)
    if tc.grad_compression == "topk":
        return TopK(variables, tc.topk_fraction, warmup_updates=tc.compression_warmup_steps,
                    momentum=_MOVED_MOMENTUM.get(optimizers.inner(optimizer), 0.0))
    return Cast(tc.grad_compression)


def check_engine(train_config, strategy) -> None:
    """`UsageError` where the run's engine cannot do its compression or local SGD."""
    tc = train_config
    what = (f"--grad_compression={tc.grad_compression}" if tc.grad_compression in STATEFUL
            else f"--sync_every={tc.sync_every}" if tc.sync_every else None)
    if what is None:
        return
    require(strategy, ReplicaLocalState, what)
    if capability(strategy, ElasticMembership):
        raise UsageError(f"{what} with --elastic: the per-replica state (error feedback, "
                         "local optimizer state) cannot follow ranks that join or leave; "
                         "drop --elastic")
