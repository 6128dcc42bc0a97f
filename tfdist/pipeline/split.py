"""Splitting a Keras functional model into pipeline stages.

A model splits where its graph narrows to one tensor: after layer k of the
model's layers in graph order, if exactly one tensor made by the model's
inputs or layers 0..k is read by a later layer or is a model output, the
model is "cut-able" there. The segments between consecutive cut points are the
*blocks* a stage boundary may fall between: a bundled transformer's decoder
blocks (a block's own skip connections stay inside its layer), the mlp's
dense layers, the cnn's residual blocks. A residual `Add` written with the
functional API at the model's top level keeps both its branches in one block,
so a split never cuts a skip connection.

`split(model, stages)` balances S contiguous groups of blocks by forward
FLOPs (counted as `tfdist.observe.flops` counts them, per block), breaking
ties by parameter bytes; `split(model, stages, names=[...])` starts stage s+1
at the named layer instead (it must begin a block). Both refuse, in one line
(`UsageError`), what cannot be split: a subclassed model, a layer called at
more than one place, more stages than blocks, a name that is not a layer or
is not at a cut point.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from absl import logging

from tfdist import compat
from tfdist.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Block:
    """Consecutive layers (names, graph order) between two cut points, with
    its input tensor's shape (batch excluded), its parameter count and bytes,
    and its forward FLOPs per example."""
    layers: tuple
    input_shape: tuple
    params: int
    param_bytes: int
    flops: int


@dataclasses.dataclass(frozen=True)
class Stage:
    """One pipeline stage: the blocks it runs, in order, and their totals."""
    index: int
    blocks: tuple

    @property
    def layers(self) -> tuple:
        return tuple(name for block in self.blocks for name in block.layers)

    @property
    def params(self) -> int:
        return sum(b.params for b in self.blocks)

    @property
    def param_bytes(self) -> int:
        return sum(b.param_bytes for b in self.blocks)

    @property
    def flops(self) -> int:
        return sum(b.flops for b in self.blocks)


def _flat(value) -> list:
    if isinstance(value, dict):
        return [t for v in value.values() for t in _flat(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat(v)]
    return [] if value is None else [value]


def _graph(model):
    """(layers in graph order, each layer's input tensors, its output tensors)
    for a functional model; `UsageError` for anything else."""
    name = getattr(model, "name", type(model).__name__)
    try:
        inputs, outputs = _flat(model.inputs), _flat(model.outputs)
    except (AttributeError, ValueError):
        inputs = outputs = None
    if not inputs or not outputs:
        raise UsageError(
            f"pipeline stages: model {name!r} ({type(model).__name__}) is not a functional "
            "Keras model (keras.Model(inputs, outputs) or keras.Sequential); a subclassed "
            "model has no graph of layers to split: build it with the functional API")
    layers, reads, makes = [], [], []
    for layer in model.layers:
        if type(layer).__name__ == "InputLayer":
            continue
        calls = compat.symbolic_calls(layer)
        if calls != 1:
            raise UsageError(
                f"pipeline stages: layer {layer.name!r} of model {name!r} is called at "
                f"{calls} places of its graph; a pipeline stage must own its layers: give "
                "each call a layer of its own")
        layer_in, layer_out = _flat(layer.input), _flat(layer.output)
        layers.append(layer)
        reads.append(layer_in)
        makes.append(layer_out)
    return inputs, outputs, layers, reads, makes


def cut_points(model) -> list:
    """Indices k (into the layers `_graph` lists) after which exactly one tensor
    crosses from layers 0..k (and the inputs) to the layers after k or to the
    model's outputs: where a stage boundary may fall."""
    return _cuts(*_graph(model))


def _cuts(inputs, outputs, layers, reads, makes, crossing_tensors=None) -> list:
    made_by = {id(t): -1 for t in inputs}
    for k, tensors in enumerate(makes):
        for t in tensors:
            made_by[id(t)] = k
    end = len(layers)
    # last_read[t]: the last position reading tensor t (end for a model output)
    last_read = {}
    for j, tensors in enumerate(reads):
        for t in tensors:
            last_read[id(t)] = max(last_read.get(id(t), -1), j)
    for t in outputs:
        last_read[id(t)] = end
    cuts = []
    for k in range(len(layers) - 1):
        crossing = {key for key, made in made_by.items()
                    if made <= k and last_read.get(key, -1) > k}
        if len(crossing) == 1:
            cuts.append(k)
            if crossing_tensors is not None:
                crossing_tensors[k] = crossing.pop()
    return cuts


def stage_models(model, stages: list) -> list:
    """One Keras model per stage, sharing `model`'s layers (and so its
    variables): stage 0 takes the model's inputs, stage s its predecessor's
    boundary tensor, and the last stage returns the model's outputs.

    Keras builds these by cloning the graph's nodes between the boundary
    tensors, which adds a symbolic call to each layer, so split first (the
    split refuses layers called at several places): `split` then `stage_models`.
    """
    import keras
    inputs, outputs, layers, reads, makes = _graph(model)
    tensors = {id(t): t for group in [inputs, *makes] for t in group}
    crossing = {}
    _cuts(inputs, outputs, layers, reads, makes, crossing)
    position = {layer.name: k for k, layer in enumerate(layers)}
    built = []
    stage_input = model.input
    for s, stage in enumerate(stages):
        if s == len(stages) - 1:
            stage_output = model.output
        else:
            stage_output = tensors[crossing[position[stage.layers[-1]]]]
        built.append(keras.Model(stage_input, stage_output, name=f"{model.name}_stage{s}"))
        stage_input = stage_output
    return built


def blocks(model, count_flops: bool = True, input_signature=None) -> list:
    """The model's blocks (see the module doc), in order. FLOPs are counted
    for inputs like `input_signature` (one example's `tf.TensorSpec`s, batch
    1: the data's, where the model's own inputs leave a length open), else
    for the model's inputs."""
    from tfdist.observe import flops as flops_lib
    graph = _graph(model)
    inputs, _, layers, _, makes = graph
    bounds = [-1, *_cuts(*graph), len(layers) - 1]
    # One trace of the whole model, its FLOPs attributed to layers by name
    # scope (a sub-model per block would add nodes to the model's layers).
    per_layer = {}
    if count_flops:
        try:
            per_layer = flops_lib.layer_flops(model, [layer.name for layer in layers],
                                              input_signature)
        except ValueError as error:   # e.g. a length the inputs leave open
            logging.warning("Cannot count the FLOPs of model %r's layers (%s); its pipeline "
                            "stages are balanced by parameter bytes.", model.name,
                            (str(error).strip().splitlines() or [""])[0])
    found = []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        members = layers[start + 1:stop + 1]
        first_in = inputs if start < 0 else makes[start]
        params = sum(_size(w.shape) for layer in members for w in layer.weights)
        param_bytes = sum(_size(w.shape) * _itemsize(w.dtype)
                          for layer in members for w in layer.weights)
        count = sum(per_layer.get(layer.name, 0) for layer in members)
        shape = tuple(first_in[0].shape[1:]) if len(first_in) == 1 else \
            tuple(tuple(t.shape[1:]) for t in first_in)
        found.append(Block(tuple(layer.name for layer in members), shape, params,
                           param_bytes, count))
    return found


def _size(shape) -> int:
    size = 1
    for dim in shape:
        size *= int(dim)
    return size


def _itemsize(dtype) -> int:
    import numpy as np
    name = getattr(dtype, "name", dtype)
    return 2 if name == "bfloat16" else np.dtype(name).itemsize


def split(model, stages: int, names: Optional[Sequence[str]] = None,
          found: Optional[list] = None, input_signature=None) -> list:
    """S `Stage`s of `model`: balanced by FLOPs (for inputs like
    `input_signature`, see `blocks`), or starting at `names` (S-1 layer
    names, each the first layer of a block)."""
    if found is None:
        found = blocks(model, count_flops=names is None, input_signature=input_signature)
    model_name = getattr(model, "name", "model")
    if stages < 1:
        raise UsageError(f"--pipeline_stages={stages}: must be at least 1")
    if stages > len(found):
        raise UsageError(
            f"--pipeline_stages={stages}: model {model_name!r} splits into only {len(found)} "
            f"block(s) (a stage boundary can fall only where one tensor crosses: "
            f"{_describe_cuts(found)}); use at most {len(found)} stages")
    if names is not None:
        starts = _named_starts(model_name, found, names, stages)
    else:
        starts = _balanced_starts([b.flops for b in found], [b.param_bytes for b in found],
                                  stages)
    bounds = [*starts, len(found)]
    return [Stage(s, tuple(found[bounds[s]:bounds[s + 1]])) for s in range(stages)]


def _describe_cuts(found) -> str:
    return "after " + ", ".join(repr(b.layers[-1]) for b in found[:-1]) if len(found) > 1 \
        else "nowhere"


def _named_starts(model_name, found, names, stages) -> list:
    names = list(names)
    if len(names) != stages - 1:
        raise UsageError(f"pipeline_split={','.join(names)}: {stages} stages need "
                         f"{stages - 1} layer name(s) where stages 2..{stages} begin, got "
                         f"{len(names)}")
    first = {b.layers[0]: i for i, b in enumerate(found)}
    every = {name: i for i, b in enumerate(found) for name in b.layers}
    starts = [0]
    for name in names:
        if name not in every:
            raise UsageError(f"pipeline_split={name}: model {model_name!r} has no layer "
                             f"{name!r}; stages may begin at {', '.join(first)}")
        if name not in first:
            raise UsageError(
                f"pipeline_split={name}: a stage cannot begin at layer {name!r}: more than "
                f"one tensor (a skip connection) crosses into it; stages may begin at "
                f"{', '.join(first)}")
        if first[name] <= starts[-1]:
            raise UsageError(f"pipeline_split={','.join(names)}: the names must be in the "
                             f"model's order, each after the one before and not the first "
                             f"block {found[0].layers[0]!r}")
        starts.append(first[name])
    return starts


def _balanced_starts(costs, ties, stages) -> list:
    """Start indices of `stages` contiguous groups: first the smallest
    possible largest group (by cost, then by the tie-break), then, among the
    splits that keep every group within it, the most even one (least sum of
    squared costs, then tie-breaks). Without the second step a dominant block
    leaves the split free to give another stage nothing at all."""
    n = len(costs)
    prefix, tprefix = [0], [0]
    for c, t in zip(costs, ties):
        prefix.append(prefix[-1] + c)
        tprefix.append(tprefix[-1] + t)

    def cost(i, j):
        return (prefix[j] - prefix[i], tprefix[j] - tprefix[i])

    def partition(score, combine, allowed):
        """best[s][j]: (score, starts) of the first j blocks in s groups."""
        inf = (float("inf"), float("inf"))
        best = [[(inf, None)] * (n + 1) for _ in range(stages + 1)]
        best[0][0] = ((0, 0), [])
        for s in range(1, stages + 1):
            for j in range(s, n + 1):
                for i in range(s - 1, j):
                    prior, starts = best[s - 1][i]
                    if starts is None or not allowed(i, j):
                        continue
                    value = combine(prior, score(i, j))
                    if value < best[s][j][0]:
                        best[s][j] = (value, starts + [i])
        return best[stages][n]

    worst, _ = partition(cost, max, lambda i, j: True)

    def squares(i, j):
        c, t = cost(i, j)
        return (c * c, t * t)

    _, starts = partition(squares, lambda a, b: (a[0] + b[0], a[1] + b[1]),
                          lambda i, j: cost(i, j)[0] <= worst[0])
    return starts


def table(found_stages: list) -> str:
    """What `--print_stages` prints: each stage's layers, parameters and FLOPs."""
    total_flops = sum(s.flops for s in found_stages) or 1
    rows = [f"{'stage':>5}  {'params':>12}  {'param bytes':>12}  {'fwd FLOPs/example':>17}  "
            f"{'share':>5}  layers"]
    for s in found_stages:
        layers = s.layers
        shown = ", ".join(layers) if len(layers) <= 6 else \
            f"{', '.join(layers[:3])}, ... ({len(layers) - 5} more), {', '.join(layers[-2:])}"
        rows.append(f"{s.index:>5}  {s.params:>12,}  {s.param_bytes:>12,}  {s.flops:>17,}  "
                    f"{s.flops / total_flops:>5.0%}  {shown}")
    return "\n".join(rows)
