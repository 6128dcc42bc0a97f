"""Private names of TensorFlow's DTensor (its dataset and its compiler's
environment switches) tfdist reads or sets; see the package docstring
(`tfdist/compat/__init__.py`). Imports no TensorFlow until called."""

from __future__ import annotations

from tfdist.compat._guard import _changed, _require, _require_called


# -- DTensor (BUILD_NOTES "DTensor with Keras 3") ------------------------------

def dtensor_dataset_one_client_per_replica(dataset):
    """Make a single-process `DTensorDataset` feed each replica its own rows.

    What: sets the private `DTensorDataset._num_clients_per_replica = 1` and
    `_partition_offset = 0` on this instance. Why: DTensor 2.21 counts a
    replica's devices from every device of the mesh's type in the process, not
    from the mesh; with more devices than the mesh uses it takes each replica
    to span 2 clients, repeats every batch and feeds every local replica the
    same examples (BUILD_NOTES "DTensorDataset counts a replica's devices",
    with the 4-CPU / 2-device-mesh reproduction). In one process no replica
    spans clients. Verified: tensorflow 2.21.0. Check: both attributes exist
    as ints and `__iter__` / `_partition` still read them.
    """
    readers = {"_num_clients_per_replica": "__iter__", "_partition_offset": "_partition"}
    for name in readers:
        what = f"tensorflow DTensorDataset.{name}"
        if not isinstance(_require(dataset, name, what), int):
            raise _changed(what, "is not an int")
    for name, reader in readers.items():
        _require_called(type(dataset), reader, name, f"tensorflow DTensorDataset.{name}")
    dataset._num_clients_per_replica = 1
    dataset._partition_offset = 0
    return dataset


# -- DTensor: how stage 3 (FSDP) gathers --------------------------------------------

_GATHER_ENV = "LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2"
_COMBINE_ENV = "DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION"
_fsdp_env_latched: dict = {}   # the values this process's DTensor programs compile with


def dtensor_fsdp_lowering(mesh_axes: dict, stage: int) -> None:
    """Choose DTensor's lowering of ZeRO-3's gathers, before anything compiles
    (called by every DTensor run's setup; the first one in a process decides).

    What: two environment switches of TensorFlow's DTensor compiler, read once
    per process, by the first DTensor program it compiles (verified: setting
    one later changes nothing; `tests/unit/test_compat.py`).

    - `DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION=0`. Why: by default
      DTensor merges the step's independent all-reduces into one, and on CPU
      every gather and reduce-scatter is an all-reduce, so the whole model's
      gathered weights and full gradients were alive at once. Measured: the
      mlp 2048x8 under stage 3 on 4 logical CPUs peaked at 4.2 GiB with it,
      2.4 GiB without, the same loss. It only makes fewer, larger collectives
      (a speed choice), so turning it off is safe for any mesh.
    - `LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2=1`, on a mesh with one
      axis larger than 1 only. Why: DTensor's default gather is a zero buffer
      plus an all-reduce, and the zero buffer of each gathered weight is a
      constant that every compiled program keeps for its lifetime (one more
      whole copy of the weights per device per traced step). The collective
      gather has none. Not on a 2-D mesh: there it is silently wrong (stage 3
      on `batch:2,model:2` ended 0.78 away from one device; `batch:4,model:1`
      matched), so such a mesh keeps the default, and is refused when this
      process already compiles with the collective gather.

    A value the user set is kept. Verified: tensorflow 2.21.0. Check: the
    refusal above (a wrong result is never silent); the memory is measured by
    `bench/dtensor.py`'s "does it fit" row and `tests/integration/test_zero.py`.
    """
    import os
    from tfdist.errors import UsageError
    flat = sum(1 for size in mesh_axes.values() if size > 1) <= 1
    if not _fsdp_env_latched:
        if stage >= 3:
            os.environ.setdefault(_COMBINE_ENV, "0")
            if flat:
                os.environ.setdefault(_GATHER_ENV, "1")
        _fsdp_env_latched.update({name: os.environ.get(name, "")
                                  for name in (_GATHER_ENV, _COMBINE_ENV)})
    if stage >= 3 and not flat and _fsdp_env_latched.get(_GATHER_ENV) == "1":
        mesh = ",".join(f"{axis}:{size}" for axis, size in mesh_axes.items())
        raise UsageError(
            f"--zero_stage=3 on --mesh={mesh}: this process compiles DTensor gathers with "
            f"{_GATHER_ENV}=1, which TensorFlow 2.21 gets wrong on a mesh with two axes "
            f"larger than 1; run this training in a new process without it, or use a "
            f"mesh with one axis larger than 1")


# -- DTensor: grappler's memory scheduling on SPMD-expanded programs ------------

# (executor type, serialized ConfigProto) of a thread's function call options ->
# the same options with grappler's memory optimizer off.
_WITHOUT_MEMORY_SCHEDULING: dict = {}
_CALL_OPTIONS = "tensorflow Context.function_call_options"

def dtensor_without_grappler_memory_scheduling():
    """A context in which the programs called (and first optimized) run without
    grappler's memory optimizer, for DTensor's step programs.

    What: replaces this thread's `Context.function_call_options` (a private
    TensorFlow object, `tensorflow/python/eager/context.py`) by a copy whose
    `ConfigProto` sets `rewrite_options.memory_optimization = NO_MEM_OPT`, and
    restores the original on exit. A function's call carries that ConfigProto
    to grappler, which optimizes the function the first time it is called.
    Why: the memory optimizer's scheduling pass turns a large `AddN` (the
    arithmetic optimizer folds the unrolled micro-batches' gradient sums into
    one) into a temporary variable plus one `AssignAdd` per input when it
    estimates the program near the device's memory, and sizes that variable
    from the statically inferred shape, which in DTensor's expanded program is
    the variable's global shape, not the device's shard: the first step failed
    with "Parameters and update must be the same size" (node
    `.../ArithmeticOptimizer/AddOpsRewrite_add_N/tmp_var_accum_K`; the mlp
    1024x2 on `--mesh=batch:1,model:2` at 8 micro-batches, batch 32; 2 and 4
    micro-batches were below its estimate). The pass only reschedules for
    memory, so without it the program computes the same sums (the same loss
    to the last bit in that run). Verified: tensorflow 2.21.0. Check: the
    context's `function_call_options` and its `executor_type` and
    `config_proto_serialized` exist, the latter as a serialized ConfigProto.
    """
    import contextlib

    from tensorflow.python.eager import context

    ctx = context.context()
    previous = _require(ctx, "function_call_options", _CALL_OPTIONS)
    options = _without_memory_scheduling(previous)

    @contextlib.contextmanager
    def scope():
        ctx.function_call_options = options
        try:
            yield
        finally:
            ctx.function_call_options = previous

    return scope()


def _without_memory_scheduling(previous):
    """`previous` (a thread's function call options) with grappler's memory
    optimizer off; made once per distinct options, not per call."""
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2

    serialized = _require(previous, "config_proto_serialized",
                          f"{_CALL_OPTIONS}.config_proto_serialized")
    executor = _require(previous, "executor_type", f"{_CALL_OPTIONS}.executor_type")
    if not isinstance(serialized, bytes):
        raise _changed(f"{_CALL_OPTIONS}.config_proto_serialized",
                       "is not a serialized ConfigProto")
    key = (executor, serialized)
    if key not in _WITHOUT_MEMORY_SCHEDULING:
        config = config_pb2.ConfigProto.FromString(serialized)
        config.graph_options.rewrite_options.memory_optimization = (
            rewriter_config_pb2.RewriterConfig.NO_MEM_OPT)
        _WITHOUT_MEMORY_SCHEDULING[key] = type(previous)(executor_type=executor,
                                                        config_proto=config)
    return _WITHOUT_MEMORY_SCHEDULING[key]
