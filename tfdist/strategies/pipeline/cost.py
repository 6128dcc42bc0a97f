"""The pipeline engine's cost model: each process's stages (their parameters,
gradients and slots, ZeRO-1 over a stage's replicas), the activations its
schedule holds at its busiest moment (`schedule.peak_in_flight`, weighted by
each stage's share of the forward FLOPs), what each further micro-batch
holds beyond them (probed), and the bubble of the schedule. No TensorFlow."""

from __future__ import annotations

from tfdist.pipeline import schedule as schedules
from tfdist.planner.costs import (Estimate, Facts, all_reduce_seconds, base_terms,
                                  send_seconds)
from tfdist.planner.probing import per_byte_and_count, probe_residual

SCHEDULES = ("1f1b", "gpipe")
MICRO_BATCHES = (2, 4, 8)
CHUNKS = (1, 2)
# The probe runs' micro-batches (two stages, 1F1B): the fewest a search tries and the most.
PROBED = (MICRO_BATCHES[0], MICRO_BATCHES[-1])


class Stages:
    family = "pipeline"

    @staticmethod
    def runtime_flags(devices: int) -> list:
        return ["--strategy=pipeline", "--pipeline_stages=2", "--microbatches=2",
                f"--virtual_devices={devices}"]

    @staticmethod
    def replicas(facts: Facts, options: dict) -> int:
        """Pipeline replicas: the positions (devices, or processes) over S."""
        host = facts.host
        positions = host.processes if host.processes > 1 else host.devices
        return positions // options["pipeline_stages"]

    @staticmethod
    def probes(devices: int) -> dict:
        """variant -> options of the probe runs (`calibrate.probe`): two
        stages on this process's devices, 1F1B, at the fewest and the most
        micro-batches a search tries."""
        if devices < 2 or devices % 2:
            return {}
        return {f"1f1b accum{m}": {"pipeline_stages": 2, "pipeline_chunks": 1,
                                   "pipeline_schedule": "1f1b", "accum_steps": m,
                                   "zero_stage": 0, "virtual_devices": devices}
                for m in PROBED}

    def unrolled(self, facts: Facts, options: dict) -> float:
        """What each micro-batch beyond the first holds beyond the schedule's
        activations in flight: the step's graph holds every micro-batch's
        forward and backward items (and their kernels' state) side by side,
        and TensorFlow's executor runs a stage's next forward as soon as its
        inputs are there, within the items' order. Measured on 2 virtual CPU
        devices, TF 2.21, one process: the cnn held 18-23 MiB and the
        transformer 28-50 MiB more per further micro-batch than the schedule's
        activations explain (1F1B and GPipe). Fitted on the probe models
        (their peaks at the fewest and the most micro-batches, beyond this
        cost model's other terms) per operation of a micro-batch's graph and
        per byte of parameters; 0 without the probes."""
        probe = facts.calibration.probe
        variants = self.probes(facts.host.devices)
        if probe is None or not variants:
            return 0.0
        fewest, most = PROBED
        growth = []
        for model_probe in (probe, probe.graph):
            if model_probe is None:
                continue
            found = [probe_residual(facts, self, "pipeline", f"1f1b accum{m}",
                                    variants[f"1f1b accum{m}"], model_probe) for m in PROBED]
            if None not in found:
                model = model_probe.model
                growth.append(((found[1] - found[0]) / (most - fewest), model.param_bytes,
                               model.step_ops or 0))
        if not growth:
            return 0.0
        per_byte, per_op = per_byte_and_count(growth if facts.model.step_ops else growth[:1])
        model = facts.model
        further = options["accum_steps"] - 1
        return further * (per_byte * model.param_bytes + per_op * (model.step_ops or 0))

    def candidates(self, facts: Facts):
        host = facts.host
        positions = host.processes if host.processes > 1 else host.devices
        for stages in (2, 4):
            if positions % stages:
                continue
            for chunks in CHUNKS:
                if not isinstance(facts.model.splits.get(stages * chunks), list):
                    continue      # the model has too few blocks (the reason is in splits)
                for kind in SCHEDULES:
                    if chunks > 1 and kind != "1f1b":
                        continue  # interleaving is a 1F1B schedule's
                    for m in MICRO_BATCHES:
                        if m < stages or (chunks > 1 and m % stages) or facts.global_batch % m:
                            continue
                        replicas = positions // stages
                        for zero in ((0, 1) if replicas > 1 and host.processes > 1 else (0,)):
                            yield {"pipeline_stages": stages, "pipeline_chunks": chunks,
                                   "pipeline_schedule": kind, "accum_steps": m,
                                   "zero_stage": zero, "virtual_devices": host.devices}

    def estimate(self, facts: Facts, options: dict) -> Estimate:
        host = facts.host
        stages, chunks = options["pipeline_stages"], options["pipeline_chunks"]
        m, kind, precision = options["accum_steps"], options["pipeline_schedule"], \
            options["precision"]
        split = facts.model.splits[stages * chunks]
        positions = host.processes if host.processes > 1 else host.devices
        replicas = positions // stages
        plan = schedules.schedule(m, kind, stages, chunks)
        flops = sum(s.flops for s in split) or 1
        share = [s.flops / flops for s in split]
        micro = facts.global_batch / replicas / m
        # Per position (device or process): its stages' state and its most
        # activations alive at once.
        held = []
        for position, items in enumerate(plan):
            mine = [s for s in range(len(split)) if s % stages == position]
            params = sum(split[s].param_bytes for s in mine)
            alive = peak = 0.0
            for s, what, _ in items:
                alive += share[s] if what == "F" else -share[s]
                peak = max(peak, alive)
            held.append((params, peak))
        model = facts.model
        trainable = model.trainable_bytes / max(1, model.param_bytes)
        slots = 1.0 / replicas if options["zero_stage"] >= 1 else 1.0
        in_one = host.processes == 1
        # One process holds every position; else the largest process holds one.
        params = sum(p for p, _ in held) * replicas if in_one else max(p for p, _ in held)
        examples = (sum(a for _, a in held) * replicas if in_one
                    else max(a for _, a in held)) * micro
        memory = {**base_terms(facts, self.family),
                  "parameters": params,
                  "gradients": params * trainable,
                  "optimizer slots": params * trainable * model.slot_ratio * slots,
                  "activations": facts.activation_bytes(examples, precision)}
        unrolled = self.unrolled(facts, options) * (replicas if in_one else 1)
        if unrolled:
            memory["further micro-batches (probed)"] = unrolled
        bubble = schedules.bubble(stages, m, chunks)
        examples_per_host = facts.global_batch / host.hosts
        compute = facts.concurrent_seconds(examples_per_host, precision, options["jit_compile"],
                                           positions // host.hosts)
        time = {"compute": compute, "bubble": compute * bubble / (1 - bubble),
                "micro-batch overhead": (m * chunks - 1) * facts.micro_batch_overhead()}
        time.update(_exchanges(facts, split, stages, replicas, micro, m * chunks))
        link = ("gradient reduction", "activation transfers") if host.hosts > 1 else ()
        return Estimate(memory, time, processes=host.processes, family=self.family,
                        over_link=tuple(n for n in link if n in time))


def _exchanges(facts: Facts, split: list, stages: int, replicas: int, micro: float,
               sends: int) -> dict:
    """Time terms of what crosses between processes: each stage's gradients
    reduced over its replicas; between stages in processes of their own,
    each micro-batch's activation forward and its gradient back (`sends`
    micro-batch passes per stage boundary)."""
    in_one = facts.host.processes == 1
    terms = {}
    if replicas > 1:
        terms["gradient reduction"] = all_reduce_seconds(
            facts, facts.model.trainable_bytes / stages, replicas, local=in_one)
    if not in_one:
        boundary = max((s.input_bytes for s in split), default=0)
        terms["activation transfers"] = send_seconds(facts, 2 * boundary * micro * sends,
                                                     2 * sends, local=False)
    return terms


COST = Stages()
