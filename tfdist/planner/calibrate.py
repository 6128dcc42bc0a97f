"""What the planner measures before it predicts: the model on one device at
two batch sizes (activation bytes per example and the step's fixed cost),
its rate per precision and XLA setting, and what each engine family's
runtime adds to a process's resident memory (a tiny model under each,
cached per host, TensorFlow and tfdist version)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import os
from typing import Callable, Optional

import tensorflow as tf

from tfdist import strategies
from tfdist.config import RunConfig, as_flags
from tfdist.errors import UsageError
from tfdist.observe import hardware
from tfdist.planner import trials as trials_lib
from tfdist.planner.costs import Calibration, OneDeviceRun, Probe

CACHE_VERSION = 7
# A loop of 100 steps, twice: an engine's resident memory grows over its first
# long loop (dtensor's, by 0.14 GiB from a 10-step loop to a 100-step one, then
# flat; one device's not at all), and a trial's loop is about as long. Without
# XLA: `--jit_compile=auto` compiles one engine's step and not another's, and
# the compilation's bytes (measured per model) would pass for the runtime's.
TINY_BATCH = 32
LOOPS = [f"--global_batch_size={TINY_BATCH}", "--train_steps=200", "--steps_per_loop=100",
         "--jit_compile=off"]
TINY = ["--model_width=16", "--model_depth=2", "--num_heads=2", *LOOPS]
# The tiny model for a kind of data: the run's own data, so the family's
# input pipeline is measured too (a width-16 mlp at batch 256 on the bundled
# images peaked at 0.81 GiB under dtensor, 0.62 on one device).
TINY_MODEL = {"image": "mlp", "tokens": "transformer", "text": "transformer"}


def trial_config(config: RunConfig, steps_per_loop: int) -> RunConfig:
    """`config` made a trial's: two loops (the first, which compiles, is not
    timed), nothing written, nothing evaluated during training."""
    train = dataclasses.replace(config.train, train_steps=2 * steps_per_loop, epochs=None,
                                steps_per_loop=steps_per_loop, model_dir=None, export_dir=None,
                                checkpoint_every=0, eval_every=0, log_every=0, profile_steps=())
    return config.replace(train=train)


def measure(config: RunConfig, steps_per_loop: int, lossy: bool, functions: dict,
            log: Callable, work_dir: Optional[str], timeout: float,
            buffer_bytes: Callable[[float], float]) -> Calibration:
    """One-device processes: float32 at a quarter of the global batch and at
    the whole (again in micro-batches), with XLA in micro-batches then whole
    (each peak its own, the larger after the smaller), and, if `lossy`,
    mixed_bfloat16 at the whole (without, then with XLA). At the whole
    batch these runs are the one-device candidates' own: each is kept in
    `Calibration.runs` (its peak where it was its process's first run), and
    the search does not try them again. `buffer_bytes(examples read)`: the
    shuffle buffer's bytes, taken off each peak (a run of the length asked
    for fills it further, which the estimates add back)."""
    batch = config.train.global_batch_size
    small, large = max(1, batch // 4), max(2, batch)
    if lossy and hardware.bf16_refusal():   # its runs would be refused: no bf16 candidates
        log(f"no mixed_bfloat16 candidates: {hardware.bf16_refusal()}")
        lossy = False
    processes = _processes(small, large, lossy)
    results = [_calibration_run(number, len(processes), config, steps_per_loop, runs,
                                functions, log, work_dir, timeout)
               for number, runs in enumerate(processes, 1)]

    def peak(record, size):
        return record["peak_bytes"] - buffer_bytes(2 * steps_per_loop * size)

    (first, start), (second, *split), (*compiled_split, compiled) = [
        r.runs for r in results[:3]]
    further = functools.partial(_further, large, _parts(large))

    rates = {("float32", "off"): second["examples_per_sec"],
             ("float32", "on"): compiled["examples_per_sec"]}
    peaks16 = None
    if lossy:
        rates[("mixed_bfloat16", "off")] = results[3].runs[0]["examples_per_sec"]
        rates[("mixed_bfloat16", "on")] = results[3].runs[1]["examples_per_sec"]
        peaks16 = (large, peak(results[3].runs[0], large))
    return Calibration(
        points=((small, peak(first, small)), (large, peak(second, large))),
        rates=rates, baselines={}, peaks16=peaks16,
        xla_bytes=max(0, compiled["peak_bytes"] - second["peak_bytes"]),
        times=((small, small / first["examples_per_sec"]),
               (large, large / second["examples_per_sec"])),
        micro_batch_seconds=further(second, split),
        xla_micro=((large // _parts(large), peak(compiled_split[0], large))
                   if compiled_split else None),
        micro_batch_seconds_xla=further(compiled, compiled_split),
        loop_steps=steps_per_loop, reference_loss=second.get("loss"),
        start_loss=start.get("loss"),
        runs=(_one_device_runs(processes[1:], results[1:], 2 * steps_per_loop * large)
              if large == batch else []))


def _further(batch: int, parts: int, whole: dict, in_parts: list) -> Optional[float]:
    """The seconds each further micro-batch adds (negative where the step
    ran faster in them): `whole`'s run at `batch` against the same batch in
    `parts` micro-batches (`in_parts`, if run). With XLA, one such run: a
    second in the same process would not measure its own peak (the first's
    compiled program stays resident; the whole batch's run after two held
    186-400 MiB more than in a process of its own, Zen 4 EPYC)."""
    if not in_parts:
        return None
    return (batch / in_parts[0]["examples_per_sec"]
            - batch / whole["examples_per_sec"]) / (parts - 1)


def _one_device_runs(processes: list, results: list, reads: float) -> list:
    """The calibration's runs at the whole batch as the one-device
    candidates' measurements."""
    found = []
    for runs, result in zip(processes, results):
        for index, (options, record) in enumerate(zip(runs, result.runs)):
            # A later run's peak holds what the earlier left: not its own.
            found.append(OneDeviceRun(
                options={k: v for k, v in options.items() if k != "global_batch_size"},
                record=record, peak=record["peak_bytes"] if index == 0 else None,
                seconds=result.seconds, reads=reads))
    return found


def _processes(small: int, large: int, lossy: bool) -> list:
    """The calibration's processes, each a list of runs (their options) in order."""
    def run(precision, jit, size, accum=1):
        return {"precision": precision, "jit_compile": jit, "accum_steps": accum,
                "global_batch_size": size}

    # The larger batch again in micro-batches, in the same process (its rate
    # alone is read): what a further micro-batch costs, without and with XLA.
    parts = _parts(large)
    split = {jit: [run("float32", jit, large, parts)] if parts > 1 else []
             for jit in ("off", "on")}
    # After the quarter batch (its record, peak included, is written first):
    # loops of one step, whose loss is the loss at the start, the scale of
    # what training reduces it by (`Calibration.start_loss`).
    start = {**run("float32", "off", small), "loop": 1}
    # With XLA, the micro-batches first (their compiled micro-batch's peak is
    # its own; the whole batch's, larger, follows).
    processes = [[run("float32", "off", small), start],
                 [run("float32", "off", large), *split["off"]],
                 [*split["on"], run("float32", "on", large)]]
    if lossy:
        processes.append([run("mixed_bfloat16", "off", large),
                          run("mixed_bfloat16", "on", large)])
    return processes


def _flags(config: RunConfig, steps_per_loop: int, options: dict) -> list:
    """A calibration run's tfdist-train flags: `config` on one device with `options`."""
    options = dict(options)
    steps_per_loop = options.pop("loop", steps_per_loop)
    one = config.replace(
        strategy=dataclasses.replace(config.strategy, name=strategies.REFERENCE,
                                     virtual_devices=1),
        train=dataclasses.replace(config.train, **options))
    return as_flags(trial_config(one, steps_per_loop))


def _parts(batch: int) -> int:
    """The micro-batches calibration splits `batch` into: the most a search
    tries (8; a further micro-batch's cost grows with their number: on a
    2-core Xeon, one device's step was as fast in 2 as whole and 1.5x slower
    in 8) that divide it, else 1 (not measured)."""
    return next((k for k in (8, 4, 2) if batch % k == 0), 1)


def _calibration_run(number, count, config, steps_per_loop, runs, functions, log, work_dir,
                     timeout) -> trials_lib.TrialResult:
    log(f"calibration {number}/{count}: one device, " + ", ".join(_describe(r) for r in runs))
    result = trials_lib.run([_flags(config, steps_per_loop, r) for r in runs],
                            functions=functions, timeout=timeout, work_dir=work_dir)
    if not result.ok:
        raise UsageError(f"the model cannot be measured on one device: {result.reason}")
    return result


def _describe(options: dict) -> str:
    accum = options["accum_steps"]
    if options.get("loop"):
        return f"{options['loop']}-step loops (the loss at the start)"
    return (f"{options['precision']} batch {options['global_batch_size']} "
            f"XLA {options['jit_compile']}" + (f" in {accum} micro-batches" if accum != 1
                                               else ""))


# -- each engine family's runtime --------------------------------------------------

def tiny_model(spec):
    """A tiny model for `spec`'s data (a user's `dataset_fn`): flattened
    inputs, one hidden layer."""
    import keras
    inputs = keras.Input(spec.input_shape)
    hidden = keras.layers.Dense(16, activation="relu")(
        keras.layers.Flatten()(keras.ops.cast(inputs, "float32")))
    return keras.Model(inputs, keras.layers.Dense(spec.num_classes)(hidden), name="tiny")


def _tiny(config: RunConfig, kind: str, functions: dict) -> tuple:
    """(flags, functions) of a tiny model on the run's own data: its input
    pipeline is part of what an engine family's processes hold."""
    if functions.get("dataset_fn"):
        tiny = {"module": __name__, "name": "tiny_model"}
        return TINY, {**functions, "model_fn": tiny, "layout_rules": None}
    data = [f for f in as_flags(config)
            if f.split("=", 1)[0] in ("--dataset", "--data_dir", "--synthetic", "--image_size",
                                      "--vocab_size", "--sequence_length")]
    shorter = ["--sequence_length=16"] if kind != "image" else []
    return TINY + data + shorter + [f"--model={TINY_MODEL.get(kind, 'mlp')}"], {}


def baselines(families: dict, devices: int, config: RunConfig, kind: str, functions: dict,
              log: Callable, work_dir: Optional[str], timeout: float) -> tuple:
    """(family -> peak resident bytes, family -> seconds per step) of a tiny
    model on the run's data under each family (cached per host, versions
    and data); `families`: family -> (its engine's flags for the tiny run,
    the processes it starts)."""
    tiny, tiny_functions = _tiny(config, kind, functions)
    data = (json.dumps(functions["dataset_fn"], sort_keys=True) if functions.get("dataset_fn")
            else " ".join(sorted(tiny)))
    key = _cache_key(devices) + "|" + data
    cache = _read_cache()
    found = {f: m for f, m in cache.get(key, {}).items() if isinstance(m, dict)}
    missing = [f for f in families if f not in found]
    for family in missing:
        log(f"measuring the {family} engine's runtime (a tiny model; cached for this host)")
        flags, processes = families[family]
        result = trials_lib.run([tiny + flags], processes=processes, functions=tiny_functions,
                                timeout=timeout, work_dir=work_dir)
        if result.ok:
            rate = result.examples_per_sec
            found[family] = {"peak": max(result.peaks),
                             "step": TINY_BATCH / rate if rate else None}
        else:
            log(f"  the {family} runtime could not be measured ({result.reason}); its "
                "processes are predicted with the one-device runtime")
    if missing:
        cache[key] = found
        _write_cache(cache)
    return ({f: m["peak"] for f, m in found.items()},
            {f: m["step"] for f, m in found.items() if m.get("step")})


# -- the probes: what an engine holds per byte and per operation of the model ---------

# The probe models: one whose state is large beside the runtime (16 MiB of
# parameters, few operations), and one of many operations and few bytes (24
# layers of 16 units: 334 operations in a micro-batch's graph, 30 KiB).
PROBE_MODELS = {"": dict(width=1024, depth=2), "graph ": dict(width=16, depth=24)}
# Whose rates the cost models read: the first's (an engine's step time
# beyond its terms); of the second only the peaks are read.
TIMED_PROBE = ""
# A probe's loops: two, of 100 steps divided among its micro-batches (at
# least 25: about a second of the slowest probe's steps on 2 cores), the
# second timed; 25 where the rates are not read. Shorter than the runtimes'
# (LOOPS): a probe's peak, unlike a tiny model's runtime, is its first
# loop's (measured on 2 cores: 200 steps against 40, peaks within 9 MiB of
# 330-970 MiB, rates within 8%), and its dtensor runs at 8 micro-batches
# spent most of their 45-50 s in 200 steps.
PROBE_LOOP_STEPS, PROBE_MIN_LOOP_STEPS = 100, 25
# Probes whose rates are not read run this many at once (their peaks are
# each process's own; a dtensor probe keeps about 1.2 of 2 cores busy).
UNTIMED_AT_ONCE = 2


def probe(wanted: dict, devices: int, config: RunConfig, log: Callable,
          work_dir: Optional[str]) -> Optional[Probe]:
    """The probe models on one device (the first at one micro-batch and at
    each number a probe runs) and under each engine's probe options: each
    run's peak and examples/s. `wanted`: engine name -> {variant: options}.
    None if nothing is wanted. Cached per host, versions and optimizer (the
    slots' temporaries are the optimizer's)."""
    if not wanted:
        return None
    runs, configs = {}, {}
    for prefix, shape in PROBE_MODELS.items():
        configs[prefix], model_runs = _probe_runs(wanted, config, shape,
                                                  timed=prefix == TIMED_PROBE)
        runs.update({prefix + name: run for name, run in model_runs.items()})
    optimizer = [f for f in as_flags(configs[""]) if f.split("=", 1)[0] in OPTIMIZER_FLAGS]
    key = _cache_key(devices) + "|probe|" + " ".join(sorted(optimizer))
    cache = _read_cache()
    found = dict(cache.get(key, {}))
    missing = [name for name in runs if name not in found]
    results = _measure_probes(runs, missing, log, work_dir)
    for name in missing:
        result = results[name]
        if result.ok:
            found[name] = {"peak": result.peaks[0], "rate": result.examples_per_sec}
        else:
            log(f"  the probe {name} could not be measured ({result.reason}); its engine's "
                "candidates are predicted without it")
    if missing:
        cache[key] = found
        _write_cache(cache)
    probes = {prefix: _measured_probe(prefix, probe_config, found)
              for prefix, probe_config in configs.items()}
    if probes[""] is None:
        return None
    return dataclasses.replace(probes[""], graph=probes["graph "])


def _measure_probes(runs: dict, missing: list, log: Callable,
                    work_dir: Optional[str]) -> dict:
    """name -> TrialResult of each of `missing` (names of `runs`): those whose
    rates are read one at a time, then the rest `_at_once()` at a time."""
    timed = [name for name in missing if _probe_prefix(name) == TIMED_PROBE]
    # The longest first (most micro-batches, then the highest ZeRO stage: the
    # 24-layer mlp at ZeRO-3 in 8 took 97 s alone), so that none runs alone last.
    untimed = sorted((name for name in missing if name not in timed), key=lambda name: (
        -runs[name].train.accum_steps, -runs[name].strategy.zero_stage))
    numbers = {name: number for number, name in enumerate(timed + untimed, 1)}

    def measure_one(name):
        log(f"probe {numbers[name]}/{len(missing)}: {name} (an mlp of "
            f"{'many operations' if name.startswith('graph ') else '16 MiB'}; cached for "
            "this host)")
        return trials_lib.run([as_flags(runs[name])], timeout=trials_lib.LONGEST_S,
                              work_dir=work_dir)

    results = {name: measure_one(name) for name in timed}   # one at a time: their rates
    with concurrent.futures.ThreadPoolExecutor(_at_once()) as pool:
        results.update(zip(untimed, pool.map(measure_one, untimed)))
    return results


def _at_once() -> int:
    return max(1, min(UNTIMED_AT_ONCE, len(os.sched_getaffinity(0))))


def _probe_prefix(name: str) -> str:
    """The `PROBE_MODELS` prefix a probe run's name starts with (the longest)."""
    return max((p for p in PROBE_MODELS if name.startswith(p)), key=len)


def _measured_probe(prefix: str, probe_config: RunConfig, found: dict) -> Optional[Probe]:
    """The probe model of `PROBE_MODELS[prefix]` from its measured runs in
    `found` (name -> peak and rate), or None without its one-device run."""
    from tfdist.data.inputs import of_run as inputs_of_run
    from tfdist.planner import profile
    own = {name[len(prefix):]: r for name, r in found.items()
           if _probe_prefix(name) == prefix}
    if strategies.REFERENCE not in own:
        return None
    reference = {1: own.pop(strategies.REFERENCE)}
    for accum in [n for n in own if n.startswith(f"{strategies.REFERENCE} accum")]:
        reference[int(accum.rsplit("accum", 1)[1])] = own.pop(accum)
    return Probe(
        model=profile.model_facts(probe_config, inputs_of_run(probe_config)),
        batch=probe_config.train.global_batch_size, reference=reference[1]["peak"],
        peaks={name: r["peak"] for name, r in own.items()},
        rates={name: r["rate"] for name, r in own.items()},
        reference_rates={accum: r["rate"] for accum, r in reference.items()},
        reference_peaks={accum: r["peak"] for accum, r in reference.items() if accum > 1})


def _probe_runs(wanted: dict, config: RunConfig, shape: dict, timed: bool = True) -> tuple:
    """(A probe model's RunConfig, name -> the RunConfig of each probe run):
    an mlp of `shape` on synthetic data, with the run's optimizer (an
    update's temporaries are its own), in two loops of `_probe_loop` steps
    (the shortest where the rates are not `timed`); one device at each
    number of micro-batches too."""
    from tfdist.config import DataConfig, ModelConfig, TrainConfig
    from tfdist.planner import search as search_lib
    probe_config = RunConfig(
        model=ModelConfig(name="mlp", **shape), data=DataConfig(synthetic=True),
        optimizer=config.optimizer,
        train=TrainConfig(global_batch_size=32, train_steps=2 * PROBE_LOOP_STEPS,
                          steps_per_loop=PROBE_LOOP_STEPS, jit_compile="off"))

    def apply(engine, options):
        loop = _probe_loop(options.get("accum_steps", 1)) if timed else PROBE_MIN_LOOP_STEPS
        return search_lib.apply(probe_config, engine,
                                {**options, "train_steps": 2 * loop, "steps_per_loop": loop})

    runs = {strategies.REFERENCE: apply(strategies.REFERENCE, {"virtual_devices": 1})}
    for engine, variants in wanted.items():
        for variant, options in variants.items():
            runs[f"{engine} {variant}"] = apply(engine, options)
    # One device at each number of micro-batches a probe runs: what a
    # further micro-batch costs there, which an engine's costs are a multiple of.
    for accum in sorted({o.get("accum_steps", 1) for v in wanted.values() for o in v.values()}
                        - {1}):
        runs[f"{strategies.REFERENCE} accum{accum}"] = apply(
            strategies.REFERENCE, {"virtual_devices": 1, "accum_steps": accum})
    return probe_config, runs


def _probe_loop(accum: int) -> int:
    return max(PROBE_MIN_LOOP_STEPS, PROBE_LOOP_STEPS // max(1, accum))


# The probe's flags its cache entry is keyed by (what an update holds).
OPTIMIZER_FLAGS = ("--optimizer", "--clip_grad_norm")


def _cache_key(devices: int) -> str:
    return (f"v{CACHE_VERSION}|{hardware.describe()}|tf {tf.__version__}|tfdist "
            f"{tfdist_version()}|devices {devices}")


def tfdist_version() -> str:
    import importlib.metadata
    try:
        return importlib.metadata.version("tfdist")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _read_cache() -> dict:
    try:
        with open(os.path.join(hardware.cache_dir(), "runtimes.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _write_cache(cache: dict) -> None:
    os.makedirs(hardware.cache_dir(), exist_ok=True)
    path = os.path.join(hardware.cache_dir(), "runtimes.json")
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        json.dump(cache, f, indent=1, sort_keys=True)
    os.replace(temporary, path)
