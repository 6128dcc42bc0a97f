"""The planner's model of memory and its search, in one process: each
engine's predicted placement against the engine's own, the candidates
against the engines' own checks, and the planner's bad input. Trials and
predictions against measured peaks: tests/integration/test_plan.py."""

import dataclasses
import os
import math

import pytest

import tfdist
from tfdist import models, strategies
from tfdist.data.function_inputs import FunctionInputs
from tfdist.errors import UsageError
from tfdist.pipeline import schedule as schedules
from tfdist.planner import costs, functions, parse_size, probing, profile, search
from tfdist.strategies.dtensor.cost import MOST
from tfdist.training import xla
from common import IMAGE_SPEC, image_dataset_fn, run_config

SPEC = dataclasses.replace(IMAGE_SPEC, num_classes=8)   # every dimension divides 4
MODEL = tfdist.ModelConfig(name="mlp", width=16, depth=2)


def build_mlp(spec):
    return models.build(MODEL, spec)


@pytest.fixture(scope="module")
def facts():
    """The bundled mlp's facts, read from the built model, with a made-up
    calibration (these tests check the arithmetic over it, not a measurement)."""
    config = run_config(optimizer="adam", batch=32).replace(model=MODEL)
    model = profile.model_facts(config, FunctionInputs(image_dataset_fn, SPEC), build_mlp,
                                models.layout_rules(MODEL))
    calibration = costs.Calibration(points=((8, 600e6), (16, 610e6)),
                                    rates={("float32", "off"): 1000.0, ("float32", "on"): 1500.0},
                                    baselines={"default": 500e6, "dtensor": 560e6},
                                    times=((8, 0.010), (16, 0.018)))
    host = costs.Host(cpu="test", cores=2, memory_budget=8 * costs.GiB, devices=4)
    return costs.Facts(model=model, calibration=calibration, host=host, global_batch=32)


def test_the_model_facts_are_the_built_models(facts):
    model = build_mlp(SPEC)
    assert facts.model.parameters == model.count_params()
    assert facts.model.param_bytes == 4 * model.count_params()
    assert facts.model.slot_ratio == pytest.approx(2.0)    # Adam: two slots per variable
    assert facts.model.flops_per_example > 0
    assert all(isinstance(facts.model.splits[s], list) for s in (2,))


@pytest.mark.parametrize("mesh,stage", [("batch:2,model:2", 0), ("batch:2,model:2", 1),
                                        ("batch:2,model:2", 2), ("batch:2,model:2", 3),
                                        ("batch:4,model:1", 3)])
def test_dtensor_cost_places_state_as_the_engine_does(facts, mesh, stage):
    """The cost model's bytes per device of variables, gradients and slots
    equal what the engine reports for its own placement (`layout_rows`)."""
    config = run_config("dtensor", optimizer="adam", batch=32).replace(
        model=MODEL, strategy=tfdist.StrategyConfig(name="dtensor", virtual_devices=4,
                                                    mesh=mesh, zero_stage=stage))
    rows = tfdist.layout_rows(config, model_fn=build_mlp, dataset_fn=image_dataset_fn, spec=SPEC,
                              layout_rules=models.layout_rules(MODEL))
    engine = {kind: sum(r["device_bytes"] for r in rows if r["kind"] == kind and r["shape"])
              for kind in ("variable", "gradient", "slot")}
    model = search.cost_model(strategies.engine("dtensor"))
    predicted = model._per_device(facts, mesh, stage)
    assert predicted["parameters"] == pytest.approx(engine["variable"], rel=1e-9)
    assert predicted["gradients"] == pytest.approx(engine["gradient"], rel=1e-9)
    assert predicted["slots"] == pytest.approx(engine["slot"], rel=1e-9)


def test_pipeline_cost_holds_each_stage_once_and_1f1b_less_than_gpipe(facts):
    model = search.cost_model(strategies.engine("pipeline"))
    options = dict(pipeline_stages=2, pipeline_chunks=1, pipeline_schedule="1f1b",
                   accum_steps=8, zero_stage=0, virtual_devices=2, precision="float32",
                   jit_compile="off")
    two = dataclasses.replace(facts, host=dataclasses.replace(facts.host, devices=2))
    one_f_one_b = model.estimate(two, options)
    gpipe = model.estimate(two, {**options, "pipeline_schedule": "gpipe"})
    assert one_f_one_b.memory["parameters"] == pytest.approx(two.model.param_bytes)
    # 1F1B holds at most S micro-batches per stage, GPipe all M: less in flight.
    assert one_f_one_b.memory["activations"] < gpipe.memory["activations"]
    assert one_f_one_b.time["bubble"] / one_f_one_b.time["compute"] == pytest.approx(
        schedules.bubble(2, 8) / (1 - schedules.bubble(2, 8)))


def _candidates(facts, lossy):
    return search.enumerate_candidates(facts, lossy)


def test_candidates_pass_the_engines_own_checks(facts):
    """Every candidate the search proposes is a configuration its engine
    accepts: the run configuration's own field checks and the engine's XLA
    check (the same functions `tfdist-train` runs)."""
    config = run_config(batch=32).replace(model=MODEL)
    found = [c for c in _candidates(facts, lossy=True) if not c.dropped]
    assert {c.engine for c in found} >= {"default", "mirrored", "dtensor", "pipeline"}
    cluster = [c for c in _candidates(_cluster(facts, 2, 1e8), lossy=True) if not c.dropped]
    assert {c.options.get("grad_compression") for c in cluster} >= {"powersgd", "topk"}
    for candidate in found + cluster:
        planned = search.apply(config, candidate.engine, candidate.options)
        assert planned.strategy.name == candidate.engine
        xla.check(planned.train.jit_compile, strategies.adapter_class(
            strategies.engine(candidate.engine)))


def test_lossless_unless_asked(facts):
    lossless = _candidates(facts, lossy=False)
    assert {c.options["precision"] for c in lossless} == {"float32"}
    assert all(c.lossless for c in lossless)
    lossy = _candidates(facts, lossy=True)
    assert "mixed_bfloat16" in {c.options["precision"] for c in lossy}   # the control


def test_a_budget_no_candidate_fits_names_the_closest_and_the_shortfall(facts):
    small = dataclasses.replace(facts, host=dataclasses.replace(facts.host,
                                                                memory_budget=100 * 2**20))
    found = _candidates(small, lossy=False)
    assert found and all(c.dropped for c in found)
    message = str(search.too_small(found, small.host.memory_budget))
    closest = min(found, key=lambda c: c.estimate.peak_bytes)
    assert closest.describe() in message and "MiB more" in message
    shortfall = (closest.estimate.peak_bytes - small.host.memory_budget) / 2**20
    assert f"({shortfall:.0f} MiB more)" in message


def test_a_candidate_over_the_budget_is_dropped_with_its_reason(facts):
    found = _candidates(facts, lossy=False)
    budget = sorted(c.estimate.peak_bytes for c in found if c.estimate)[len(found) // 2]
    tight = dataclasses.replace(facts, host=dataclasses.replace(facts.host,
                                                                memory_budget=budget))
    kept = _candidates(tight, lossy=False)
    over = [c for c in kept if c.estimate and c.estimate.peak_bytes > budget]
    assert over and all("over the budget" in c.dropped for c in over)
    assert all(not c.dropped for c in kept if c.estimate and c.estimate.peak_bytes <= budget)


def test_the_users_functions_are_named_for_trial_processes():
    ref = functions.reference(build_mlp, "model_fn")
    assert functions.resolve(ref) is build_mlp
    with pytest.raises(UsageError, match="module-level function"):
        functions.reference(lambda spec: None, "model_fn")
    rules = models.layout_rules(MODEL)
    record = functions.rules_record(rules)
    assert list(functions.layout_rules(record)) == [(p, tuple(s)) for p, s in rules]


@pytest.mark.parametrize("text,expected", [("6G", 6 * 2**30), ("1500M", 1500 * 2**20),
                                           ("2GiB", 2 * 2**30), ("1048576", 2**20)])
def test_sizes(text, expected):
    assert parse_size(text, "--memory_budget") == expected


@pytest.mark.parametrize("text", ["abc", "0", "-1G", "1K", "nanG", "infG"])
def test_bad_sizes(text):
    with pytest.raises(UsageError, match="--memory_budget"):
        parse_size(text, "--memory_budget")


def test_the_step_overhead_is_the_intercept_of_the_two_step_times(facts):
    # 10 ms at 8, 18 ms at 16: 1 ms per example, 2 ms whatever the batch.
    assert facts.step_overhead() == pytest.approx(0.002)
    assert math.isfinite(facts.compute_seconds(32, "float32", "off"))


def test_no_bf16_calibration_where_bf16_matmuls_would_abort(monkeypatch):
    """Under a oneDNN cap below AVX-512 on an AVX-512 CPU a bf16 run is
    refused, so the planner's lossy calibration leaves bf16 out (its
    candidates are then dropped as unmeasured); without the cap it runs it."""
    from tfdist.observe import hardware
    from tfdist.planner import calibrate
    record = {"examples_per_sec": 100.0, "peak_bytes": 2**29}
    for refusal, runs in (("capped", 3), (None, 4)):
        started = []
        monkeypatch.setattr(hardware, "bf16_refusal", lambda r=refusal: r)
        monkeypatch.setattr(calibrate.trials_lib, "run",
                            lambda runs, **kw: started.append(runs) or _result([record] * len(runs)))
        calibration = calibrate.measure(run_config(batch=32), 4, True, {}, lambda line: None,
                                        None, 60.0, lambda examples: 0.0)
        assert len(started) == runs
        assert (("mixed_bfloat16", "on") in calibration.rates) == (refusal is None)


def _result(records: list):
    return search.trials_lib.TrialResult(ok=True, reason="", seconds=5.0, runs=records,
                                         peaks=[records[-1]["peak_bytes"]])


def test_calibration_at_the_whole_batch_is_the_one_device_candidates_trials(facts,
                                                                            monkeypatch):
    """Calibration's runs at the whole batch are one-device candidates: they
    count as those candidates' trials (a run's peak only where it was its
    process's first), and the search starts with the other engines; the
    control: without them, its first trial is one device's."""
    from tfdist.planner import calibrate
    flags_seen = []

    def run(runs, **kw):
        flags_seen.extend(runs)
        return _result([{"examples_per_sec": 1000.0 * (i + 1), "peak_bytes": 2**29 + i}
                        for i in range(len(runs))])
    monkeypatch.setattr(calibrate.trials_lib, "run", run)
    calibration = calibrate.measure(run_config(batch=32), 4, False, {}, lambda line: None,
                                    None, 60.0, lambda examples: 0.0)
    assert {(r.options["jit_compile"], r.options["accum_steps"], r.peak)
            for r in calibration.runs} == {("off", 1, 2**29), ("off", 8, None),
                                           ("on", 8, 2**29), ("on", 1, None)}
    # XLA's micro-batches ran first in their process: their peak is their own.
    assert calibration.xla_micro == (4, 2**29)
    assert all("--virtual_devices=1" in f and "--strategy=default" in f for f in flags_seen)

    def firsts(runs):
        measured = dataclasses.replace(facts, calibration=dataclasses.replace(
            facts.calibration, runs=runs))
        candidates = search.enumerate_candidates(measured, False)
        search.adopt(candidates, measured)
        return [c for c in candidates if c.calibrated], search.first_trials(candidates)

    adopted, first = firsts(calibration.runs)
    assert len(adopted) == 4 and all(c.engine == "default" for c in adopted)
    assert {c.measured_peak() for c in adopted} == {2**29, None}
    assert first and "default" not in {c.engine for c in first}
    adopted, first = firsts([])
    assert not adopted and "default" in {c.engine for c in first}


def _probed(facts, per_byte: dict):
    """`facts` with a probe whose measured peaks exceed the dtensor cost
    model's own prediction by `per_byte[(stage, accum)]` bytes per computed
    byte (the probe model is the test's mlp itself)."""
    cost = search.cost_model(strategies.engine("dtensor"))
    devices = facts.host.devices
    bare = dataclasses.replace(facts, calibration=dataclasses.replace(
        facts.calibration, probe=costs.Probe(model=facts.model, batch=8, reference=600e6,
                                             peaks={})))
    peaks = {}
    for variant, options in cost.probes(devices).items():
        key = (options["zero_stage"], options["accum_steps"])
        predicted = -probing.probe_residual(
            dataclasses.replace(bare, calibration=dataclasses.replace(
                bare.calibration, probe=dataclasses.replace(bare.calibration.probe,
                                                            peaks={f"dtensor {variant}": 0.0}))),
            cost, "dtensor", variant, options)
        computed = cost._per_device(facts, options["mesh"], 0)["computed"] * devices
        peaks[f"dtensor {variant}"] = predicted + per_byte.get(key, 0.0) * computed
    return dataclasses.replace(facts, calibration=dataclasses.replace(
        bare.calibration, probe=dataclasses.replace(bare.calibration.probe, peaks=peaks)))


def test_dtensor_memory_adds_what_its_probe_measured_beyond_its_terms(facts):
    """What the probe measured beyond the state terms, per computed byte at
    each ZeRO stage and per further micro-batch, scales to a candidate; the
    control: without a probe the term is 0."""
    cost = search.cost_model(strategies.engine("dtensor"))
    probed = _probed(facts, {(0, 1): 16.0, (1, 1): 20.0, (2, 1): 23.0, (3, 1): 6.0,
                             (0, 8): 30.0, (1, 8): 34.0, (2, 8): 44.0, (3, 8): 27.0})
    options = {"mesh": "batch:4,model:1", "zero_stage": 0, "accum_steps": 1,
               "virtual_devices": 4, "precision": "float32", "jit_compile": "off"}
    computed = cost._per_device(facts, options["mesh"], 0)["computed"] * facts.host.devices

    def term(f, **changes):
        return cost.estimate(f, {**options, **changes}).memory["step transients (probed)"]

    assert term(probed) == pytest.approx(16.0 * computed)
    assert term(probed, zero_stage=2) == pytest.approx(23.0 * computed)
    assert term(probed, zero_stage=2, accum_steps=8) == pytest.approx(44.0 * computed)
    assert term(probed, accum_steps=2) == pytest.approx(18.0 * computed)   # +2 per micro-batch
    assert term(probed, zero_stage=1, accum_steps=4) == pytest.approx(26.0 * computed)
    assert term(probed, zero_stage=3, accum_steps=4) == pytest.approx(15.0 * computed)
    assert term(probed, zero_stage=3, accum_steps=8) == pytest.approx(27.0 * computed)
    assert term(facts) == 0.0


def test_the_probes_tell_bytes_per_byte_from_bytes_per_operation():
    """Two probe models' residuals are solved for the bytes held per computed
    byte and per graph operation; one probe (or a model whose operations are
    not counted) gives bytes per byte alone, and neither comes out negative."""
    per_byte, per_op = 3.0, 1e5
    bytes_probe, graph_probe = (16e6, 48), (3e4, 334)
    residuals = [(per_byte * c + per_op * o, c, o) for c, o in (bytes_probe, graph_probe)]
    assert probing.per_byte_and_count(residuals) == pytest.approx((per_byte, per_op))
    # The control: the bytes probe alone puts its operations' share on its bytes.
    alone = probing.per_byte_and_count(residuals[:1])
    assert alone[1] == 0.0 and alone[0] == pytest.approx(per_byte + per_op * 48 / 16e6)
    assert probing.per_byte_and_count([(-5.0, 16e6, 48), (-1.0, 3e4, 334)]) == (0.0, 0.0)
    assert probing.per_byte_and_count([]) == (0.0, 0.0)


def test_dtensor_memory_grows_with_the_graph_of_each_micro_batch(facts):
    """With the graph probe, dtensor's probed term carries bytes per operation
    of a micro-batch's graph and, at a ZeRO stage, per trained variable,
    times the micro-batches; the control: the same model with its
    operations not counted (or no graph probe) has neither."""
    cost = search.cost_model(strategies.engine("dtensor"))
    per_op, per_variable = {1: 1e5, MOST: 8e5}, {1: 2e6, MOST: 16e6}
    graph_model = dataclasses.replace(facts.model, variables=facts.model.variables[:2],
                                      step_ops=334)
    bare = _probed(facts, {})
    bare = dataclasses.replace(bare, calibration=dataclasses.replace(
        bare.calibration, probe=dataclasses.replace(
            bare.calibration.probe,   # the probe of few operations: fewer than the model
            model=dataclasses.replace(facts.model, step_ops=20),
            graph=costs.Probe(model=graph_model, batch=8, reference=500e6, peaks={}))))

    def trained(model):
        return sum(1 for v in model.variables if v.trainable)

    def peaks(probe):
        found = {}
        for variant, options in cost.probes(facts.host.devices).items():
            one = dataclasses.replace(probe, peaks={f"dtensor {variant}": 0.0})
            accum, stage = options["accum_steps"], options["zero_stage"]
            found[f"dtensor {variant}"] = (
                -probing.probe_residual(bare, cost, "dtensor", variant, options, one)
                + per_op[accum] * probe.model.step_ops
                + (per_variable[accum] * trained(probe.model) if stage else 0.0))
        return found

    probe = bare.calibration.probe
    with_graph = dataclasses.replace(bare, calibration=dataclasses.replace(
        bare.calibration, probe=dataclasses.replace(
            probe, peaks=peaks(probe),
            graph=dataclasses.replace(probe.graph, peaks=peaks(probe.graph)))))
    options = {"mesh": "batch:4,model:1", "zero_stage": 0, "accum_steps": 1,
               "virtual_devices": 4, "precision": "float32", "jit_compile": "off"}

    def term(f, **changes):
        return cost.estimate(f, {**options, **changes}).memory["step transients (probed)"]

    ops, variables = facts.model.step_ops, trained(facts.model)
    assert ops and ops > 40 and variables > 2
    assert term(with_graph) == pytest.approx(1e5 * ops, rel=1e-6)
    assert term(with_graph, accum_steps=8) == pytest.approx(8e5 * ops, rel=1e-6)
    assert term(with_graph, accum_steps=2) == pytest.approx(2e5 * ops, rel=1e-6)
    assert term(with_graph, zero_stage=3, accum_steps=8) == pytest.approx(
        8e5 * ops + 16e6 * variables, rel=1e-6)
    assert term(with_graph, zero_stage=1, accum_steps=1) == pytest.approx(
        1e5 * ops + 2e6 * variables, rel=1e-6)
    uncounted = dataclasses.replace(with_graph, model=dataclasses.replace(facts.model,
                                                                         step_ops=None))
    alone = dataclasses.replace(with_graph, calibration=dataclasses.replace(
        with_graph.calibration, probe=dataclasses.replace(with_graph.calibration.probe,
                                                          graph=None)))
    for control in (uncounted, alone):   # the few-operations probe's residual, per byte
        computed = cost._per_device(facts, options["mesh"], 0)["computed"] * facts.host.devices
        probe_computed = cost._per_device(dataclasses.replace(facts, model=probe.model),
                                          options["mesh"], 0)["computed"] * facts.host.devices
        assert term(control, accum_steps=8) == pytest.approx(
            8e5 * probe.model.step_ops * computed / probe_computed, rel=1e-6)


def test_a_micro_batch_loop_holds_a_second_graph_on_each_replica(facts):
    """Without XLA, micro-batches in TensorFlow's loop hold its body's copy of
    a micro-batch's graph on each replica: the graph probe's bytes per
    operation at 8 micro-batches against one, times the model's operations;
    the controls: one micro-batch, XLA, or no graph probe hold none."""
    graph_model = dataclasses.replace(facts.model, step_ops=334)
    graph = costs.Probe(model=graph_model, batch=32, reference=300e6, peaks={},
                        reference_peaks={8: 300e6 + 334 * 1e5})
    probe = costs.Probe(model=facts.model, batch=32, reference=300e6, peaks={}, graph=graph)
    probed = dataclasses.replace(facts, calibration=dataclasses.replace(facts.calibration,
                                                                        probe=probe))
    assert graph.loop_bytes_per_op() == pytest.approx(1e5)

    def term(f, engine, **options):
        cost = search.cost_model(strategies.engine(engine))
        options = {"virtual_devices": 1 if engine == "default" else 4, "precision": "float32",
                   "jit_compile": "off", "accum_steps": 2, **options}
        return cost.estimate(f, options).memory.get("micro-batch loop's graph", 0.0)

    ops = facts.model.step_ops
    assert term(probed, "default") == pytest.approx(ops * 1e5)
    assert term(probed, "mirrored") == pytest.approx(4 * ops * 1e5)
    assert term(probed, "default", accum_steps=1) == 0.0
    assert term(probed, "mirrored", jit_compile="on") == 0.0
    assert term(facts, "default") == 0.0


def test_pipeline_micro_batches_hold_what_its_probes_measured_beyond_the_schedule(facts):
    """What the pipeline's probes (two stages, 1F1B, at the fewest and the
    most micro-batches) held beyond the schedule's activations, per further
    micro-batch, fitted per operation of a micro-batch's graph (the probe of
    many operations) and per parameter byte (the probe of few), scales to a
    candidate by its micro-batches; the controls: no probe, or the probes
    holding nothing beyond the terms, add nothing."""
    from tfdist.strategies.pipeline import cost as pipeline_cost
    cost = search.cost_model(strategies.engine("pipeline"))
    per_op, per_byte = 2e5, 0.5     # bytes per further micro-batch
    graph_model = dataclasses.replace(facts.model, variables=facts.model.variables[:2],
                                      step_ops=334)
    bare = dataclasses.replace(facts, calibration=dataclasses.replace(
        facts.calibration, probe=costs.Probe(
            model=dataclasses.replace(facts.model, step_ops=20), batch=8, reference=600e6,
            peaks={}, graph=costs.Probe(model=graph_model, batch=8, reference=500e6,
                                        peaks={}))))

    def peaks(probe, extra: bool):
        found = {}
        for variant, options in cost.probes(facts.host.devices).items():
            one = dataclasses.replace(probe, peaks={f"pipeline {variant}": 0.0})
            model = probe.model
            found[f"pipeline {variant}"] = (
                -probing.probe_residual(bare, cost, "pipeline", variant, options, one)
                + extra * (options["accum_steps"] - 1) * (per_op * model.step_ops
                                                          + per_byte * model.param_bytes))
        return found

    def probed(extra: bool):
        probe = bare.calibration.probe
        return dataclasses.replace(bare, calibration=dataclasses.replace(
            bare.calibration, probe=dataclasses.replace(
                probe, peaks=peaks(probe, extra),
                graph=dataclasses.replace(probe.graph, peaks=peaks(probe.graph, extra)))))

    def term(f, accum, chunks=1, schedule="1f1b"):
        options = {"pipeline_stages": 2, "pipeline_chunks": chunks,
                   "pipeline_schedule": schedule, "accum_steps": accum, "zero_stage": 0,
                   "virtual_devices": 4, "precision": "float32", "jit_compile": "off"}
        return cost.estimate(f, options).memory.get("further micro-batches (probed)", 0.0)

    assert set(cost.probes(4)) == {f"1f1b accum{m}" for m in pipeline_cost.PROBED}
    measured = probed(True)
    model = facts.model
    replicas = 2                        # 4 devices over 2 stages, all in this process
    for accum in (2, 4, 8):
        assert term(measured, accum) == pytest.approx(
            replicas * (accum - 1) * (per_op * model.step_ops + per_byte * model.param_bytes),
            rel=1e-6)
    assert term(measured, 8, schedule="gpipe") == pytest.approx(term(measured, 8))
    assert term(probed(False), 8) == pytest.approx(0.0, abs=1.0)
    assert term(facts, 8) == 0.0


def test_compiled_programs_without_the_update_hold_what_their_own_run_measured(facts):
    """Where a compiled program holds no update (micro-batches; mirrored's
    replicas, whose gradients are summed between their programs and the
    update), XLA's bytes are what the run in compiled micro-batches held
    beyond the plain run's predicted peak at that micro-batch, on each
    replica; one device's whole step (the update compiled with it) keeps
    the whole step's. The control: without that run, the whole step's."""
    cost = search.cost_model(strategies.engine("default"))
    mirrored = search.cost_model(strategies.engine("mirrored"))
    calibration = dataclasses.replace(facts.calibration, xla_bytes=400e6)
    micro = 4
    plain = (calibration.intercept() + calibration.slope() * micro
             + facts.model.trainable_bytes)
    measured = dataclasses.replace(facts, calibration=dataclasses.replace(
        calibration, xla_micro=(micro, plain + 90e6)))
    unmeasured = dataclasses.replace(facts, calibration=calibration)

    def xla(model, f, accum, devices=1):
        options = {"virtual_devices": devices, "precision": "float32", "jit_compile": "on",
                   "accum_steps": accum}
        return model.estimate(f, options).memory["XLA compilation"]

    assert xla(cost, measured, 2) == pytest.approx(90e6)
    assert xla(cost, measured, 8) == pytest.approx(90e6)
    assert xla(cost, measured, 1) == pytest.approx(400e6)   # the update compiled with it
    assert xla(cost, unmeasured, 2) == pytest.approx(400e6)
    for accum in (1, 2):                                    # each replica its program
        assert xla(mirrored, measured, accum, 4) == pytest.approx(4 * 90e6)
    assert xla(mirrored, unmeasured, 1, 4) == pytest.approx(400e6)


def test_the_search_ends_when_no_trial_left_could_win(facts, monkeypatch):
    """After each engine's first trial, a candidate is tried only while its
    refined prediction is within 5% of the best measured; the control: the
    same search without that bound goes on to the trials asked for."""
    candidates = [c for c in _candidates(facts, lossy=False) if not c.dropped]

    def run(measured_share):
        tried = []

        def measure(s, candidate, number):
            tried.append(candidate)
            batch = facts.global_batch
            rate = candidate.predicted_rate(batch) * measured_share(candidate)
            candidate.trial = search.trials_lib.TrialResult(
                ok=True, reason="", seconds=1.0, runs=[{"examples_per_sec": rate}],
                peaks=[5e8])
        monkeypatch.setattr(search, "measure", measure)
        fresh = [dataclasses.replace(c, trial=None, factor=1.0) for c in candidates]
        state = search.Search(facts=facts, trial_config=None, functions={}, trials=20,
                              log=lambda line: None)
        search.run(state, fresh)
        return tried

    engines = len({c.engine for c in candidates})
    # The best predicted candidate measures twice as fast as predicted: no other can win.
    best = search.rank(candidates)[0].describe()
    assert len(run(lambda c: 2.0 if c.describe() == best else 1.0)) == engines
    monkeypatch.setattr(search, "WORTH", 0.0)
    assert len(run(lambda c: 2.0 if c.describe() == best else 1.0)) == 20


def _cluster(facts, hosts: int, rate: float):
    """`facts` for 2 processes over `hosts` hosts with `rate` bytes/s between them."""
    return dataclasses.replace(facts, host=dataclasses.replace(
        facts.host, processes=2, hosts=hosts, devices=1, link_bytes_per_s=rate,
        peak_flops={"float32": 1e11}))


def test_a_slow_link_moves_the_choice_to_what_sends_less(facts):
    """Two hosts: over 10 Mbit/s the best predicted candidate exchanges less
    than the whole gradient (compressed, or weights averaged every few
    steps), over 100 Gbit/s it sends it whole; the control: without lossy
    choices none of them is a candidate."""
    def gain(rate):
        """(best lossy, its predicted speed over the best lossless)."""
        ranked = search.rank(_candidates(_cluster(facts, 2, rate), lossy=True))
        lossy = next(c for c in ranked if not c.lossless)
        kept = next(c for c in ranked if c.lossless)
        return lossy, kept.predicted_seconds() / lossy.predicted_seconds()

    slow, slow_gain = gain(10e6 / 8)   # the test's mlp has 14 KB of parameters
    assert slow.options.get("grad_compression", "none") != "none" or slow.options.get(
        "sync_every"), slow.describe()
    assert slow_gain >= search.LOSSY_GAIN      # worth its accuracy cost
    assert gain(100e9 / 8)[1] < search.LOSSY_GAIN   # not: the whole gradient is sent
    lossless = _candidates(_cluster(facts, 2, 100e6 / 8), lossy=False)
    assert not any(c.options.get("grad_compression", "none") != "none"
                   or c.options.get("sync_every") for c in lossless)


def test_what_crosses_hosts_is_not_scaled_by_what_trials_on_one_host_measured(facts):
    """A trial on one host measures the terms it runs; the link's terms are
    predicted for the link asked for and added unscaled."""
    cluster = _cluster(facts, 2, 100e6 / 8)
    candidate = next(c for c in _candidates(cluster, lossy=False)
                     if c.engine == "multi_worker")
    link = candidate.estimate.link_seconds
    assert link > 0 and candidate.estimate.over_link == ("gradient all-reduce",)
    before = candidate.predicted_seconds()
    candidate.factor = 2.0
    assert candidate.predicted_seconds() == pytest.approx(2 * (before - link) + link)
    # The control: on one host nothing is over a link, and all of it scales.
    local = next(c for c in _candidates(_cluster(facts, 1, 100e6 / 8), lossy=False)
                 if c.engine == "multi_worker")
    assert local.estimate.over_link == ()
    local.factor = 2.0
    assert local.predicted_seconds() == pytest.approx(2 * local.estimate.step_seconds)


def test_a_pipeline_over_hosts_sends_its_boundary_activations_over_the_link(facts):
    cluster = _cluster(facts, 2, 100e6 / 8)
    piped = [c for c in _candidates(cluster, lossy=False) if c.engine == "pipeline"]
    assert piped and all("activation transfers" in c.estimate.over_link for c in piped)
    assert all(c.estimate.time["activation transfers"] > 0 for c in piped)


@pytest.mark.parametrize("text,expected", [("100mbit", 12.5e6), ("10Gbit", 1.25e9),
                                           ("125MB", 125e6), ("1.5gbit/s", 1.875e8)])
def test_rates(text, expected):
    from tfdist.planner import parse_rate
    assert parse_rate(text, "--link_bandwidth") == pytest.approx(expected)


@pytest.mark.parametrize("text", ["fast", "10", "-1gbit", "0mbit", "nangbit", "10 furlongs"])
def test_bad_rates(text):
    from tfdist.planner import parse_rate
    with pytest.raises(UsageError, match="--link_bandwidth"):
        parse_rate(text, "--link_bandwidth")


@pytest.mark.parametrize("processes,hosts,link,match", [
    (3, 2, 1e9, "must divide --plan_workers=3"), (2, 2, None, "give --link_bandwidth")])
def test_a_cluster_that_cannot_be_planned_is_refused_before_any_measurement(
        processes, hosts, link, match):
    config = run_config(batch=32).replace(model=MODEL)
    with pytest.raises(UsageError, match=match):
        tfdist.plan(config, processes=processes, hosts=hosts, link_bandwidth=link,
                    log=lambda line: None)


def test_a_lossy_choice_wins_only_where_it_is_clearly_faster_at_a_small_loss(facts):
    """The winner keeps the math unless a lossy candidate measured at least
    LOSSY_GAIN times faster than the best lossless one and its training
    loss within LOSS_ALLOWANCE of the float32 one-device run's after the
    same steps, as a share of that run's reduction of the loss. The
    controls: as fast but 10% of that reduction behind, or its loss from a
    trial of another length (not comparable), it does not win."""
    found = [c for c in _candidates(_cluster(facts, 1, 100e6 / 8), lossy=True)
             if not c.dropped]
    kept = next(c for c in found if c.lossless)
    lossy = next(c for c in found if not c.lossless)
    calibration = dataclasses.replace(facts.calibration, loop_steps=20, reference_loss=2.0,
                                      start_loss=3.0)

    def measured(candidate, rate, loss=2.0, loop=20):
        candidate.trial = search.trials_lib.TrialResult(
            ok=True, reason="", seconds=1.0, runs=[{"examples_per_sec": rate, "loss": loss}],
            peaks=[5e8])
        candidate.trial_loop = loop

    def chosen():
        return search.winner([kept, lossy], facts.global_batch, calibration)

    measured(kept, 100.0)
    measured(lossy, 105.0, loss=2.01)
    assert chosen() is kept
    measured(lossy, 111.0, loss=2.01)
    assert chosen() is lossy and lossy.loss_change(calibration) == pytest.approx(0.01)
    measured(lossy, 111.0, loss=2.1)
    assert chosen() is kept
    measured(lossy, 111.0, loss=2.01, loop=30)
    assert lossy.loss_change(calibration) is None and chosen() is kept


def test_a_trial_that_changes_the_math_runs_the_calibrations_loops(facts):
    """Its loss is then comparable with the reference run's; a lossless
    candidate's trial is sized by its own predicted step time (the control)."""
    from tfdist.planner import trial_config
    calibrated = dataclasses.replace(facts, calibration=dataclasses.replace(
        facts.calibration, loop_steps=37, reference_loss=2.0))
    found = [c for c in _candidates(_cluster(calibrated, 1, 100e6 / 8), lossy=True)
             if not c.dropped]
    lossy = next(c for c in found if not c.lossless)
    kept = next(c for c in found if c.lossless)
    config = run_config(batch=32).replace(model=MODEL)
    assert trial_config(config, lossy, calibrated).train.steps_per_loop == 37
    assert trial_config(config, kept, calibrated).train.steps_per_loop != 37

def test_a_tensor_parallel_mesh_over_hosts_sums_its_activations_over_the_link(facts):
    """A `model` axis larger than a process's devices spans processes: its
    exchanges of split layers' outputs cross the link between hosts; within
    a process they are memory copies (the control)."""
    cost = search.cost_model(strategies.engine("dtensor"))
    options = {"zero_stage": 0, "accum_steps": 1, "virtual_devices": 2,
               "precision": "float32", "jit_compile": "off"}
    cluster = dataclasses.replace(_cluster(facts, 2, 100e6 / 8), host=dataclasses.replace(
        _cluster(facts, 2, 100e6 / 8).host, devices=2))
    across = cost.estimate(cluster, {**options, "mesh": "batch:1,model:4"})
    within = cost.estimate(cluster, {**options, "mesh": "batch:2,model:2"})
    assert "tensor-parallel exchanges" in across.over_link
    assert "tensor-parallel exchanges" not in within.over_link
    assert "gradient reduction" in within.over_link        # its batch rows span the hosts
    assert (across.time["tensor-parallel exchanges"]
            > 10 * within.time["tensor-parallel exchanges"])


def test_each_family_runtime_adds_its_measured_step_floor(facts):
    """What a tiny model's step costs under an engine family beyond one
    device's is a term of every candidate of that family (a small model's
    step under mirrored or dtensor is mostly that), none of one device's;
    the control: without the tiny runs' step times, no such term."""
    floors = {"default": 0.001, "mirrored": 0.003, "dtensor": 0.0045}
    timed = dataclasses.replace(facts, calibration=dataclasses.replace(
        facts.calibration, step_floors=floors))
    term = "runtime per step (its family's, measured)"
    options = {"precision": "float32", "jit_compile": "off", "accum_steps": 1}
    for engine, extra in (("mirrored", 0.002), ("dtensor", 0.0035), ("default", None)):
        cost = search.cost_model(strategies.engine(engine))
        chosen = {**options, **next(iter(cost.candidates(timed)))}
        if engine == "dtensor":
            chosen.update(zero_stage=0)
        with_floor, without = (search.estimate(cost, f, chosen) for f in (timed, facts))
        assert with_floor.time.get(term) == (pytest.approx(extra) if extra else None), engine
        assert term not in without.time
        assert with_floor.step_seconds == pytest.approx(without.step_seconds + (extra or 0))


def test_over_hosts_a_trial_measures_the_computation_and_the_link_is_added(facts):
    """A trial runs every process on this host: the rate expected on the
    cluster is its computation as measured (against the trial's own
    prediction) plus the links' predicted time; on one host it is the
    measured rate itself (the control)."""
    cluster = _cluster(facts, 2, 100e6 / 8)
    candidate = next(c for c in _candidates(cluster, lossy=False) if c.engine == "multi_worker")
    cost = search.cost_model(strategies.engine("multi_worker"))
    candidate.trial_estimate = cost.estimate(
        dataclasses.replace(cluster, host=cluster.host.one_host()), candidate.options)
    batch, local = facts.global_batch, candidate.trial_estimate.step_seconds
    candidate.trial = search.trials_lib.TrialResult(   # measured twice as slow as predicted
        ok=True, reason="", seconds=1.0, runs=[{"examples_per_sec": batch / (2 * local)}],
        peaks=[5e8])
    e = candidate.estimate
    assert candidate.expected_rate(batch) == pytest.approx(
        batch / (2 * (e.step_seconds - e.link_seconds) + e.link_seconds))
    assert candidate.expected_rate(batch) < candidate.measured_rate()
    here = next(c for c in _candidates(_cluster(facts, 1, 100e6 / 8), lossy=False)
                if c.engine == "multi_worker")
    here.trial = candidate.trial
    assert here.expected_rate(batch) == here.measured_rate()


def test_each_family_runtime_is_measured_with_its_own_processes(tmp_path, monkeypatch):
    """multi_worker's runtime is a tiny run of two processes (each holds its
    collective runtime), the peak the larger of theirs; the others one."""
    from tfdist.planner import calibrate, trials as trials_lib
    monkeypatch.setenv("TFDIST_CACHE_DIR", str(tmp_path))
    started = {}

    def run(runs, processes=1, **kwargs):
        family = next(f.split("=")[1] for f in runs[0] if f.startswith("--strategy="))
        started[family] = processes
        return trials_lib.TrialResult(ok=True, reason="", seconds=1.0,
                                      runs=[{"examples_per_sec": 3200.0 / processes}],
                                      peaks=[5e8, 6e8][:processes])
    monkeypatch.setattr(trials_lib, "run", run)
    families = {}
    for engine in ("default", "multi_worker"):
        cost = search.cost_model(strategies.engine(engine))
        families[cost.family] = (cost.runtime_flags(2), getattr(cost, "runtime_processes", 1))
    found, steps = calibrate.baselines(families, 2, run_config(batch=32), "image", {},
                                       lambda line: None, None, 60.0)
    assert started == {"default": 1, "multi_worker": 2}
    assert found == {"default": 5e8, "multi_worker": 6e8}
    # Its step at the tiny run's batch (32): 10 ms on one device, 20 under multi_worker.
    assert steps == pytest.approx({"default": 0.01, "multi_worker": 0.02})
    started.clear()   # cached: measured once per host
    assert calibrate.baselines(families, 2, run_config(batch=32), "image", {},
                               lambda line: None, None, 60.0) == (found, steps)
    assert not started


def test_probes_whose_rates_are_read_run_alone_and_the_rest_two_at_a_time(
        tmp_path, monkeypatch):
    """The 16 MiB probe's runs (their step times are read) run one at a
    time, in loops of 100 steps over their micro-batches (at least 25); the
    24-layer probe's (peaks only) two at a time, in loops of 25, the most
    micro-batches first. The control: the timed ones never overlapped."""
    import threading
    import time
    from tfdist.planner import calibrate, trials as trials_lib
    monkeypatch.setenv("TFDIST_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibrate, "_at_once", lambda: 2)
    lock, running, log = threading.Lock(), [], []

    def run(runs, **kwargs):
        values = dict(f[2:].split("=", 1) for f in runs[0] if "=" in f)
        graph = values["model_depth"] == "24"
        with lock:
            running.append(graph)
            log.append((graph, len(running), int(values["accum_steps"]),
                        int(values["steps_per_loop"]), int(values["train_steps"])))
        time.sleep(0.05)
        with lock:
            running.remove(graph)
        return trials_lib.TrialResult(ok=True, reason="", seconds=0.1,
                                      runs=[{"examples_per_sec": 100.0}], peaks=[4e8])
    monkeypatch.setattr(trials_lib, "run", run)
    wanted = {"dtensor": search.cost_model(strategies.engine("dtensor")).probes(2)}
    probe = calibrate.probe(wanted, 2, run_config(batch=32), lambda line: None, None)
    timed, untimed = [e for e in log if not e[0]], [e for e in log if e[0]]
    assert len(timed) == len(untimed) == 10 and log.index(untimed[0]) == len(timed)
    assert all(alone == 1 for _, alone, *_ in timed)               # never beside another
    assert max(beside for _, beside, *_ in untimed) == 2            # two at a time
    assert {(accum, loop, steps) for _, _, accum, loop, steps in timed} == {
        (1, 100, 200), (8, 25, 50)}
    assert {(loop, steps) for *_, loop, steps in untimed} == {(25, 50)}
    assert [accum for _, _, accum, *_ in untimed[:5]] == [8] * 5    # the longest first
    assert probe is not None and probe.graph is not None


def test_a_further_micro_batch_costs_what_calibration_measured_it_to(facts, monkeypatch):
    """Calibration runs the larger batch whole and in 8 micro-batches, with
    and without XLA; each further one costs a seventh of the difference, per
    XLA setting, instead of the step's fixed cost (which also holds the
    once-per-step update); the control: unmeasured, the fixed cost stands in."""
    from tfdist.planner import calibrate
    seconds = {("off", "1"): 0.010, ("off", "8"): 0.017, ("on", "1"): 0.006, ("on", "8"): 0.020}

    def run(runs, **kw):
        records = []
        for flags in runs:
            values = dict(f[2:].split("=", 1) for f in flags if "=" in f)
            step = seconds[(values["jit_compile"], values.get("accum_steps", "1"))]
            batch = int(values["global_batch_size"])
            records.append({"examples_per_sec": batch / step, "peak_bytes": 2**29})
        return _result(records)
    monkeypatch.setattr(calibrate.trials_lib, "run", run)
    calibration = calibrate.measure(run_config(batch=32), 4, False, {}, lambda line: None,
                                    None, 60.0, lambda examples: 0.0)
    assert calibration.micro_batch_seconds == pytest.approx(0.001)
    assert calibration.micro_batch_seconds_xla == pytest.approx(0.002)
    cost = search.cost_model(strategies.engine("default"))
    measured = dataclasses.replace(facts, calibration=dataclasses.replace(
        facts.calibration, micro_batch_seconds=0.001, micro_batch_seconds_xla=0.002))

    def overhead(f, jit):
        return cost.estimate(f, {"accum_steps": 4, "precision": "float32",
                                 "jit_compile": jit}).time["micro-batch overhead"]

    assert overhead(measured, "off") == pytest.approx(3 * 0.001)
    assert overhead(measured, "on") == pytest.approx(3 * 0.002)
    assert overhead(facts, "on") == pytest.approx(3 * facts.step_overhead())
    # Faster in micro-batches (measured so): the term is negative, at most
    # half the step's computation.
    faster = dataclasses.replace(facts, calibration=dataclasses.replace(
        facts.calibration, micro_batch_seconds=-0.001))
    assert overhead(faster, "off") == pytest.approx(-0.003)
    compute = cost.estimate(faster, {"accum_steps": 4, "precision": "float32",
                                     "jit_compile": "off"}).time["compute"]
    much_faster = dataclasses.replace(faster, calibration=dataclasses.replace(
        faster.calibration, micro_batch_seconds=-compute))
    assert overhead(much_faster, "off") == pytest.approx(-compute / 2)


def test_dtensor_micro_batches_cost_what_its_probes_measured_beyond_one_devices(facts):
    """dtensor's further micro-batch is one device's measured cost times
    what its probes at 1 and 8 micro-batches added over one device's at 1
    and 8 (per ZeRO stage); the controls: without probe rates, or where one
    device's own cost is within noise, the factor is 1."""
    cost = search.cost_model(strategies.engine("dtensor"))
    batch = 32
    # One device: 10 ms at one micro-batch, 12.1 ms at 8 (0.3 ms more each).
    rates = {f"dtensor zero{stage} accum{accum}": batch / seconds
             for stage, per in ((0, 0.0009), (3, 0.0021))
             for accum, seconds in ((1, 0.01), (8, 0.01 + 7 * per))}
    probe = costs.Probe(model=facts.model, batch=batch, reference=6e8, peaks={}, rates=rates,
                        reference_rates={1: batch / 0.01, 8: batch / 0.0121})
    probed = dataclasses.replace(facts, calibration=dataclasses.replace(
        facts.calibration, probe=probe, micro_batch_seconds=0.0005))
    options = {"mesh": "batch:4,model:1", "zero_stage": 0, "accum_steps": 4,
               "virtual_devices": 4, "precision": "float32", "jit_compile": "off"}

    def overhead(f, **changes):
        return cost.estimate(f, {**options, **changes}).time["micro-batch overhead"]

    assert overhead(probed) == pytest.approx(3 * 0.0005 * 3.0)
    assert overhead(probed, zero_stage=3) == pytest.approx(3 * 0.0005 * 7.0)
    assert overhead(probed, zero_stage=1) == pytest.approx(3 * 0.0005)     # no probe rates
    noisy = dataclasses.replace(probe, reference_rates={1: batch / 0.01, 8: batch / 0.01015})
    assert overhead(dataclasses.replace(probed, calibration=dataclasses.replace(
        probed.calibration, probe=noisy))) == pytest.approx(3 * 0.0005)


def test_devices_at_once_gain_alike_with_and_without_xla(facts):
    """Devices computing at once gain at most what the best one device (here
    with XLA, 1500 examples/s) leaves of the host's peak, with XLA or
    without: XLA's gain on several devices is one device's; the control: a
    host without a measured peak is assumed to gain nothing."""
    flops = facts.model.flops_per_example
    peaked = dataclasses.replace(facts, host=dataclasses.replace(
        facts.host, peak_flops={"float32": 1.2 * 1500.0 * flops}))
    assert peaked.concurrency("float32", 2) == pytest.approx(1.2)
    off, on = (peaked.concurrent_seconds(64, "float32", jit, 2) for jit in ("off", "on"))
    assert off / on == pytest.approx(1.5)
    assert facts.concurrency("float32", 2) == 1.0


def test_dtensor_zero_stages_cost_what_their_probes_measured_beyond_stage_0(facts):
    """A ZeRO stage's time beyond stage 0's and its modeled terms is its
    probe's unexplained seconds less stage 0's, per computed byte (the probe
    model is the test's own here: 1 to 1); the control: without probe rates
    there is no such term."""
    cost = search.cost_model(strategies.engine("dtensor"))
    options = {"mesh": "batch:4,model:1", "zero_stage": 0, "accum_steps": 1,
               "virtual_devices": 4, "precision": "float32", "jit_compile": "off"}
    bare = dataclasses.replace(facts, calibration=dataclasses.replace(
        facts.calibration, probe=costs.Probe(model=facts.model, batch=32, reference=6e8,
                                             peaks={}, reference_rates={1: 3200.0})))
    predicted = {stage: cost.estimate(probing.probe_facts(bare), {**options, "zero_stage": stage}
                                      ).step_seconds for stage in (0, 1, 3)}
    unexplained = {0: 0.002, 1: 0.005, 3: 0.009}    # seconds beyond each stage's prediction
    rates = {f"dtensor zero{stage} accum1": 32 / (predicted[stage] + unexplained[stage])
             for stage in predicted}
    probed = dataclasses.replace(bare, calibration=dataclasses.replace(
        bare.calibration, probe=dataclasses.replace(bare.calibration.probe, rates=rates)))

    def term(f, stage):
        return cost.estimate(f, {**options, "zero_stage": stage}).time.get(
            "ZeRO beyond its terms (probed)")

    assert term(probed, 1) == pytest.approx(0.003)
    assert term(probed, 3) == pytest.approx(0.007)
    assert term(probed, 0) is None and term(probed, 2) is None    # stage 2 not probed
    assert term(facts, 1) is None


@pytest.mark.parametrize("lines,where,name", [
    ("12:memory:/tfdist-launch-7/worker-0\n0::/\n", "memory/tfdist-launch-7/worker-0",
     "memory.max_usage_in_bytes"),
    ("0::/tfdist-launch-7/worker-0\n", "tfdist-launch-7/worker-0", "memory.peak")])
def test_a_capped_trial_reads_its_cgroups_peak_v1_or_v2(tmp_path, monkeypatch, lines, where,
                                                        name):
    """Under `--worker_memory` a trial's peak is its memory cgroup's (v1's
    max usage or v2's peak); without a cap (the control) none is read."""
    from tfdist.planner import trial
    own = tmp_path / "cgroup"
    own.write_text(lines)
    (tmp_path / where).mkdir(parents=True)
    (tmp_path / where / name).write_text("123456789\n")
    monkeypatch.setenv("TFDIST_WORKER_MEMORY", "1000000000")
    assert trial._cgroup_peak(str(own), str(tmp_path)) == 123456789
    monkeypatch.delenv("TFDIST_WORKER_MEMORY")
    assert trial._cgroup_peak(str(own), str(tmp_path)) is None


def test_the_reference_runtime_is_measured_for_a_cluster_too(facts):
    """The families' runtimes are deltas from the one-device engine's: on a
    cluster (no one-device candidate) it is still measured, beside
    multi_worker's two processes; dtensor's is not where it has no
    candidate (the control)."""
    from tfdist import planner
    cluster = _cluster(facts, 2, 1e8)
    found = planner.runtime_families(cluster)
    assert found["default"][1] == 1 and found["multi_worker"][1] == 2
    assert "mirrored" not in found        # one device per process: no mirrored candidate
    one = planner.runtime_families(facts)
    assert "multi_worker" not in one and {"default", "mirrored", "dtensor"} <= set(one)


def test_an_uncapped_trial_counts_its_anonymous_peak_not_the_shared_libraries(tmp_path):
    """Without a cgroup of its own a trial's peak is its peak resident set
    less the file-backed pages it maps (TensorFlow's libraries, shared from
    the page cache and not charged to a cgroup again): measured on one run,
    721 MiB resident, 315 MiB cgroup peak. The control: the resident peak
    alone would count the 400 MiB of libraries."""
    from tfdist.planner import trial
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmHWM:\t  737364 kB\nVmRSS:\t  700000 kB\n"
                      "RssAnon:\t  280240 kB\nRssFile:\t  419760 kB\nRssShmem:\t    1024 kB\n")
    assert trial._anonymous_peak(str(status)) == (737364 - 419760 - 1024) * 1024
    assert trial._anonymous_peak(str(status)) < 737364 * 1024 - 400 * 2**20
    status.write_text("Name:\tpython\n")
    assert trial._anonymous_peak(str(status)) is None


def test_a_trial_process_reports_a_peak_below_its_resident_set():
    """This process measured as a trial measures itself: the anonymous peak
    is positive and below the resident peak (the control: ru_maxrss)."""
    import resource
    from tfdist.planner import trial
    found, measured_as = trial.peak()
    assert measured_as in ("anonymous", "cgroup")
    resident = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert 0 < found < resident


def test_horovod_is_a_candidate_for_worker_processes_where_it_is_built(facts, monkeypatch):
    """Planned for two worker processes, Horovod's ranks are candidates beside
    multi_worker's (same terms: the trials tell their collectives apart), and
    only where Horovod is installed; `--strategy=auto` started as a TF_CONFIG
    cluster cannot switch to horovodrun, so its launches leave Horovod out.
    The controls: installed and any launch, they are there."""
    import importlib.machinery
    import importlib.util
    from tfdist.strategies import records
    real = importlib.util.find_spec
    built = importlib.machinery.ModuleSpec("horovod", None)   # as if built (make horovod)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: built if name == "horovod" else real(name, *a))
    cluster = _cluster(facts, 2, 1e9)
    found = {c.engine for c in _candidates(cluster, lossy=False) if not c.dropped}
    assert {"multi_worker", "horovod"} <= found
    workers = dataclasses.replace(cluster, host=dataclasses.replace(
        cluster.host, launches=(records.WORKERS, records.ONE_OR_WORKERS)))
    found = {c.engine for c in _candidates(workers, lossy=False) if not c.dropped}
    assert "multi_worker" in found and "horovod" not in found
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "horovod" else real(name, *a))
    assert "horovod" not in {c.engine for c in _candidates(cluster, lossy=False)}


def test_a_trial_starts_its_processes_as_its_engine_does(tmp_path, monkeypatch):
    """One process alone; a TF_CONFIG cluster under tfdist-launch (also for a
    memory cap); Horovod's ranks under horovodrun, which cannot cap each
    rank: a one-line refusal instead of an uncapped trial. A `horovodrun` on
    the PATH stands in where Horovod is not built yet (`make test` builds it
    beside the unit tests)."""
    from tfdist.planner import trials
    spec, out = str(tmp_path / "spec.json"), str(tmp_path)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "horovodrun").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "bin" / "horovodrun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{os.environ['PATH']}:{tmp_path / 'bin'}")

    def start(strategy, processes, cap=None):
        return trials.command([[f"--strategy={strategy}"]], processes, cap, spec, out)

    assert start("default", 1)[1:3] == ["-m", "tfdist.planner.trial"]
    launched = start("multi_worker", 2)
    assert launched[0].endswith("tfdist-launch") and "--workers=2" in launched
    assert "--worker_memory=1000" in start("default", 1, cap=1000)
    ranks = start("horovod", 2)
    assert ranks[0].endswith("horovodrun") and ranks[1:5] == ["-np", "2", "-H", "localhost:2"]
    assert ranks[ranks.index("-m") - 1] == trials.sys.executable
    with pytest.raises(UsageError, match="horovodrun"):
        start("horovod", 2, cap=1000)
    refused = trials.run([["--strategy=horovod"]], processes=2, cap=1000, work_dir=out)
    assert not refused.ok and "horovodrun" in refused.reason


def test_the_plan_says_how_to_start_its_winner():
    from tfdist.strategies import records
    flagfile = "--flagfile=plan.cfg"
    assert records.local_command(strategies.engine("dtensor"), 1, flagfile) == \
        "tfdist-train --flagfile=plan.cfg"
    assert records.local_command(strategies.engine("multi_worker"), 2, flagfile) == \
        "tfdist-launch --workers=2 -- tfdist-train --flagfile=plan.cfg"
    assert records.local_command(strategies.engine("horovod"), 4, flagfile) == \
        "horovodrun -np 4 -H localhost:4 --gloo tfdist-train --flagfile=plan.cfg"


def test_calibration_measures_the_loss_at_the_start_and_the_reference_run(monkeypatch):
    """One-step loops after the quarter batch give the loss at the start;
    the float32 whole-batch run's loss is the reference, its loop the length
    lossy trials run. The start run is not a candidate's measurement."""
    from tfdist.planner import calibrate

    def run(runs, **kw):
        records = []
        for flags in runs:
            one_step = "--steps_per_loop=1" in flags
            records.append({"examples_per_sec": 1000.0, "peak_bytes": 2**29,
                            "loss": 3.0 if one_step else 2.0})
        return _result(records)
    monkeypatch.setattr(calibrate.trials_lib, "run", run)
    calibration = calibrate.measure(run_config(batch=32), 4, False, {}, lambda line: None,
                                    None, 60.0, lambda examples: 0.0)
    assert (calibration.start_loss, calibration.reference_loss) == (3.0, 2.0)
    assert calibration.loop_steps == 4
    assert all(r.options.get("loop") is None and r.record["loss"] == 2.0
               for r in calibration.runs)
