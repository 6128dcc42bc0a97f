"""`cnn`: a small ResNet (conv stem, residual blocks with BatchNorm, global pool).

Two stages: `depth` residual blocks at `width` channels, then a strided
transition and `depth` blocks at 2*`width` channels.
"""

import keras
from keras import layers

from tfdist.models.blocks import Block

DATA_KINDS = ("image",)


def layout_rules(config):
    """DTensor layouts: none, the cnn replicates (data parallel over `batch`).
    Its convolutions are small (32-64 channels): splitting channels over
    `model` would add an all-gather per convolution and per BatchNorm for
    a few kB of weights each, costing more than it saves."""
    del config
    return []


def _batch_norm(name):
    # momentum 0.9 (Keras: 0.99): moving statistics that track the weights
    # within ~10 steps, so short runs evaluate well.
    return layers.BatchNormalization(momentum=0.9, name=name)


@keras.saving.register_keras_serializable(package="tfdist")
class ResidualBlock(Block):
    """conv-BN-ReLU-conv-BN plus a (projected) shortcut, then ReLU."""

    def __init__(self, channels, strides=1, **kwargs):
        super().__init__(**kwargs)
        self.channels, self.strides = channels, strides
        self.conv_a = layers.Conv2D(channels, 3, strides=strides, padding="same",
                                    use_bias=False, name="conv_a")
        self.bn_a = _batch_norm("bn_a")
        self.conv_b = layers.Conv2D(channels, 3, padding="same", use_bias=False, name="conv_b")
        self.bn_b = _batch_norm("bn_b")
        self.projection = None

    def get_config(self):
        return {**super().get_config(), "channels": self.channels, "strides": self.strides}

    def build(self, input_shape):
        if self.strides != 1 or input_shape[-1] != self.channels:
            self.projection = layers.Conv2D(self.channels, 1, strides=self.strides,
                                            use_bias=False, name="projection")

    def forward(self, x, training=None):
        y = keras.ops.relu(self.bn_a(self.conv_a(x), training=training))
        y = self.bn_b(self.conv_b(y), training=training)
        shortcut = self.projection(x) if self.projection is not None else x
        return keras.ops.relu(shortcut + y)


def build(config, spec) -> keras.Model:
    inputs = keras.Input(spec.input_shape, name="inputs")
    # A strided stem halves the resolution early: most of the compute of a
    # small ResNet sits in the first full-resolution layers.
    x = layers.Conv2D(config.width, 3, strides=2, padding="same", use_bias=False,
                      name="stem_conv")(inputs)
    x = layers.ReLU()(_batch_norm("stem_bn")(x))
    for stage, channels in enumerate((config.width, 2 * config.width)):
        for block in range(config.depth):
            strides = 2 if stage > 0 and block == 0 else 1
            x = ResidualBlock(channels, strides, recompute=config.recompute,
                              name=f"stage{stage}_block{block}")(x)
    x = layers.GlobalAveragePooling2D()(x)
    logits = layers.Dense(spec.num_classes, dtype="float32", name="logits")(x)
    return keras.Model(inputs, logits, name="cnn")
