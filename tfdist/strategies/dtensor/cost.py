"""The dtensor engine's cost model: each variable, gradient and optimizer
slot by its layout on a batch x model mesh and the ZeRO stage (the layout
rules and `sharding.zero_spec`, as the engine itself places them), ZeRO-3's
gathered layers, and what its reductions move. No TensorFlow."""

from __future__ import annotations

import math

from tfdist import sharding
from tfdist.errors import UsageError
from tfdist.planner.costs import (Estimate, Facts, all_reduce_seconds, base_terms, dividers)

ZERO_STAGES = (0, 1, 2, 3)


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
        totals = dict(parameters=0.0, gradients=0.0, slots=0.0, gathered=0.0)
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
        memory["activations"] = facts.activation_bytes(
            facts.global_batch / host.processes / accum, precision)
        batch_axis = axes[sharding.BATCH]
        examples = facts.global_batch / host.hosts
        compute = facts.concurrent_seconds(examples, precision, options["jit_compile"],
                                           local * host.processes // host.hosts)
        time = {"compute": compute}
        if stage >= 3:   # the forward pass again in the backward (FSDP), a third more
            time["second forward pass (ZeRO-3)"] = compute / 3
        across = host.processes > 1
        reduced = facts.model.trainable_bytes / axes[sharding.MODEL]
        time["gradient reduction"] = all_reduce_seconds(facts, reduced, batch_axis,
                                                        local=not across)
        if stage >= 3:   # each layer gathered twice per step (half the bytes of an all-reduce each)
            time["parameter gathers (ZeRO-3)"] = all_reduce_seconds(
                facts, facts.model.param_bytes / axes[sharding.MODEL], batch_axis,
                local=not across)
        if accum > 1:
            time["micro-batch overhead"] = (accum - 1) * facts.step_overhead()
        return Estimate(memory, time, processes=host.processes, family=self.family)


COST = TensorSharding()
