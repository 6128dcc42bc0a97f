"""A base for model blocks that can recompute their activations (`--recompute`).

Gradient checkpointing: in training, a block's forward pass runs under
`tf.recompute_grad`, which keeps only the block's input and recomputes its
inner activations during the backward pass. Peak activation memory drops from
all layers' to about one block's, for about one extra forward pass.

Caveat: layers with training-time side effects run twice per step. For
BatchNormalization that means the moving statistics take two (identical)
updates per step, a faster-moving average; the trainable weights and the
gradients are unchanged.
"""

import keras
import tensorflow as tf


class Block(keras.layers.Layer):
    """Subclasses implement `forward(x, training)`; `call` adds recomputation.

    Subclasses register with `keras.saving.register_keras_serializable` and
    extend `get_config` with their own arguments, so an exported
    `model.keras` loads with `keras.saving.load_model` after `import tfdist.models`.
    """

    def __init__(self, *, recompute: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.recompute = recompute

    def get_config(self):
        return {**super().get_config(), "recompute": self.recompute}

    def forward(self, x, training=None):
        raise NotImplementedError

    def call(self, x, training=None):
        if self.recompute and training:
            return tf.recompute_grad(lambda inputs: self.forward(inputs, training=True))(x)
        return self.forward(x, training=training)
