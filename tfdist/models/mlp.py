"""`mlp`: a multi-layer perceptron over flattened inputs."""

import keras

DATA_KINDS = ("image",)


def layout_rules(config):
    """DTensor layouts: hidden layers alternate column- and row-sharded on
    `model` (Megatron's pairing: a column-sharded layer's output feeds the next
    layer's sharded input dimension, so only every second layer all-reduces);
    the logits layer takes the sharding the last hidden layer leaves."""
    rules = [(r"hidden_\d*[02468]/kernel$", (None, "model")),
             (r"hidden_\d*[02468]/bias$", ("model",)),
             (r"hidden_\d*[13579]/kernel$", ("model", None))]
    if config.depth % 2:  # the last hidden layer is column-sharded
        rules.append((r"logits/kernel$", ("model", None)))
    return rules


def build(config, spec) -> keras.Model:
    inputs = keras.Input(spec.input_shape, name="inputs")
    x = keras.layers.Flatten()(inputs)
    for i in range(config.depth):
        x = keras.layers.Dense(config.width, activation="relu", name=f"hidden_{i}")(x)
    logits = keras.layers.Dense(spec.num_classes, dtype="float32", name="logits")(x)
    return keras.Model(inputs, logits, name="mlp")
