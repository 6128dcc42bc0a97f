"""Every private Keras, TensorFlow and Horovod name tfdist reads or replaces.

Keras 3 and TensorFlow 2.21 leave a few holes that tfdist can only fill by
reading or replacing an upstream name that is not public (BUILD_NOTES.md,
"Upstream patches"). Each such use lives here, in one small function whose
docstring says what it touches, why (the upstream bug and where BUILD_NOTES
reproduces it) and the versions it was verified on. Each checks, before it
relies on the name, that the name is there and is still used the way the
workaround assumes (e.g. that the Keras method tfdist replaces is still the one
Keras calls), and raises `UpstreamChanged` -- one line naming the attribute and
the versions -- when it is not: a patch never becomes a silent no-op.
`tests/unit/test_compat.py` has a test per entry that fails if the patch stops
taking effect.

The package is split by upstream; every public name is re-exported here, so
callers write `compat.<name>`:

- `_guard.py`: `VERIFIED`, `UpstreamChanged` and the checks every entry uses.
- `tf_internals.py`: TensorFlow core, tf.distribute, checkpoints, graphs,
  gradients, resource variables.
- `dtensor_internals.py`: TensorFlow's DTensor (its dataset, its compiler's
  environment switches).
- `keras_optimizers.py`: Keras 3's optimizers.
- `keras_stages.py`: Keras 3 for pipeline stages (a functional model's graph
  of calls, variables placed, a model built without storage).
- `keras_internals.py`: the rest of Keras 3 (variables, layers, losses,
  metrics, random draws).
- `keras_matplotlib.py`: start-up, Keras's eager import of matplotlib.

A test that replaces a module-level private name (a cache such as
`_CHECKED`) patches it in the module that reads it, not here.

Importing this package is cheap (no TensorFlow, no Keras): `tfdist.app` imports
modules that import it before flags are parsed. TensorFlow and Keras are
imported inside the functions, which only run once they are loaded anyway.

Outside this package, tfdist code reads no `tensorflow.python`, `keras.src` or
`tf.__internal__` name and no underscore attribute of an upstream object.
"""

from tfdist.compat._guard import VERIFIED, UpstreamChanged
from tfdist.compat.dtensor_internals import (
    dtensor_dataset_one_client_per_replica,
    dtensor_fsdp_lowering,
    dtensor_without_grappler_memory_scheduling,
)
from tfdist.compat.keras_internals import (
    KERAS_RANDOM_DRAWS,
    align_ranks,
    build_metric,
    check_keras_variable_of,
    checkpoint_sharded_whole,
    compiled_config,
    fuse_batchnorm,
    keras_initializer_of,
    keras_mask,
    keras_name_scopes_restored,
    keras_metric,
    keras_random_draws,
    keras_seed_tensor,
    keras_variable_of,
    model_layers,
    replace_batchnorm_moments,
)
from tfdist.compat.keras_matplotlib import defer_keras_matplotlib
from tfdist.compat.keras_stages import (
    build_without_storage,
    functional_graph,
    give_storage,
    move_variable,
    replay_functional,
    standardize_inputs,
)
from tfdist.compat.keras_optimizers import (
    adam_slots,
    disable_optimizer_all_reduce,
    learning_rate_times,
    optimizer_slots,
    optimizer_updates_sharded_variables,
    variable_index,
)
from tfdist.compat.tf_internals import (
    checkpoint_object_graph,
    serialized_object_graph,
    COLLECTIVE_KEY_STRIDE,
    coordination_key_value,
    custom_gradients_on_tape,
    gradient_overridden,
    graph_custom_gradient,
    graph_function,
    is_sharded,
    next_collective_key_base,
    EMPTY,
    LOCAL,
    created_without_broadcast,
    set_storage,
    sharded_variable_type,
    strategy_supports_no_merge_call,
    update_checkpoint_state,
)

__all__ = [
    "COLLECTIVE_KEY_STRIDE", "KERAS_RANDOM_DRAWS", "UpstreamChanged", "VERIFIED", "adam_slots",
    "EMPTY", "LOCAL", "align_ranks", "build_metric", "build_without_storage",
    "checkpoint_object_graph", "created_without_broadcast", "give_storage", "check_keras_variable_of",
    "checkpoint_sharded_whole",
    "compiled_config", "coordination_key_value", "custom_gradients_on_tape",
    "defer_keras_matplotlib", "disable_optimizer_all_reduce", "fuse_batchnorm",
    "dtensor_dataset_one_client_per_replica", "dtensor_fsdp_lowering",
    "dtensor_without_grappler_memory_scheduling", "functional_graph",
    "gradient_overridden", "graph_custom_gradient", "graph_function", "is_sharded",
    "keras_initializer_of", "keras_mask", "keras_name_scopes_restored", "keras_metric",
    "keras_random_draws", "keras_seed_tensor", "keras_variable_of", "learning_rate_times",
    "model_layers",
    "replace_batchnorm_moments",
    "move_variable", "next_collective_key_base", "optimizer_slots",
    "optimizer_updates_sharded_variables", "replay_functional", "set_storage",
    "serialized_object_graph", "sharded_variable_type", "standardize_inputs", "strategy_supports_no_merge_call",
    "update_checkpoint_state", "variable_index",
]
