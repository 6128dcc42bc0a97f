"""The Python API: `tfdist.train(config, model_fn=..., dataset_fn=...)`.

The CLI (`tfdist-train`) is a thin layer over this: flags -> RunConfig -> `train`.
Start-up order matters and is fixed here: the engine is created before any
other TensorFlow op (MultiWorkerMirroredStrategy requires it, and virtual CPU
devices must be set before the runtime starts; --strategy=auto plans in a
process of its own), then data, then the model and optimizer in its scope.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional

import keras
import tensorflow as tf
from absl import logging

from tfdist import exporting as export_lib
from tfdist import models, sharding, strategies
from tfdist.checkpointing import Checkpointer, ReplicaState, checkpoint_dir
from tfdist.config import RunConfig
from tfdist.data.function_inputs import DatasetFn
from tfdist.data.inputs import of_run as inputs_of_run
from tfdist.data.spec import DatasetSpec
from tfdist.errors import UsageError, WorkerFault
from tfdist.observe import flops, hardware, logs, peak
from tfdist.observe import summary as summary_lib
from tfdist.training import batchnorm, compression, optimizers, xla, xla_cache
from tfdist.training.precision import Precision
from tfdist.training.task import Task, task_for
from tfdist.strategies.capabilities import (PipelineStages, ScheduledSteps, ServingProcesses,
                                            TensorSharding, ZeroStages, capability, require)
from tfdist.mesh_model import MeshModel, StagesModel
from tfdist.training.controller import Controller
from tfdist.training.trainer import Trainer, total_steps


@dataclasses.dataclass
class RunResult:
    summary: dict          # the run summary (also printed and written as summary.json)
    # The trained model; predicts, evaluates on host data. Where this process
    # does not hold it whole, a `MeshModel` (tensor sharding: runs on the mesh)
    # or a `StagesModel` (pipeline stages); see tfdist/mesh_model.py.
    model: keras.Model
    optimizer: keras.optimizers.Optimizer
    is_chief: bool = True  # only the chief prints and writes the summary
    # For `tfdist.export(result, ...)`: the engine the model lives on and how
    # to build a plain copy of it.
    strategy: object = dataclasses.field(default=None, repr=False)
    rebuild: Optional[Callable[[], keras.Model]] = dataclasses.field(default=None, repr=False)
    # Under tensor sharding (dtensor): the model whose variables are split
    # over the mesh, as trained (`model` is its plain copy); None elsewhere.
    sharded_model: Optional[keras.Model] = dataclasses.field(default=None, repr=False)


def export(source, export_dir: str, *, model_fn=None, spec=None) -> dict:
    """Write model.keras and a SavedModel (serving signature `serve`) to `export_dir`.

    source: a `RunResult` (its trained model) or a model_dir (its latest
    checkpoint; runs of your own model_fn pass it again). Returns the paths.
    """
    if isinstance(source, RunResult):
        if isinstance(source.model, StagesModel):
            source.model.save(os.path.join(export_dir, "model.keras"))   # says why not
        if isinstance(source.model, MeshModel):
            return export_lib.export_mesh_model(source.model, export_dir)
        return export_lib.export_model(source.model, export_dir, strategy=source.strategy,
                                       rebuild=source.rebuild)
    return export_lib.export_checkpoint(str(source), export_dir, model_fn=model_fn, spec=spec)


def check_model_dir(model_dir: Optional[str], flag: str = "--model_dir") -> None:
    """Fail early, before any training, if `model_dir` cannot be written."""
    if not model_dir:
        return
    try:
        os.makedirs(model_dir, exist_ok=True)
        probe = os.path.join(model_dir, f".tfdist-write-probe-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as error:
        raise UsageError(f"{flag}={model_dir} is not a writable directory: "
                         f"{error.strerror or error}") from None


def check_export_dir(export_dir: Optional[str]) -> None:
    """The export is staged beside `export_dir`: its parent must be writable."""
    if export_dir:
        parent = os.path.dirname(os.path.abspath(export_dir))
        if os.path.exists(export_dir) and not os.path.isdir(export_dir):
            raise UsageError(f"--export_dir={export_dir} is a file; give a directory")
        try:
            check_model_dir(parent, "--export_dir")
        except UsageError:
            raise UsageError(f"--export_dir={export_dir}: its directory {parent} is not "
                             "writable") from None


def check_batch(config: RunConfig, replicas: int) -> None:
    """The global batch must split evenly into replicas x micro-batches."""
    tc = config.train
    parts = replicas * tc.accum_steps
    if tc.global_batch_size % parts:
        raise UsageError(
            f"--global_batch_size={tc.global_batch_size} must be divisible by replicas "
            f"({replicas}) x --accum_steps ({tc.accum_steps}) = {parts}; "
            f"e.g. {max(parts, tc.global_batch_size // parts * parts)}")


def memory_advice(config: RunConfig, replicas: int) -> str:
    """What would reduce a worker's memory, for this run's batch."""
    tc = config.train
    per_replica = tc.global_batch_size // max(replicas, 1)
    micro = per_replica // tc.accum_steps
    more = tc.accum_steps * 2
    advice = [f"--accum_steps={more} (micro-batches of {max(per_replica // more, 1)})"
              if per_replica >= more else None,
              None if config.model.recompute else "--recompute",
              "--precision=mixed_bfloat16" if tc.precision == "float32" else None,
              f"a smaller --global_batch_size (now {tc.global_batch_size})"]
    return (f"per-replica batch {per_replica}, micro-batch {micro}; to use less memory: "
            + ", ".join(a for a in advice if a))


def out_of_memory(config: RunConfig, strategy, step: int, error) -> str:
    """One line for a ResourceExhaustedError during training."""
    text = str(getattr(error, "message", error)).strip().splitlines()
    return (f"{strategy.describe_process()}: out of memory in the steps after step {step} "
            f"({memory_advice(config, strategy.num_replicas)}): "
            f"{(text[0] if text else type(error).__name__)[:200]}")


def slow_choice_warnings(config: RunConfig, jit_level: str, strategy=None,
                         convolution_share: float = 0.0, large: float = 1.0) -> list[str]:
    """One line for each setting known to be slow on this CPU, with what is faster."""
    tc, lines = config.train, []
    bf16 = hardware.bf16_support()
    if tc.precision == "mixed_bfloat16" and bf16 == "emulated":
        lines.append("--precision=mixed_bfloat16 is emulated on this CPU (no AVX512-BF16 or "
                     "AMX-BF16): its convolutions and non-XLA matmuls run slower than float32 "
                     "(the demo cnn: 49 vs 230 examples/s on an AVX2 EPYC); use float32")
    if tc.precision == "mixed_float16":
        lines.append("--precision=mixed_float16 runs emulated float16 kernels on CPUs "
                     "(0.5x float32 for the mlp, ~15x slower for convolutions, measured by "
                     "bench/features.py): use float32, or mixed_bfloat16 on AMX CPUs")
    shared = strategy.shared_cpu_replicas if strategy is not None else 0
    if shared:
        lines.append(f"{shared} replicas share this CPU's {os.cpu_count()} cores as virtual "
                     "devices: a way to test multi-device code, not to speed a CPU up (every "
                     "replica's step and optimizer update contend for the same threads: "
                     "the mlp ran 0.48x (float32) and 0.66x (bfloat16) of one device on a "
                     "2-core EPYC, 0.78x and 0.61x on an AMX Xeon; bench/vs_fit.py measures "
                     "this CPU); for speed on one CPU use --strategy=default")
    buckets, supports = bool(tc.reduce_bucket_mb), strategy is None or strategy.supports_xla
    auto = (xla.resolve("auto", tc.precision, strategy, convolution_share, buckets, large)
            if strategy else xla.auto_level(tc.precision, True, convolution_share, buckets, large))
    if tc.jit_compile != "auto" and jit_level != auto and supports:
        lines.append(f"--jit_compile={tc.jit_compile}: on this CPU (bf16 matmuls: {bf16}) "
                     f"{xla.describe('auto', auto)} is faster for --precision={tc.precision} "
                     "(bench/vs_fit.py); --jit_compile=auto picks it")
    return lines


def _run_description(config, strategy, model, spec, controller, peak_lr) -> list[str]:
    """The derived quantities a user should see before the first step."""
    tc, oc = config.train, config.optimizer
    trainer = controller.trainer
    per_replica = tc.global_batch_size // strategy.num_replicas
    micro = f", {tc.accum_steps} micro-batches of {per_replica // tc.accum_steps}" \
        if tc.accum_steps > 1 else ""
    wire = {"none": "float32", "powersgd": f"powersgd rank {tc.powersgd_rank}",
            "topk": f"top {tc.topk_fraction:g} of each matrix"}.get(tc.grad_compression,
                                                                  tc.grad_compression)
    if tc.sync_every:
        wire = f"local SGD: float32 weights every {tc.sync_every} steps"
    lines = [
        f"hardware: {hardware.describe()}",
        strategy.describe(),
        f"model {model.name}: {model.count_params():,} parameters, precision {tc.precision}",
        f"dataset {spec.name}: global batch {tc.global_batch_size} = {strategy.num_replicas} "
        f"replica(s) x {per_replica}{micro}; {controller.total_steps} steps",
        f"learning rate: peak {peak_lr:g} ({oc.lr_scaling} scaling of {oc.learning_rate:g} "
        f"from batch {oc.base_batch_size}), {oc.warmup_steps} warm-up steps, {oc.lr_decay}",
        trainer.task.describe(),
        xla.describe(tc.jit_compile, trainer.jit_level) + (
            "; the replicas share one CPU: for speed, --strategy=default (see the warning)"
            if strategy.shared_cpu_replicas else ""),
    ]
    if controller.flops_per_example:
        peak_text = (f"; this host's matmul peak for {tc.precision} "
                     f"{controller.peak_tflops:.3f} TFLOP/s (tfdist-peak)"
                     if controller.peak_tflops else "")
        lines.append(f"training FLOPs per example: {controller.flops_per_example / 1e6:.1f} M "
                     f"(matmuls and convolutions, 3x forward){peak_text}")
    if strategy.step_copies > 1:  # an explicit gradient all-reduce (not DTensor's SPMD)
        lines.insert(4, f"sent per replica per update: {trainer.bytes_per_update / 1e6:.3f} MB "
                        f"({wire})")
    return lines


def train(config: RunConfig, *, model_fn: Optional[Callable[[DatasetSpec], keras.Model]] = None,
          dataset_fn: Optional[DatasetFn] = None,
          spec: Optional[DatasetSpec] = None, layout_rules=None, loss=None, metrics=None,
          export_dir: Optional[str] = None, plan_options: Optional[dict] = None) -> RunResult:
    """Train under `config.strategy`; return the run summary and the model.

    model_fn: builds a Keras 3 model from the dataset's `DatasetSpec`
      (default: the registered builder `config.model.name`). It runs in the
      engine's scope; it may `model.compile(loss=, metrics=)` to supply those.
    dataset_fn: `dataset_fn(split, input_context)` returning unbatched
      (x, y) or (x, y, sample_weight) examples of "train" or "test" for one
      input pipeline; x may be a dict of named features (default: the TFDS
      dataset `config.data.dataset`). `spec` describes it if the model needs it.
    layout_rules: `--strategy=dtensor` only: [(regex over variable path,
      sharding spec)], e.g. [(r"dense/kernel$", (None, "model"))]; default: the
      registered builder's rules (none, i.e. replicated, for your own model_fn).
      A `keras.distribution.LayoutMap` (axes batch and model) works too, with
      Keras's matching (`tfdist.sharding.LayoutRules.from_keras`).
    loss: a Keras 3 loss (object or name) or a callable (y_true, y_pred) ->
      per-example (or per-position) loss; default: the compiled model's, else
      `config.train.loss` on logits.
    metrics: Keras 3 metrics (objects or names); default: the compiled
      model's, else `config.train.metrics` (with the config's loss).
    export_dir: after training the chief writes model.keras and a SavedModel
      here (default `config.train.export_dir`; see `tfdist.export`).
    plan_options: `tfdist.plan`'s keywords under --strategy=auto (`tfdist.planner.auto`).
    """
    strategies.check_name(config.strategy.name)
    if model_fn is None:
        models.check_name(config.model.name)
    if layout_rules is not None:   # a bad LayoutMap fails here, before the engine starts
        layout_rules = sharding.as_layout_rules(layout_rules)
    if export_dir is not None:
        config = config.replace(train=config.train.replace(export_dir=export_dir))
    if strategies.is_auto(config.strategy):
        from tfdist.planner import auto
        return auto.train(train, config, plan_options, model_fn=model_fn, dataset_fn=dataset_fn,
                          spec=spec, layout_rules=layout_rules, loss=loss, metrics=metrics)
    strategy = strategies.create(config.strategy)
    strategy.setup()
    servers = capability(strategy, ServingProcesses)
    if servers and servers.serve_if_server():   # e.g. a parameter server: the job is over
        return RunResult(summary={}, model=None, optimizer=None, is_chief=False,
                         strategy=strategy)
    logs.configure(strategy, log_all_ranks=config.train.log_all_ranks)
    try:
        return _train(config, strategy, model_fn, dataset_fn, spec, layout_rules, loss, metrics)
    finally:
        strategy.close()


def _task(config: RunConfig, strategy, model, inputs, loss, metrics) -> Task:
    """The loss and metrics, checked against the data, the model and the engine."""
    task, specs = task_for(config, model, inputs, loss, metrics)
    strategy.check_task(task, *specs)
    return task


def _build(config, strategy, model_fn, inputs, steps, layout_rules):
    """Model and optimizer, built in the engine's scope under the precision policy."""
    if layout_rules is None and model_fn is None:
        layout_rules = models.layout_rules(config.model)
    sharded = capability(strategy, TensorSharding)
    if sharded:
        sharded.set_layout_rules(sharding.as_layout_rules(layout_rules))
    precision = Precision(config.train.precision,
                          loss_scale_growth_steps=config.train.loss_scale_growth_steps)
    pipeline = capability(strategy, PipelineStages)

    def build():
        keras.utils.set_random_seed(config.train.seed)
        with precision.policy_scope():
            model = model_fn(inputs.spec) if model_fn else models.build(config.model, inputs.spec)
            return inputs.built(model)

    with strategy.scope():
        model = pipeline.build_model(build) if pipeline else build()
        if pipeline:   # stages on their devices, before the optimizer's slots are made
            pipeline.place_model(model, inputs.example_signature())
        scheduled = capability(strategy, ScheduledSteps)
        optimizer = precision.wrap_optimizer(optimizers.create(
            config.optimizer, global_batch_size=config.train.global_batch_size,
            total_steps=steps,
            lr_factor=scheduled.learning_rate_factor() if scheduled else None))
        compression.prepare_optimizer(config.train, config.optimizer.name, optimizer, model,
                                      log=strategy.is_chief)
        if pipeline:   # a process holding some stages makes the others' slots freed
            pipeline.build_optimizer(optimizer, model.trainable_variables)
        else:
            optimizer.build(model.trainable_variables)
    strategy.on_optimizer_built(optimizer, model.trainable_variables)
    if sharded:
        sharded.prepare_model(model)
    return model, optimizer


def _serving_model(config: RunConfig, model_fn, inputs) -> keras.Model:
    """A fresh copy of the model outside any engine, under the run's precision
    policy, for export (its weights are then set from the trained model)."""
    precision = Precision(config.train.precision)
    with precision.policy_scope():
        return inputs.built(model_fn(inputs.spec) if model_fn
                            else models.build(config.model, inputs.spec))


def describe_layouts(config: RunConfig, *, model_fn=None, dataset_fn=None, spec=None,
                     layout_rules=None) -> str:
    """`--print_layouts`: where each variable, gradient and optimizer slot lives
    on `config.strategy.mesh` (stored and compute layouts, global and per-device
    bytes, read from the shards), and the per-device totals."""
    return _on_mesh(config, model_fn, dataset_fn, spec, layout_rules,
                    lambda strategy, model, optimizer: strategy.layout_report(model, optimizer))


def layout_rows(config: RunConfig, *, model_fn=None, dataset_fn=None, spec=None,
                layout_rules=None) -> list:
    """The rows of `describe_layouts` as dicts (kind, path, shape, stored,
    compute, global_bytes, device_bytes, whole), for programs and tests."""
    return _on_mesh(config, model_fn, dataset_fn, spec, layout_rules,
                    lambda strategy, model, optimizer: strategy.layout_rows(model, optimizer))


def _on_mesh(config, model_fn, dataset_fn, spec, layout_rules, fn):
    """`fn(strategy, model, optimizer)` with the model and optimizer built on
    the run's mesh (nothing trained)."""
    return _built(config, TensorSharding, "--print_layouts describes tensor sharding; "
                  "--strategy={} does not shard tensors (use dtensor)",
                  model_fn, dataset_fn, spec, layout_rules, fn)


def describe_stages(config: RunConfig, *, model_fn=None, dataset_fn=None, spec=None) -> str:
    """`--print_stages`: the pipeline's stages (device, layers, parameters,
    forward FLOPs) and what its schedule holds, for `config` (nothing trained)."""
    return _built(config, PipelineStages, "--print_stages describes pipeline stages; "
                  "--strategy={} has none (use --strategy=pipeline)",
                  model_fn, dataset_fn, spec, None,
                  lambda strategy, model, optimizer: strategy.stage_report(model))


def _built(config, interface, refusal, model_fn, dataset_fn, spec, layout_rules, fn):
    """`fn(strategy, model, optimizer)` with the model and optimizer built
    under the run's engine, which must implement `interface` (else `refusal`,
    formatted with the engine's name); nothing trained."""
    strategies.check_name(config.strategy.name)
    strategy = strategies.create(config.strategy)
    if not isinstance(strategy, interface):
        raise UsageError(refusal.format(config.strategy.name))
    strategy.setup()
    try:
        strategy.check_config(config)
        inputs = inputs_of_run(config, dataset_fn, spec)
        model, optimizer = _build(config, strategy, model_fn, inputs, 1, layout_rules)
        return fn(strategy, model, optimizer)
    finally:
        strategy.close()


def _check_run(config, strategy, dataset_fn, spec):
    """Every check of the run's settings against the engine and the data,
    before anything is built; returns the inputs."""
    tc = config.train
    if config.strategy.zero:
        require(strategy, ZeroStages, f"--zero_stage={config.strategy.zero}").check_zero(config)
    strategy.check_config(config)
    compression.check_engine(tc, strategy)
    batchnorm.check(tc, strategy)
    check_batch(config, strategy.num_replicas)
    xla.check(tc.jit_compile, strategy)
    if "bfloat16" in tc.precision and hardware.bf16_refusal():
        raise UsageError(f"--precision={tc.precision}: {hardware.bf16_refusal()}")
    if tc.profile_steps and not tc.model_dir:
        raise UsageError(f"--profile_steps={','.join(map(str, tc.profile_steps))} writes its "
                         "trace into model_dir/tensorboard; set --model_dir")
    if strategy.is_chief:
        check_model_dir(tc.model_dir)
        check_export_dir(tc.export_dir)
    inputs = inputs_of_run(config, dataset_fn, spec)
    inputs.check_sharding(strategy.num_input_pipelines)
    train_examples = inputs.spec.train_examples
    if train_examples and tc.global_batch_size > train_examples:
        raise UsageError(f"--global_batch_size={tc.global_batch_size} is larger than the "
                         f"{train_examples} training examples of {inputs.spec.name}")
    return inputs


def _checkpointer(config, strategy, model, optimizer, trainer) -> Optional[Checkpointer]:
    """The run's checkpointer (None without a model_dir), with the
    per-replica state every process saves beside each checkpoint."""
    tc = config.train
    if not tc.model_dir:
        return None
    checkpointer = Checkpointer(checkpoint_dir(tc.model_dir), keep=tc.keep_checkpoints,
                                is_chief=strategy.is_chief,
                                shared_write=isinstance(strategy, TensorSharding)
                                and strategy.num_workers > 1,
                                model=model, optimizer=optimizer, step=trainer.step)
    pipeline = capability(strategy, PipelineStages)
    if pipeline:   # each process writes and reads its own stages' part
        checkpointer.parts = pipeline.checkpoint_parts(checkpointer.checkpoint,
                                                       trainer.training_state)
    if trainer.replica_state_variables:
        checkpointer.replica_state = ReplicaState(
            checkpoint_dir(tc.model_dir), keep=tc.keep_checkpoints,
            signature={"grad_compression": tc.grad_compression, "rank": tc.powersgd_rank,
                       "fraction": tc.topk_fraction, "sync_every": tc.sync_every,
                       "replicas": strategy.num_replicas},
            process=strategy.worker_index, processes=strategy.num_workers,
            variables=trainer.replica_state_variables,
            replica_values=trainer.local_state.replica_values)
    return checkpointer


def _train(config, strategy, model_fn, dataset_fn, spec, layout_rules, loss,
           metrics) -> RunResult:
    tc = config.train
    inputs = _check_run(config, strategy, dataset_fn, spec)
    steps = total_steps(tc, inputs.spec)
    model, optimizer = _build(config, strategy, model_fn, inputs, steps, layout_rules)
    task = _task(config, strategy, model, inputs, loss, metrics)

    by_op = flops.try_forward_flops_by_op(model, lambda: inputs.example_signature()) or {}
    flops_per_example = flops.TRAINING_PASSES * sum(by_op.values()) or None
    traits = dict(convolution_share=flops.convolution_share(by_op), large=xla.large_share(model))
    jit_level = xla.resolve(tc.jit_compile, tc.precision, strategy,
                            buckets=bool(tc.reduce_bucket_mb), **traits)
    jit_level = batchnorm.prepare(tc, strategy, model, jit_level)
    peak_tflops = peak.precision_peak_tflops(tc.precision, measure=strategy.is_chief) \
        if flops_per_example else None
    trainer = Trainer(config=config, strategy=strategy, model=model, optimizer=optimizer,
                      task=task, jit_level=jit_level)
    if strategy.is_chief and tc.model_dir:   # once every check has passed
        export_lib.write_run_record(tc.model_dir, config, inputs.spec,
                                    builder=model_fn is None)
    checkpointer = _checkpointer(config, strategy, model, optimizer, trainer)
    controller = Controller(config=config, trainer=trainer, inputs=inputs, total_steps=steps,
                            checkpointer=checkpointer, flops_per_example=flops_per_example,
                            peak_tflops=peak_tflops)
    peak_lr = optimizers.peak_learning_rate(config.optimizer, tc.global_batch_size)
    for line in _run_description(config, strategy, model, inputs.spec, controller, peak_lr):
        logging.info(line)
    if strategy.is_chief:   # one line per run, not one per worker
        for line in slow_choice_warnings(config, jit_level, strategy, **traits):
            logging.warning(line)
    try:
        metrics = controller.fit()
    except tf.errors.ResourceExhaustedError as error:
        raise WorkerFault(out_of_memory(config, strategy, controller.loop_start, error)) from None
    except tf.errors.OpError as error:   # (the XLA cache's disk filling up: named as such)
        raise WorkerFault(xla_cache.caused(error) or strategy.describe_fault(error)) from error
    summary = summary_lib.run_summary(config, controller, inputs, metrics, peak_lr=peak_lr)
    return _finish(config, strategy, model, optimizer, summary, task,
                   lambda: _serving_model(config, model_fn, inputs))


def _finish(config, strategy, model, optimizer, summary, task, rebuild) -> RunResult:
    """Export and write the summary (the chief), and the `RunResult`.

    A model whose variables are sharded over a mesh cannot run on host data
    (Keras would get regular tensors where the mesh's SPMD program expects
    DTensors), so under tensor sharding `RunResult.model` is a plain copy
    with the gathered weights, made by every process (the gather is a
    collective), and the sharded one is `RunResult.sharded_model`.
    """
    tc = config.train
    sharded = model if isinstance(strategy, TensorSharding) else None
    if sharded is not None:
        refusal = strategy.host_copy_refusal(sharded)
        if refusal:
            logging.warning("%s: RunResult.model runs predict, evaluate and save on the mesh "
                            "(tfdist.MeshModel)", refusal)
            model = MeshModel(sharded, strategy, task, is_chief=strategy.is_chief)
        else:
            model = export_lib.host_copy(sharded, strategy, rebuild)
    elif capability(strategy, ScheduledSteps) and strategy.is_chief:
        # Keras would schedule predict on the workers, which refuses host data.
        model = export_lib.host_copy(model, strategy, rebuild)
    pipeline = capability(strategy, PipelineStages)
    staged = pipeline is not None and not pipeline.holds_whole_model()
    if isinstance(model, MeshModel) and tc.export_dir:   # every process: gathers
        summary["export"] = export_lib.export_mesh_model(model, tc.export_dir)
    elif strategy.is_chief and tc.export_dir and staged:   # not gathered: it said why
        logging.warning("no export to %s: the chief holds its pipeline stages only; run "
                        "tfdist-export --model_dir=%s --export_dir=%s where the model fits",
                        tc.export_dir, tc.model_dir, tc.export_dir)
    elif strategy.is_chief and tc.export_dir:
        summary["export"] = export_lib.export_model(
            model, tc.export_dir, strategy=None if sharded else strategy,
            rebuild=None if sharded else rebuild)
    if strategy.is_chief and tc.model_dir:
        summary_lib.write_summary(tc.model_dir, summary)
    if staged:
        model = StagesModel.of(model, pipeline, task)
    if sharded is not None:
        strategy.end_of_run()
    return RunResult(summary=summary, model=model, optimizer=optimizer,
                     is_chief=strategy.is_chief, strategy=None if sharded else strategy,
                     rebuild=None if sharded else rebuild, sharded_model=sharded)
