"""The cost models of the data-parallel engines that keep a whole replica per
device or process: `default` (one device), `mirrored` (this process's
devices), `multi_worker` and `horovod` (one replica per process, its
gradients exchanged whole, cast, compressed, or its weights averaged every
few steps; the two differ in their collectives' implementation, which the
search's trials measure).
Each engine's record names its model here (`Engine.cost`); the shared terms
are `tfdist.planner.costs`. No TensorFlow."""

from __future__ import annotations

import dataclasses
import importlib.util
import math

from tfdist.config import TrainConfig
from tfdist.matrices import matrix_shape
from tfdist.planner.costs import (Estimate, Facts, all_gather_seconds, all_reduce_seconds,
                                  base_terms, state)

# How a process's gradients may cross the cluster (each changes the math, so
# a search tries them only where lossy choices are allowed): cast to bf16 for
# the sum, PowerSGD and top-k at their default rank and share, and local SGD
# averaging the weights every SYNC_EVERY steps.
COMPRESSIONS = ("bf16", "powersgd", "topk")
SYNC_EVERY = 8
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
POWERSGD_RANK = _DEFAULTS["powersgd_rank"]
TOPK_FRACTION = _DEFAULTS["topk_fraction"]
# Passes over a gradient's bytes that compressing it costs beyond its FLOPs
# (error feedback in and out, the approximation; top-k's selection): a
# first guess, which the group's trials scale like every other term.
PASSES = {"powersgd": 4, "topk": 8}


def _accumulator(options: dict) -> float:
    return 1.0 if options["accum_steps"] > 1 else 0.0


def _loop_graph(facts: Facts, options: dict, replicas: int) -> dict:
    """Micro-batches in TensorFlow's loop: its body holds a second copy of a
    micro-batch's graph on each replica (measured on the cnn, 859
    operations: about 0.09 GiB more on one device, 0.18 under mirrored on 2,
    from one micro-batch to two); with XLA the body is one compiled call."""
    probe = facts.calibration.probe
    if options["accum_steps"] < 2 or options["jit_compile"] == "on" or probe is None:
        return {}
    per_op = probe.graph.loop_bytes_per_op() if probe.graph else 0.0
    return ({"micro-batch loop's graph": replicas * (facts.model.step_ops or 0) * per_op}
            if per_op else {})


def _overhead(facts: Facts, options: dict, compute: float) -> dict:
    """What the candidate's micro-batches add to (or take from) the step, as
    one device measured them (with the candidate's XLA setting); what they
    take at most half of the step's `compute` (one device's gain applied to
    replicas sharing the cores)."""
    accum = options["accum_steps"]
    if accum <= 1:
        return {}
    return {"micro-batch overhead": max(-compute / 2, facts.micro_batches_seconds(
        options["jit_compile"], accum))}


class OneDevice:
    """`default`: the whole model and batch on one device."""

    family = "default"

    @staticmethod
    def runtime_flags(devices: int) -> list:
        """The engine's flags for a tiny run measuring its runtime's memory."""
        return ["--strategy=default", "--virtual_devices=1"]

    @staticmethod
    def replicas(facts: Facts, options: dict) -> int:
        return 1

    def candidates(self, facts: Facts):
        if facts.host.processes == 1:
            yield {"virtual_devices": 1}   # no devices beside it (as calibration runs it)

    def estimate(self, facts: Facts, options: dict) -> Estimate:
        batch, precision = facts.global_batch, options["precision"]
        memory = {**base_terms(facts, self.family, options["jit_compile"],
                                 options["accum_steps"], update_compiled=True),
                  **state(facts, accumulator=_accumulator(options)),
                  "activations": facts.activation_bytes(batch / options["accum_steps"],
                                                        precision),
                  **_loop_graph(facts, options, 1)}
        time = {"compute": facts.compute_seconds(batch, precision, options["jit_compile"])}
        time.update(_overhead(facts, options, time["compute"]))
        return Estimate(memory, time, family=self.family)


class LocalReplicas:
    """`mirrored`: a whole replica on each of this process's devices, the
    gradients all-reduced among them (memory copies)."""

    family = "mirrored"

    @staticmethod
    def runtime_flags(devices: int) -> list:
        return ["--strategy=mirrored", f"--virtual_devices={devices}"]

    @staticmethod
    def replicas(facts: Facts, options: dict) -> int:
        return options["virtual_devices"]

    def candidates(self, facts: Facts):
        if facts.host.processes == 1 and facts.host.devices > 1:
            yield {"virtual_devices": facts.host.devices}

    def estimate(self, facts: Facts, options: dict) -> Estimate:
        devices = options["virtual_devices"]
        batch, precision = facts.global_batch, options["precision"]
        copies = float(devices)
        memory = {**base_terms(facts, self.family, options["jit_compile"],
                                 options["accum_steps"], devices),
                  **state(facts, copies, copies, copies, copies * _accumulator(options)),
                  "activations": facts.activation_bytes(batch / options["accum_steps"],
                                                        precision),
                  **_loop_graph(facts, options, devices)}
        time = {"compute": facts.concurrent_seconds(batch, precision, options["jit_compile"],
                                                    devices),
                "gradient all-reduce": all_reduce_seconds(
                    facts, facts.model.trainable_bytes, devices, local=True)}
        time.update(_overhead(facts, options, time["compute"]))
        return Estimate(memory, time, family=self.family)


class ReplicaPerProcess:
    """`multi_worker`, `horovod`: one replica per process, the gradients
    all-reduced over the cluster's links. `needs`: the module the engine
    imports, without which it has no candidates (Horovod is built apart)."""

    def __init__(self, family: str, needs: str = ""):
        self.family, self.needs = family, needs

    # Its runtime is measured with two processes (started as the engine's are),
    # each with its collective runtime (gRPC server, or Gloo's).
    runtime_processes = 2

    def runtime_flags(self, devices: int) -> list:
        return [f"--strategy={self.family}", "--virtual_devices=1"]

    @staticmethod
    def replicas(facts: Facts, options: dict) -> int:
        return facts.host.processes

    def candidates(self, facts: Facts):
        if self.needs and importlib.util.find_spec(self.needs) is None:
            return
        if facts.host.processes > 1:
            yield {"virtual_devices": 1}
            for kind in COMPRESSIONS:
                if kind == "powersgd" and any(min(matrix) < POWERSGD_RANK
                                              for matrix in _shapes(facts)[0]):
                    continue   # the engine refuses a rank above a matrix's smaller side
                yield {"virtual_devices": 1, "grad_compression": kind}
            yield {"virtual_devices": 1, "sync_every": SYNC_EVERY, "accum_steps": 1}

    def estimate(self, facts: Facts, options: dict) -> Estimate:
        host = facts.host
        workers, precision = host.processes, options["precision"]
        per_worker = facts.global_batch / workers
        kind = options.get("grad_compression", "none")
        memory = {**base_terms(facts, self.family, options["jit_compile"],
                                 options["accum_steps"]),
                  **state(facts, accumulator=_accumulator(options)),
                  "activations": facts.activation_bytes(per_worker / options["accum_steps"],
                                                        precision),
                  **_loop_graph(facts, options, 1)}
        if kind in PASSES:   # error feedback (and top-k's momentum) per replica
            memory[f"compression state ({kind})"] = facts.model.trainable_bytes * (
                2 if kind == "topk" else 1)
        # The processes of one host share its cores.
        time = {"compute": facts.concurrent_seconds(facts.global_batch / host.hosts, precision,
                                                    options["jit_compile"],
                                                    workers // host.hosts)}
        time.update(_overhead(facts, options, time["compute"]))
        exchange = _exchange(facts, kind, options.get("sync_every", 0), workers)
        time.update(exchange)
        time.update(_compression_compute(facts, kind))
        return Estimate(memory, time, processes=workers, family=self.family,
                        over_link=tuple(exchange) if host.hosts > 1 else ())


def _shapes(facts: Facts) -> tuple:
    """(matrices as [n, m], bytes sent whole) of the trained variables, as
    the compressions treat them (`matrices.matrix_shape`)."""
    matrices, whole = [], 0
    for variable in facts.model.variables:
        if not variable.trainable:
            continue
        matrix = matrix_shape(variable.shape)
        if matrix is None:
            whole += variable.bytes
        else:
            matrices.append(matrix)
    return matrices, whole


def _exchange(facts: Facts, kind: str, sync_every: int, workers: int) -> dict:
    """Seconds per step the gradients' (or weights') exchange takes."""
    trainable = facts.model.trainable_bytes
    if sync_every:
        return {"weight averaging (local SGD)": all_reduce_seconds(
            facts, facts.model.param_bytes, workers, local=False) / sync_every}
    if kind in ("bf16", "fp16"):
        return {f"gradient all-reduce ({kind})": all_reduce_seconds(
            facts, trainable / 2, workers, local=False)}
    matrices, whole = _shapes(facts)
    if kind == "powersgd":   # P then Q all-reduced (float32), 1-D tensors whole
        p = sum(4 * n * POWERSGD_RANK for n, m in matrices)
        q = sum(4 * m * POWERSGD_RANK for n, m in matrices)
        return {"gradient exchange (PowerSGD)": all_reduce_seconds(facts, p + whole, workers,
                                                                   local=False)
                + all_reduce_seconds(facts, q, workers, local=False)}
    if kind == "topk":       # a value and an index per kept entry, gathered from all
        sent = sum(8 * max(1, math.ceil(TOPK_FRACTION * n * m)) for n, m in matrices)
        return {"gradient exchange (top-k)": all_gather_seconds(facts, sent, workers,
                                                                local=False)
                + all_reduce_seconds(facts, whole, workers, local=False)}
    return {"gradient all-reduce": all_reduce_seconds(facts, trainable, workers, local=False)}


def _compression_compute(facts: Facts, kind: str) -> dict:
    if kind not in PASSES:
        return {}
    matrices, _ = _shapes(facts)
    seconds = PASSES[kind] * facts.model.trainable_bytes / facts.host.local_bytes_per_s
    peak = facts.host.peak_flops.get("float32")
    if kind == "powersgd" and peak:   # P = M Q and Q = M^T P
        seconds += sum(4 * n * m * POWERSGD_RANK for n, m in matrices) / peak
    return {f"compression ({kind})": seconds}


ONE_DEVICE = OneDevice()
LOCAL_REPLICAS = LocalReplicas()
MULTI_WORKER = ReplicaPerProcess("multi_worker")
HOROVOD = ReplicaPerProcess("horovod", needs="horovod")
