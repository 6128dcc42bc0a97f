"""Training FLOPs per example of a Keras 3 model, for model FLOP/s and MFU.

The count is read off the TensorFlow graph of one example's forward pass
(`model(x, training=False)` traced on a batch of 1), so it covers whatever
Keras lowered a layer to: `Dense` on 2-D inputs is a `MatMul`, on 3-D inputs a
`Tensordot` `MatMul`; `EinsumDense` (attention projections) a `BatchMatMulV2`
or `Einsum`; `MultiHeadAttention` scores an `Einsum`; grouped convolutions a
`Conv2D` inside a nested function. Nested function bodies (calls, `If`
branches, `While` bodies) are walked too.

Only matmul-class ops are counted (MatMul, BatchMatMul, Einsum with two
operands, convolutions), each as 2 FLOPs per multiply-accumulate. Elementwise
ops (activations, norms, softmax, bias adds) are left out on purpose: MFU
compares against a matmul peak (`tfdist.observe.peak`), and those ops run
nowhere near it; this is the convention of the PaLM/Megatron MFU figures.

Caveats: a `While` body counts once (its trip count is a runtime value), so
recurrent models are undercounted; of an `If`'s branches the costlier one
counts. Every shape must be static once the batch is 1, else the count fails.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import tensorflow as tf
from absl import logging

from tfdist import compat

# Training = forward + backward, and the backward pass of a matmul is two
# matmuls of the same size (gradient w.r.t. the activations and w.r.t. the
# weights), so a training step costs 3 forward passes (Kaplan et al. 2020's
# 6 * params FLOPs per token). Recomputation (`--recompute`) is not counted:
# MFU measures useful work, not work the run chose to redo.
TRAINING_PASSES = 3


def forward_flops(model, input_signature=None) -> int:
    """Matmul-class FLOPs of one example's forward pass through `model`.

    `input_signature`: `tf.TensorSpec`s with a batch dimension of 1, structured
    like the model's inputs (one spec, a list, or a dict by input name);
    by default built from `model.inputs`.
    """
    return sum(forward_flops_by_op(model, input_signature).values())


def forward_flops_by_op(model, input_signature=None) -> dict:
    """`forward_flops` split by op type, e.g. {"MatMul": ..., "Conv2D": ...}."""
    if input_signature is None:
        input_signature = _input_signature(model)
    traced = tf.function(lambda inputs: model(inputs, training=False), autograph=False)
    graph = traced.get_concrete_function(input_signature).graph
    by_op: dict = {}
    _graph_flops(graph, (graph,), by_op)
    return by_op


def forward_flops_by_scope(model, input_signature=None) -> dict:
    """`forward_flops` split by the name scope each op of the traced graph sits
    in directly under the model's: a functional model's top-level layers, whose
    scopes TensorFlow may have made unique with a "_<n>" suffix (see
    `layer_flops`). Ops called through nested functions count where the call is."""
    if input_signature is None:
        input_signature = _input_signature(model)
    traced = tf.function(lambda inputs: model(inputs, training=False), autograph=False)
    graph = traced.get_concrete_function(input_signature).graph
    by_scope: dict = {}
    for op in graph.get_operations():
        counter = _COUNTERS.get(op.type)
        flops = (counter(op) if counter is not None else 0) + _called_flops(op, (graph,), {})
        if flops:
            parts = op.name.split("/")
            scope = parts[1] if len(parts) > 2 else ""
            by_scope[scope] = by_scope.get(scope, 0) + flops
    return by_scope


def layer_flops(model, names, input_signature=None) -> dict:
    """{layer name: forward FLOPs per example} for `names`, top-level layers of
    `model` (their scopes matched exactly, else with TensorFlow's "_<n>"
    suffix), and "" for FLOPs outside every named layer."""
    import re
    found = {name: 0 for name in names}
    found[""] = 0
    for scope, flops in forward_flops_by_scope(model, input_signature).items():
        if scope in found:
            found[scope] += flops
            continue
        base = re.sub(r"_\d+$", "", scope)
        found[base if base in found else ""] += flops
    return found


def convolution_share(by_op: dict) -> float:
    """The fraction of FLOPs in convolutions (0 for a model without any)."""
    total = sum(by_op.values())
    return sum(v for k, v in by_op.items() if "Conv" in k) / total if total else 0.0


def training_flops_per_example(model, input_signature=None) -> int:
    """FLOPs of one example's training step: 3 x `forward_flops` (the backward
    pass costs about twice the forward)."""
    return TRAINING_PASSES * forward_flops(model, input_signature)


def try_training_flops_per_example(model) -> Optional[int]:
    """`training_flops_per_example`, or None (with one warning) if the model
    cannot be traced or counted: a missing MFU must not end a training run."""
    by_op = try_forward_flops_by_op(model)
    return None if by_op is None else TRAINING_PASSES * sum(by_op.values())


def try_forward_flops_by_op(model, data_signature=None) -> Optional[dict]:
    """`forward_flops_by_op`, or None (with one warning line). Where the
    model's own inputs leave a dimension open (keras-hub's sequence length)
    and `data_signature()` gives one example of the data (`tf.TensorSpec`s,
    batch 1), or the model has no symbolic inputs (subclassed), the FLOPs
    are counted for the data's shapes."""
    from tfdist import compat
    try:
        signature = data_signature() if data_signature is not None and (
            _leaves_a_length_open(model) or not getattr(model, "inputs", None)) else None
        with compat.keras_name_scopes_restored():   # a failed trace leaves its scope
            return forward_flops_by_op(model, signature)
    except Exception as error:  # noqa: BLE001 - whatever fails, the run goes on
        first_line = (str(error).strip().splitlines() or [""])[0]
        logging.warning("Cannot count the FLOPs of model %r (%s: %s); MFU will not be "
                        "reported.", getattr(model, "name", model), type(error).__name__,
                        first_line)
        return None


def model_tflops(examples_per_sec: float, flops_per_example: int) -> float:
    """Achieved model TFLOP/s at `examples_per_sec`."""
    return examples_per_sec * flops_per_example / 1e12


def mfu(examples_per_sec: float, flops_per_example: int, peak_tflops: float) -> float:
    """Model FLOP/s utilisation: achieved model TFLOP/s over the peak (0..1)."""
    if peak_tflops <= 0:
        raise ValueError(f"peak_tflops must be positive, got {peak_tflops}")
    return model_tflops(examples_per_sec, flops_per_example) / peak_tflops


def _leaves_a_length_open(model) -> bool:
    """Whether one of the model's symbolic inputs has an open dimension
    after the batch (so its FLOPs depend on the data's shape)."""
    inputs = getattr(model, "inputs", None) or []
    return any(d is None for t in inputs for d in tuple(t.shape)[1:])


def _input_signature(model):
    """Batch-1 `tf.TensorSpec`s in the structure the model was built with."""
    inputs = getattr(model, "inputs", None)
    if not inputs:
        raise ValueError(f"model {getattr(model, 'name', model)!r} has no symbolic inputs "
                         "(subclassed and never built?); pass input_signature")
    try:
        structure = model.input  # functional models keep their single/list/dict structure
    except AttributeError:  # a Sequential model that was never called
        structure = inputs[0] if len(inputs) == 1 else inputs
    return tf.nest.map_structure(lambda t: tf.TensorSpec((1, *t.shape[1:]), t.dtype), structure)


def _graph_flops(graph, scopes, by_op: dict) -> int:
    """FLOPs of every op in `graph` and in the functions its ops call, also
    added to `by_op` per op type. `scopes`: `graph` and the graphs it is
    nested in, innermost last."""
    total = 0
    for op in graph.get_operations():
        counter = _COUNTERS.get(op.type)
        if counter is not None:
            flops = counter(op)
            by_op[op.type] = by_op.get(op.type, 0) + flops
            total += flops
        total += _called_flops(op, scopes, by_op)
    return total


def _called_flops(op, scopes, by_op: dict) -> int:
    """FLOPs of the functions `op` calls: the costlier branch of an If/Case
    (one of them runs), one pass of a While's condition and body, all others."""
    names = [function for value in op.node_def.attr.values()
             for function in ([value.func.name] if value.HasField("func")
                              else [f.name for f in value.list.func])]
    if op.type in ("If", "StatelessIf", "Case", "StatelessCase"):
        branches = [({}, name) for name in names]
        counted = [(_function_flops(name, scopes, part), part) for part, name in branches]
        if not counted:
            return 0
        flops, part = max(counted, key=lambda c: c[0])
        for kind, value in part.items():
            by_op[kind] = by_op.get(kind, 0) + value
        return flops
    return sum(_function_flops(name, scopes, by_op) for name in names)


def _function_flops(name, scopes, by_op: dict) -> int:
    for graph in reversed(scopes):
        function = compat.graph_function(graph, name)   # the traced FuncGraph
        if function is not None:
            return _graph_flops(function.graph, (*scopes, function.graph), by_op)
    raise ValueError(f"function {name} is not in the graph's function library")


def _shape(tensor, op) -> list[int]:
    shape = tensor.shape
    if not shape.is_fully_defined():
        raise ValueError(f"{op.type} op {op.name} has a non-static input shape {shape}")
    return shape.as_list()


def _matmul(op) -> int:
    a, b = _shape(op.inputs[0], op), _shape(op.inputs[1], op)
    m, k = (a[1], a[0]) if op.get_attr("transpose_a") else (a[0], a[1])
    n = b[0] if op.get_attr("transpose_b") else b[1]
    return 2 * m * n * k


def _batch_matmul(op) -> int:
    a, b = _shape(op.inputs[0], op), _shape(op.inputs[1], op)
    m, k = (a[-1], a[-2]) if op.get_attr("adj_x") else (a[-2], a[-1])
    n = b[-2] if op.get_attr("adj_y") else b[-1]
    batch = math.prod(np.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2])))
    return 2 * batch * m * n * k


def _einsum(op) -> int:
    """2 x the product of every index's size: each output element sums over
    the contracted indices with one multiply-add each. A one-operand einsum is
    a transpose or a reduction, not a matmul: 0."""
    if len(op.inputs) != 2:
        return 0
    terms = op.get_attr("equation").decode().split("->")[0].split(",")
    sizes, ellipses = {}, []
    for term, tensor in zip(terms, op.inputs):
        shape = _shape(tensor, op)
        head, dots, tail = term.partition("...")
        ellipsis_end = len(shape) - len(tail)
        ellipses.append(tuple(shape[len(head):ellipsis_end]) if dots else ())
        for letter, size in zip(head + tail, shape[:len(head)] + shape[ellipsis_end:]):
            sizes[letter] = max(sizes.get(letter, 1), size)
    return 2 * math.prod(sizes.values()) * math.prod(np.broadcast_shapes(*ellipses))


def _conv(op) -> int:
    """Filter (..., in channels per group, out channels): each output element
    takes kernel-volume x in-channels-per-group multiply-adds."""
    out, kernel = _shape(op.outputs[0], op), _shape(op.inputs[1], op)
    return 2 * math.prod(out) * math.prod(kernel[:-1])


def _depthwise_conv(op) -> int:
    """Filter (kh, kw, in channels, multiplier): one input channel per output."""
    out, kernel = _shape(op.outputs[0], op), _shape(op.inputs[1], op)
    return 2 * math.prod(out) * math.prod(kernel[:-2])


def _conv_transpose(op) -> int:
    """`Conv2DTranspose` lowers to the input gradient of a convolution, which
    costs what that convolution costs: its output is this op's input 2."""
    kernel, forward_out = _shape(op.inputs[1], op), _shape(op.inputs[2], op)
    return 2 * math.prod(forward_out) * math.prod(kernel[:-1])


_COUNTERS = {
    "MatMul": _matmul,
    "BatchMatMul": _batch_matmul,
    "BatchMatMulV2": _batch_matmul,
    "BatchMatMulV3": _batch_matmul,
    "Einsum": _einsum,
    "Conv2D": _conv,
    "Conv3D": _conv,
    "DepthwiseConv2dNative": _depthwise_conv,
    "Conv2DBackpropInput": _conv_transpose,
    "Conv3DBackpropInputV2": _conv_transpose,
}
