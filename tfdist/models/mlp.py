"""`mlp`: a multi-layer perceptron over flattened inputs."""

import keras

DATA_KINDS = ("image",)


def build(config, spec) -> keras.Model:
    inputs = keras.Input(spec.input_shape, name="inputs")
    x = keras.layers.Flatten()(inputs)
    for i in range(config.depth):
        x = keras.layers.Dense(config.width, activation="relu", name=f"hidden_{i}")(x)
    logits = keras.layers.Dense(spec.num_classes, dtype="float32", name="logits")(x)
    return keras.Model(inputs, logits, name="mlp")
