"""The search: candidates from every engine's cost model crossed with the
shared options a search may try, estimated, dropped where they would not
fit, ranked by predicted step time, the best measured in trials, the time
model refined from what the trials measured, and a winner chosen by
measurement.

Which candidates are tried first: the best predicted of each engine (an
engine's predictions are off by a factor of its own more than anything,
and one trial per engine measures it), then, with every engine's
predictions scaled by what its trial measured, the best not yet tried,
while one is predicted close enough to the best measured to win.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import time
from typing import Callable, Optional

from tfdist import config as config_lib
from tfdist import strategies
from tfdist.config import RunConfig
from tfdist.errors import UsageError
from tfdist.planner import trials as trials_lib
from tfdist.planner.costs import Estimate, Facts, GiB

# The shared options a search crosses with each engine's candidates, unless
# the engine sets them itself (a pipeline's micro-batches are its accum_steps).
SHARED = ("precision", "jit_compile", "accum_steps")


@dataclasses.dataclass
class Candidate:
    engine: str
    options: dict                 # option name -> value (the engine's, then the shared)
    estimate: Optional[Estimate] = None
    dropped: str = ""             # why it is not a candidate (over budget, ...)
    trial: Optional[trials_lib.TrialResult] = None
    factor: float = 1.0           # measured / predicted step time of its engine's trials
    # Its estimate for its trial's length (a short run fills less of the
    # shuffle buffer than the run asked for): what its trial's peak is compared with.
    trial_estimate: Optional[Estimate] = None
    calibrated: bool = False      # its trial was a calibration run (`adopt`)
    trial_loop: int = 0           # the steps of each of its trial's two loops

    def loss_change(self, calibration) -> Optional[float]:
        """Its trial's training loss against the calibration's float32
        one-device run (same data, same initial weights, same length), as a
        share of what that run reduced the loss by from the start: what
        changing the math cost over the trial's steps. None where its trial
        was of another length or a loss is missing. (Relative to the loss
        itself it would mislead: near zero, runs that keep the math measured
        up to 46% apart after 120 steps, from float rounding alone.)"""
        if calibration is None:
            return None
        reference, start = calibration.reference_loss, calibration.start_loss
        loss = (self.trial.runs[-1].get("loss") if self.trial and self.trial.ok
                and self.trial.runs else None)
        if (loss is None or reference is None or start is None or start <= reference
                or not calibration.loop_steps or self.trial_loop != calibration.loop_steps):
            return None
        return (loss - reference) / (start - reference)

    def expected_peak(self) -> float:
        """The predicted peak its measurement is compared with (its trial's
        where it was tried, else the run's)."""
        return (self.trial_estimate or self.estimate).peak_bytes

    @property
    def lossless(self) -> bool:
        return not _lossy_options(self.options)

    def describe(self) -> str:
        """The engine and its options as flags: the engine's layout always
        (a mesh, a ZeRO stage, stages), the shared options where not default."""
        parts = [self.engine]
        for name, value in self.options.items():
            if name == "virtual_devices" or (name in SHARED and value == _default(name)):
                continue
            parts.append(f"{_flag(name)}={_shown(value)}")
        return " ".join(parts)

    def predicted_seconds(self) -> float:
        """Its step time: the terms its trials can measure scaled by what
        they measured, plus the time on the links between hosts."""
        link = self.estimate.link_seconds
        return (self.estimate.step_seconds - link) * self.factor + link

    @property
    def group(self) -> tuple:
        """What its predictions are off by alike: its engine and how its
        gradients cross (a compression's own cost is predicted less well)."""
        return (self.engine, self.options.get("grad_compression", "none"),
                bool(self.options.get("sync_every")))

    def predicted_rate(self, batch: int) -> float:
        seconds = self.predicted_seconds()
        return batch / seconds if seconds and math.isfinite(seconds) else 0.0

    def measured_rate(self) -> Optional[float]:
        return self.trial.examples_per_sec if self.trial and self.trial.ok else None

    def expected_rate(self, batch: int) -> Optional[float]:
        """Its examples/s on the cluster planned for: what its trial measured,
        where the trial ran it as planned (one host); over several hosts,
        its computation as measured here plus its predicted time on the
        links between them."""
        rate = self.measured_rate()
        if not rate or not self.estimate.link_seconds:
            return rate
        own = batch / rate / (self.trial_estimate or self.estimate).step_seconds
        link = self.estimate.link_seconds
        return batch / ((self.estimate.step_seconds - link) * own + link)

    def measured_peak(self) -> Optional[float]:
        return max(self.trial.peaks) if self.trial and self.trial.peaks else None


def _fields() -> dict:
    """option name -> (part, field) of every declared option."""
    return {field.name: (part, field) for part, field in config_lib.options()}


def _default(name: str):
    part, field = _fields()[name]
    return field.default


def _flag(name: str) -> str:
    return "--" + config_lib.flag_name(_fields()[name][1])


def _shown(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _lossy_options(options: dict) -> list:
    """The options whose value changes the math from the default's."""
    fields = _fields()
    return [name for name, value in options.items()
            if name in fields and config_lib.declaration(fields[name][1]).math
            and value != fields[name][1].default]


def apply(config: RunConfig, engine: str, options: dict) -> RunConfig:
    """`config` with the candidate's engine and options set."""
    fields = _fields()
    parts = {"strategy": {"name": engine}}
    for name, value in options.items():
        parts.setdefault(fields[name][0], {})[name] = value
    return config.replace(**{part: dataclasses.replace(getattr(config, part), **values)
                             for part, values in parts.items()})


def cost_model(engine) -> Optional[object]:
    if not engine.cost:
        return None
    module, _, name = engine.cost.partition(":")
    return getattr(importlib.import_module(module), name)


def shared_values(name: str, lossy: bool) -> tuple:
    """The values a search tries for shared option `name`: its declared
    `tunable` values, without those that change the math unless `lossy`."""
    part, field = _fields()[name]
    declared = config_lib.declaration(field)
    values = tuple(declared.tunable) or (field.default,)
    if declared.math and not lossy:
        values = tuple(v for v in values if v == field.default)
    return values


def enumerate_candidates(facts: Facts, lossy: bool) -> list:
    """Every engine's candidates crossed with the shared options, estimated;
    those that cannot run or would not fit marked `dropped`."""
    found = []
    for engine in strategies.engines():
        model = cost_model(engine)
        if model is None or (not engine.synchronous and not lossy):
            continue
        if not facts.host.can_start(engine):
            continue      # these processes were not started as its are
        xla = strategies.adapter_class(engine).supports_xla   # the engine's own fact
        for layout in model.candidates(facts):
            combos = [dict(layout)]
            for name in SHARED:
                if name in layout:
                    continue
                values = shared_values(name, lossy)
                if name == "jit_compile" and not xla:
                    values = ("off",)
                combos = [{**c, name: v} for c in combos for v in values]
            for options in combos:
                if not lossy and _lossy_options(options):
                    continue      # an engine's own choice that changes the math
                found.append(_estimated(Candidate(engine.name, options), model, facts))
    return found


def _estimated(candidate: Candidate, model, facts: Facts) -> Candidate:
    options = candidate.options
    batch, accum = facts.global_batch, options["accum_steps"]
    replicas = model.replicas(facts, options)
    if batch % (replicas * accum):
        candidate.dropped = (f"the global batch {batch} does not divide into {replicas} "
                             f"replica(s) x {accum} micro-batch(es)")
        return candidate
    if facts.rate(options["precision"], options["jit_compile"]) is None:
        candidate.dropped = "not measured on this host (no calibration run for it)"
        return candidate
    candidate.estimate = estimate(model, facts, options)
    budget = facts.host.memory_budget
    if candidate.estimate.peak_bytes > budget:
        candidate.dropped = (f"predicted {candidate.estimate.peak_bytes / GiB:.2f} GiB per "
                             f"process, over the budget of {budget / GiB:.2f} GiB")
    return candidate


@dataclasses.dataclass
class Search:
    """A search's state and settings (see `run`)."""

    facts: Facts
    trial_config: Callable        # candidate -> the RunConfig of its trial
    functions: dict
    trials: int = 5
    seconds: float = 180.0
    cap: bool = False             # trials under a memory cap at the budget
    log: Callable = print
    work_dir: Optional[str] = None
    started: float = dataclasses.field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.started)


def rank(candidates: list) -> list:
    """The candidates that may run, fastest predicted first."""
    live = [c for c in candidates if not c.dropped]
    return sorted(live, key=lambda c: (c.predicted_seconds(), c.describe()))


def run(search: Search, candidates: list) -> Optional[Candidate]:
    """Trials of the best candidates; returns the winner (best measured
    examples/s), or None if every trial failed."""
    batch = search.facts.global_batch
    _refine(candidates, batch)
    if not rank(candidates):
        return None
    firsts = first_trials(candidates)
    tried = 0
    queue = firsts
    while tried < search.trials and search.left() > 0:
        pending = [c for c in queue if c.trial is None]
        if not pending:
            _refine(candidates, batch)
            pending = [c for c in rank(candidates) if c.trial is None]
            if not pending or not _worth_a_trial(pending[0], candidates, search):
                break
            queue = pending
        candidate = pending[0]
        measure(search, candidate, tried + 1)
        tried += 1
    _refine(candidates, batch)
    return winner(candidates, batch, search.facts.calibration)


def first_trials(candidates: list) -> list:
    """The best predicted of each engine (and compression) not yet measured,
    the best that keeps the math first where none that does is measured
    (what a lossy pick must beat, `winner`)."""
    order = rank(candidates)
    measured = [c for c in candidates if c.measured_rate()]
    firsts, seen = [], {c.group for c in measured}
    for candidate in order:
        if candidate.group not in seen:
            seen.add(candidate.group)
            firsts.append(candidate)
    lossless = next((c for c in order if c.lossless), None)
    if (lossless is not None and lossless not in firsts
            and not any(c.lossless for c in measured)):
        firsts.insert(0, lossless)
    return firsts


def adopt(candidates: list, facts: Facts) -> None:
    """The calibration's one-device runs at the whole batch as those
    candidates' trials (the same engine, options and length): the search
    does not run them again."""
    for run in facts.calibration.runs:
        for c in candidates:
            if (c.engine == strategies.REFERENCE and not c.dropped and c.trial is None
                    and all(c.options.get(k) == v for k, v in run.options.items())):
                c.trial_estimate = _trial_estimate(facts, c, run.reads)
                c.trial = trials_lib.TrialResult(ok=True, reason="", seconds=run.seconds,
                                                 runs=[run.record],
                                                 peaks=[run.peak] if run.peak else [])
                c.calibrated = True
                c.trial_loop = facts.calibration.loop_steps


def _trial_estimate(facts: Facts, candidate: Candidate, reads: float) -> Estimate:
    """`candidate`'s estimate for a trial reading `reads` examples, every
    process on this host (what a trial runs)."""
    return estimate(cost_model(strategies.engine(candidate.engine)),
                    dataclasses.replace(facts, examples_read=reads, host=facts.host.one_host()),
                    candidate.options)


def estimate(cost, facts: Facts, options: dict) -> Estimate:
    """`cost`'s estimate (an engine's cost model) with what every engine's
    step shares: what its family's runtime adds to each step (measured)."""
    found = cost.estimate(facts, options)
    extra = facts.runtime_step_seconds(found.family)
    if extra > 0:
        found.time["runtime per step (its family's, measured)"] = extra
    return found


# A choice that changes the math wins only where it is this much faster than
# the best that does not (measured): a user who allows them trades accuracy
# for time, not for the trials' noise.
LOSSY_GAIN = 1.10
# ... and only where its trial's training loss is above the float32
# one-device run's (after the same steps from the same weights on the same
# data) by at most this share of what that run reduced the loss by. Choices
# that keep the math measure within float rounding of it (the mlp, 120
# steps: XLA and 8 micro-batches 0.0%; mirrored's loss 46% below the
# reference's, which is 0.2% of the reduction).
LOSS_ALLOWANCE = 0.02


def winner(candidates: list, batch: int, calibration=None) -> Optional[Candidate]:
    """The candidate that keeps the math expected fastest on the cluster
    (measured, on one host), unless one that changes it is expected at least
    LOSSY_GAIN times faster and its loss was measured within LOSS_ALLOWANCE
    of the reference's (`Candidate.loss_change`)."""
    def rate(c):
        return c.expected_rate(batch)

    def acceptable(c):
        if c.lossless:
            return True
        change = c.loss_change(calibration)
        return change is not None and change <= LOSS_ALLOWANCE

    measured = [c for c in candidates if c.measured_rate()]
    if not measured:
        return None
    lossless = [c for c in measured if c.lossless]
    if not lossless:
        return max(measured, key=rate)
    best = max((c for c in measured if acceptable(c)), key=rate)
    kept = max(lossless, key=rate)
    return best if best.lossless or rate(best) >= LOSSY_GAIN * rate(kept) else kept


# A candidate is worth a trial after every engine's first while its refined
# prediction is within this share of the best measured: closer than the
# trials' noise (+-5% over a timed second and a half on 2 cores) it could win.
WORTH = 0.95


def _worth_a_trial(candidate: Candidate, candidates: list, search: Search) -> bool:
    batch = search.facts.global_batch
    best = max((c.expected_rate(batch) for c in candidates if c.measured_rate()),
               default=None)
    if best is None or candidate.predicted_rate(batch) >= WORTH * best:
        return True
    search.log(f"no trial left is predicted within {1 - WORTH:.0%} of the best measured "
               f"({best:.0f} examples/s; next {candidate.describe()}: "
               f"{candidate.predicted_rate(batch):.0f} predicted): the search ends")
    return False


def measure(search: Search, candidate: Candidate, number: int) -> None:
    """Run `candidate`'s trial (its own length and processes); its result and the
    estimate for that length are set on it."""
    estimate = candidate.estimate
    timeout = max(30.0, min(search.left(), 240.0))
    cap = int(search.facts.host.memory_budget) if search.cap else None
    short = search.trial_config(candidate)
    candidate.trial_loop = short.train.steps_per_loop
    reads = short.train.train_steps * short.train.global_batch_size
    candidate.trial_estimate = _trial_estimate(search.facts, candidate, reads)
    search.log(f"trial {number}/{search.trials}: {candidate.describe()} (predicted "
               f"{candidate.predicted_rate(search.facts.global_batch):.0f} examples/s, "
               f"{candidate.trial_estimate.peak_bytes / GiB:.2f} GiB per process for the "
               "trial)")
    candidate.trial = trials_lib.run([config_lib.as_flags(short)],
                                     processes=estimate.processes, functions=search.functions,
                                     cap=cap, timeout=timeout, work_dir=search.work_dir)
    trial = candidate.trial
    if trial.ok:
        search.log(f"  measured {trial.examples_per_sec:.0f} examples/s, peak "
                   f"{max(trial.peaks) / GiB:.2f} GiB per process, {trial.seconds:.0f} s")
    else:
        search.log(f"  failed after {trial.seconds:.0f} s: {trial.reason}")


def _refine(candidates: list, batch: int) -> None:
    """Scale each group's (engine's, compression's) predicted step times by
    the geometric mean of measured / predicted over its trials (predicted
    for the trial: every process on this host)."""
    ratios = {}
    for c in candidates:
        rate = c.measured_rate()
        predicted = (c.trial_estimate or c.estimate).step_seconds if c.estimate else 0.0
        if rate and predicted:
            ratios.setdefault(c.group, []).append(batch / rate / predicted)
    for c in candidates:
        found = ratios.get(c.group)
        if found:
            c.factor = math.exp(sum(math.log(r) for r in found) / len(found))


def too_small(candidates: list, budget: float) -> UsageError:
    """The error for a budget no candidate fits: the closest and by how much."""
    sized = [c for c in candidates if c.estimate is not None]
    if not sized:
        reasons = sorted({c.dropped for c in candidates})
        return UsageError("no candidate can run: " + "; ".join(reasons[:3]))
    closest = min(sized, key=lambda c: c.estimate.peak_bytes)
    over = closest.estimate.peak_bytes - budget
    return UsageError(f"--memory_budget={size_text(budget)} is too small for every "
                      f"candidate; the closest, {closest.describe()}, needs "
                      f"{size_text(closest.estimate.peak_bytes)} per process "
                      f"({over / 2**20:.0f} MiB more)")


def size_text(nbytes: float) -> str:
    """Bytes for a person: MiB below a GiB, else GiB with two decimals."""
    return f"{nbytes / 2**20:.0f}M" if nbytes < GiB else f"{nbytes / GiB:.2f}G"
