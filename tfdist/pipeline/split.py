"""Splitting a Keras functional model into pipeline stages.

The split reads the model's graph of calls, looking through nested
functional models (a keras-hub CausalLM calls its backbone as one layer):
each call of a layer or Keras op, in the graph's order. A model splits
where its graph narrows to one tensor: after call k, if exactly one tensor
made by calls 0..k is read by a later call or is a model output, a stage
boundary may fall there. The model's own inputs do not count: every stage
reads them (across processes every worker of a pipeline replica reads the
same batch), so keras-hub's padding mask, read by every decoder block, does
not stop a split. The segments between consecutive cut points are the
*blocks* a stage boundary may fall between: a decoder block (its skip
connections stay inside its layer), the mlp's dense layers, the cnn's
residual blocks. A residual `Add` written with the functional API keeps both
its branches in one block, so a split never cuts a skip connection.

A layer called at several places (tied embeddings: keras-hub's CausalLMs
embed the tokens with `token_embedding` and compute the logits with the same
layer reversed) belongs to every stage that calls it: its weights live on
each of those stages, and the engine sums their gradients
(`tfdist/strategies/pipeline/`), so the copies stay identical.

`split(model, stages)` balances S contiguous groups of blocks by forward
FLOPs (counted as `tfdist.observe.flops` counts them, per block), breaking
ties by parameter bytes; `split(model, stages, names=[...])` starts stage s+1
at the named layer instead (it must begin a block). Both refuse, in one line
(`UsageError`), what cannot be split: a subclassed model, more stages than
blocks, a name that is not a layer or is not at a cut point.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Optional, Sequence

from absl import logging

from tfdist import compat
from tfdist.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Block:
    """Consecutive calls (their layers' names, graph order) between two cut points, with
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
        """The names of the layers (and Keras ops) the stage calls, in order."""
        return tuple(name for block in self.blocks for name in block.layers)

    @property
    def calls(self) -> int:
        return sum(len(block.layers) for block in self.blocks)

    @property
    def params(self) -> int:
        return sum(b.params for b in self.blocks)

    @property
    def param_bytes(self) -> int:
        return sum(b.param_bytes for b in self.blocks)

    @property
    def flops(self) -> int:
        return sum(b.flops for b in self.blocks)


def flatten(value) -> list:
    """The tensors of a nested structure (dicts by insertion order)."""
    if isinstance(value, dict):
        return [t for v in value.values() for t in flatten(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in flatten(v)]
    return [] if value is None else [value]


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of a layer or Keras op in the model's graph: its arguments,
    the tensors it reads among them and the tensors it makes (symbolic)."""
    operation: object
    args: tuple
    kwargs: dict
    reads: tuple
    makes: tuple
    outputs: object   # `makes` as the call returned them

    @property
    def name(self) -> str:
        return self.operation.name


@dataclasses.dataclass(frozen=True)
class Graph:
    """A functional model's calls in the graph's order, nested functional
    models flattened: the model's inputs, its outputs (the tensors the last
    calls make) and the calls."""
    inputs: list
    outputs: object
    calls: list


_GRAPHS = weakref.WeakKeyDictionary()   # model -> its Graph (one replay per model)


def model_graph(model) -> Graph:
    """`model`'s `Graph`; `UsageError` for anything but a functional model."""
    if model in _GRAPHS:
        return _GRAPHS[model]
    import keras
    name = getattr(model, "name", type(model).__name__)
    if compat.functional_graph(model) is None:
        raise UsageError(
            f"pipeline stages: model {name!r} ({type(model).__name__}) is not a functional "
            "Keras model (keras.Model(inputs, outputs) or keras.Sequential); a subclassed "
            "model has no graph of layers to split: build it with the functional API")
    calls = []

    def call(operation, *args, **kwargs):
        nested = compat.functional_graph(operation)
        if nested is not None:   # look through it: its inputs are these arguments
            # (Keras passes a nested model its masks as `mask=`: none here.)
            given = keras.tree.flatten(args[0] if len(args) == 1 else list(args))
            if len(given) != len(nested.inputs) or any(
                    isinstance(t, keras.KerasTensor) for t in keras.tree.flatten(kwargs)):
                raise UsageError(
                    f"pipeline stages: model {name!r} calls model {operation.name!r} with "
                    f"{len(given)} tensor(s) for its {len(nested.inputs)} input(s); pass them "
                    "as one list or dict in the order of its inputs")
            return _replay(nested, given, call)
        outputs = operation(*args, **kwargs)
        reads = [t for t in keras.tree.flatten((args, kwargs)) if isinstance(t, keras.KerasTensor)]
        calls.append(Call(operation, args, kwargs, tuple(reads), tuple(flatten(outputs)), outputs))
        return outputs

    inputs = list(compat.functional_graph(model).inputs)
    found = Graph(inputs, compat.replay_functional(model, call), calls)
    _GRAPHS[model] = found
    return found


def _replay(nested, given, call):
    """The outputs of functional model `nested` called on tensors `given`
    (one per input), each call of its graph made through `call`."""
    import keras
    by_input = {id(t): g for t, g in zip(nested.inputs, given)}

    def inner(operation, *args, **kwargs):
        args, kwargs = keras.tree.map_structure(
            lambda t: by_input.get(id(t), t) if isinstance(t, keras.KerasTensor) else t,
            (args, kwargs))
        return call(operation, *args, **kwargs)

    return compat.replay_functional(nested, inner)


def cut_points(model) -> list:
    """Indices k (into the graph's calls) after which exactly one tensor made
    by calls 0..k is read by a later call or is a model output: where a stage
    boundary may fall."""
    return graph_cuts(model_graph(model))


def graph_cuts(graph: Graph, crossing_tensors=None) -> list:
    made_by = {}
    for k, call in enumerate(graph.calls):
        for t in call.makes:
            made_by[id(t)] = k
    end = len(graph.calls)
    # last_read[t]: the last call reading tensor t (end for a model output)
    last_read = {}
    for j, call in enumerate(graph.calls):
        for t in call.reads:
            last_read[id(t)] = max(last_read.get(id(t), -1), j)
    for t in flatten(graph.outputs):
        last_read[id(t)] = end
    tensors = {id(t): t for call in graph.calls for t in call.makes}
    cuts = []
    for k in range(end - 1):
        crossing = {key for key, made in made_by.items()
                    if made <= k and last_read.get(key, -1) > k}
        if len(crossing) == 1:
            cuts.append(k)
            if crossing_tensors is not None:
                crossing_tensors[k] = tensors[crossing.pop()]
    return cuts


def blocks(model, count_flops: bool = True, input_signature=None) -> list:
    """The model's blocks (see the module doc), in order. FLOPs are counted
    for inputs like `input_signature` (one example's `tf.TensorSpec`s, batch
    1: the data's, where the model's own inputs leave a length open), else
    for the model's inputs."""
    import keras

    from tfdist.observe import flops as flops_lib
    graph = model_graph(model)
    calls = graph.calls
    crossing = {}
    bounds = [-1, *graph_cuts(graph, crossing), len(calls) - 1]
    # One trace of the whole (flattened) model, its FLOPs attributed to
    # layers by name scope; a layer called at n places gets 1/n at each.
    per_layer, times = {}, {}
    for call in calls:
        times[call.name] = times.get(call.name, 0) + 1
    if count_flops:
        try:
            flat = keras.Model(graph.inputs, graph.outputs, name=model.name)
            per_layer = flops_lib.layer_flops(flat, list(times), input_signature)
        except ValueError as error:   # e.g. a length the inputs leave open
            logging.warning("Cannot count the FLOPs of model %r's layers (%s); its pipeline "
                            "stages are balanced by parameter bytes.", model.name,
                            (str(error).strip().splitlines() or [""])[0])
    found = []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        members = calls[start + 1:stop + 1]
        weights = list({id(w): w for call in members
                        for w in getattr(call.operation, "weights", ())}.values())
        params = sum(size(w.shape) for w in weights)
        param_bytes = sum(size(w.shape) * itemsize(w.dtype) for w in weights)
        count = sum(per_layer.get(call.name, 0) // times[call.name] for call in members)
        first_in = graph.inputs if start < 0 else [crossing[start]]
        shape = tuple(first_in[0].shape[1:]) if len(first_in) == 1 else \
            tuple(tuple(t.shape[1:]) for t in first_in)
        found.append(Block(tuple(call.name for call in members), shape, params,
                           param_bytes, count))
    return found


def size(shape) -> int:
    """Elements of a tensor of `shape`."""
    return math.prod(int(dim) for dim in shape)


def itemsize(dtype) -> int:
    """Bytes of one element of `dtype` (a name or a dtype object)."""
    import numpy as np
    name = getattr(dtype, "name", dtype)
    return 2 if name == "bfloat16" else np.dtype(name).itemsize


def split(model, stages: int, names: Optional[Sequence[str]] = None,
          found: Optional[list] = None, input_signature=None, flag: str = "") -> list:
    """S `Stage`s of `model`: balanced by FLOPs (for inputs like
    `input_signature`, see `blocks`), or starting at `names` (S-1 layer
    names, each the first layer of a block). `flag` names the option that
    asked for S in errors (default --pipeline_stages=S)."""
    flag = flag or f"--pipeline_stages={stages}"
    if found is None:
        found = blocks(model, count_flops=names is None, input_signature=input_signature)
    model_name = getattr(model, "name", "model")
    if stages < 1:
        raise UsageError(f"{flag}: must be at least 1")
    if stages > len(found):
        raise UsageError(
            f"{flag}: model {model_name!r} splits into only {len(found)} "
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
    first, every = {}, {}
    for i, b in enumerate(found):
        first.setdefault(b.layers[0], i)
        for name in b.layers:
            every.setdefault(name, i)
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
