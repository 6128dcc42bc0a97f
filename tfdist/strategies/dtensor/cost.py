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
from tfdist.planner.costs import Estimate, Facts, all_reduce_seconds, base_terms, dividers
from tfdist.planner.probing import per_byte_and_count, probe_residual, probe_time_residual

ZERO_STAGES = (0, 1, 2, 3)
# The probe runs (ZeRO stage, micro-batches): every stage at one micro-batch
# and at the most micro-batches a search tries (what each further one holds
# differs by stage: measured, stage 0's growth fell 140-200 MiB short of
# stages 2's and 3's at 8). The growth is not linear in them (slower to 4,
# faster to 8), so fewer are interpolated, from above.
MOST = 8
PROBES = tuple((stage, accum) for stage in ZERO_STAGES for accum in (1, MOST))


def _trained(model) -> int:
    """The model's trained variables (what ZeRO splits)."""
    return sum(1 for v in model.variables if v.trainable)


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
        """What the engine holds beyond the state terms, fitted on the probe
        models: per computed byte (the SPMD step's per-device copies and
        update temporaries, and the unrolled micro-batches' gradients side
        by side), per operation of a micro-batch's graph (each device's
        expanded graph, once per unrolled micro-batch) and, at a ZeRO stage,
        per trained variable (each split variable's gathers and scatters,
        expanded per device, once per micro-batch). Measured on 2 virtual
        CPU devices, TF 2.21: about 0.1 MiB per operation and micro-batch
        (the cnn's 859 operations held 0.09 GiB more per further micro-batch,
        a 24-layer mlp of 16 units, 334 operations, 0.035), which no count of
        bytes explains; that mlp's 50 variables held 1.2 GiB more at ZeRO-3
        than at ZeRO-0 with 8 micro-batches. At one micro-batch and at MOST,
        interpolated between; scaled to this model's computed bytes,
        operations and variables; 0 without a probe."""
        if facts.calibration.probe is None:
            return 0.0
        stage, accum = options["zero_stage"], options["accum_steps"]
        one, most = (self._fitted(facts, stage, n) for n in (1, MOST))
        if one is None:
            return 0.0
        per_byte, per_op, per_variable = (a + (accum - 1) * (b - a) / (MOST - 1)
                                          for a, b in zip(one, most or one))
        model = facts.model
        return max(0.0, self._computed(facts, options) * per_byte
                   + (model.step_ops or 0) * per_op + _trained(model) * per_variable)

    def _fitted(self, facts: Facts, stage: int, accum: int) -> Optional[tuple]:
        """(bytes per computed byte, per operation, per trained variable) the
        probes measured at ZeRO `stage` with `accum` micro-batches beyond
        this cost model's other terms: the operations' share from stage 0's
        runs of the two probe models, the variables' from the stage's beyond
        that (both only where this model's operations are counted); None if
        not measured."""
        zero = self._residuals(facts, 0, accum)
        found = self._residuals(facts, stage, accum)
        if not found or not zero:
            return None
        if not facts.model.step_ops:   # the probe of few operations alone, per byte
            return per_byte_and_count([(found[0][1], found[0][2], 0)])[0], 0.0, 0.0
        per_byte, per_op = per_byte_and_count([(r, c, o) for _, r, c, o, _ in zero])
        if stage == 0:
            return per_byte, per_op, 0.0
        per_byte, per_variable = per_byte_and_count(
            [(r - per_op * o, c, v) for _, r, c, o, v in found])
        return per_byte, per_op, per_variable

    def _residuals(self, facts: Facts, stage: int, accum: int) -> list:
        """[(probe, bytes left out, bytes computed, operations, trained
        variables)] of each probe model measured at ZeRO `stage` with `accum`
        micro-batches, the probe of few operations first."""
        variant = f"zero{stage} accum{accum}"
        options = self.probes(facts.host.devices).get(variant)
        probe, found = facts.calibration.probe, []
        for model_probe in (probe, probe.graph) if options else ():
            missed = (probe_residual(facts, self, "dtensor", variant, options, model_probe)
                      if model_probe else None)
            if missed is not None:
                model = model_probe.model
                found.append((model_probe, missed,
                              self._computed(dataclasses.replace(facts, model=model), options),
                              model.step_ops or 0, _trained(model)))
        return found

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
