"""`layout_rules=` takes a Keras 3 `keras.distribution.LayoutMap` too.

A layout map written for Keras on JAX (keras-hub's `get_layout_map`, axes
`batch` and `model`) must run unchanged on the dtensor engine, matched as
Keras matches it (keras/src/distribution/distribution_lib.py,
`LayoutMap.__getitem__`, Keras 3.15.1: the exact key, else `re.fullmatch`,
not tfdist's `re.search`). Every lookup here is checked against Keras's own
`LayoutMap.__getitem__`, so a Keras that changes its semantics fails here.

keras-hub is not a dependency: 0.32.0 needs tensorflow-text, which pulls the
full `tensorflow` wheel beside the pinned `tensorflow_cpu` (plus kagglehub,
huggingface_hub, tokenizers, sentencepiece). Its Llama layout map is
transcribed below instead; it converts exactly as Keras reads it, and a
Llama-shaped model trained under it matches one device.
"""


import keras
import pytest
from keras import layers, ops
from tensorflow.experimental import dtensor

import tfdist
from tfdist import sharding
from tfdist.data.spec import DatasetSpec
from tfdist.errors import UsageError

from common import run_config, token_dataset_fn_for
from test_dtensor import _assert_matches

AXES = {"batch": 2, "model": 2}
# Strings, not devices: Keras's DeviceMesh only stores them (its default,
# `list_devices()`, would start TensorFlow's runtime; see the notes on
# `_mesh`). tfdist ignores a LayoutMap's mesh and uses the run's.
MESH_DEVICES = [f"cpu:{i}" for i in range(4)]


def _mesh(shape=(2, 2), axis_names=("batch", "model")):
    return keras.distribution.DeviceMesh(shape, axis_names, devices=MESH_DEVICES)


def llama_layout_map(device_mesh, model_parallel_dim_name="model",
                     data_parallel_dim_name="batch"):
    """keras-hub 0.32.0, keras_hub/src/models/llama/llama_backbone.py,
    `LlamaBackbone.get_layout_map` (Apache-2.0), transcribed without its
    argument checks. ("The sharding config is based on the Gemma team
    training config", arXiv:2403.08295.)"""
    data_dim = data_parallel_dim_name
    model_dim = model_parallel_dim_name
    layout_map = keras.distribution.LayoutMap(device_mesh)
    layout_map["token_embedding/embeddings"] = (model_dim, data_dim)
    layout_map["transformer_layer.*self_attention.*(query|key|value).kernel"] = (
        model_dim, data_dim, None)
    layout_map["transformer_layer.*attention_output.kernel"] = (model_dim, None, data_dim)
    layout_map["transformer_layer.*feedforward_intermediate_dense.kernel"] = (data_dim, model_dim)
    layout_map["transformer_layer.*feedforward_gate_dense.kernel"] = (data_dim, model_dim)
    layout_map["transformer_layer.*feedforward_output_dense.kernel"] = (model_dim, data_dim)
    return layout_map


def _keras_spec(layout_map, path, rank):
    """What Keras itself gives `path` (its `LayoutMap.__getitem__`)."""
    layout = layout_map[path]
    return (None,) * rank if layout is None else layout.axes


def _check_like_keras(layout_map, paths_and_shapes):
    rules = sharding.as_layout_rules(layout_map)
    assert rules.match == sharding.KERAS
    for path, shape in paths_and_shapes:
        assert rules.spec_for(path, shape, AXES) == _keras_spec(layout_map, path, len(shape)), path
    return rules


# -- conversion and matching (no TensorFlow work) ------------------------------
def test_keys_match_like_keras_fullmatch_not_search():
    layout_map = keras.distribution.LayoutMap(None)   # a LayoutMap needs no mesh at all
    layout_map["dense.*kernel"] = (None, "model")
    layout_map["kernel"] = ("model", None)
    paths = [("dense/kernel", (4, 4)),          # fullmatch: the first key; search: both keys
             ("my_dense/kernel", (4, 4)),       # search would match; Keras: no key, replicated
             ("dense/kernel_mask", (4, 4)),     # likewise
             ("block/dense_1/kernel", (4, 4))]  # likewise ("dense" is not at the start)
    rules = _check_like_keras(layout_map, paths)
    assert [rules.spec_for(p, s, AXES) for p, s in paths] == [
        (None, "model"), (None, None), (None, None), (None, None)]
    # tfdist's own rules, the same regexes: re.search, unchanged for plain lists.
    plain = sharding.as_layout_rules([("dense.*kernel", (None, "model"))])
    assert plain.match == sharding.SEARCH
    assert [plain.spec_for(p, s, AXES) for p, s in paths] == [(None, "model")] * 4
    both = sharding.as_layout_rules([("dense.*kernel", (None, "model")),
                                     ("kernel", ("model", None))])
    with pytest.raises(UsageError, match="more than one rule"):
        both.spec_for("dense/kernel", (4, 4), AXES)   # search: both; Keras: only the first


def test_an_exact_key_wins_over_regex_keys_as_in_keras():
    layout_map = keras.distribution.LayoutMap(None)
    layout_map["dense/kernel"] = ("model", None)
    layout_map["dense/.*"] = (None, "model")
    layout_map[".*/kernel"] = (None, "batch")
    # Keras returns the exact key's layout without looking at the two regexes
    # that also fullmatch; a path matched only by the regexes is ambiguous.
    _check_like_keras(layout_map, [("dense/kernel", (4, 4))])
    with pytest.raises(ValueError, match="multiple layout"):
        layout_map["dense/other/kernel"]
    with pytest.raises(UsageError) as error:
        sharding.as_layout_rules(layout_map).spec_for("dense/other/kernel", (4, 4), AXES)
    message = str(error.value)
    assert "\n" not in message and "dense/other/kernel" in message
    assert "'dense/.*'" in message and "'.*/kernel'" in message, message


def test_tensor_layout_values():
    mesh = _mesh()
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["a/kernel"] = keras.distribution.TensorLayout((None, "model"))
    layout_map["b/kernel"] = keras.distribution.TensorLayout(("model", "batch"), mesh)
    layout_map["c/bias"] = ("model",)     # Keras wraps a tuple in a TensorLayout
    assert all(isinstance(v, keras.distribution.TensorLayout) for v in layout_map.values())
    rules = _check_like_keras(layout_map, [("a/kernel", (4, 6)), ("b/kernel", (4, 6)),
                                           ("c/bias", (4,)), ("d/kernel", (4, 6))])
    assert list(rules) == [("a/kernel", (None, "model")), ("b/kernel", ("model", "batch")),
                           ("c/bias", ("model",))]


def test_an_axis_the_mesh_lacks_is_one_line_before_the_engine_starts():
    # Valid for Keras (its mesh has a "data" axis), not for tfdist's batch x model.
    layout_map = keras.distribution.LayoutMap(_mesh(axis_names=("data", "model")))
    layout_map["dense.*kernel"] = ("data", "model")
    with pytest.raises(UsageError) as error:
        # `train` converts the map first: nothing is created, no data is read.
        tfdist.train(run_config("dtensor"), model_fn=lambda spec: pytest.fail("built"),
                     dataset_fn=lambda *a: pytest.fail("read"), layout_rules=layout_map)
    message = str(error.value)
    assert "\n" not in message
    assert "LayoutMap key 'dense.*kernel': axis 'data' is not a mesh axis" in message
    assert "batch and model" in message


def test_a_key_that_is_not_a_regex_is_one_line():
    layout_map = keras.distribution.LayoutMap(None)
    layout_map["dense/(kernel"] = (None, "model")
    with pytest.raises(UsageError, match=r"^LayoutMap key 'dense/\(kernel' is not a regular"):
        sharding.as_layout_rules(layout_map)


def test_llama_layout_map_matches_keras_on_its_paths():
    paths = _llama_paths(vocab=12)
    layout_map = llama_layout_map(_mesh((1, 4)))
    _check_like_keras(layout_map, paths)
    rules = sharding.as_layout_rules(layout_map)
    sharded = {p for p, s in paths if any(rules.spec_for(p, s, AXES))}
    assert len(sharded) == 1 + 2 * 7   # the embedding; 7 kernels per layer; norms and logits not


# -- a Llama-shaped model trained under the map ---------------------------------
TOKENS = DatasetSpec(name="random_tokens", kind="tokens", input_shape=(8,), num_classes=12,
                     train_examples=128, eval_examples=32)


class SelfAttention(layers.Layer):
    """Causal multi-head attention with keras-hub Llama's variable names."""

    def __init__(self, width, heads, **kwargs):
        super().__init__(**kwargs)
        self.head_dim = width // heads
        shape = (None, heads, self.head_dim)
        self.query = layers.EinsumDense("btd,dnh->btnh", shape, name="query")
        self.key = layers.EinsumDense("bsd,dnh->bsnh", shape, name="key")
        self.value = layers.EinsumDense("bsd,dnh->bsnh", shape, name="value")
        self.attention_output = layers.EinsumDense("btnh,nhd->btd", (None, width),
                                                   name="attention_output")

    def call(self, x):
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = ops.einsum("btnh,bsnh->bnts", q, k) / self.head_dim ** 0.5
        length = ops.shape(x)[1]
        scores = ops.where(ops.tril(ops.ones((length, length), "bool")), scores, -1e9)
        return self.attention_output(ops.einsum("bnts,bsnh->btnh", ops.softmax(scores), v))


class DecoderLayer(layers.Layer):
    """A pre-norm Llama decoder layer (RMS norms, gated SiLU FFN)."""

    def __init__(self, width, heads, hidden, **kwargs):
        super().__init__(**kwargs)
        self.self_attention_layernorm = layers.RMSNormalization(name="self_attention_layernorm")
        self.self_attention = SelfAttention(width, heads, name="self_attention")
        self.feedforward_layernorm = layers.RMSNormalization(name="feedforward_layernorm")
        dense = lambda units, name: layers.Dense(units, use_bias=False, name=name)  # noqa: E731
        self.feedforward_gate_dense = dense(hidden, "feedforward_gate_dense")
        self.feedforward_intermediate_dense = dense(hidden, "feedforward_intermediate_dense")
        self.feedforward_output_dense = dense(width, "feedforward_output_dense")

    def call(self, x):
        x = x + self.self_attention(self.self_attention_layernorm(x))
        y = self.feedforward_layernorm(x)
        gate = self.feedforward_gate_dense(y)
        # SiLU written out: `ops.silu` (tf.nn.silu, a custom gradient) fails to
        # compile under DTensor on TF 2.21 ("operand #0 does not dominate this
        # use"), with or without layout rules.
        y = gate * ops.sigmoid(gate) * self.feedforward_intermediate_dense(y)
        return x + self.feedforward_output_dense(y)


def llama_like(spec, width=8, heads=4, hidden=16, depth=2):
    """A functional model whose variable paths are keras-hub LlamaBackbone's
    (`token_embedding/embeddings`, `transformer_layer_0/self_attention/query/
    kernel`, ...), plus a logits layer."""
    tokens = keras.Input(spec.input_shape, dtype="int32", name="token_ids")
    x = layers.Embedding(spec.num_classes, width, name="token_embedding")(tokens)
    for i in range(depth):
        x = DecoderLayer(width, heads, hidden, name=f"transformer_layer_{i}")(x)
    x = layers.RMSNormalization(name="sequence_output_layernorm")(x)
    return keras.Model(tokens, layers.Dense(spec.num_classes, name="logits")(x))


def _llama_paths(**sizes):
    spec = DatasetSpec(name="t", kind="tokens", input_shape=(8,), num_classes=sizes.pop("vocab"))
    return [(v.path, tuple(v.shape)) for v in llama_like(spec, **sizes).variables]


MESH = "batch:2,model:2"


def _run_config(strategy, steps=3):
    config = run_config("default", optimizer="adam", learning_rate=0.01, steps=steps, batch=16)
    return config.replace(strategy=tfdist.StrategyConfig(
        name=strategy, virtual_devices=4 if strategy == "dtensor" else 2, mesh=MESH))


@pytest.fixture(scope="module")
def llama_runs():
    """The Llama-shaped model trained 3 steps from the same weights on one
    device and on the 2x2 mesh under keras-hub's Llama layout map, unchanged."""
    keras.utils.set_random_seed(1)
    initial = llama_like(TOKENS, depth=1).get_weights()   # one layer: half the trace time

    def model_fn(spec):
        model = llama_like(spec, depth=1)
        model.set_weights(initial)
        return model

    layout_map = llama_layout_map(_mesh())
    runs = {strategy: tfdist.train(
        _run_config(strategy), model_fn=model_fn, dataset_fn=token_dataset_fn_for(TOKENS),
        spec=TOKENS, layout_rules=layout_map if strategy == "dtensor" else None)
        for strategy in ("default", "dtensor")}
    return initial, layout_map, runs


def test_llama_layout_map_stores_every_variable_as_keras_says(llama_runs):
    """Each variable is stored as the map says, `batch` included: the map
    splits weights over `batch` too (FSDP on JAX), and tfdist stores them so
    and gathers that dimension for use, as under --zero_stage=3 (DTensor
    alone refuses such a weight: "Contracting dimension for matmul has
    sharding dimension batch for the left input and model for the right")."""
    _, layout_map, runs = llama_runs
    variables = runs["dtensor"].sharded_model.variables
    assert len(variables) == 13
    for variable in variables:
        layout = dtensor.fetch_layout(variable.value.read_value())
        got = tuple(None if a == dtensor.UNSHARDED else a for a in layout.sharding_specs)
        assert got == _keras_spec(layout_map, variable.path, len(variable.shape)), variable.path
    both = [v.path for v in variables if {"batch", "model"} <= set(dtensor.fetch_layout(
        v.value.read_value()).sharding_specs)]
    assert len(both) == 1 + 7, both   # the embedding and the layer's 7 kernels


def test_llama_layout_map_trains_what_one_device_trains(llama_runs):
    initial, _, runs = llama_runs
    _assert_matches(runs["dtensor"], runs["default"], initial)
