"""What a run optimises and measures: a Keras loss and Keras metrics, made exact
under data parallelism.

Keras computes a loss per batch: the loss values (per example, or per
position of a sequence) times the sample weights (and any Keras mask), summed,
divided by the reduction's divisor: the number of values
(`sum_over_batch_size`, the default), the valid ones when a mask is present,
the sum of the weights (`mean_with_sample_weight`), or 1 (`sum`). Under data
parallelism each replica holds only part of the batch, so tfdist keeps the
numerator and the divisor apart: each replica sums its values, the
numerators and divisors are added over replicas, workers and micro-batches in
the step's one reduction, and the gradient is that of the global numerator
over the global divisor. Where the divisor is known before the step (no mask,
a fixed shape) the gradient is scaled by it directly; otherwise the summed
gradient is rescaled by it after the reduction.

Metrics are Keras metric objects used statelessly: every replica computes the
change a batch makes to a metric's state variables (from zero state; every
Keras metric's state is a sum of per-batch contributions: totals, counts,
confusion counts), the changes travel in the same reduction, the host adds
them up, and `stateless_result` turns the sums into the metric's value. No
average of averages, no per-replica metric variables, no extra collective.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfdist import compat
from tfdist.errors import UsageError, first_line

SUM_OVER_BATCH = "sum_over_batch_size"
REDUCTIONS = (SUM_OVER_BATCH, "mean", "sum", "mean_with_sample_weight", None, "none")

# The default of the CLI and of `tfdist.train` without a loss: every bundled
# builder ends in logits over classes (or over the vocabulary, per position).
DEFAULT_LOSS = "sparse_categorical_crossentropy"
DEFAULT_METRICS = ("accuracy",)

# `--loss` names (config.LOSSES) for the bundled builders: their outputs are
# logits and the bundled datasets' labels are class indices.
CLI_LOSSES = {
    "sparse_categorical_crossentropy":
        lambda smoothing: keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    "categorical_crossentropy": lambda smoothing: _OneHot(keras.losses.CategoricalCrossentropy(
        from_logits=True, label_smoothing=smoothing)),
    "categorical_focal_crossentropy": lambda smoothing: _OneHot(
        keras.losses.CategoricalFocalCrossentropy(from_logits=True,
                                                  label_smoothing=smoothing)),
}


class _OneHot(keras.losses.Loss):
    """A categorical loss fed class-index labels (one-hot over the logits' classes)."""

    def __init__(self, inner: keras.losses.Loss):
        super().__init__(name=inner.name, reduction=inner.reduction)
        self.inner = inner

    def call(self, y_true, y_pred):
        depth = y_pred.shape[-1]
        return self.inner.call(tf.one_hot(tf.cast(y_true, tf.int32), depth, dtype=y_pred.dtype),
                               y_pred)


def cli_loss(name: str, label_smoothing: float = 0.0) -> keras.losses.Loss:
    """A `config.LOSSES` name (checked by the config) as a loss on logits."""
    return CLI_LOSSES[name](label_smoothing)


def cli_metric(name: str):
    if name == "top5_accuracy":
        return keras.metrics.SparseTopKCategoricalAccuracy(k=5, name="top5_accuracy")
    if name == "crossentropy":
        return keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name="crossentropy")
    return name   # accuracy: Keras picks sparse/binary/categorical from the shapes


def _name_of(obj) -> str:
    if isinstance(obj, str):
        return obj
    return getattr(obj, "name", None) or getattr(obj, "__name__", None) or type(obj).__name__


def _as_loss(identifier) -> tuple[Callable, Optional[str], str]:
    """(values_fn(y_true, y_pred) -> unreduced values, reduction, name)."""
    if isinstance(identifier, keras.losses.Loss):
        return identifier.call, identifier.reduction, identifier.name
    if isinstance(identifier, str):
        try:
            resolved = keras.losses.get(identifier)
        except (ValueError, TypeError):
            raise UsageError(
                f"loss={identifier!r} is not a Keras loss; valid: a name such as "
                "sparse_categorical_crossentropy, categorical_crossentropy, "
                "binary_crossentropy, mse, mae, huber, or a keras.losses.Loss object or "
                "a callable (y_true, y_pred) -> per-example loss") from None
        if isinstance(resolved, keras.losses.Loss):
            return resolved.call, resolved.reduction, identifier
        return _aligned(resolved), SUM_OVER_BATCH, identifier
    if callable(identifier):
        return identifier, SUM_OVER_BATCH, _name_of(identifier)
    raise UsageError(f"loss={identifier!r} is neither a Keras loss (name or object) nor a "
                     "callable (y_true, y_pred) -> per-example loss")


def _aligned(fn):
    """A Keras loss function, with targets and predictions brought to the same
    rank first (as `keras.losses.Loss` does; e.g. (B,) targets, (B, 1) outputs)."""

    def call(y_true, y_pred):
        y_true, y_pred = compat.align_ranks(y_true, y_pred)
        return fn(y_true, y_pred)
    return call


def _mask_of(*tensors):
    for tensor in tensors:
        mask = compat.keras_mask(tensor)
        if mask is not None:
            return mask
    return None


def _align_weight(weight, values):
    """`weight` (per example, or per position) broadcastable against `values`."""
    weight = tf.cast(weight, values.dtype)
    while weight.shape.rank < values.shape.rank:
        weight = weight[..., None]
    while weight.shape.rank > values.shape.rank and weight.shape[-1] == 1:
        weight = tf.squeeze(weight, -1)
    return weight


@dataclasses.dataclass
class _MetricLayout:
    metric: keras.metrics.Metric
    shapes: list
    dtypes: list

    @property
    def size(self) -> int:
        return sum(int(np.prod(s)) for s in self.shapes)


class Task:
    """A loss and metrics for `Trainer`; build with `Task.resolve`."""

    def __init__(self, loss, metrics: Sequence = (), *, from_logits_hint: bool = False):
        self.loss_identifier = loss
        self._values_fn, reduction, self.loss_name = _as_loss(loss)
        if reduction not in REDUCTIONS:
            raise UsageError(f"loss {self.loss_name!r} has reduction={reduction!r}; tfdist "
                             f"supports {', '.join(map(str, REDUCTIONS))}")
        self.reduction = {None: SUM_OVER_BATCH, "none": SUM_OVER_BATCH,
                          "mean": SUM_OVER_BATCH}.get(reduction, reduction)
        self.from_logits = bool(getattr(loss, "from_logits", False) or from_logits_hint
                                or getattr(getattr(loss, "inner", None), "from_logits", False))
        self._metric_identifiers = list(metrics)
        self._layouts: list[_MetricLayout] = []

    # -- construction -------------------------------------------------------
    @classmethod
    def resolve(cls, loss=None, metrics=None, model: Optional[keras.Model] = None) -> "Task":
        """The task for `tfdist.train(loss=, metrics=)`: what was passed, else what
        `model.compile` was given, else the default (sparse categorical
        cross-entropy on logits, accuracy)."""
        compiled = (compat.compiled_config(model) if model is not None else None) or {}
        if loss is None and compiled.get("loss") is not None:
            loss = compiled["loss"]
            if metrics is None:
                metrics = [*(compiled.get("metrics") or []),
                           *(compiled.get("weighted_metrics") or [])]
        if loss is None:
            return cls(keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                  name=DEFAULT_LOSS),
                       DEFAULT_METRICS if metrics is None else metrics)
        if isinstance(loss, (dict, list, tuple)):
            raise UsageError("a loss per model output is not supported; pass one callable "
                             "(y_true, y_pred) -> per-example loss over the output structure")
        if isinstance(metrics, dict):
            raise UsageError("metrics per model output are not supported; pass a list")
        return cls(loss, list(metrics or ()))

    def build(self, y_spec, pred_spec, w_spec, *, global_batch_size: int) -> None:
        """Create the metric objects for targets/predictions of these specs and
        check, by tracing, that the loss and each metric accept them.
        Raises `UsageError` naming the misfit."""
        self.global_batch_size = global_batch_size
        self._layouts = []
        names = set()
        for identifier in self._metric_identifiers:
            metric = self._metric(identifier, y_spec, pred_spec)
            if metric.name in names:
                raise UsageError(f"metric name {metric.name!r} is given twice; give each "
                                 "metric a distinct name=")
            names.add(metric.name)
            try:   # e.g. F1Score sizes its state by the targets
                with tf.init_scope():
                    compat.build_metric(metric, y_spec.shape, pred_spec.shape)
            except (ValueError, TypeError) as error:
                raise UsageError(f"metric {metric.name!r} does not fit targets "
                                 f"{y_spec.dtype.name} {_shape(y_spec)} and predictions "
                                 f"{pred_spec.dtype.name} {_shape(pred_spec)}: "
                                 f"{first_line(error)}") from None
            self._layouts.append(_MetricLayout(metric, [tuple(v.shape) for v in metric.variables],
                                               [v.dtype for v in metric.variables]))
        self._check(y_spec, pred_spec, w_spec)

    def _metric(self, identifier, y_spec, pred_spec) -> keras.metrics.Metric:
        if isinstance(identifier, str):
            lowered = identifier.lower()
            binary = pred_spec.shape.rank and pred_spec.shape[-1] == 1
            sparse = y_spec.shape.rank < pred_spec.shape.rank
            if self.from_logits and (lowered == "binary_accuracy" or
                                     (lowered in ("accuracy", "acc") and binary)):
                # On logits the decision threshold is 0, not 0.5.
                return keras.metrics.BinaryAccuracy(name=identifier, threshold=0.0)
            if lowered == "auc" and self.from_logits:
                return keras.metrics.AUC(name=identifier, from_logits=True)
            if lowered in ("crossentropy", "ce") and self.from_logits:
                cls = (keras.metrics.SparseCategoricalCrossentropy if sparse else
                       keras.metrics.BinaryCrossentropy if binary else
                       keras.metrics.CategoricalCrossentropy)
                return cls(name=identifier, from_logits=True)
        elif not (isinstance(identifier, keras.metrics.Metric) or callable(identifier)):
            raise UsageError(f"metric {identifier!r} is neither a Keras metric (name or "
                             "object) nor a callable (y_true, y_pred) -> values")
        try:
            with tf.init_scope():   # its (unused) variables: plain, outside any engine
                return compat.keras_metric(identifier, y_spec, pred_spec)
        except (ValueError, TypeError) as error:
            raise UsageError(f"metric {identifier!r} is not a Keras metric: "
                             f"{first_line(error)}; valid: names such as accuracy, auc, "
                             "precision, recall, mae, mse, or keras.metrics objects") from None

    def _check(self, y_spec, pred_spec, w_spec) -> None:
        what = (f"targets {y_spec.dtype.name} {_shape(y_spec)} and predictions "
                f"{pred_spec.dtype.name} {_shape(pred_spec)}")
        y, p, w = (tf.TensorSpec([2, *s.shape[1:]], s.dtype) for s in (y_spec, pred_spec, w_spec))
        try:
            tf.function(lambda y, p, w: self.loss_terms(y, p, w, tf.ones([2])),
                        autograph=False).get_concrete_function(y, p, w)
        except Exception as error:  # noqa: BLE001  (any trace error is a misfit)
            raise UsageError(f"loss {self.loss_name!r} does not fit {what}: "
                             f"{first_line(error)}") from None
        for layout in self._layouts:
            try:
                tf.function(lambda y, p, w: self._deltas(layout, y, p, w),
                            autograph=False).get_concrete_function(y, p, w)
            except Exception as error:  # noqa: BLE001
                raise UsageError(f"metric {layout.metric.name!r} does not fit {what}: "
                                 f"{first_line(error)}") from None

    # -- in the replica step --------------------------------------------------
    def loss_terms(self, y, y_pred, weight, real):
        """(numerator, divisor, global_divisor) of this batch's loss.

        `weight`: the sample weights (0 for evaluation padding); `real`: 1 per
        real example. The numerator is the sum of weighted values; the divisor
        is this batch's share of the reduction's divisor (shares add up over
        replicas and micro-batches). `global_divisor` is the whole global
        batch's divisor when it is known without the data (a Python float),
        else None: the divisor then depends on weights or masks, and the
        trainer rescales the reduced gradient by the reduced divisor.
        """
        values = self._values_fn(y, y_pred)
        values = tf.cast(tf.convert_to_tensor(values), tf.float32)
        mask = _mask_of(values, y_pred)
        if values.shape.rank == 0:
            raise ValueError("the loss returned a scalar; tfdist needs the unreduced, "
                             "per-example values (a Keras Loss's call(), or a function "
                             "returning shape (batch,) or (batch, ...))")
        w = _align_weight(weight, values)
        if mask is not None:
            w = w * _align_weight(tf.cast(mask, tf.float32), values)
        numerator = tf.reduce_sum(values * w)
        positions = values.shape[1:].num_elements()
        real = tf.cast(real, tf.float32)
        if self.reduction == "sum":
            # Reported per global batch; the objective is the plain sum.
            return numerator, tf.reduce_sum(real) / self.global_batch_size, 1.0
        if self.reduction == "mean_with_sample_weight":
            return numerator, tf.reduce_sum(w * tf.ones_like(values)), None
        if mask is not None:   # Keras: the mean over valid (unmasked) values
            valid = _align_weight(tf.cast(mask, tf.float32), values) * _align_weight(real, values)
            return numerator, tf.reduce_sum(valid * tf.ones_like(values)), None
        if positions is None:
            count = tf.cast(tf.size(values) // tf.shape(values)[0], tf.float32)
            return numerator, tf.reduce_sum(real) * count, None
        return (numerator, tf.reduce_sum(real) * positions,
                float(self.global_batch_size * positions))

    def _deltas(self, layout: _MetricLayout, y, y_pred, weight):
        zeros = [tf.zeros(s, d) for s, d in zip(layout.shapes, layout.dtypes)]
        mask = _mask_of(y_pred)
        if mask is not None:
            weight = _align_weight(weight, tf.cast(mask, tf.float32)) * tf.cast(mask, tf.float32)
        new = layout.metric.stateless_update_state(zeros, y, y_pred, sample_weight=weight)
        return [tf.reshape(tf.cast(v, tf.float32), [-1]) for v in new]

    @property
    def metric_layouts(self) -> list:
        return list(self._layouts)

    def deltas_of(self, layout, y, y_pred, weight):
        """One metric's state change for a batch (`metric_layouts` entry)."""
        return self._deltas(layout, y, y_pred, weight)

    def metric_deltas(self, y, y_pred, weight):
        """The change this batch makes to every metric's state, as one vector."""
        parts = [d for layout in self._layouts for d in self._deltas(layout, y, y_pred, weight)]
        return tf.concat(parts, axis=0) if parts else tf.zeros([0])

    @property
    def metric_size(self) -> int:
        return sum(layout.size for layout in self._layouts)

    @property
    def metric_names(self) -> list[str]:
        return [layout.metric.name for layout in self._layouts]

    # -- on the host -----------------------------------------------------------
    def results(self, loss_numerator: float, loss_divisor: float, states) -> dict:
        """Loss and metric values from summed numerator, divisor and metric states."""
        values = {"loss": loss_numerator / loss_divisor if loss_divisor else 0.0}
        offset = 0
        states = np.asarray(states, dtype=np.float64)
        for layout in self._layouts:
            variables = []
            for shape, dtype in zip(layout.shapes, layout.dtypes):
                size = int(np.prod(shape))
                variables.append(tf.constant(states[offset:offset + size].reshape(shape),
                                             dtype=dtype))
                offset += size
            result = np.asarray(layout.metric.stateless_result(variables), dtype=np.float64)
            if result.ndim == 0:
                values[layout.metric.name] = float(result)
            else:
                for i, value in enumerate(result.reshape(-1)):
                    values[f"{layout.metric.name}_{i}"] = float(value)
        return values

    def describe(self) -> str:
        metrics = ", ".join(self.metric_names) or "none"
        return f"loss {self.loss_name} ({self.reduction}); metrics: {metrics}"


def _shape(spec) -> str:
    return "(" + ", ".join("None" if d is None else str(d) for d in spec.shape) + \
        ("," if spec.shape.rank == 1 else "") + ")"




def task_for(config, model: keras.Model, inputs, loss=None, metrics=None):
    """(the built `Task`, (targets, predictions, weights) specs) for training
    `model` on `inputs` under `config`: `loss`/`metrics` as passed, else the
    compiled model's, else `config.train.loss`/`metrics` (names, on logits).
    Raises `UsageError` for a misfit."""
    from tfdist.data import inputs as inputs_lib

    tc = config.train
    if loss is None and compat.compiled_config(model) is None:
        loss = cli_loss(tc.loss, tc.label_smoothing)
        if metrics is None:
            metrics = [cli_metric(name) for name in tc.metrics]
    task = Task.resolve(loss, metrics, model)
    element = inputs_lib.with_weights(
        inputs.examples("train", tf.distribute.InputContext())).element_spec
    x_spec, y_spec, w_spec = (tf.nest.map_structure(
        lambda s: tf.TensorSpec([None, *s.shape], s.dtype), part) for part in element)
    try:
        output = model.compute_output_spec(tf.nest.map_structure(
            lambda s: keras.KerasTensor(s.shape, s.dtype), x_spec))
    except Exception as error:  # noqa: BLE001  (a model that does not take these inputs)
        raise UsageError(f"model {model.name} does not take the dataset's inputs {x_spec}: "
                         f"{first_line(error)}") from None
    if isinstance(output, (list, tuple, dict)) and not isinstance(y_spec, type(output)):
        raise UsageError(f"model {model.name} has several outputs but the targets are "
                         f"{y_spec}; give one target per output")
    pred_spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), output)
    task.build(y_spec, pred_spec, w_spec, global_batch_size=tc.global_batch_size)
    return task, (y_spec, pred_spec, w_spec)
