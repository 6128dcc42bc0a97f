"""Private names of Keras 3 that pipeline stages need: a functional model's
graph of calls (`replay_functional`), a built variable moved to a stage's
device, and a model built without storage so that each process gives its
own stages' variables theirs. See the package docstring
(`tfdist/compat/__init__.py`). Imports no TensorFlow or Keras until called."""

from __future__ import annotations

import contextlib

from tfdist.compat._guard import _changed, _require


def replay_functional(model, call) -> list:
    """Run a functional model's graph on its own inputs, calling
    `call(operation, *args, **kwargs)` at each node in the graph's order
    instead of the operation: the model's outputs, as `call` returned them.

    What: Keras's private `Function._run_through_graph(inputs, operation_fn,
    call_fn)` (its `call_fn` hook) and `Sequential._functional` (a built
    Sequential's graph). Why: a pipeline splits a model at the nodes of its
    graph, looking through nested functional models (a keras-hub CausalLM
    calls its backbone, a functional model, as one layer) and through layers
    called at several places (tied embeddings): Keras 3 has no public graph
    of calls, only `layer.input`/`layer.output`, which return a layer's first
    call. Verified: keras 3.15.1. Check: both exist and the hook is called.
    """
    graph = functional_graph(model)
    if graph is None:
        raise _changed("keras Functional (a functional model's graph)",
                       f"is not the class of {type(model).__name__}")
    run = _require(graph, "_run_through_graph", "keras Function._run_through_graph")
    called = []

    def hooked(operation, *args, **kwargs):
        called.append(operation)
        return call(operation, *args, **kwargs)

    outputs = run(list(graph.inputs), operation_fn=lambda operation: operation, call_fn=hooked)
    if graph.operations and not called:
        raise _changed("keras Function._run_through_graph", "no longer calls its call_fn")
    return outputs


def functional_graph(model):
    """The keras `Functional` whose graph `model` runs: itself, a built
    Sequential's inner one, or None for anything else (a subclassed model, a
    layer). See `replay_functional`."""
    from keras.src.models.functional import Functional
    from keras.src.models.sequential import Sequential
    if isinstance(model, Sequential):
        model = _require(model, "_functional", "keras Sequential._functional")
    return model if isinstance(model, Functional) else None


def standardize_inputs(model, inputs) -> list:
    """`inputs` as the flat list a functional `model` maps onto `model.inputs`
    when called (dict keys matched to input names, tensors converted, ranks
    aligned), as Keras does.

    What: Keras's private `Functional._standardize_inputs`. Why: a pipeline
    stage after the first reads only some of the model's inputs (keras-hub's
    padding mask), so tfdist needs Keras's own mapping of the data onto the
    inputs, not a guess at it. Verified: keras 3.15.1. Check: the method exists.
    """
    graph = functional_graph(model)
    standardize = _require(graph, "_standardize_inputs", "keras Functional._standardize_inputs")
    return list(standardize(inputs))


def move_variable(variable, device: str) -> None:
    """Move the storage of Keras variable `variable` to `device`, keeping the
    Keras object (which layers, optimizers and checkpoints refer to).

    What: a Keras 3 `Variable` on the TensorFlow backend keeps its storage, a
    `tf.Variable`, in `_value`, and `_initialize(value)` adopts a given
    `tf.Variable` as that storage. Why: pipeline stages must hold
    their layers' variables on their own device, but a functional model's
    variables are created when it is built, before the model can be split
    (the split reads the built graph), and Keras has no public way to place a
    built variable. A new `tf.Variable` with the old one's value, name,
    trainability and aggregation is made on `device` and adopted; the old one
    is freed. Verified on tensorflow 2.21.0, keras 3.15.1.
    """
    import tensorflow as tf
    what = "keras Variable._value (its tf.Variable storage) and _initialize"
    old = _require(variable, "_value", what)
    adopt = _require(variable, "_initialize", what)
    if not isinstance(old, tf.Variable):
        raise _changed(what, f"holds {type(old).__name__}, not a tf.Variable")
    with tf.device(device):
        new = tf.Variable(old.read_value(), trainable=old.trainable,
                          name=old.name.split(":")[0], aggregation=old.aggregation,
                          synchronization=old.synchronization)
    adopt(new)
    if variable.value is not new:
        raise _changed(what, "did not adopt the given tf.Variable")


# -- a stage built without the other stages' storage -----------------------------

def build_without_storage(build):
    """`(build(), variables, assigned)`: the Keras variables `build` made, in
    the order it made them, none of them with storage yet, and the values
    `build` assigned to them ({id(variable): value}, e.g. weights it loaded).
    Each gets its storage only from `give_storage`.

    What: `keras.StatelessScope(initialize_variables=False)` (public) leaves
    each variable made inside without storage (`_value` None), keeping its
    initializer; Keras lists them in its private global attribute
    "uninitialized_variables" (keras `backend.common.global_state`) and would
    initialise every one at the next default StatelessScope's exit, so they
    are taken off that list here. Why: a process that runs one pipeline stage
    must not hold the other stages' weights, but the split reads the built
    model's graph. A variable made from a value, not an initializer (which
    Keras refuses in a StatelessScope: keras-hub's tasks compile themselves
    with an optimizer whose step counter is made from 0), is made with its
    value, outside the scope (Keras's private `Variable.__init__` wrapped for
    the build). Verified: keras 3.15.1. Check: every variable listed has no
    storage and a callable initializer, and the list is a list. Nothing is
    left listed or wrapped, whatever `build` raises."""
    import keras
    from keras.src.backend.common import global_state
    get = _require(global_state, "get_global_attribute",
                   "keras backend.common.global_state.get_global_attribute")
    key = "uninitialized_variables"
    before = list(get(key) or [])
    try:
        with _values_made_outside(global_state), \
                keras.StatelessScope(initialize_variables=False) as scope:
            if get("stateless_scope") is not scope:
                raise _changed("keras StatelessScope", 'is no longer the global attribute '
                               '"stateless_scope"')
            result = build()
    finally:
        listed = get(key)
        if listed is not None and not isinstance(listed, list):
            raise _changed(f"keras global_state {key}", "is no longer a list")
        earlier = {id(v) for v in before}
        made = [v for v in listed or () if id(v) not in earlier]
        global_state.set_global_attribute(key, before)
    for variable in made:
        if getattr(variable, "_value", None) is not None or \
                not callable(getattr(variable, "_initializer", None)):
            raise _changed("keras.StatelessScope(initialize_variables=False)",
                           f"made variable {variable.path!r} with storage or without an "
                           "initializer")
    ours = {id(v) for v in made}
    assigned = {key: value for key, value in scope.state_mapping.items() if key in ours}
    return result, made, assigned


@contextlib.contextmanager
def _values_made_outside(global_state):
    """Inside, a Keras variable made from a value (not an initializer) is
    made outside any StatelessScope. See `build_without_storage`."""
    from keras.src.backend.common import variables
    init = _require(variables.Variable, "__init__", "keras Variable.__init__")

    def made_outside(self, initializer, *args, **kwargs):
        if isinstance(initializer, str) or callable(initializer):
            return init(self, initializer, *args, **kwargs)
        scope = global_state.get_global_attribute("stateless_scope")
        global_state.set_global_attribute("stateless_scope", None)
        try:
            return init(self, initializer, *args, **kwargs)
        finally:
            global_state.set_global_attribute("stateless_scope", scope)

    variables.Variable.__init__ = made_outside
    try:
        yield
    finally:
        variables.Variable.__init__ = init


def give_storage(variable, value=None) -> None:
    """Give `variable`, made by `build_without_storage`, its storage: `value`
    or its initializer's value, made by Keras as it would (a `tf.Variable`
    under the current variable creators, in `tf.init_scope`).

    What: Keras's private `Variable._deferred_initialize()` (and
    `_initializer`, replaced by a constant one where `value` is given). Why:
    see `build_without_storage`. Verified: keras 3.15.1. Check: the variable
    holds a `tf.Variable` after."""
    import tensorflow as tf
    what = "keras Variable._deferred_initialize"
    initialize = _require(variable, "_deferred_initialize", what)
    if value is not None:
        _require(variable, "_initializer", "keras Variable._initializer")
        variable._initializer = lambda shape, dtype=None: tf.cast(value, dtype or variable.dtype)
    initialize()
    if not isinstance(getattr(variable, "_value", None), tf.Variable):
        raise _changed(what, "left the variable without a tf.Variable")
