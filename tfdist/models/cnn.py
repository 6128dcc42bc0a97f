"""`cnn`: a small ResNet (conv stem, residual blocks with BatchNorm, global pool).

Two stages: `depth` residual blocks at `width` channels, then a strided
transition and `depth` blocks at 2*`width` channels.
"""

import keras
from keras import layers

DATA_KINDS = ("image",)


def _conv_bn(x, channels, strides=1, name=""):
    x = layers.Conv2D(channels, 3, strides=strides, padding="same", use_bias=False,
                      name=f"{name}_conv")(x)
    # momentum 0.9 (Keras: 0.99): moving statistics that track the weights
    # within ~10 steps, so short runs evaluate well.
    return layers.BatchNormalization(momentum=0.9, name=f"{name}_bn")(x)


def _residual_block(x, channels, strides, name):
    shortcut = x
    y = layers.ReLU()(_conv_bn(x, channels, strides, name=f"{name}_a"))
    y = _conv_bn(y, channels, name=f"{name}_b")
    if strides != 1 or shortcut.shape[-1] != channels:
        shortcut = layers.Conv2D(channels, 1, strides=strides, use_bias=False,
                                 name=f"{name}_proj")(shortcut)
    return layers.ReLU()(layers.Add()([shortcut, y]))


def build(config, spec) -> keras.Model:
    inputs = keras.Input(spec.input_shape, name="inputs")
    # A strided stem halves the resolution early: most of the compute of a
    # small ResNet sits in the first full-resolution layers.
    x = layers.ReLU()(_conv_bn(inputs, config.width, strides=2, name="stem"))
    for stage, channels in enumerate((config.width, 2 * config.width)):
        for block in range(config.depth):
            strides = 2 if stage > 0 and block == 0 else 1
            x = _residual_block(x, channels, strides, name=f"stage{stage}_block{block}")
    x = layers.GlobalAveragePooling2D()(x)
    logits = layers.Dense(spec.num_classes, dtype="float32", name="logits")(x)
    return keras.Model(inputs, logits, name="cnn")
