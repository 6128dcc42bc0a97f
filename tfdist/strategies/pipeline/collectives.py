"""The collectives between a cross-process pipeline's workers: the boundary
tensors between neighbouring stages' workers (`Transfer`), the sum over one
stage's pipeline replicas (`StageGroup`), and over every worker of the stages
that share a layer (`SharedGroup`)."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import tensorflow as tf

from tfdist.strategies.base import by_dtype, runs_within

if TYPE_CHECKING:
    from tfdist.strategies.pipeline.engine import PipelineStrategy


class Transfer:
    """Boundary tensors between the stages of one pipeline replica across
    processes: one point-to-point group (a 2-member collective group) per
    pair of neighbouring stages, one instance per micro-batch and direction.
    The shapes come from the stage models' outputs (fixed after the batch),
    the micro-batch's rows from the labels every worker reads."""

    GROUP_BASE = 1 << 20      # far above MultiWorkerMirroredStrategy's own keys
    INSTANCE_BASE = 1 << 20
    EVAL_INSTANCE_BASE = INSTANCE_BASE + (1 << 15)   # `PipelineStrategy.forward`'s
    # `predict_through_stages`': one instance per batch size (TensorFlow keeps
    # a collective instance's shape for the life of the process)
    PREDICT_INSTANCE_BASE = EVAL_INSTANCE_BASE + (1 << 14)
    # `gather_stages`: a group of worker 0 and worker w (the first of a stage's
    # workers holding a tensor: its replica 0, or under ZeRO-1 a slot's replica)
    GATHER_GROUP_BASE = GROUP_BASE + (1 << 17)
    GATHER_INSTANCE_BASE = INSTANCE_BASE + (1 << 17)
    # `scatter_stages`: a group of worker 0 and worker w
    SCATTER_GROUP_BASE = GROUP_BASE + (1 << 18)

    def __init__(self, strategy: PipelineStrategy, replica: int, rows,
                 instance_base: int = INSTANCE_BASE):
        self._strategy = strategy
        self._replica = replica
        self._timeout = float(strategy.config.collective_timeout_s)
        self._rows = rows   # the batch's (or micro-batch's) rows
        self._instance_base = instance_base

    def _group(self, first: int) -> int:
        """The group of stages `first` and `first` + 1 of this replica."""
        return self.GROUP_BASE + self._replica * self._strategy.num_stages + first

    def _dtype(self, first: int):
        return tf.as_dtype(self._strategy._stage_outputs[first].dtype)

    def _wire(self, first: int):
        """The dtype a boundary tensor travels in: TensorFlow's collectives
        take no bfloat16 (TF 2.21), so bfloat16 goes as float32 (exactly:
        every bfloat16 is a float32) and is cast back on arrival."""
        dtype = self._dtype(first)
        return tf.float32 if dtype == tf.bfloat16 else dtype

    def _send(self, value, first: int, instance: int):
        return tf.raw_ops.CollectiveBcastSendV2(
            input=tf.cast(value, self._wire(first)), group_size=2, group_key=self._group(first),
            instance_key=self._instance_base + instance, communication_hint="auto",
            timeout_seconds=self._timeout)

    def _receive(self, first: int, instance: int):
        boundary = self._strategy._stage_outputs[first].shape[1:]
        # Outside the stage's chain: every receive is posted when the step
        # starts, so the neighbour's send completes as soon as it runs and a
        # transfer's latency hides behind this stage's other items.
        with tf.control_dependencies(None):
            shape = tf.concat([[self._rows], tf.constant(boundary, tf.int32)], 0)
            received = tf.raw_ops.CollectiveBcastRecvV2(
                group_size=2, group_key=self._group(first),
                instance_key=self._instance_base + instance, shape=shape, T=self._wire(first),
                communication_hint="auto", timeout_seconds=self._timeout)
        return tf.cast(received, self._dtype(first))

    def send_activation(self, stage: int, i: int, value):
        return self._send(value, stage, 2 * i)

    def receive_activation(self, stage: int, i: int):
        return self._receive(stage - 1, 2 * i)

    def send_gradient(self, stage: int, i: int, value):
        return self._send(value, stage - 1, 2 * i + 1)

    def receive_gradient(self, stage: int, i: int):
        return self._receive(stage, 2 * i + 1)


class StageGroup:
    """The R workers that run one stage (one per pipeline replica; with
    --pipeline_chunks, the same v stages), as a collective group: their
    gradients summed, per dtype in buckets."""

    GROUP_BASE = Transfer.GROUP_BASE + (1 << 16)   # beside the stage pairs' groups
    INSTANCE_BASE = Transfer.INSTANCE_BASE + (1 << 16)
    # `share`'s, one per variable of a stage (below `SharedGroup`'s instances)
    SHARE_INSTANCE_BASE = INSTANCE_BASE + (1 << 12)

    def __init__(self, strategy: PipelineStrategy):
        self._strategy = strategy
        self.size = strategy.pipeline_replicas
        self.key = self.GROUP_BASE + strategy.position

    def share(self, variable, index: int, mine: bool):
        """`variable`'s value from the one member where `mine` (its
        `index`-th share in a step): the sum of that value and the others'
        zeros (exact), one collective. (A broadcast from that member,
        which would send half as much, timed out here: TF 2.21.)"""
        sent = (tf.convert_to_tensor(variable) if mine
                else tf.zeros(variable.shape, variable.dtype))
        return self._sum([sent], self.SHARE_INSTANCE_BASE + index)[0]

    # Packed per collective, one after the other: the packing, the sum and its
    # split are each a transient copy of what is packed, so a stage's
    # gradients packed at once (a 400M-parameter mlp's 0.8 GB stage) held two
    # or three copies more than the gradients themselves.
    BUCKET_BYTES = 64 << 20
    MAX_BUCKETS = 1000   # at most 2001 per dtype: instance keys below SHARE_INSTANCE_BASE

    def all_reduce_sum(self, tensors) -> list:
        """The sum over the group, per dtype in buckets of about
        `BUCKET_BYTES` (the same on every member: by the tensors' order and
        shapes), each bucket's collective after the previous one's."""
        instances = itertools.count(self.INSTANCE_BASE)

        def summed(same):
            out = []
            sizes = [t.shape.num_elements() * t.dtype.size for t in same]
            # at most 2 x MAX_BUCKETS + 1 runs: any two neighbours exceed the limit
            limit = max(self.BUCKET_BYTES, -(-sum(sizes) // self.MAX_BUCKETS))
            for bucket in runs_within(same, sizes, limit):
                with tf.control_dependencies(out[-1:]):
                    out += self._sum(bucket, next(instances))
            return out

        return by_dtype(tensors, summed)

    def _sum(self, tensors, instance_key: int) -> list:
        """One collective for `tensors` (one dtype), packed into one vector."""
        dtype = tensors[0].dtype
        # bfloat16 (--grad_compression=bf16) goes as float32, as boundaries do.
        wire = tf.float32 if dtype == tf.bfloat16 else dtype
        flat = tf.concat([tf.reshape(tf.cast(t, wire), [-1]) for t in tensors], 0)
        summed = tf.raw_ops.CollectiveReduceV2(
            input=flat, group_size=self.size, group_key=self.key, instance_key=instance_key,
            ordering_token=[], merge_op="Add", final_op="Id", communication_hint="auto",
            timeout_seconds=float(self._strategy.config.collective_timeout_s))
        parts = tf.split(summed, [t.shape.num_elements() for t in tensors])
        return [tf.cast(tf.reshape(part, t.shape), dtype) for part, t in zip(parts, tensors)]


class EveryWorker(StageGroup):
    """All N workers as one group of explicit keys (`predict_through_stages`
    returns the last stage's outputs to every worker through it): the
    strategy's own all-reduce takes its instance keys from a per-process
    count of what each worker traced, which agree only while every worker
    traces the same functions in the same order; after training, user code
    decides what each worker traces."""

    GROUP_BASE = StageGroup.GROUP_BASE + (1 << 14)   # beside the stage groups' keys

    def __init__(self, strategy: PipelineStrategy):
        super().__init__(strategy)
        self.size, self.key = strategy._num_workers, self.GROUP_BASE

    def sum(self, tensors, instance_key: int) -> list:
        return self._sum(tensors, instance_key)


class SharedGroup(StageGroup):
    """Every worker of the stages that hold a shared layer (tied embeddings:
    stage 0 and the last), across all pipeline replicas: the layer's
    gradients summed among them, so each stage's copy takes the same update.
    One group per set of stages, its key the set's place among the model's
    sets (the same on every worker: the split is)."""

    GROUP_BASE = StageGroup.GROUP_BASE + (1 << 15)
    INSTANCE_BASE = StageGroup.INSTANCE_BASE + (1 << 15)

    def __init__(self, strategy: PipelineStrategy, stages: tuple):
        super().__init__(strategy)
        # a worker running several of the stages (--pipeline_chunks) is one member
        self.size = len({s % strategy.positions for s in stages}) * strategy.pipeline_replicas
        self.key = self.GROUP_BASE + sorted(set(strategy.shared_variables().values())).index(
            stages)
