"""`transformer`: a small Transformer, for next-token prediction or text classification.

Pre-norm blocks (`DecoderBlock`) of multi-head self-attention and a GELU FFN (4x)
over token plus learned position embeddings. On "tokens" data it is a causal
decoder with logits over the vocabulary at every position; on "text" data
(token ids of a text, 0 = padding, one label per text) a non-causal encoder
whose final states are averaged over the non-padding positions into class
logits.
"""

import keras
from keras import layers, ops

from tfdist.errors import UsageError
from tfdist.models.blocks import Block

DATA_KINDS = ("tokens", "text")


def layout_rules(config):
    """DTensor layouts, Megatron-style: attention heads and the FFN's hidden
    units are split over `model`. Query/key/value kernels (d, heads, head_dim)
    and the FFN up-projection are column-sharded; the attention output
    (heads, head_dim, d) and the FFN down-projection are row-sharded, so each
    block needs one all-reduce in attention and one in the FFN. Embeddings
    are sharded on their vocabulary (positions) dimension; norms and output
    biases replicate. (Sharding embeddings on the hidden dimension beside
    sharded heads fails to compile in DTensor 2.21: "EmitAllScatter was passed
    a desired_layout ... not more sharded than the original_layout".)"""
    del config
    return [
        (r"attn/(query|key|value)/kernel$", (None, "model", None)),
        (r"attn/(query|key|value)/bias$", ("model", None)),
        (r"attn/attention_output/kernel$", ("model", None, None)),
        (r"ffn_in/kernel$", (None, "model")),
        (r"ffn_in/bias$", ("model",)),
        (r"ffn_out/kernel$", ("model", None)),
        (r"(token_embedding|position_embedding/table)/embeddings$", ("model", None)),
    ]


@keras.saving.register_keras_serializable(package="tfdist")
class PositionEmbedding(layers.Layer):
    """Adds a learned embedding of each position to its token embedding."""

    def __init__(self, length, dim, **kwargs):
        super().__init__(**kwargs)
        self.length, self.dim = length, dim
        self.embedding = layers.Embedding(length, dim, name="table")

    def get_config(self):
        return {**super().get_config(), "length": self.length, "dim": self.dim}

    def call(self, x):
        positions = ops.arange(ops.shape(x)[1])
        return x + ops.cast(self.embedding(positions), x.dtype)


@keras.saving.register_keras_serializable(package="tfdist")
class DecoderBlock(Block):
    """Pre-norm self-attention (causal unless `causal=False`) and a 4x GELU FFN,
    each with a residual."""

    def __init__(self, width, num_heads, causal=True, **kwargs):
        super().__init__(**kwargs)
        self.width, self.num_heads, self.causal = width, num_heads, causal
        self.ln1 = layers.LayerNormalization(epsilon=1e-5, name="ln1")
        self.attention = layers.MultiHeadAttention(num_heads, width // num_heads, name="attn")
        self.ln2 = layers.LayerNormalization(epsilon=1e-5, name="ln2")
        self.ffn_in = layers.Dense(4 * width, activation="gelu", name="ffn_in")
        self.ffn_out = layers.Dense(width, name="ffn_out")

    def get_config(self):
        return {**super().get_config(), "width": self.width, "num_heads": self.num_heads,
                "causal": self.causal}

    def forward(self, x, training=None):
        y = self.ln1(x)
        x = x + self.attention(y, y, use_causal_mask=self.causal, training=training)
        return x + self.ffn_out(self.ffn_in(self.ln2(x)))


@keras.saving.register_keras_serializable(package="tfdist")
class MaskedAverage(layers.Layer):
    """Average of the states (batch, T, d) over the positions whose token id
    (batch, T) is not 0 (padding); an all-padding text averages to zeros."""

    def call(self, states, tokens):
        mask = ops.cast(ops.not_equal(tokens, 0), states.dtype)[..., None]
        total = ops.sum(states * mask, axis=1)
        return total / ops.maximum(ops.sum(mask, axis=1), ops.cast(1, states.dtype))


def build(config, spec) -> keras.Model:
    if config.width % config.num_heads:
        raise UsageError(f"--model_width={config.width} must be divisible by "
                         f"--num_heads={config.num_heads}")
    text = spec.kind == "text"
    length = spec.input_shape[0]
    vocab_size = spec.vocab_size if text else spec.num_classes
    if not vocab_size:
        raise UsageError(f"--dataset={spec.name} has text data without a vocabulary size "
                         "(DatasetSpec.vocab_size)")
    inputs = keras.Input((length,), dtype="int32", name="tokens")
    x = layers.Embedding(vocab_size, config.width, name="token_embedding")(inputs)
    x = PositionEmbedding(length, config.width, name="position_embedding")(x)
    for i in range(config.depth):
        x = DecoderBlock(config.width, config.num_heads, causal=not text,
                         recompute=config.recompute, name=f"block{i}")(x)
    x = layers.LayerNormalization(epsilon=1e-5, name="final_ln")(x)
    if text:
        x = MaskedAverage(name="pool")(x, inputs)
    logits = layers.Dense(spec.num_classes, dtype="float32", name="logits")(x)
    return keras.Model(inputs, logits, name="transformer")
