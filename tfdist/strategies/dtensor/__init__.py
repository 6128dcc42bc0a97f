"""`dtensor`: tensor sharding (model parallel and hybrid data x model) with
`tf.experimental.dtensor`, for unchanged Keras 3 models.

The whole step runs SPMD on DTensor values: one program over the global
batch, split over the mesh's `batch` axis, with variables split over its
`model` axis by the model's layout rules (`tfdist/sharding.py`). There are
no replicas to reduce across: DTensor inserts the collectives a layout needs,
so `all_reduce_sum` is the identity and `step_copies` is 1.

How a Keras 3 model lands on the mesh (Keras has no DTensor path on the
TensorFlow backend): the model and optimizer are built inside
`tf.variable_creator_scope`, whose creator turns each variable's initial value
into a DTensor with the layout its rule gives. Optimizer slots always take
their variable's layout (a slot on another layout makes Adam silently wrong);
the updates run through `updates`, which never reads a slot back.

ZeRO (`--zero_stage`) also splits state over the `batch` axis, on a dimension
the variable's rule leaves whole (`sharding.zero_spec`):
  1: optimizer slots (gathered to the variable's layout for the update);
  2: slots and gradients: each gradient leaves the backward pass in its slot's
     layout (the data-parallel sum becomes a reduce-scatter), accumulates and
     updates there; only the weight update is gathered to the variable;
  3 (FSDP): slots, gradients and the variables themselves. A variable is
     stored split; inside `compute_scope` (the trainer's forward and backward
     passes) every read of it is relayouted to its rule's layout (an
     all-gather), and the gradient of that relayout comes back split as
     stored (a reduce-scatter).
Under every split layout (any stage, tensor parallel too) each device's shard
of a Keras variable's initial value is drawn alone, equal to that slice of one
device's value (`init`): the same seed gives the same initial weights
on every mesh and engine, and no process makes a whole variable whose
initializer is element-wise.

The modules: `engine` (`DTensorStrategy`, the adapter), `variables`
(`MeshVariable`, the variable creator, host <-> mesh moves), `gather`
(ZeRO-3's per-layer gathering), `updates` (optimizer updates correct on
DTensors), `init` (initial values shard by shard), `ops` (gradients DTensor
can shard, and the refusal of ops it cannot), `rules` (generated: the op types
DTensor has a layout rule for), `clients` (a mesh over several processes),
`report` (`--print_layouts`, the run summary).

This module imports no TensorFlow: the names below load their module on
first use.
"""

import importlib

_EXPORTS = {"DTensorStrategy": "engine", "MeshVariable": "variables"}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
