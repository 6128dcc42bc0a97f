"""The stages of a split model as Keras runs them (`StageModel`): each
stage's calls of the model's graph (`tfdist/pipeline/split.py`) replayed on
the tensor from the stage before and the model inputs they read, with the
model's own layers, so a layer called on several stages (tied embeddings) is
one layer with one set of variables in each of them."""

from __future__ import annotations

import functools

from tfdist import compat
from tfdist.pipeline.split import flatten, graph_cuts, model_graph


class StageModel:
    """One stage as Keras runs it: the stage's calls replayed in the graph's
    order on the tensor from the stage before (none on stage 0) and the model
    inputs its calls read, with the model's own layers (and so its
    variables). Call it as `stage(boundary, inputs, training=...)`, with the
    model's own `inputs` (the batch's features, as the whole model takes
    them). `output` is the symbolic tensor (or the model's outputs) it makes."""

    def __init__(self, whole, name: str, calls: list, boundary, reads: list, inputs: list,
                 output):
        self._whole = whole
        self.takes_boundary = boundary is not None
        self.reads = reads   # indices into the whole model's flat inputs
        self.output = output
        symbolic_inputs = ([boundary] if boundary is not None else []) + \
            [inputs[i] for i in reads]
        self.layer = _replay_layer_class()(name, calls, symbolic_inputs, output)

    def __call__(self, boundary, inputs, training=None):
        flat = compat.standardize_inputs(self._whole, inputs) if self.reads else []
        values = ([boundary] if self.takes_boundary else []) + [flat[i] for i in self.reads]
        return self.layer(values, training=training)

    @property
    def variables(self) -> list:
        return self.layer.variables

    @property
    def trainable_variables(self) -> list:
        return self.layer.trainable_variables

    @property
    def losses(self) -> list:
        return self.layer.losses


def data_outputs(model, built: list, input_signature) -> list:
    """What each stage makes for inputs like `input_signature` (one example of
    the data: `tf.TensorSpec`s in the structure the model takes): the stages
    run symbolically, so a length the model leaves open (keras-hub's
    sequence length) is the data's. Each stage's output (symbolic, batch
    open), or its own `output` where the data's structure does not map onto
    the model's inputs."""
    import keras
    graph = model_graph(model)
    specs = keras.tree.flatten(input_signature) if input_signature is not None else []
    if len(specs) != len(graph.inputs):
        return [stage.output for stage in built]
    symbolic = [keras.KerasTensor((None, *spec.shape[1:]), dtype=spec.dtype.name)
                for spec in specs]
    outputs, boundary = [], None
    for stage in built:
        values = ([boundary] if stage.takes_boundary else []) + [symbolic[i] for i in stage.reads]
        boundary = stage.layer(values)
        outputs.append(boundary)
    return outputs


@functools.cache
def _replay_layer_class():
    """The Keras layer class `Replay` (made once Keras is imported)."""
    import keras

    class Replay(keras.layers.Layer):
        """Calls (`Call`s of one graph) replayed on values for their symbolic
        inputs, as a Keras layer: its sublayers are the calls' layers (so its
        variables and losses are theirs), and `training` reaches them through
        Keras's call context, as in a functional model. It casts nothing:
        each layer casts its own inputs under a mixed precision policy."""

        def __init__(self, name, calls, inputs, output):
            super().__init__(name=name, autocast=False, dtype="float32")
            self._calls, self._symbolic_inputs, self._output = calls, inputs, output
            unique = {id(c.operation): c.operation for c in calls}
            self.stage_layers = [op for op in unique.values() if isinstance(op, keras.Layer)]
            self.built = True

        def call(self, values, training=None):
            known = {id(t): v for t, v in zip(self._symbolic_inputs, values)}

            def fill(value):
                return known[id(value)] if isinstance(value, keras.KerasTensor) else value

            for c in self._calls:
                args, kwargs = keras.tree.map_structure(fill, (c.args, c.kwargs))
                out = c.operation(*args, **kwargs)
                for symbolic, value in zip(c.makes, flatten(out)):
                    known[id(symbolic)] = value
            return keras.tree.map_structure(fill, self._output)

    return Replay


def stage_models(model, stages: list) -> list:
    """One `StageModel` per stage, sharing `model`'s layers (and so its
    variables); a layer called on several stages is in each of them."""
    graph = model_graph(model)
    crossing = {}
    graph_cuts(graph, crossing)
    input_index = {id(t): i for i, t in enumerate(graph.inputs)}
    built, boundary, first = [], None, 0
    for s, stage in enumerate(stages):
        last = first + stage.calls - 1
        calls = graph.calls[first:last + 1]
        reads = []
        for call in calls:
            for t in call.reads:
                if id(t) in input_index and input_index[id(t)] not in reads:
                    reads.append(input_index[id(t)])
        output = graph.outputs if s == len(stages) - 1 else crossing[last]
        built.append(StageModel(model, f"{model.name}_stage{s}", calls, boundary, reads,
                                graph.inputs, output))
        boundary, first = output, last + 1
    return built
