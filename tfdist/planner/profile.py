"""The model as the planner sees it: built once in the planning process on
one device (nothing trained), read into `costs.ModelFacts`: its variables,
the optimizer's slot bytes per trained byte, the FLOPs of a training
example, the pipeline splits the search may try, its layout rules."""

from __future__ import annotations

import hashlib
from typing import Optional

import keras
import tensorflow as tf

from tfdist import models, sharding
from tfdist.config import RunConfig
from tfdist.errors import UsageError
from tfdist.observe import flops as flops_lib
from tfdist.pipeline import split as split_lib
from tfdist.planner.costs import ModelFacts, Stage, Variable
from tfdist.training import optimizers
from tfdist.training.precision import Precision

# Stage counts (S x chunks) a search may split into.
SPLITS = (2, 4, 8)


def model_facts(config: RunConfig, inputs, model_fn=None, layout_rules=None) -> ModelFacts:
    """Build the run's model and optimizer under float32 and read their facts."""
    keras.utils.set_random_seed(config.train.seed)
    with Precision("float32").policy_scope():
        model = inputs.built(model_fn(inputs.spec) if model_fn
                             else models.build(config.model, inputs.spec))
        example = inputs.example_signature()
        optimizer = optimizers.create(config.optimizer,
                                      global_batch_size=config.train.global_batch_size,
                                      total_steps=1)
        optimizer.build(model.trainable_variables)
    variables = [Variable(v.path, tuple(int(d) for d in v.shape), split_lib.itemsize(v.dtype),
                          v.trainable) for v in model.weights]
    trainable = sum(v.bytes for v in variables if v.trainable) or 1
    slots = sum(split_lib.size(v.shape) * split_lib.itemsize(v.dtype) for v in optimizer.variables
                if len(v.shape) > 0)
    if layout_rules is None and model_fn is None:
        layout_rules = models.layout_rules(config.model)
    by_op = flops_lib.try_forward_flops_by_op(model, lambda: example)
    return ModelFacts(
        name=model.name, buffered_example_bytes=_buffered_example_bytes(inputs),
        variables=variables, slot_ratio=slots / trainable,
        flops_per_example=(flops_lib.TRAINING_PASSES * sum(by_op.values()) if by_op else None),
        splits=_splits(model, example),
        layout_rules=sharding.as_layout_rules(layout_rules) if layout_rules else None,
        signature=signature(model), step_ops=step_ops(model, example))


def step_ops(model, example, batch: int = 2) -> Optional[int]:
    """The operations in the graph of one micro-batch's forward and backward
    pass of `model` on one device (the gradients of the sum of its floating
    outputs, traced at `batch` examples of `example`'s signature), or None
    if the model cannot be traced so."""
    signature = tf.nest.map_structure(
        lambda s: tf.TensorSpec([batch, *s.shape[1:]], s.dtype), example)

    def gradients(x):
        with tf.GradientTape() as tape:
            outputs = [tf.cast(o, tf.float32) for o in tf.nest.flatten(model(x, training=True))
                       if o.dtype.is_floating]
            loss = tf.add_n([tf.reduce_sum(o) for o in outputs])
        return tape.gradient(loss, model.trainable_variables)

    try:
        graph = tf.function(gradients, autograph=False).get_concrete_function(signature).graph
    except (TypeError, ValueError, NotImplementedError, tf.errors.OpError):
        return None
    return len(graph.get_operations())


def _buffered_example_bytes(inputs, sample: int = 64) -> float:
    """The mean bytes of one training example as the shuffle buffer holds it
    (an image's encoded bytes under the global order), over `sample`."""
    examples, _ = inputs.undecoded_examples("train", tf.distribute.InputContext())
    sizes = []
    for example in examples.take(sample):
        sizes.append(sum(int(tf.reduce_sum(tf.strings.length(t))) if t.dtype == tf.string
                         else t.numpy().nbytes for t in tf.nest.flatten(example)))
    return sum(sizes) / len(sizes) if sizes else 0.0


def _splits(model, signature) -> dict:
    """stages -> [Stage] for each of SPLITS the model allows, else the reason."""
    try:
        found = split_lib.blocks(model, input_signature=signature)
    except (UsageError, ValueError, TypeError) as error:
        reason = (str(error).strip().splitlines() or [""])[0]
        return {stages: reason for stages in SPLITS}
    splits = {}
    for stages in SPLITS:
        try:
            splits[stages] = [Stage(s.param_bytes, s.flops,
                                    _input_bytes(s.blocks[0].input_shape) if s.index else 0)
                              for s in split_lib.split(model, stages, found=found)]
        except UsageError as error:
            splits[stages] = str(error)
    return splits


def _input_bytes(shape) -> int:
    """Bytes per example of a stage's input activation (float32; 0 where a
    dimension is left open)."""
    dims = [d for d in shape]
    if any(d is None or isinstance(d, tuple) for d in dims):
        return 0
    return 4 * split_lib.size(dims)


def signature(model) -> str:
    """A digest of the model's variables (shapes, dtypes, trainable, in their
    order; not their names, which Keras numbers by how many models the
    process built before): what a cached plan is keyed by, with the batch,
    the cluster and the host."""
    text = "\n".join(f"{tuple(int(d) for d in v.shape)}:{split_lib.itemsize(v.dtype)}:"
                     f"{v.trainable}" for v in model.weights)
    return f"{type(model).__name__}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
