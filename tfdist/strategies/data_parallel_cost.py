"""The cost models of the data-parallel engines that keep a whole replica per
device or process: `default` (one device), `mirrored` (this process's
devices), `multi_worker` (one replica per process). Each
engine's record names its model here (`Engine.cost`); the shared terms are
`tfdist.planner.costs`. No TensorFlow."""

from __future__ import annotations

from tfdist.planner.costs import Estimate, Facts, all_reduce_seconds, base_terms, state


def _accumulator(options: dict) -> float:
    return 1.0 if options["accum_steps"] > 1 else 0.0


def _overhead(facts: Facts, options: dict, launches: int = 1) -> dict:
    """Each micro-batch beyond the first costs the step's fixed overhead again."""
    extra = (options["accum_steps"] - 1) * launches
    return {"micro-batch overhead": extra * facts.step_overhead()} if extra else {}


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
            yield {}

    def estimate(self, facts: Facts, options: dict) -> Estimate:
        batch, precision = facts.global_batch, options["precision"]
        memory = {**base_terms(facts, self.family, options["jit_compile"]),
                  **state(facts, accumulator=_accumulator(options)),
                  "activations": facts.activation_bytes(batch / options["accum_steps"],
                                                        precision)}
        time = {"compute": facts.compute_seconds(batch, precision, options["jit_compile"]),
                **_overhead(facts, options)}
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
        memory = {**base_terms(facts, self.family, options["jit_compile"]),
                  **state(facts, copies, copies, copies, copies * _accumulator(options)),
                  "activations": facts.activation_bytes(batch / options["accum_steps"],
                                                        precision)}
        time = {"compute": facts.concurrent_seconds(batch, precision, options["jit_compile"],
                                                    devices),
                "gradient all-reduce": all_reduce_seconds(
                    facts, facts.model.trainable_bytes, devices, local=True),
                **_overhead(facts, options)}
        return Estimate(memory, time, family=self.family)


class ReplicaPerProcess:
    """`multi_worker`: one replica per process, the gradients
    all-reduced over the cluster's links."""

    def __init__(self, family: str):
        self.family = family

    def runtime_flags(self, devices: int):
        return None   # measured with a cluster (not yet: the one-device runtime applies)

    @staticmethod
    def replicas(facts: Facts, options: dict) -> int:
        return facts.host.processes

    def candidates(self, facts: Facts):
        if facts.host.processes > 1:
            yield {"virtual_devices": 1}

    def estimate(self, facts: Facts, options: dict) -> Estimate:
        host = facts.host
        workers, precision = host.processes, options["precision"]
        per_worker = facts.global_batch / workers
        memory = {**base_terms(facts, self.family, options["jit_compile"]),
                  **state(facts, accumulator=_accumulator(options)),
                  "activations": facts.activation_bytes(per_worker / options["accum_steps"],
                                                        precision)}
        # The processes of one host share its cores.
        time = {"compute": facts.concurrent_seconds(facts.global_batch / host.hosts, precision,
                                                    options["jit_compile"],
                                                    workers // host.hosts),
                "gradient all-reduce": all_reduce_seconds(
                    facts, facts.model.trainable_bytes, workers, local=False),
                **_overhead(facts, options)}
        return Estimate(memory, time, processes=workers, family=self.family)


ONE_DEVICE = OneDevice()
LOCAL_REPLICAS = LocalReplicas()
MULTI_WORKER = ReplicaPerProcess("multi_worker")
