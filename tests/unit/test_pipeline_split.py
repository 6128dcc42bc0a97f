"""Splitting models into pipeline stages (tfdist/pipeline/split.py)."""

import keras
import pytest

from tfdist import models
from tfdist.config import ModelConfig
from tfdist.errors import UsageError
from tfdist.observe import flops
from tfdist.pipeline import split

from common import IMAGE_SPEC


def _residual_model():
    """a -> b, with a's output added back after b: no cut between b and add."""
    inputs = keras.Input((8,), name="x")
    a = keras.layers.Dense(16, name="a")(inputs)
    b = keras.layers.Dense(16, name="b")(a)
    added = keras.layers.Add(name="add")([a, b])
    out = keras.layers.Dense(4, name="out")(added)
    return keras.Model(inputs, out, name="residual")


def test_the_mlp_splits_between_every_layer_and_balances_by_flops():
    model = models.build(ModelConfig(name="mlp", width=32, depth=4), IMAGE_SPEC)
    found = split.blocks(model)
    assert [b.layers for b in found] == [("flatten",), ("hidden_0",), ("hidden_1",),
                                         ("hidden_2",), ("hidden_3",), ("logits",)] or \
        [b.layers[-1] for b in found][1:] == ["hidden_0", "hidden_1", "hidden_2", "hidden_3",
                                              "logits"]
    pixels = 8 * 8 * 3
    assert [b.flops for b in found][-5:] == [2 * pixels * 32, *[2 * 32 * 32] * 3,
                                             2 * 32 * IMAGE_SPEC.num_classes]
    assert sum(b.params for b in found) == model.count_params()
    stages = split.split(model, 2, found=found)
    assert [s.index for s in stages] == [0, 1]
    assert sum(len(s.blocks) for s in stages) == len(found)
    # hidden_0 (6144 FLOPs) alone outweighs two 2048-FLOP layers: the balanced
    # split puts it with flatten and the rest on stage 1
    assert stages[0].layers[-1] == "hidden_0", split.table(stages)
    assert max(s.flops for s in stages) == 2 * pixels * 32


def test_the_transformer_splits_at_its_blocks():
    from tfdist.data.spec import DatasetSpec
    spec = DatasetSpec(name="tokens", kind="tokens", input_shape=(16,), num_classes=64,
                       vocab_size=64)
    model = models.build(ModelConfig(name="transformer", width=32, depth=4, num_heads=2), spec)
    found = split.blocks(model)
    names = [name for b in found for name in b.layers]
    block_names = [n for n in names if n.startswith("block")]
    assert len(block_names) == 4
    for name in block_names:   # each decoder block can begin a stage
        assert any(b.layers[0] == name for b in found), [b.layers for b in found]
    # every FLOP of the model lands in a block (attributed by layer name scope)
    assert sum(b.flops for b in found) == flops.forward_flops(model)
    assert sum(b.params for b in found) == model.count_params()
    stages = split.split(model, 4, found=found)
    assert len(stages) == 4 and all(s.flops > 0 for s in stages), split.table(stages)
    print(split.table(stages))


def test_a_model_with_an_open_sequence_length_is_counted_on_the_data_shape():
    """Inputs of shape (None, None) (keras-hub's backbones): the FLOPs are
    counted for one example of the data; without one, the split balances
    parameter bytes instead of failing."""
    import tensorflow as tf
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(32, 8, name="embed")(tokens)
    x = keras.layers.Dense(64, name="wide")(x)
    x = keras.layers.Dense(8, name="narrow")(x)
    model = keras.Model(tokens, keras.layers.Dense(4, name="out")(x))
    signature = tf.TensorSpec([1, 16], tf.int32)
    found = split.blocks(model, input_signature=signature)
    by_layer = {b.layers[-1]: b.flops for b in found}
    assert by_layer["wide"] == 2 * 16 * 8 * 64 and by_layer["narrow"] == 2 * 16 * 64 * 8
    stages = split.split(model, 2, input_signature=signature)
    assert sum(s.flops for s in stages) == sum(by_layer.values())
    unknown = split.blocks(model)
    assert all(b.flops == 0 for b in unknown)
    assert len(split.split(model, 2, found=unknown)) == 2


def test_a_named_split_and_its_errors():
    model = _residual_model()
    found = split.blocks(model)
    assert [b.layers for b in found] == [("a",), ("b", "add"), ("out",)]
    stages = split.split(model, 2, names=["out"])
    assert [s.layers for s in stages] == [("a", "b", "add"), ("out",)]
    with pytest.raises(UsageError, match="a stage cannot begin at layer 'add': more than one "
                                         "tensor \\(a skip connection\\)"):
        split.split(model, 2, names=["add"])
    with pytest.raises(UsageError, match="has no layer 'nope'; stages may begin at a, b, out"):
        split.split(model, 2, names=["nope"])
    with pytest.raises(UsageError, match="3 stages need 2 layer name"):
        split.split(model, 3, names=["b"])
    with pytest.raises(UsageError, match="--pipeline_stages=4: model 'residual' splits into "
                                         "only 3 block"):
        split.split(model, 4)


def test_models_that_cannot_split_are_refused_in_one_line():
    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__(name="sub")
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    sub = Subclassed()
    sub(keras.ops.zeros((1, 3)))
    with pytest.raises(UsageError, match="'sub' \\(Subclassed\\) is not a functional") as raised:
        split.blocks(sub)
    assert "\n" not in str(raised.value)

    inputs = keras.Input((4,))
    shared = keras.layers.Dense(4, name="shared")
    out = shared(shared(inputs))
    with pytest.raises(UsageError, match="layer 'shared' of model .* is called at 2 places"):
        split.blocks(keras.Model(inputs, out))


def test_balanced_partition_minimises_the_largest_stage():
    assert split._balanced_starts([1, 1, 1, 1, 4], [0] * 5, 2) == [0, 4]
    assert split._balanced_starts([3, 1, 1, 1, 1, 1], [0] * 6, 3) == [0, 1, 3] or \
        split._balanced_starts([3, 1, 1, 1, 1, 1], [0] * 6, 3) == [0, 1, 4]
    # equal FLOPs: parameter bytes decide
    assert split._balanced_starts([1, 1, 1], [10, 0, 0], 2) == [0, 1]
