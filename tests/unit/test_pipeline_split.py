"""Splitting models into pipeline stages (tfdist/pipeline/split.py)."""

import keras
import pytest

from tfdist import models
from tfdist.config import ModelConfig
from tfdist.errors import UsageError
from tfdist.observe import flops
from tfdist.pipeline import split
from tfdist.pipeline import stages as stages_lib

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



def _run_stages(model, stages, x):
    out = None
    for stage in stages_lib.stage_models(model, stages):
        out = stage(out, x, training=False)
    return out


def test_a_layer_called_on_two_stages_is_on_both_and_nested_models_are_looked_through():
    """A tied embedding (called for the tokens and, transposed, for the
    logits) inside and outside a nested functional model: the split sees
    every call, the model's inputs (the mask, read by a later layer) do not
    stop a cut, and the stages compute what the model computes."""
    import numpy as np
    tokens = keras.Input((6,), dtype="int32", name="tokens")
    mask = keras.Input((6,), name="mask")
    embed = keras.layers.Embedding(11, 8, name="embed")
    x = embed(tokens)
    inner_in, inner_mask = keras.Input((6, 8)), keras.Input((6,))
    h = keras.layers.Dense(8, name="inner_dense")(inner_in)
    h = keras.layers.Multiply(name="masked")([h, keras.layers.Reshape((6, 1))(inner_mask)])
    body = keras.Model([inner_in, inner_mask], h, name="body")
    x = body([x, mask])
    x = keras.layers.Dense(8, name="outer_dense")(x)
    logits = keras.layers.Lambda(lambda t: keras.ops.matmul(t, keras.ops.transpose(
        embed.embeddings)), name="tied_logits")(x)
    model = keras.Model([tokens, mask], logits, name="tied")
    found = split.blocks(model)
    names = [name for b in found for name in b.layers]
    assert "inner_dense" in names and "body" not in names, names
    assert [b.layers[0] for b in found][:2] == ["embed", "inner_dense"], found
    stages = split.split(model, 2, names=["outer_dense"])
    built = stages_lib.stage_models(model, stages)
    assert built[1].takes_boundary and built[1].reads == []
    assert built[0].reads == [1, 0] or sorted(built[0].reads) == [0, 1]
    x = [np.random.RandomState(0).randint(0, 11, (3, 6)).astype("int32"),
         np.ones((3, 6), "float32")]
    np.testing.assert_allclose(_run_stages(model, stages, x), model(x), rtol=1e-6, atol=1e-6)

    shared = keras.layers.Dense(4, name="shared")
    inputs = keras.Input((4,))
    twice = keras.Model(inputs, keras.layers.Dense(4, name="last")(
        shared(keras.layers.Dense(4, name="middle")(shared(inputs)))))
    stages = split.split(twice, 2, names=["middle"])
    assert stages[0].layers == ("shared",) and stages[1].layers == ("middle", "shared", "last")
    first, second = stages_lib.stage_models(twice, stages)
    assert {v.path for v in first.trainable_variables} <= \
        {v.path for v in second.trainable_variables}


@pytest.mark.parametrize("kind", ["gemma", "gpt2"])
def test_keras_hub_causal_lms_split_at_their_decoder_blocks(kind):
    """keras-hub's CausalLMs: the backbone is looked through, the padding
    mask (read by every block) does not stop a cut, the reversed token
    embedding makes the logits on the last stage, and the stages compute the
    model's output."""
    import numpy as np
    keras_hub = pytest.importorskip("keras_hub")
    if kind == "gemma":
        backbone = keras_hub.models.GemmaBackbone(
            vocabulary_size=32, num_layers=2, num_query_heads=2, num_key_value_heads=1,
            hidden_dim=16, intermediate_dim=32, head_dim=8)
        model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
        blocks, last = ["decoder_block_0", "decoder_block_1"], "final_normalization"
    else:
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=32, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
            max_sequence_length=8)
        model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        blocks, last = ["transformer_layer_0", "transformer_layer_1"], "layer_norm"
    found = split.blocks(model, count_flops=False)
    starts = [b.layers[0] for b in found]
    assert set(blocks) <= set(starts), starts
    stages = split.split(model, 3, names=[blocks[0], last])
    assert stages[0].layers[0] == "token_embedding" and stages[2].layers[-1] == "token_embedding"
    x = {"token_ids": np.random.RandomState(1).randint(1, 32, (2, 8)).astype("int32"),
         "padding_mask": np.ones((2, 8), "int32")}
    np.testing.assert_allclose(_run_stages(model, stages, x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "gemma", "gpt2"])
def test_keras_hub_causal_lms_build_without_storage_and_split(kind):
    """A pipeline across processes builds the user's model with no storage,
    splits it, and gives each process its own stages' variables: keras-hub's
    CausalLMs (which compile themselves, making an optimizer's step counter
    from a value) build so, split with every weight still without storage,
    and the weights then given, in any order, are a normal build's with the
    same seed, bit for bit."""
    import numpy as np

    from tfdist import compat
    pytest.importorskip("keras_hub")
    from common import hub_causal_lm
    keras.utils.set_random_seed(5)
    expected = hub_causal_lm(kind).get_weights()
    keras.utils.set_random_seed(5)
    model, made, assigned = compat.build_without_storage(lambda: hub_causal_lm(kind))
    stages = split.split(model, 2)
    assert stages[0].layers[0] == "token_embedding" and not assigned
    assert {id(v) for v in model.weights} <= {id(v) for v in made}
    assert all(v._value is None for v in model.weights)
    for variable in reversed(made):
        compat.give_storage(variable)
    for got, want in zip(model.get_weights(), expected):
        np.testing.assert_array_equal(got, want)


def test_balanced_partition_minimises_the_largest_stage():
    assert split._balanced_starts([1, 1, 1, 1, 4], [0] * 5, 2) == [0, 4]
    assert split._balanced_starts([3, 1, 1, 1, 1, 1], [0] * 6, 3) == [0, 1, 3] or \
        split._balanced_starts([3, 1, 1, 1, 1, 1], [0] * 6, 3) == [0, 1, 4]
    # equal FLOPs: parameter bytes decide
    assert split._balanced_starts([1, 1, 1], [10, 0, 0], 2) == [0, 1]
