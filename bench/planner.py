"""Is the planner's pick the best, and is its model right? (`tfdist.plan`)

For each model (bundled ones by name, and two models tfdist did not build,
bench/planner_models.py: a subclassed residual MLP and a functional
wide-and-deep model over ids):

1. The planner's search as a user runs it (`tfdist.plan`, its default
   trials and time bound): its pick and the search's seconds.
2. The exhaustive grid over the same candidates (every one the planner
   predicted to fit), each measured in a trial process of its own, as the
   planner measures its trials; with --grid_passes=2 the grid again, for the
   grid's own repeat-vs-repeat Kendall tau (the noise's ceiling).
3. The pick against the grid's best, re-measured interleaved (--repeats
   each, medians): the pick's share of the best.
4. Kendall tau of the planner's predicted examples/s against the grid's
   measured; the search's time against the grid's; each grid run's
   predicted peak memory against its measured peak (the memory rule: within
   15% where the predicted bytes above the runtime are at least 1 GiB,
   else within 150 MiB).
5. The pick against tfdist's default flags (mirrored over 2 virtual
   devices, --jit_compile=auto), measured the same way.

Ratios, not absolute times: 2 shared cores. Usage:

    python bench/planner.py [--models=mlp,residual,wide_deep] [--grid_passes=1]
    python bench/planner.py --memory_only [--models=...]
    python bench/planner.py --models=cnn,transformer --suffix=_cnn_transformer

--suffix names the results apart (bench/results/planner<suffix>.md and
planner_memory<suffix>.md), so that models measured in another run keep
their tables.

--memory_only runs the planner's search and the grid only, and writes each
grid run's predicted and measured peak, term by term
(bench/results/planner_memory.md): the memory model's error per configuration.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

GiB, MiB = 2**30, 2**20


def kendall_tau(xs: list, ys: list) -> float:
    """Kendall's tau-b of two equally long sequences."""
    concordant = discordant = ties_x = ties_y = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    n = concordant + discordant
    denominator = ((n + ties_x) * (n + ties_y)) ** 0.5
    return (concordant - discordant) / denominator if denominator else float("nan")


def _within_rule(predicted: float, measured: float, runtime: float) -> bool:
    above = predicted - runtime
    allowed = 0.15 * predicted if above >= GiB else 150 * MiB
    return abs(predicted - measured) <= allowed


def _setup(name: str):
    """(RunConfig, model_fn, dataset_fn, spec) of model `name`."""
    import tfdist
    import planner_models as outside
    base = dict(strategy=tfdist.StrategyConfig(virtual_devices=2),
                optimizer=tfdist.OptimizerConfig(name="adam"),
                train=tfdist.TrainConfig(global_batch_size=256, train_steps=200))
    if name == "residual":
        return (tfdist.RunConfig(**base), outside.residual_fn, outside.vectors_fn,
                outside.VECTORS)
    if name == "wide_deep":
        return (tfdist.RunConfig(**base), outside.wide_deep_fn, outside.ids_fn, outside.TOKENS)
    width = {"mlp": 512, "cnn": 32, "transformer": 128}[name]
    dataset = {"transformer": "tfdist_tokens"}.get(name, "tfdist_shapes")
    return (tfdist.RunConfig(**base, model=tfdist.ModelConfig(name=name, width=width),
                             data=tfdist.DataConfig(dataset=dataset, synthetic=True)),
            None, None, None)


def _fresh(candidate):
    return dataclasses.replace(candidate, trial=None, trial_estimate=None)


def _grid(name: str, work: str, passes: int, log=print):
    """(plan, search, grid, [measured runs of each pass]) of model `name`."""
    import tfdist
    from tfdist.planner import functions as functions_lib, search as search_lib, trial_config
    config, model_fn, dataset_fn, spec = _setup(name)
    plan = tfdist.plan(config, model_fn=model_fn, dataset_fn=dataset_fn, spec=spec,
                       log=lambda line: log(f"  [{name}] {line}"), work_dir=work)
    functions = functions_lib.records(model_fn, dataset_fn, spec=spec)
    search = search_lib.Search(facts=plan.facts, functions=functions, trials=0,
                               seconds=1e9, log=lambda line: None, work_dir=work,
                               trial_config=lambda c: trial_config(config, c, plan.facts))
    grid = search_lib.rank(plan.candidates)
    passes_run = []
    for number in range(passes):
        measured = []
        for index, candidate in enumerate(grid):
            run = _fresh(candidate)
            search_lib.measure(search, run, index + 1)
            measured.append(run)
            log(f"  [{name}] grid {number + 1}.{index + 1}/{len(grid)}: {run.describe()}: "
                f"{run.measured_rate() or run.trial.reason} (predicted "
                f"{run.predicted_rate(plan.facts.global_batch):.0f})")
        passes_run.append(measured)
    return plan, search, grid, passes_run


def memory_rows(name: str, runs: list) -> list:
    """One row per measured grid run: its predicted and measured peak, the
    error, the memory rule, and the predicted terms (MiB)."""
    rows = []
    for run in runs:
        if not run.measured_peak():
            continue
        estimate, measured = run.trial_estimate, run.measured_peak()
        runtime = estimate.memory.get("runtime", 0.0)
        terms = ", ".join(f"{k} {v / MiB:.0f}" for k, v in estimate.memory.items() if v)
        rows.append([name, run.describe(), f"{estimate.peak_bytes / MiB:.0f}",
                     f"{measured / MiB:.0f}", f"{(measured - estimate.peak_bytes) / MiB:+.0f}",
                     "yes" if _within_rule(estimate.peak_bytes, measured, runtime) else "no",
                     terms])
    return rows


MEMORY_DESCRIPTION = (
    "Each grid run of the planner (a trial process per candidate, as the planner "
    "measures) with its predicted peak, term by term, against its measured peak "
    "(its memory cgroup's peak where it has one, else its anonymous peak: what its "
    "cgroup is charged with TensorFlow's libraries already in the page cache); the "
    "memory rule: within 15% where the predicted bytes above the runtime are at least "
    "1 GiB, else within 150 MiB.")
MEMORY_HEADER = ["model", "configuration", "predicted MiB", "measured MiB",
                 "measured - predicted", "within the rule", "predicted terms (MiB)"]


def bench_model(name: str, args, work: str) -> dict:
    from tfdist import config as config_lib
    from tfdist.planner import calibrate, search as search_lib
    from tfdist.planner import trial_config, trials as trials_lib
    config = _setup(name)[0]
    plan, search, grid, passes = _grid(name, work, args.grid_passes,
                                       log=lambda line: print(line, flush=True))
    first = passes[0]
    ok = [i for i, run in enumerate(first) if run.measured_rate()]
    best = max(ok, key=lambda i: first[i].measured_rate())
    pick = next(i for i, c in enumerate(grid) if c.describe() == plan.winner.describe())
    rates = {"pick": [], "best": []}
    for _ in range(args.repeats):   # interleaved: the host's drift hits both alike
        for label, index in (("pick", pick), ("best", best)):
            run = _fresh(grid[index])
            search_lib.measure(search, run, 0)
            rates[label].append(run.measured_rate() or 0.0)
    defaults = calibrate.trial_config(
        config.replace(strategy=config.strategy.replace(name="mirrored")),
        trial_config(config, grid[pick]).train.steps_per_loop)
    default = trials_lib.run([config_lib.as_flags(defaults)], functions=search.functions,
                             timeout=240, work_dir=work)
    predicted = [grid[i].predicted_rate(plan.facts.global_batch) for i in ok]
    tau = kendall_tau(predicted, [first[i].measured_rate() for i in ok])
    repeat_tau = None
    if len(passes) > 1:
        both = [i for i in ok if passes[1][i].measured_rate()]
        repeat_tau = kendall_tau([first[i].measured_rate() for i in both],
                                 [passes[1][i].measured_rate() for i in both])
    errors = []
    for run in first:
        if run.measured_peak():
            runtime = run.trial_estimate.memory.get("runtime", 0.0)
            errors.append((abs(run.expected_peak() - run.measured_peak()),
                           _within_rule(run.expected_peak(), run.measured_peak(), runtime),
                           run.describe()))
    worst = max(errors) if errors else (0.0, True, "-")
    grid_seconds = sum(run.trial.seconds for run in first)
    fit_rate, fit_label = best_fit(name, trial_config(config, grid[pick]).train.steps_per_loop)
    cap = capped(search, first, pick, work)
    return {
        "pick / fit": (statistics.median(rates["pick"]) / fit_rate if fit_rate
                       else f"fit failed: {fit_label}"),
        "best fit": fit_label, **cap,
        "memory rows": memory_rows(name, first),
        "model": name, "grid": len(grid), "pick": plan.winner.describe(),
        "best": first[best].describe(),
        "pick / best": statistics.median(rates["pick"]) / statistics.median(rates["best"]),
        "search s": plan.seconds, "search / grid": plan.seconds / grid_seconds,
        "tau": tau, "repeat tau": repeat_tau,
        "pick / defaults": statistics.median(rates["pick"]) / (default.examples_per_sec or
                                                                 float("nan")),
        "worst memory error MiB": worst[0] / MiB, "memory rule": sum(e[1] for e in errors),
        "runs": len(errors), "worst": worst[2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,residual,wide_deep")
    parser.add_argument("--grid_passes", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory_only", action="store_true")
    parser.add_argument("--suffix", default="", choices=("", "_cnn_transformer"),
                        help="results in bench/results/planner<suffix>.md")
    parser.add_argument("--fit_child", help=argparse.SUPPRESS)
    parser.add_argument("--fit_steps_per_execution", type=int, default=20,
                        help=argparse.SUPPRESS)
    parser.add_argument("--fit_seconds", type=float, default=3.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fit_child:
        return fit_child(args.fit_child, args.fit_steps_per_execution, args.fit_seconds)
    clock = common.Clock()
    print(common.hardware_header(), flush=True)
    if args.memory_only:
        return memory_only(args, clock)
    header = ["model", "grid", "pick", "best", "pick / best", "search s", "search / grid",
              "tau", "repeat tau", "pick / defaults", "pick / best fit", "worst memory error MiB",
              "within the memory rule", "worst memory case"]
    cap_header = ["model", "cap MiB (pick's predicted peak + the rule's tolerance)",
                  "the pick under the cap", "its cgroup peak MiB",
                  "control: the grid's highest prediction", "its predicted / measured MiB",
                  "its cap MiB", "the control under its cap"]
    rows, cap_rows, memory = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-planner-") as work:
        for name in args.models.split(","):
            r = bench_model(name, args, work)
            row = [r["model"], r["grid"], r["pick"], r["best"], f"{r['pick / best']:.2f}",
                   f"{r['search s']:.0f}", f"{r['search / grid']:.2f}", f"{r['tau']:.2f}",
                   "-" if r["repeat tau"] is None else f"{r['repeat tau']:.2f}",
                   f"{r['pick / defaults']:.2f}",
                   (f"{r['pick / fit']:.2f} ({r['best fit']})"
                    if isinstance(r["pick / fit"], float) else r["pick / fit"]),
                   f"{r['worst memory error MiB']:.0f}",
                   f"{r['memory rule']}/{r['runs']}", r["worst"]]
            common.print_row(row, header)
            rows.append(row)
            cap_row = [r["model"], f"{r['cap MiB']:.0f}", r["pick under cap"],
                       ("-" if r["pick cgroup peak MiB"] is None
                        else f"{r['pick cgroup peak MiB']:.0f}"), r["control"],
                       f"{r['control predicted MiB']:.0f} / {r['control measured MiB']:.0f}",
                       f"{r['control cap MiB']:.0f}", r["control under cap"]]
            common.print_row(cap_row, cap_header)
            cap_rows.append(cap_row)
            memory.extend(r["memory rows"])
    description = (
        "The planner's pick (tfdist.plan with its defaults: 5 trials, 180 s) against the "
        "exhaustive grid over the candidates it predicted to fit (each a trial process, as "
        "the planner measures), the pick and the grid's best re-measured interleaved "
        f"({args.repeats} each, medians); Kendall tau of predicted vs measured examples/s "
        "over the grid (repeat tau: the grid measured twice, the noise's ceiling); each "
        "grid run's predicted peak against its measured peak; the pick against tfdist's "
        "default flags (mirrored, 2 virtual devices, --jit_compile=auto) and against the "
        "best working Keras `fit` on one device (with or without XLA, steps_per_execution "
        "as the pick's loop) on the same model and input pipeline.")
    after = ("The pick in a memory cgroup capped at its predicted peak plus the memory "
             "rule's tolerance (`tfdist-launch --worker_memory`), and the control: the grid "
             "run predicted highest, under the same cap or, where that cap is not below its "
             "predicted peak less the rule's tolerance, under that lower cap (predicted not "
             "to fit). The grid's peaks are measured as the planner measures them (a process's "
             "anonymous peak: what its cgroup is charged with TensorFlow's libraries already "
             "in the page cache); the capped runs read their cgroup's peak.\n\n"
             + common.markdown_table(cap_rows, cap_header))
    models = "" if not args.suffix else f" ({', '.join(args.models.split(','))})"
    common.finish(f"planner{args.suffix}", f"The planner against the exhaustive grid{models}",
                  description, rows, header, clock, after=after)
    write_memory(memory, args.suffix, models)


def write_memory(rows: list, suffix: str = "", models: str = "") -> None:
    """The memory model's error per grid run (bench/results/planner_memory<suffix>.md)."""
    common.write_section(f"planner_memory{suffix}",
                         f"The planner's memory model per configuration{models}",
                         MEMORY_DESCRIPTION + "\n\n" + common.markdown_table(rows, MEMORY_HEADER))


# -- Keras fit on the same model and data, beside the pick -----------------------------

def fit_child(name: str, steps_per_execution: int, seconds: float) -> None:
    """Keras `fit` on model `name`'s model and tfdist's own input pipeline
    for it (as `bench/vs_fit.py` measures), without and with XLA, on one
    device: a JSON line each with its examples/s or its error."""
    import json
    import keras
    import tensorflow as tf
    import vs_fit
    from tfdist import models
    from tfdist.data import inputs as inputs_lib
    from tfdist.data.inputs import of_run
    config, model_fn, dataset_fn, spec = _setup(name)
    inputs = of_run(config, dataset_fn, spec)
    batch = config.train.global_batch_size
    data = inputs_lib.train_dataset_fn(
        inputs, global_batch_size=batch, seed=0,
        shuffle_buffer=config.data.shuffle_buffer)(tf.distribute.InputContext())
    data = data.map(lambda x, y, weight: (x, y))
    for label, jit in (("fit", False), ("fit+XLA", True)):
        keras.utils.set_random_seed(0)
        try:
            model = inputs.built(model_fn(inputs.spec) if model_fn
                                 else models.build(config.model, inputs.spec))
            model.compile(keras.optimizers.Adam(1e-3),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          jit_compile=jit, steps_per_execution=steps_per_execution)
            timer = vs_fit._step_timer(seconds)
            model.fit(data, steps_per_epoch=10_000_000, epochs=1, verbose=0, callbacks=[timer])
            print(json.dumps({"variant": label,
                              "examples_per_sec": timer.steps * batch / timer.elapsed}),
                  flush=True)
        except Exception as error:  # noqa: BLE001 - a crash is a result here
            print(json.dumps({"variant": label, "error": vs_fit._short_error(error)}),
                  flush=True)


def best_fit(name: str, steps_per_execution: int, seconds: float = 3.0) -> tuple:
    """(examples/s of the best working fit, its label), from a child process."""
    import json
    import subprocess
    out = subprocess.run([sys.executable, os.path.abspath(__file__), f"--fit_child={name}",
                          f"--fit_steps_per_execution={steps_per_execution}",
                          f"--fit_seconds={seconds}"], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    found = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    working = [r for r in found if r.get("examples_per_sec")]
    if not working:
        return None, "; ".join(r.get("error", "") for r in found) or out.stderr[-200:]
    best = max(working, key=lambda r: r["examples_per_sec"])
    return best["examples_per_sec"], best["variant"]


# -- the pick under a memory cap just above its predicted peak, and the control --------

def allowance(predicted: float, runtime: float) -> float:
    """The memory rule's tolerance for a prediction (bytes)."""
    return 0.15 * predicted if predicted - runtime >= GiB else 150 * MiB


def capped(search, runs: list, pick: int, work: str) -> dict:
    """The pick under `--worker_memory` at its predicted peak (for a trial's
    length) plus the memory rule's tolerance: it should finish. The control:
    the grid run predicted highest, under that cap or, where that cap would
    not be below its own predicted peak less the rule's tolerance, under
    that lower cap: predicted not to fit, it should be OOM-killed. Together
    they bracket each one's cgroup peak around its prediction. `runs`: the
    grid's measured runs."""
    from tfdist import config as config_lib
    from tfdist.planner import trials as trials_lib
    chosen = runs[pick].trial_estimate
    cap = int(chosen.peak_bytes + allowance(chosen.peak_bytes, chosen.memory.get("runtime", 0)))

    def under_cap(run, limit):
        result = trials_lib.run([config_lib.as_flags(search.trial_config(run))],
                                processes=run.estimate.processes, functions=search.functions,
                                cap=limit, timeout=300, work_dir=work)
        if result.ok:
            return "finished", result
        killed = "OOM killer" in result.reason
        return ("OOM-killed (the kernel's OOM killer at the cap)" if killed
                else result.reason), result

    estimated = [r for r in runs if r.trial_estimate]
    control = max(estimated, key=lambda r: r.trial_estimate.peak_bytes)
    predicted = control.trial_estimate.peak_bytes
    control_cap = int(min(cap, predicted - allowance(
        predicted, control.trial_estimate.memory.get("runtime", 0))))
    pick_outcome, pick_result = under_cap(runs[pick], cap)
    control_outcome, _ = under_cap(control, control_cap)
    return {"cap MiB": cap / MiB, "pick under cap": pick_outcome,
            "pick cgroup peak MiB": (max(pick_result.peaks) / MiB if pick_result.ok
                                     and pick_result.peaks else None),
            "control": control.describe(), "control cap MiB": control_cap / MiB,
            "control predicted MiB": predicted / MiB,
            "control measured MiB": (control.measured_peak() or 0) / MiB,
            "control under cap": control_outcome}


def memory_only(args, clock) -> None:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-planner-") as work:
        for name in args.models.split(","):
            _, _, _, passes = _grid(name, work, 1, log=lambda line: print(line, flush=True))
            for row in memory_rows(name, passes[0]):
                common.print_row(row, MEMORY_HEADER)
                rows.append(row)
    common.finish(f"planner_memory{args.suffix}", "The planner's memory model per configuration",
                  MEMORY_DESCRIPTION, rows, MEMORY_HEADER, clock)


if __name__ == "__main__":
    main()
