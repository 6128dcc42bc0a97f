"""`pipeline`: pipeline parallelism over local devices or processes.

The model is split into --pipeline_stages stages (`tfdist.pipeline.split`:
balanced by FLOPs over its blocks, or at --pipeline_split's layers); stage s
lives on device s (its layers' variables and their optimizer slots there) or
in worker s, and each global batch is cut into --microbatches (the same
number as --accum_steps) micro-batches that flow through the stages on a GPipe or 1F1B schedule
(`tfdist.pipeline.schedule`). With --pipeline_chunks=v the model is split
into S x v stages and device (worker) d runs stages d, d + S, ... (interleaved
1F1B); below, "stage s's device" is device s mod S. One traced program holds
every stage's items; each device's items are chained with control
dependencies in its schedule's order, so each device runs its own schedule
and the stages' work overlaps wherever the data allows. With more devices than stages (a multiple of S),
R = devices / S pipeline replicas each take 1/R of the batch, and their
gradients are summed before the one update.

Where it runs:
- in one process (no cluster): stage s on local device s: GPUs, or the
  logical CPUs of --virtual_devices. Logical CPUs share one process's
  threadpool, so they prove correctness and placement but never speed
  (docs/guides/pipeline.md).
- across processes (a TF_CONFIG cluster of N = S x R workers, e.g. from
  tfdist-launch): worker k runs stage k mod S of pipeline replica k div S
  (with chunks: its stages k mod S, k mod S + S, ...),
  its own program (one client per stage: bench/pipeline_probe.py measured
  that one client driving several tasks runs their parts one after the
  other), and sends boundary tensors to its neighbours point to point
  (`CollectiveBcastSendV2`/`RecvV2` in a group of two). Each worker
  updates only its stage (`splits_update`): it sums its stage's gradients
  with the same stage of the other R - 1 pipeline replicas (a collective
  among those R workers; none for R = 1), the loss and metric counters and
  the clipping norm over all N, and applies the optimizer to its stage's
  variables. It also holds only its stage: the model is built without the
  storage of other stages' weights where it can be (else whole, then the
  others freed once every worker has the chief's), and their optimizer
  slots are freed as they are made (`compat.set_storage`; the variable
  objects stay, so checkpoints keep their layout). Evaluation runs through
  the stages like training (`forward`). Each checkpoint is written in parts
  (`tfdist.checkpoint_parts`: each worker the variables it holds, merged by
  the chief into one ordinary checkpoint) and each worker restores only what
  it holds. At the end of training the chief gathers the other stages'
  weights (`gather_stages`, from each stage's replica 0), for export and
  `RunResult.model`, unless --nopipeline_gather or its memory limit says no;
  the other workers never hold the whole model.

The update equals gradient accumulation of the same micro-batches on one
device: each micro-batch's loss is the trainer's (`MicroBatchLoss`), its
gradients flow back stage by stage (the boundary activation's gradient is the
next stage's input gradient), and each stage's are summed in micro-batch
order. BatchNorm-style state updates in each stage's forward, micro-batch by
micro-batch, as under accumulation; metrics are counted on the last stage.

The modules: `engine` (`PipelineStrategy`, the adapter: stages, placement,
checks, reports), `step` (one pipeline replica's items in the traced step),
`processes` (stages across processes: boundary transfers, the stage's
gradient sum, holding one stage, gathering and scattering the stages),
`inference` (the forward pass through stages across processes: evaluation,
and `StagesModel.predict`). The split and the schedules are
`tfdist.pipeline`.

This module imports no TensorFlow: `PipelineStrategy` loads `engine` on
first use.
"""

import importlib

_EXPORTS = {"PipelineStrategy": "engine"}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
