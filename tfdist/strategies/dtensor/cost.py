"""The dtensor engine's cost model: each variable, gradient and optimizer
slot by its layout on a batch x model mesh and the ZeRO stage (the layout
rules and `sharding.zero_spec`, as the engine itself places them), ZeRO-3's
gathered layers, what the engine holds beyond them (measured by its probes,
per byte), and what its reductions and tensor-parallel exchanges move, over
the links between hosts where its axes span them. No TensorFlow."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from tfdist import sharding
from tfdist.errors import UsageError
from tfdist.planner.costs import (Estimate, Facts, all_reduce_seconds, base_terms, dividers,
                                  probe_residual, probe_time_residual)

ZERO_STAGES = (0, 1, 2, 3)
# The probe runs (ZeRO stage, micro-batches): every stage at one micro-batch
# and at the most micro-batches a search tries (what each further one holds
# differs by stage: measured, stage 0's growth fell 140-200 MiB short of
# stages 2's and 3's at 8). The growth is not linear in them (slower to 4,
# faster to 8), so fewer are interpolated, from above.
MOST = 8
PROBES = tuple((stage, accum) for stage in ZERO_STAGES for accum in (1, MOST))


def _shards(spec, axes: dict) -> int:
    return math.prod(axes[a] for a in spec if a is not None)


class TensorSharding:
    family = "dtensor"

    @staticmethod
    def runtime_flags(devices: int) -> list:
        return ["--strategy=dtensor", f"--mesh=batch:{devices},model:1",
                f"--virtual_devices={devices}"]

    @staticmethod
    def replicas(facts: Facts, options: dict) -> int:
        return dict(sharding.parse_mesh(options["mesh"]))[sharding.BATCH]

    @staticmethod
    def probes(devices: int) -> dict:
        """variant -> options of the probe runs (`calibrate.probe`): on this
        process's devices over `batch`."""
        return {f"zero{stage} accum{accum}": {"mesh": f"batch:{devices},model:1",
                                               "zero_stage": stage, "accum_steps": accum,
                                               "virtual_devices": devices}
                for stage, accum in PROBES if devices > 1 or stage == 0}

    def transients(self, facts: Facts, options: dict) -> float:
        """What the engine holds per computed byte beyond the state terms
        (measured: on 2 virtual CPU devices, TF 2.21, 16-23 bytes per byte
        at ZeRO 0-2 and 5-6 at ZeRO-3 with one micro-batch, and about 2 more
        per further micro-batch: the SPMD step's per-device copies and
        update temporaries, and the unrolled micro-batches' gradients side
        by side), scaled to this model's computed bytes; 0 without a probe."""
        probe = facts.calibration.probe
        if probe is None:
            return 0.0
        devices = facts.host.devices
        stage, accum = options["zero_stage"], options["accum_steps"]
        per_byte = {}
        for variant, probe_options in self.probes(devices).items():
            missed = probe_residual(facts, self, "dtensor", variant, probe_options)
            if missed is not None:
                computed = self._computed(dataclasses.replace(facts, model=probe.model),
                                          probe_options)
                per_byte[(probe_options["zero_stage"], probe_options["accum_steps"])] = (
                    max(0.0, missed) / computed)
        one = per_byte.get((stage, 1))
        if one is None:
            return 0.0
        more = ((per_byte[(stage, MOST)] - one) / (MOST - 1)
                if (stage, MOST) in per_byte else 0.0)
        return self._computed(facts, options) * max(0.0, one + (accum - 1) * more)

    def micro_batch_factor(self, facts: Facts, stage: int) -> Optional[float]:
        """What a further micro-batch costs at ZeRO `stage` as a multiple of
        one device's (its probes at 1 and MOST micro-batches against one
        device's: measured on 2 virtual CPU devices, TF 2.21, the engine's
        unrolled micro-batches over `batch` cost several times one device's
        loop; over `model` not: the mlp on batch:1,model:2 ran 11.9k, 13.9k,
        11.6k and 8.7k examples/s at 1, 2, 4 and 8 micro-batches)."""
        probe = facts.calibration.probe
        if probe is None:
            return None
        return probe.micro_batch_factor("dtensor", f"zero{stage} accum1",
                                        f"zero{stage} accum{MOST}", MOST)

    def zero_seconds(self, facts: Facts, options: dict) -> Optional[float]:
        """What the ZeRO stage costs per step beyond stage 0 and beyond its
        modeled terms (sharded updates and their gathers within a process):
        its probe's unexplained seconds less stage 0's, per computed byte,
        scaled to this model; None without the probes."""
        stage = options["zero_stage"]
        if stage == 0 or facts.calibration.probe is None:
            return None
        variants = self.probes(facts.host.devices)
        found = [probe_time_residual(facts, self, "dtensor", f"zero{s} accum1",
                                     variants[f"zero{s} accum1"])
                 if f"zero{s} accum1" in variants else None for s in (0, stage)]
        if None in found:
            return None
        devices = facts.host.devices
        mesh = f"batch:{devices},model:1"
        probe = self._computed(dataclasses.replace(facts, model=facts.calibration.probe.model),
                               {"mesh": mesh})
        return (found[1] - found[0]) * self._computed(facts, options) / probe

    def _computed(self, facts: Facts, options: dict) -> float:
        """The bytes this process's devices compute with (each device's share
        of the split variables)."""
        return self._per_device(facts, options["mesh"], 0)["computed"] * facts.host.devices

    def candidates(self, facts: Facts):
        """Every mesh of this process's devices (times the cluster's processes)
        the layout rules allow, at every ZeRO stage that splits something."""
        devices = facts.host.devices * facts.host.processes
        rules = facts.model.layout_rules
        for model_axis in dividers(devices):
            if model_axis > 1 and not len(rules or ()):
                continue          # nothing would be split over `model`
            batch_axis = devices // model_axis
            mesh = f"batch:{batch_axis},model:{model_axis}"
            try:
                self._per_device(facts, mesh, 0)
            except UsageError:
                continue          # a rule the mesh cannot divide
            for stage in ZERO_STAGES if batch_axis > 1 else (0,):
                yield {"mesh": mesh, "zero_stage": stage,
                       "virtual_devices": facts.host.devices}

    @staticmethod
    def _per_device(facts: Facts, mesh: str, stage: int) -> dict:
        """Bytes per device: parameters, gradients, slots; and the largest
        variable as computed (gathered over `batch` under ZeRO-3)."""
        axes = dict(sharding.parse_mesh(mesh))
        rules = sharding.as_layout_rules(facts.model.layout_rules)
        model = facts.model
        totals = dict(parameters=0.0, gradients=0.0, slots=0.0, gathered=0.0, computed=0.0)
        for variable in model.variables:
            spec = rules.spec_for(variable.path, variable.shape, axes)
            split = sharding.zero_spec(spec, variable.shape, axes)
            computed = variable.bytes / _shards(spec, axes)
            totals["parameters"] += variable.bytes / _shards(split if stage >= 3 else spec, axes)
            if variable.trainable:
                totals["gradients"] += variable.bytes / _shards(split if stage >= 2 else spec,
                                                                axes)
                totals["slots"] += (variable.bytes * model.slot_ratio
                                    / _shards(split if stage >= 1 else spec, axes))
            totals["gathered"] = max(totals["gathered"], computed)
            totals["computed"] += computed
        return totals

    def estimate(self, facts: Facts, options: dict) -> Estimate:
        host, stage = facts.host, options["zero_stage"]
        axes = dict(sharding.parse_mesh(options["mesh"]))
        per_device = self._per_device(facts, options["mesh"], stage)
        local = host.devices             # devices each process holds
        accum = options["accum_steps"]
        precision = options["precision"]
        memory = {**base_terms(facts, self.family),
                  "parameters": per_device["parameters"] * local,
                  "gradients": per_device["gradients"] * local,
                  "optimizer slots": per_device["slots"] * local}
        if accum > 1:
            memory["accumulated gradients"] = per_device["gradients"] * local
        if stage >= 3:   # one layer whole (over batch) on each device while it computes
            memory["gathered layer (ZeRO-3)"] = per_device["gathered"] * local
        memory["step transients (probed)"] = self.transients(facts, options)
        memory["activations"] = facts.activation_bytes(
            facts.global_batch / host.processes / accum, precision)
        time, over_link = self._time(facts, options, axes)
        return Estimate(memory, time, processes=host.processes, family=self.family,
                        over_link=over_link)

    def _time(self, facts: Facts, options: dict, axes: dict) -> tuple:
        """(time terms, those over the links between hosts). The mesh's
        devices are row-major over (batch, model), each process holding
        consecutive ones: `model` spans processes where it is larger than a
        process's devices, `batch` where a process holds fewer of its rows."""
        host, stage = facts.host, options["zero_stage"]
        local, accum, precision = host.devices, options["accum_steps"], options["precision"]
        batch_axis, model_axis = axes[sharding.BATCH], axes[sharding.MODEL]
        compute = facts.concurrent_seconds(facts.global_batch / host.hosts, precision,
                                           options["jit_compile"],
                                           local * host.processes // host.hosts)
        time = {"compute": compute}
        if stage >= 3:   # the forward pass again in the backward (FSDP), a third more
            time["second forward pass (ZeRO-3)"] = compute / 3
        several = host.processes > 1
        batch_across = several and batch_axis > max(1, local // model_axis)
        model_across = several and model_axis > local
        reduced = facts.model.trainable_bytes / model_axis
        time["gradient reduction"] = all_reduce_seconds(facts, reduced, batch_axis,
                                                        local=not batch_across)
        if stage >= 3:   # each layer gathered twice per step (half the bytes of an all-reduce each)
            time["parameter gathers (ZeRO-3)"] = all_reduce_seconds(
                facts, facts.model.param_bytes / model_axis, batch_axis, local=not batch_across)
        probed = self.zero_seconds(facts, options)
        if probed is not None:   # at most taking back ZeRO-3's second forward pass
            time["ZeRO beyond its terms (probed)"] = max(
                -time.get("second forward pass (ZeRO-3)", 0.0), probed)
        if model_axis > 1:   # split layers' outputs (and their gradients) summed over `model`
            time["tensor-parallel exchanges"] = all_reduce_seconds(
                facts, facts.activation_bytes(facts.global_batch / batch_axis, precision),
                model_axis, local=not model_across)
        if accum > 1:   # the probes' factor where the mesh is theirs, all `batch`
            factor = self.micro_batch_factor(facts, stage) if model_axis == 1 else None
            time["micro-batch overhead"] = (accum - 1) * facts.micro_batch_overhead() * (
                factor or 1.0)
        over_link = []
        if host.hosts > 1:
            over_link += ["gradient reduction"] * batch_across
            over_link += ["parameter gathers (ZeRO-3)"] * (batch_across and stage >= 3)
            over_link += ["tensor-parallel exchanges"] * (model_across and model_axis > 1)
        return time, tuple(over_link)


COST = TensorSharding()
