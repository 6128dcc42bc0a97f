"""What the probe models measured, against a cost model's prediction for
them: the bytes and seconds an engine holds or spends beyond its terms
(`calibrate.probe` measures the probes; the engines' cost models scale the
residuals to a candidate). No TensorFlow."""

from __future__ import annotations

import dataclasses
from typing import Optional

from tfdist.planner.costs import Calibration, Facts, Probe


def probe_facts(facts: Facts, probe: Optional[Probe] = None) -> Facts:
    """The probe model's facts on this host (one process): its one-device
    peak at both batch sizes and its one-device rate (float32, no XLA). They
    have no probe, so an engine's cost model predicts it without the terms
    its probes measure. `probe`: which (default the calibration's)."""
    probe = probe or facts.calibration.probe
    batch = probe.batch
    rate = probe.reference_rates.get(1)
    return Facts(
        model=probe.model,
        calibration=Calibration(points=((batch, probe.reference), (2 * batch, probe.reference)),
                                rates={("float32", "off"): rate} if rate else {},
                                baselines=facts.calibration.baselines),
        host=dataclasses.replace(facts.host, processes=1, hosts=1), global_batch=batch)


PROBE_OPTIONS = {"precision": "float32", "jit_compile": "off", "accum_steps": 1}


def probe_residual(facts: Facts, cost, engine: str, variant: str, options: dict,
                   probe: Optional[Probe] = None) -> Optional[float]:
    """What `cost` (an engine's cost model) leaves out on the probe model
    under `options` (its probe `variant`): the measured peak less the
    predicted one, in bytes; None if the probe was not measured. `probe`:
    which (default the calibration's)."""
    probe = probe or facts.calibration.probe
    measured = probe.peaks.get(f"{engine} {variant}") if probe else None
    if measured is None:
        return None
    return measured - cost.estimate(probe_facts(facts, probe),
                                    {**PROBE_OPTIONS, **options}).peak_bytes


def per_byte_and_count(residuals: list) -> tuple:
    """(bytes per byte, bytes per counted thing: a graph operation, a
    variable) that explain `residuals`, a list of (bytes left out, bytes
    computed, count) of the probe models: the two probes' linear system,
    solved; one probe, or two the system cannot tell apart, gives its bytes
    per byte alone. Neither is negative."""
    usable = [(max(0.0, r), c, o) for r, c, o in residuals if c > 0]
    if not usable:
        return 0.0, 0.0
    (r1, c1, o1) = usable[0]
    if len(usable) > 1 and o1 and usable[1][2]:
        r2, c2, o2 = usable[1]
        det = c1 * o2 - c2 * o1
        if abs(det) > 1e-9 * c1 * o2:
            per_byte, per_op = (r1 * o2 - r2 * o1) / det, (c1 * r2 - c2 * r1) / det
            if per_byte < 0:   # all of it per count, as the probe of many says
                return 0.0, r2 / o2
            if per_op < 0:
                return r1 / c1, 0.0
            return per_byte, per_op
    return r1 / c1, 0.0


def probe_time_residual(facts: Facts, cost, engine: str, variant: str, options: dict
                        ) -> Optional[float]:
    """The same for step time: the probe's measured seconds per step under
    `options` less `cost`'s prediction for it; None if not measured."""
    probe = facts.calibration.probe
    rate = probe.rates.get(f"{engine} {variant}") if probe else None
    if not rate or not probe.reference_rates.get(1):
        return None
    predicted = cost.estimate(probe_facts(facts), {**PROBE_OPTIONS, **options}).step_seconds
    return probe.batch / rate - predicted
