"""`transformer`: a small causal Transformer decoder for next-token prediction.

Pre-norm blocks of causal multi-head self-attention and a GELU FFN (4x),
token plus learned position embeddings, logits over the vocabulary at every
position.
"""

import keras
from keras import layers, ops

from tfdist.errors import UsageError

DATA_KINDS = ("tokens",)


class PositionEmbedding(layers.Layer):
    """Adds a learned embedding of each position to its token embedding."""

    def __init__(self, length, dim, **kwargs):
        super().__init__(**kwargs)
        self.embedding = layers.Embedding(length, dim, name="table")

    def call(self, x):
        positions = ops.arange(ops.shape(x)[1])
        return x + ops.cast(self.embedding(positions), x.dtype)


def _block(x, config, name):
    key_dim = config.width // config.num_heads
    y = layers.LayerNormalization(epsilon=1e-5, name=f"{name}_ln1")(x)
    y = layers.MultiHeadAttention(config.num_heads, key_dim, name=f"{name}_attn")(
        y, y, use_causal_mask=True)
    x = layers.Add()([x, y])
    y = layers.LayerNormalization(epsilon=1e-5, name=f"{name}_ln2")(x)
    y = layers.Dense(4 * config.width, activation="gelu", name=f"{name}_ffn_in")(y)
    y = layers.Dense(config.width, name=f"{name}_ffn_out")(y)
    return layers.Add()([x, y])


def build(config, spec) -> keras.Model:
    if config.width % config.num_heads:
        raise UsageError(f"--model_width={config.width} must be divisible by "
                         f"--num_heads={config.num_heads}")
    length = spec.input_shape[0]
    inputs = keras.Input((length,), dtype="int32", name="tokens")
    x = layers.Embedding(spec.num_classes, config.width, name="token_embedding")(inputs)
    x = PositionEmbedding(length, config.width, name="position_embedding")(x)
    for i in range(config.depth):
        x = _block(x, config, name=f"block{i}")
    x = layers.LayerNormalization(epsilon=1e-5, name="final_ln")(x)
    logits = layers.Dense(spec.num_classes, dtype="float32", name="logits")(x)
    return keras.Model(inputs, logits, name="transformer")
