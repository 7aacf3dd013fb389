"""The models `tfdist train` can build from config.

Each ends in a float32 softmax so that mixed-precision policies keep the loss in
float32 (the Keras mixed-precision guide's advice).

Example:

    >>> from tfdist.config import ModelConfig
    >>> model = build(ModelConfig(), input_shape=(8, 8, 1), num_classes=10)
    >>> model.output_shape
    (None, 10)
"""

from __future__ import annotations

import keras

from tfdist.config.schema import ModelConfig, ModelName

__all__ = ["build"]


def build(config: ModelConfig, *, input_shape: tuple[int, ...], num_classes: int) -> keras.Model:
    """Builds the configured model (call under a strategy's scope)."""
    layers = keras.layers
    if ModelName(config.name) == ModelName.DIGITS_CNN:
        body = [
            layers.Conv2D(config.width, 3, padding="same", activation="relu"),
            layers.Conv2D(2 * config.width, 3, padding="same", activation="relu"),
            layers.MaxPooling2D(),
            layers.Flatten(),
            layers.Dense(4 * config.width, activation="relu"),
        ]
    else:
        body = [layers.Flatten()]
        body += [layers.Dense(config.width, activation="relu") for _ in range(config.depth)]
    head = [
        layers.Dropout(config.dropout),
        layers.Dense(num_classes),
        layers.Activation("softmax", dtype="float32"),
    ]
    return keras.Sequential(
        [keras.Input(input_shape), *body, *head], name=ModelName(config.name).value
    )
