"""ZeRO-3's gathering of split variables for use: inside
`DTensorStrategy.compute_scope` (`Gathering.scope`) every read of a split
variable is relayouted to its compute layout (`MeshVariable._read_variable_op`,
an all-gather), and each layer that owns one gathers its weights only while
it computes (`Gathering.per_layer`). Each strategy owns one `Gathering`; its
variables and wrapped layers hold it."""

from __future__ import annotations

import contextlib
import functools
import threading

import tensorflow as tf

from tfdist import compat


def _zero_after(tensors):
    """A scalar zero computed from `tensors`: added to a variable's shard
    before its gather, it makes the gather wait for them. A control
    dependency would not: DTensor's passes keep control edges only between
    stateful ops (verified: gathers under `tf.control_dependencies` still ran
    at the start of the step). One scalar sum over the mesh per use."""
    floats = [t for t in tensors if t.dtype.is_floating]
    if not floats:
        return None
    return tf.stop_gradient(tf.add_n([tf.cast(tf.reduce_sum(t), tf.float32) for t in floats]) * 0.0)


class Gathering(threading.local):
    """Whether reads gather now (per thread: a trace runs in its caller's)."""

    active = False
    recomputing = False   # a layer's forward again, for its backward pass
    after = None          # a scalar zero the gathers wait for (see `per_layer`)

    @contextlib.contextmanager
    def scope(self):
        before, self.active = self.active, True
        try:
            yield
        finally:
            self.active = before

    def runs_as_is(self, args, kwargs) -> bool:
        """Whether a layer's call runs as it is: outside a traced
        `compute_scope`, while the layer is recomputed, or with other tensor
        arguments than one floating input (see `per_layer`)."""
        return (self.recomputing or not self.active or not tf.inside_function()
                or not args or not tf.is_tensor(args[0]) or not args[0].dtype.is_floating
                or any(tf.is_tensor(a) for a in tf.nest.flatten((args[1:], kwargs))))

    def waiting_for(self, tensors, run):
        """`run()`, whose gathers wait for `tensors` (`_zero_after`)."""
        before, self.after = self.after, _zero_after(tensors)
        try:
            return run()
        finally:
            self.after = before

    def recomputed_backward(self, layer, x, rest, kwargs):
        """The gradient function of `layer`'s gathered call on `x`: the layer
        recomputed once its output gradient exists, its weights gathered again."""
        def backward(dy, variables=None):
            x_again = tf.identity(x)
            # Gathered as in the forward pass, also where the gradient is
            # taken outside `compute_scope`.
            before = self.recomputing, self.active
            self.recomputing = self.active = True
            try:
                with tf.GradientTape() as tape:
                    tape.watch(x_again)
                    y_again = self.waiting_for(tf.nest.flatten(dy),
                                               lambda: layer(x_again, *rest, **kwargs))
            finally:
                self.recomputing, self.active = before
            sources = [x_again] + list(variables or [])
            grads = tape.gradient(y_again, sources, output_gradients=dy)
            dx, dvars = grads[0], grads[1:]
            # The layer below starts its backward pass once these gradients
            # are reduce-scattered, else the backward pass (fast) runs ahead
            # of the reductions (slow) and every layer's whole gradient
            # waits in memory at once.
            done = _zero_after([g for g in dvars if g is not None])
            if dx is not None and done is not None:
                dx = dx + tf.cast(done, dx.dtype)
            return dx, dvars

        return backward

    def per_layer(self, layer, call):
        """`layer.call`, so that under stage 3 a layer's gathered weights live
        only while the layer computes: gathered after its input exists
        (TensorFlow runs an op as soon as its inputs are ready, and a read
        depends on nothing, so every gather would otherwise run at the start
        of the step), dropped after the forward use, and gathered again for
        the backward pass once the layer's output gradient exists, by
        recomputing the layer there (the gradient of a matmul would otherwise
        keep its gathered operand alive from the forward pass to the backward
        one). Calls with other tensor arguments than one floating input run as
        they are: a lookup (`Embedding`) needs no weights for its gradient, and
        DTensor failed to compile the custom gradient of an integer input
        ("operand #0 does not dominate this use")."""
        @functools.wraps(call)
        def gathered_call(*args, **kwargs):
            if self.runs_as_is(args, kwargs):
                return call(*args, **kwargs)
            rest = args[1:]

            def forward(x):
                y = self.waiting_for([x], lambda: call(x, *rest, **kwargs))
                return y, self.recomputed_backward(layer, x, rest, kwargs)

            return compat.graph_custom_gradient(forward, args[0])

        return gathered_call
