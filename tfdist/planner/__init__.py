"""The planner: `tfdist.plan(config, ...)` and `tfdist-plan` choose the
engine and its options for the user's model on this host.

Model -> facts (`profile.py`), one-device measurements (`calibrate.py`),
every engine's candidates and their predicted memory and time (each
engine's cost model, `tfdist.planner.costs`), trials of the best
(`search.py`, `trials.py`), a ranked table and the winner as a flagfile.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import time
from typing import Callable, Optional

from tfdist import config as config_lib
from tfdist import strategies
from tfdist.config import RunConfig
from tfdist.errors import UsageError
from tfdist.observe import hardware
from tfdist.planner import functions as functions_lib, search as search_lib
from tfdist.planner.costs import Facts, GiB, Host
from tfdist.planner.search import Candidate

DEFAULT_TRIALS = 5
DEFAULT_SEARCH_SECONDS = 180.0


@dataclasses.dataclass
class Plan:
    """A finished search: every candidate (tried, ranked or dropped) and the winner."""

    config: RunConfig             # the run asked for
    facts: Facts
    candidates: list
    winner: Candidate
    seconds: float = 0.0

    @property
    def runner_up(self) -> Optional[Candidate]:
        batch = self.facts.global_batch
        measured = sorted((c for c in self.candidates if c.measured_rate()),
                          key=lambda c: -c.expected_rate(batch))
        return measured[1] if len(measured) > 1 else None

    def winner_config(self) -> RunConfig:
        return search_lib.apply(self.config, self.winner.engine, self.winner.options)

    def flagfile(self) -> str:
        return config_lib.flagfile(self.winner_config())

    def rows(self) -> list:
        """One dict per candidate: tried first (the fastest expected on the
        cluster first: measured, over several hosts with the links'
        predicted time), then the rest by predicted time, then the dropped."""
        batch = self.facts.global_batch
        tried = sorted((c for c in self.candidates if c.trial),
                       key=lambda c: -(c.expected_rate(batch) or 0))
        ranked = [c for c in search_lib.rank(self.candidates) if not c.trial]
        dropped = [c for c in self.candidates if c.dropped]
        rows = []
        for c in tried + ranked + dropped:
            rate = c.measured_rate()
            rows.append({
                "candidate": c.describe(),
                "predicted_gib": c.expected_peak() / GiB if c.estimate else None,
                "measured_gib": (c.measured_peak() / GiB) if c.measured_peak() else None,
                "predicted_examples_per_sec": c.predicted_rate(batch) if c.estimate else None,
                "measured_examples_per_sec": rate,
                "expected_examples_per_sec": c.expected_rate(batch),
                "mfu": self._mfu(c, rate),
                "loss_change": c.loss_change(self.facts.calibration),
                # The chosen one's measurement may be calibration's (its peak
                # only where that run was its process's first).
                "measured_by": "calibration" if c.calibrated else "trial" if c.trial else None,
                "status": ("chosen" if c is self.winner
                           else "measured in calibration" if c.calibrated
                           else "tried" if c.trial and c.trial.ok
                           else f"failed: {c.trial.reason}" if c.trial
                           else f"dropped: {c.dropped}" if c.dropped else "not tried"),
            })
        return rows

    def _mfu(self, candidate, rate) -> Optional[float]:
        flops = self.facts.model.flops_per_example
        peak = self.facts.host.peak_flops.get(candidate.options["precision"])
        return rate * flops / peak if rate and flops and peak else None

    def table(self, limit: int = 20) -> str:
        """The rows as Markdown; where choices that change the math were
        allowed, with each trial's training loss against the float32
        one-device run's after the same steps (what the change cost)."""
        rows = self.rows()
        hosts = self.facts.host.hosts
        measured = (f"measured here (expected over {hosts} hosts)" if hosts > 1
                    else "measured")
        lossy = any(not c.lossless for c in self.candidates)
        loss = (f" loss vs float32 one device after {2 * self.facts.calibration.loop_steps} "
                "steps (share of its reduction) |" if lossy else "")
        empty = " |" * (3 + lossy)   # the cells between a candidate and the status
        lines = ["| # | candidate | memory GiB predicted / measured | examples/s predicted / "
                 f"{measured} | MFU |{loss} status |", "|---" * (6 + lossy) + "|"]
        shown = [r for r in rows if not r["status"].startswith("dropped")][:limit]
        dropped = [r for r in rows if r["status"].startswith("dropped")]
        for number, r in enumerate(shown, 1):
            lines.append(f"| {number} | {r['candidate']} | {_num(r['predicted_gib'], 2)} / "
                         f"{_num(r['measured_gib'], 2)} | "
                         f"{_num(r['predicted_examples_per_sec'], 0)} / "
                         f"{_num(r['measured_examples_per_sec'], 0)}"
                         + (f" ({_num(r['expected_examples_per_sec'], 0)})" if hosts > 1
                            and r["measured_examples_per_sec"] else "")
                         + f" | {_pct(r['mfu'])} |"
                         + (f" {_change(r['loss_change'])} |" if lossy else "")
                         + f" {r['status']} |")
        live = sum(1 for r in rows if not r["status"].startswith("dropped"))
        if live > len(shown):
            lines.append(f"| | ... {live - len(shown)} more not tried |{empty} |")
        reasons = {}
        for r in dropped:
            reasons.setdefault(r["status"][len("dropped: "):], []).append(r["candidate"])
        for reason, names in sorted(reasons.items()):
            lines.append(f"| | {len(names)} dropped, e.g. {names[0]} |{empty} {reason} |")
        return "\n".join(lines)

    def explain(self, candidate: Optional[Candidate] = None) -> str:
        c = candidate or self.winner
        e = c.estimate
        lines = [f"{c.describe()}: {e.processes} process(es)",
                 f"  memory of its largest process, predicted {e.peak_bytes / GiB:.3f} GiB"
                 + (f", measured {c.measured_peak() / GiB:.3f} GiB" if c.measured_peak()
                    else "") + ":"]
        lines += [f"    {name:<32} {value / GiB:8.3f} GiB" for name, value in e.memory.items()]
        lines.append(f"  time per step, predicted {c.predicted_seconds() * 1e3:.1f} ms"
                     + (f", the terms a trial here measures x {c.factor:.2f} (its group's "
                        "trials measured / predicted)" if c.factor != 1.0 else "")
                     + (f", {', '.join(e.over_link)} over the links as predicted"
                        if e.over_link else "")
                     + (f", measured {self.facts.global_batch / c.measured_rate() * 1e3:.1f} ms"
                        + (" here" if self.facts.host.hosts > 1 else "")
                        if c.measured_rate() else "") + ":")
        lines += [f"    {name:<32} {value * 1e3:8.1f} ms" for name, value in e.time.items()]
        return "\n".join(lines)


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: Optional[str], flag: str) -> Optional[int]:
    """"6G" -> bytes (powers of 1024); None stays None; else `UsageError`."""
    if text is None:
        return None
    raw = text.strip().upper().removesuffix("B").removesuffix("I")
    number, unit = (raw[:-1], raw[-1]) if raw[-1:] in "KMGT" else (raw, "")
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        value = -1
    if not math.isfinite(value) or value < 2**20:
        raise UsageError(f"{flag}={text!r} is not a size of at least 1M: bytes with an "
                         "optional K, M, G or T suffix, e.g. 6G or 1500M")
    return int(value)


_RATES = {"KBIT": 1e3 / 8, "MBIT": 1e6 / 8, "GBIT": 1e9 / 8, "TBIT": 1e12 / 8,
          "KB": 1e3, "MB": 1e6, "GB": 1e9}


def parse_rate(text: Optional[str], flag: str) -> Optional[float]:
    """"100mbit" -> bytes/s (bits as tc writes them, or KB/MB/GB: bytes, powers
    of 1000); None stays None; else `UsageError`."""
    if text is None:
        return None
    raw = text.strip().upper().removesuffix("/S").removesuffix("PS")
    unit = next((u for u in sorted(_RATES, key=len, reverse=True) if raw.endswith(u)), None)
    try:
        value = float(raw[:-len(unit)]) * _RATES[unit] if unit else -1.0
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 1e3:
        raise UsageError(f"{flag}={text!r} is not a link rate: a number with kbit, mbit, "
                         "gbit (bits/s) or KB, MB, GB (bytes/s), e.g. 10gbit or 100mbit")
    return value


def _num(value, digits) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _change(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def host_facts(config: RunConfig, memory_budget: Optional[int], processes: int,
               lossy: bool, hosts: int = 1, link_bandwidth: Optional[float] = None,
               launches: tuple = ()) -> Host:
    from tfdist.observe import peak
    cores = len(os.sched_getaffinity(0))
    devices = config.strategy.virtual_devices or cores
    peaks = {}
    for precision in ("float32", "mixed_bfloat16") if lossy else ("float32",):
        tflops = peak.precision_peak_tflops(precision)
        if tflops:
            peaks[precision] = tflops * 1e12
    limit = hardware.memory_limit_bytes()
    budget = memory_budget or limit
    if processes > hosts:   # processes of one host share its memory
        budget = min(budget, limit / (processes // hosts))
    link = {"link_bytes_per_s": link_bandwidth} if link_bandwidth else {}
    return Host(cpu=hardware.describe(), cores=cores, memory_budget=budget, devices=devices,
                processes=processes, hosts=hosts, peak_flops=peaks, launches=tuple(launches),
                **link)


def plan(config: RunConfig, *, model_fn=None, dataset_fn=None, spec=None, layout_rules=None,
         memory_budget: Optional[int] = None, allow_lossy: bool = False, processes: int = 1,
         hosts: int = 1, link_bandwidth: Optional[float] = None,
         trials: int = DEFAULT_TRIALS, search_seconds: float = DEFAULT_SEARCH_SECONDS,
         cap_trials: bool = False, launches: tuple = (), log: Callable = print,
         work_dir: Optional[str] = None) -> Plan:
    """Choose the engine and options for `config`'s model, data and global
    batch: `processes` worker processes over `hosts` hosts like this one
    (`link_bandwidth`, bytes/s each way, between them; trials run here, the
    links are predicted; `launches`: only engines started one of these ways,
    `records.LAUNCHES`, default any). Raises `UsageError` for bad input and
    for a budget no candidate fits."""
    started = time.monotonic()
    _check(memory_budget, trials, spec, dataset_fn, processes, hosts, link_bandwidth)
    functions = functions_lib.records(model_fn, dataset_fn, layout_rules, spec)
    host = host_facts(config, memory_budget, processes, allow_lossy, hosts, link_bandwidth,
                      launches)
    log(f"planning on {host.cpu}, {host.cores} cores, {host.devices} devices per process, "
        f"{processes} process(es)"
        + (f" over {hosts} hosts, {host.link_bytes_per_s * 8 / 1e6:,.0f} Mbit/s between them"
           if hosts > 1 else "")
        + f", memory budget {host.memory_budget / GiB:.2f} GiB per process")
    with tempfile.TemporaryDirectory(prefix="tfdist-plan-", dir=work_dir) as scratch:
        facts, once = _measured_facts(config, host, model_fn, dataset_fn, spec, layout_rules,
                                      functions, allow_lossy, search_seconds, log, scratch)
        started += once   # a host's own measurements, made once, are not the search's
        candidates = search_lib.enumerate_candidates(facts, allow_lossy)
        search_lib.adopt(candidates, facts)
        if not search_lib.rank(candidates):
            raise search_lib.too_small(candidates, host.memory_budget)
        log(f"{len(candidates)} candidates, {len(search_lib.rank(candidates))} predicted to fit;"
            f" trials of the best (at most {trials}, {search_seconds:.0f} s)")
        search = search_lib.Search(
            facts=facts, functions=functions, trials=trials,
            seconds=search_seconds - (time.monotonic() - started), cap=cap_trials, log=log,
            work_dir=scratch, trial_config=lambda c: trial_config(config, c, facts))
        winner = search_lib.run(search, candidates)
    if winner is None:
        failed = [c for c in candidates if c.trial]
        raise UsageError("every trial failed; the first: "
                         + (f"{failed[0].describe()}: {failed[0].trial.reason}" if failed
                            else "none ran"))
    return Plan(config=config, facts=facts, candidates=candidates, winner=winner,
                seconds=time.monotonic() - started)


def _check(memory_budget, trials, spec, dataset_fn, processes=1, hosts=1,
           link_bandwidth=None) -> None:
    if hosts < 1 or processes % hosts:
        raise UsageError(f"--plan_hosts={hosts}: must divide --plan_workers={processes} "
                         "(the same processes on each host)")
    if hosts > 1 and not link_bandwidth:
        raise UsageError(f"--plan_hosts={hosts}: give --link_bandwidth, the link between "
                         "the hosts (e.g. 10gbit; bench/allreduce.py measures one)")
    if memory_budget is not None and memory_budget <= 0:
        raise UsageError(f"--memory_budget={memory_budget}: must be a positive size")
    if trials < 1:
        raise UsageError(f"--plan_trials={trials}: at least one trial")
    if spec is not None and dataset_fn is None:
        raise UsageError("spec= is the shape of dataset_fn's data; give dataset_fn too")


def _measured_facts(config, host, model_fn, dataset_fn, spec, layout_rules, functions,
                    allow_lossy, search_seconds, log, scratch) -> tuple:
    """(The model's facts, its one-device measurements and each engine
    family's runtime; the seconds spent on this host's own measurements,
    which are cached). The processes this starts are the calibration."""
    from tfdist.data.inputs import of_run as inputs_of_run
    from tfdist.planner import calibrate, profile   # TensorFlow loads here
    inputs = inputs_of_run(config, dataset_fn, spec)
    model = profile.model_facts(config, inputs, model_fn, layout_rules)
    log(f"model {model.name}: {model.parameters:,} parameters, "
        f"{model.param_bytes / GiB:.3f} GiB (+ gradients and optimizer slots: "
        f"{model.trainable_bytes * (1 + model.slot_ratio) / GiB:.3f} GiB), "
        + (f"{model.flops_per_example / 1e6:,.1f} MFLOP per example" if model.flops_per_example
           else "FLOPs not countable"))
    steps = _steps_per_loop(model, host, config.train.global_batch_size)
    reads = Facts(model=model, calibration=None, host=host, global_batch=0,
                  shuffle_buffer=0 if config.data.synthetic else config.data.shuffle_buffer)
    calibration = calibrate.measure(config, steps, allow_lossy, functions, log, scratch,
                                    timeout=max(60.0, search_seconds / 2),
                                    buffer_bytes=reads.buffer_bytes)
    host_started = time.monotonic()
    families = runtime_families(reads)
    calibration.baselines, calibration.step_floors = calibrate.baselines(
        families, host.devices, config, inputs.spec.kind, functions, log, scratch,
        timeout=120.0)
    probes = {engine.name: search_lib.cost_model(engine).probes(host.devices)
              for engine in strategies.engines()
              if hasattr(search_lib.cost_model(engine), "probes")}
    calibration.probe = calibrate.probe(probes, host.devices, config, log, scratch)
    once = time.monotonic() - host_started
    if once > 10:
        log(f"this host's engine runtimes and probes took {once:.0f} s (cached: once per "
            "host; not counted in --search_seconds)")
    from tfdist.training.trainer import total_steps
    return Facts(model=model, calibration=calibration, host=host,
                 global_batch=config.train.global_batch_size,
                 shuffle_buffer=0 if config.data.synthetic else config.data.shuffle_buffer,
                 examples_read=total_steps(config.train, inputs.spec)
                 * config.train.global_batch_size), once


def runtime_families(facts: Facts) -> dict:
    """family -> (flags, processes) of the tiny runs measuring each engine
    family's runtime: the families of engines with candidates here, and the
    reference's always (the others are measured against it)."""
    families = {}
    for engine in strategies.engines():
        cost = search_lib.cost_model(engine)
        flags = cost.runtime_flags(facts.host.devices) if cost else None
        wanted = cost and (cost.family == strategies.REFERENCE or (
            facts.host.can_start(engine) and next(iter(cost.candidates(facts)), None) is not None))
        if flags and wanted:
            families.setdefault(cost.family, (flags, getattr(cost, "runtime_processes", 1)))
    return families


def trial_config(config: RunConfig, candidate: Candidate,
                 facts: Optional[Facts] = None) -> RunConfig:
    """`candidate`'s configuration, made a trial's (`calibrate.trial_config`):
    loops of about TIMED_SECONDS, or, for a candidate that changes the math,
    the calibration's loops (in `facts`), so that its loss compares with the
    float32 one-device run's (`Candidate.loss_change`)."""
    from tfdist.planner import calibrate
    steps = (facts.calibration.loop_steps
             if facts and facts.calibration and facts.calibration.loop_steps
             and not candidate.lossless else _trial_steps(candidate.predicted_seconds()))
    return calibrate.trial_config(search_lib.apply(config, candidate.engine, candidate.options),
                                  steps)


# A trial times its second loop (the first compiles): long enough that the
# host's noise is a few percent of it (measured on 2 cores: +-30% over 60 ms,
# +-5% over a second), short enough for 5-8 trials in the search's minutes.
TIMED_SECONDS = 1.5


def _steps_per_loop(model, host: Host, batch: int) -> int:
    """The calibration's loop, before anything is measured: about
    TIMED_SECONDS at a third of this host's matmul peak, 3 to 200 steps."""
    peak = host.peak_flops.get("float32")
    if not (model.flops_per_example and peak):
        return 20
    return _trial_steps(model.flops_per_example * batch / (peak / 3))


def _trial_steps(step_seconds: float) -> int:
    """A trial's loop: about TIMED_SECONDS of steps of `step_seconds`, 3 to 200."""
    if not (step_seconds and math.isfinite(step_seconds)):
        return 20
    return int(min(200, max(3, math.ceil(TIMED_SECONDS / step_seconds))))


__all__ = ["Plan", "parse_rate", "parse_size", "plan"]
