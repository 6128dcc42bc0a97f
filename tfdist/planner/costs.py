"""What every engine's cost model shares: the facts a plan is made from and
the formulas over them. No engine is named here; each engine states its own
candidates and costs beside its adapter (`Engine.cost`), in these terms. An
estimate is a sum of named terms (`tfdist-plan --explain` prints them):
- memory, bytes of the largest process: the resident baseline of the
  engine's family (TensorFlow, Keras, the input pipeline; measured), the
  training state it holds (by layout, ZeRO stage and pipeline stage),
  activations (measured at two batch sizes on one device) and transients;
- time, seconds per step: the computation at the rate measured for this
  model on this host (per precision and XLA setting), what the family's
  runtime adds to every step (measured on a tiny model), then what the
  engine adds (reductions over an alpha-beta link model, a pipeline's
  bubble, ZeRO-3's second forward pass). Trials measure the best, and each
  engine's predictions are scaled by what its trials measured.
No TensorFlow here: the formulas are plain arithmetic over `Facts`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Optional

# The engine the calibration runs on (one device), whose runtime the others'
# are measured against.
from tfdist.strategies import REFERENCE

GiB = 2**30
MiB = 2**20


@dataclasses.dataclass(frozen=True)
class Variable:
    """One of the model's variables: where it is, its size, whether trained."""

    path: str
    shape: tuple
    itemsize: int
    trainable: bool

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of a pipeline split: its parameter bytes and forward FLOPs
    per example (its share of the activations and of the time), and the
    bytes per example of the activation it receives from the stage before
    (0 for the first)."""

    param_bytes: int
    flops: int
    input_bytes: int = 0


@dataclasses.dataclass
class ModelFacts:
    """The model as the planner sees it (read from the built model, nothing trained)."""

    name: str
    variables: list              # [Variable]
    slot_ratio: float            # optimizer slot bytes per trainable variable byte
    flops_per_example: Optional[int]   # forward + backward, or None if not countable
    # Pipeline splits the planner may try: stages -> [Stage], or the reason
    # the model cannot be split so (a string).
    splits: dict = dataclasses.field(default_factory=dict)
    layout_rules: object = None  # `sharding.LayoutRules` for tensor sharding, or None
    signature: str = ""          # what identifies the model (for the cache key)
    buffered_example_bytes: float = 0.0   # one example in the shuffle buffer
    # Operations in the graph of one micro-batch's forward and backward pass
    # (traced on one device with Keras's own kernels), or None if not traced:
    # what an engine that holds each step's graph per device pays for.
    step_ops: Optional[int] = None

    @property
    def param_bytes(self) -> int:
        return sum(v.bytes for v in self.variables)

    @property
    def trainable_bytes(self) -> int:
        return sum(v.bytes for v in self.variables if v.trainable)

    @property
    def parameters(self) -> int:
        return sum(math.prod(v.shape) for v in self.variables)

    @property
    def largest_variable_bytes(self) -> int:
        return max((v.bytes for v in self.variables), default=0)


@dataclasses.dataclass
class Probe:
    """The probe model (`calibrate.probe`) measured on one device and under
    engines' probe options: what an engine holds beyond its cost model's
    terms, per byte of the model, where that is more than noise. `peaks`:
    "<engine> <variant>" -> peak resident bytes; `reference`: the one-device
    run's peak; `rates`: "<engine> <variant>" -> examples/s, and the
    one-device runs' by micro-batches, `reference_rates`: accum -> examples/s."""

    model: ModelFacts
    batch: int
    reference: float
    peaks: dict
    rates: dict = dataclasses.field(default_factory=dict)
    reference_rates: dict = dataclasses.field(default_factory=dict)
    # The same runs of a deep, narrow mlp (many operations, few bytes), its
    # peaks only: what an engine holds per graph operation, not per byte.
    graph: Optional["Probe"] = None
    reference_peaks: dict = dataclasses.field(default_factory=dict)   # accum -> one device's

    def loop_bytes_per_op(self) -> float:
        """What one device holds per operation of a micro-batch's graph once
        micro-batches run in a loop (its body, a second copy of the graph):
        this probe at its most micro-batches against one, per operation of
        its model (a 24-layer mlp of 16 units: 0.09 MiB); 0 unmeasured."""
        if not self.reference_peaks or not self.model.step_ops:
            return 0.0
        most = self.reference_peaks[max(self.reference_peaks)]
        return max(0.0, most - self.reference) / self.model.step_ops

    def micro_batch_factor(self, engine: str, one: str, most: str, accum: int
                           ) -> Optional[float]:
        """What a further micro-batch costs under `engine`'s probe variant
        `most` (`accum` micro-batches) beyond its variant `one` (one
        micro-batch), as a multiple of what it costs on one device; None
        where a rate is missing or one device's cost is within noise."""
        def seconds(rate):
            return self.batch / rate if rate else None

        times = [seconds(self.rates.get(f"{engine} {one}")),
                 seconds(self.rates.get(f"{engine} {most}")),
                 seconds(self.reference_rates.get(1)), seconds(self.reference_rates.get(accum))]
        if None in times or accum < 2:
            return None
        engine_more = max(0.0, times[1] - times[0])
        reference_more = times[3] - times[2]
        # Below 2% of its step the one-device cost is the timing's noise: no factor.
        if reference_more <= 0.02 * times[2]:
            return None
        return engine_more / reference_more


@dataclasses.dataclass
class OneDeviceRun:
    """A calibration run at the whole batch: a one-device candidate measured."""

    options: dict                # precision, jit_compile, accum_steps
    record: dict                 # its trial record (examples/s, peak so far)
    peak: Optional[float]        # its own peak, where it was its process's first run
    seconds: float               # its process's
    reads: float                 # examples it read (its shuffle buffer's filling)


@dataclasses.dataclass
class Calibration:
    """What was measured for this model on this host (`calibrate.py`).
    `points`: (batch, peak resident bytes) of the one-device float32 runs
    without XLA; `peaks16`: (batch, peak) of the mixed_bfloat16 run, if
    measured; `rates`: (precision, jit) -> examples/s at the larger batch;
    `baselines`: engine family -> the peak of a tiny model under it (what
    the family's runtime costs beyond the one-device engine's), and
    `step_floors`: its seconds per step (what a step costs there whatever
    the model); `times`:
    (batch, seconds per step) of the two float32 runs; `runs`: those at the
    whole batch, the one-device candidates' measurements."""

    points: tuple                # (batch, peak less its shuffle buffer's bytes)
    rates: dict
    baselines: dict
    step_floors: dict = dataclasses.field(default_factory=dict)
    peaks16: Optional[tuple] = None
    times: tuple = ()
    xla_bytes: float = 0.0       # what a process's peak grew by when its step was compiled
    # (micro-batch, peak) of the whole batch in micro-batches, each compiled,
    # or None if not measured: what compiling adds to a program without the
    # update, not the whole step's (the cnn: 423 MiB for the whole step at
    # batch 256, 87-97 in 2-8 micro-batches).
    xla_micro: Optional[tuple] = None
    # What one further micro-batch added to a step (one device, without and
    # with XLA: the whole batch against it in 8), negative where the step ran
    # faster in micro-batches; None if not measured.
    micro_batch_seconds: Optional[float] = None
    micro_batch_seconds_xla: Optional[float] = None
    probe: Optional[Probe] = None
    runs: list = dataclasses.field(default_factory=list)
    # The loop the calibration ran (two of them), and the training loss of its
    # float32 one-device run at the whole batch: the math every candidate
    # keeps or changes, on the same data from the same weights. A trial of
    # the same length compares its loss with it (`Candidate.loss_change`), as
    # a share of what the reference reduced the loss by from the start
    # (`start_loss`: a run's second step, one-step loops).
    loop_steps: int = 0
    reference_loss: Optional[float] = None
    start_loss: Optional[float] = None

    def slope(self) -> float:
        """Activation bytes per example (float32), from the two batch sizes."""
        (b1, p1), (b2, p2) = self.points
        return max(0.0, (p2 - p1) / (b2 - b1))

    def intercept(self) -> float:
        (b1, p1), _ = self.points
        return p1 - self.slope() * b1


@dataclasses.dataclass
class Host:
    """This host and the cluster planned for."""

    cpu: str
    cores: int
    memory_budget: int           # bytes each process may use
    devices: int                 # devices each process may split its share over
    processes: int = 1           # processes planned for (a cluster's size)
    hosts: int = 1               # distinct hosts among them
    peak_flops: dict = dataclasses.field(default_factory=dict)   # precision -> FLOP/s
    link_bytes_per_s: float = 1.0e9     # between hosts (--link_bandwidth)
    link_latency_s: float = 1.0e-4
    loopback_bytes_per_s: float = 1.0e9  # between the processes of one host
    loopback_latency_s: float = 1.0e-4
    local_bytes_per_s: float = 4.0e9    # between the devices of one process (memory copies)
    # The ways of starting processes a choice may need (`records.LAUNCHES`):
    # `--strategy=auto` can only run an engine the way its processes were
    # started; empty: any (tfdist-plan prints how to start the winner).
    launches: tuple = ()

    def can_start(self, engine) -> bool:
        """Whether a choice may need `engine`'s way of starting processes."""
        return not self.launches or engine.launch in self.launches

    def one_host(self) -> "Host":
        """This cluster with every process on this host: what a trial runs."""
        return dataclasses.replace(self, hosts=1)


@dataclasses.dataclass
class Facts:
    """Everything a cost model reads: the model, what was measured, the
    host, and the run's fixed choices (the global batch; the optimizer)."""

    model: ModelFacts
    calibration: Calibration
    host: Host
    global_batch: int
    shuffle_buffer: int = 0      # examples the input pipeline's shuffle holds at most
    examples_read: float = math.inf   # by each process over the run (fills the buffer)

    # -- memory ----------------------------------------------------------------
    def base(self, family: str) -> float:
        """The resident bytes of a process of engine family `family` before
        the model's state and activations: one device's measured intercept
        less its state, plus what the family's runtime adds (measured on a
        tiny model)."""
        one_device = self.calibration.intercept() - self.state_total()
        baselines = self.calibration.baselines
        reference = baselines.get(REFERENCE, 0)
        return max(0.0, one_device) + max(0.0, baselines.get(family, reference) - reference)

    def buffer_bytes(self, examples_read: Optional[float] = None) -> float:
        """The shuffle buffer's bytes once `examples_read` passed through it."""
        read = self.examples_read if examples_read is None else examples_read
        return min(self.shuffle_buffer, read) * self.model.buffered_example_bytes

    def state_total(self) -> float:
        model = self.model
        return model.param_bytes + model.trainable_bytes * (1 + model.slot_ratio)

    def activation_bytes(self, examples: float, precision: str) -> float:
        """Bytes of activations for `examples` in flight in one process."""
        return self.slope(precision) * examples

    def slope(self, precision: str) -> float:
        calibration = self.calibration
        if precision != "float32" and calibration.peaks16:
            batch, peak = calibration.peaks16
            return max(0.0, (peak - calibration.intercept()) / batch)
        return calibration.slope()

    # -- time ------------------------------------------------------------------
    def rate(self, precision: str, jit: str) -> Optional[float]:
        """Measured examples/s of one device for this model, or None."""
        return self.calibration.rates.get((precision, jit))

    def compute_seconds(self, examples: float, precision: str, jit: str) -> float:
        rate = self.rate(precision, jit)
        return examples / rate if rate else math.inf

    def micro_batch_overhead(self, jit: str = "off") -> float:
        """Seconds each micro-batch beyond the first adds to a step, at least
        0: measured (the same batch whole and in 8 micro-batches on one
        device, with and without XLA), else the step's fixed cost
        (`step_overhead`), which also holds the update and the host's loop,
        made once per step."""
        measured = self._further_micro_batch(jit)
        return self.step_overhead() if measured is None else max(0.0, measured)

    def _further_micro_batch(self, jit: str) -> Optional[float]:
        """Calibration's seconds per further micro-batch with this XLA
        setting (without XLA where that was not measured), or None."""
        measured = (self.calibration.micro_batch_seconds_xla if jit == "on" else None)
        return self.calibration.micro_batch_seconds if measured is None else measured

    def micro_batches_seconds(self, jit: str, count: int) -> float:
        """Seconds `count` micro-batches add to one device's step against the
        whole batch in one, negative where the step ran faster in them (a
        smaller micro-batch's activations stay in the caches: the
        transformer's compiled step on a 2-core Zen 4 EPYC ran 648, 682, 734
        and 757 examples/s whole and in 2, 4 and 8; the cnn's plain one
        1729, 1701, 1587, 1344): linear in the micro-batches, through the
        runs whole and in 8; unmeasured, the fixed cost per further
        micro-batch (`micro_batch_overhead`)."""
        further = self._further_micro_batch(jit)
        return (count - 1) * (self.micro_batch_overhead(jit) if further is None else further)

    def step_overhead(self) -> float:
        """Seconds a step costs whatever its batch (launching its ops, the
        host loop), from the step times at the two measured batch sizes."""
        times = self.calibration.times
        if len(times) != 2:
            return 0.0
        (b1, t1), (b2, t2) = times
        per_example = (t2 - t1) / (b2 - b1)
        return max(0.0, t1 - per_example * b1)

    def concurrency(self, precision: str, devices: int) -> float:
        """How much faster `devices` kept busy at once compute than one:
        at most the cores, and at most what the best one device (with or
        without XLA: a slower step uses the cores worse, not less; measured,
        XLA's gain on 2 virtual devices as on one, 1.38x and 1.45x) leaves of
        the host's matmul peak (a device at 40% of it gains at most 2.5x)."""
        rate = max((r for (p, _), r in self.calibration.rates.items()
                    if p == precision and r), default=None)
        peak = self.host.peak_flops.get(precision)
        flops = self.model.flops_per_example
        if devices <= 1 or not (rate and peak and flops):
            return 1.0
        return max(1.0, min(devices, self.host.cores, peak / (rate * flops)))

    def concurrent_seconds(self, examples: float, precision: str, jit: str,
                           devices: int) -> float:
        """`compute_seconds` for `devices` of one host working at once."""
        return (self.compute_seconds(examples, precision, jit)
                / self.concurrency(precision, devices))

    def runtime_step_seconds(self, family: str) -> float:
        """A step's cost under `family`'s runtime beyond one device's (tiny models')."""
        floors = self.calibration.step_floors
        return max(0.0, floors.get(family, 0.0) - floors.get(REFERENCE, math.inf))


def _link(facts: Facts, local: bool) -> tuple:
    """(bytes/s, latency s) of the slowest link a collective crosses: memory
    copies within a process, the loopback between processes of one host,
    else the link between hosts."""
    host = facts.host
    if local:
        return host.local_bytes_per_s, 0.0
    if host.hosts > 1:
        return host.link_bytes_per_s, host.link_latency_s
    return host.loopback_bytes_per_s, host.loopback_latency_s


def all_reduce_seconds(facts: Facts, nbytes: float, members: int, local: bool) -> float:
    """A ring all-reduce of `nbytes` among `members`: 2(n-1)/n of the bytes
    cross each link, in 2(n-1) latency-bound rounds (the alpha-beta model)."""
    if members <= 1:
        return 0.0
    speed, latency = _link(facts, local)
    return latency * 2 * (members - 1) + 2 * (members - 1) / members * nbytes / speed


def all_gather_seconds(facts: Facts, nbytes: float, members: int, local: bool) -> float:
    """A ring all-gather of `nbytes` from each of `members`: each receives
    the other (n-1) shares, in n-1 rounds."""
    if members <= 1:
        return 0.0
    speed, latency = _link(facts, local)
    return latency * (members - 1) + (members - 1) * nbytes / speed


def send_seconds(facts: Facts, nbytes: float, messages: int, local: bool) -> float:
    """`messages` point-to-point sends of `nbytes` in all."""
    speed, latency = _link(facts, local)
    return latency * messages + nbytes / speed


@dataclasses.dataclass
class Estimate:
    """One candidate's predicted cost: terms by name (bytes of its largest
    process, seconds per step), and how many processes it starts."""

    memory: dict
    time: dict
    processes: int = 1
    family: str = REFERENCE      # the runtime whose resident baseline applies
    # Time terms spent on the links between hosts: a trial on one host does
    # not measure them, so what trials measured does not scale them.
    over_link: tuple = ()

    @property
    def peak_bytes(self) -> float:
        return sum(self.memory.values())

    @property
    def step_seconds(self) -> float:
        return sum(self.time.values())

    @property
    def link_seconds(self) -> float:
        return sum(self.time.get(name, 0.0) for name in self.over_link)


def state(facts: Facts, params: float = 1.0, grads: float = 1.0, slots: float = 1.0,
          accumulator: float = 0.0) -> dict:
    """Memory terms of the training state at the given fractions (copies) of
    the whole model's: parameters, gradients, optimizer slots, accumulator."""
    model = facts.model
    terms = {"parameters": model.param_bytes * params,
             "gradients": model.trainable_bytes * grads,
             "optimizer slots": model.trainable_bytes * model.slot_ratio * slots}
    if accumulator:
        terms["accumulated gradients"] = model.trainable_bytes * accumulator
    return terms


def base_terms(facts: Facts, family: str, jit: str = "off", accum: int = 1,
               replicas: int = 1, update_compiled: bool = False) -> dict:
    """The process's resident baseline, and XLA's compilation where the step
    is compiled: the whole step's as measured where one program holds the
    forward, the backward and the update (`update_compiled`, one
    micro-batch: one device), else what a program without the update held
    (calibration's run in compiled micro-batches, beyond the plain run's
    predicted peak at that micro-batch), on each of the process's
    `replicas`, which run theirs at once: micro-batches, and replicas whose
    gradients are summed between their programs and the update (mirrored
    with XLA at one micro-batch, measured on 2 virtual CPU devices of a Zen
    4 EPYC: the cnn's programs held 290-306 MiB beyond the plain
    prediction, twice its compiled micro-batch's, not the whole step's
    494)."""
    terms = {"runtime": facts.base(family), "shuffle buffer": facts.buffer_bytes()}
    calibration = facts.calibration
    compiled = calibration.xla_bytes
    if calibration.xla_micro and not (accum == 1 and update_compiled):
        micro, peak = calibration.xla_micro
        compiled = replicas * max(0.0, peak - calibration.intercept()
                                  - calibration.slope() * micro - facts.model.trainable_bytes)
    if jit == "on" and compiled:
        terms["XLA compilation"] = compiled
    return terms


def dividers(n: int) -> Iterable[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
