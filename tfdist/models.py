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

import math

import keras

from tfdist.config.schema import ModelConfig, ModelName
import tensorflow as tf

from tfdist.layers import ParallelMLP, ParallelMultiHeadAttention, ShardedEmbedding
from tfdist.parallel import DeviceGroup, current_group

__all__ = ["PixelTokens", "PositionEmbedding", "build"]

INTENSITY_LEVELS = 9  # digits pixels (k/16) to eighths: fewer, better-trained rows


@keras.saving.register_keras_serializable(package="tfdist")
class PixelTokens(keras.layers.Layer):
    """Each pixel as one token id: its position and its intensity level.

    Intensities are clipped to [0, 1] and rounded to `levels` steps, so an
    image of P pixels becomes P ids below P * levels.
    """

    def __init__(self, levels: int = INTENSITY_LEVELS, **kwargs):
        super().__init__(**kwargs)
        self.levels = levels

    def call(self, images):
        ops = keras.ops
        flat = ops.reshape(images, (-1, math.prod(images.shape[1:])))
        level = ops.cast(ops.round(ops.clip(ops.cast(flat, "float32"), 0, 1) * (self.levels - 1)), "int32")
        return ops.arange(flat.shape[-1], dtype="int32") * self.levels + level

    def compute_output_shape(self, input_shape):
        return (input_shape[0], math.prod(input_shape[1:]))

    def get_config(self):
        return {**super().get_config(), "levels": self.levels}


@keras.saving.register_keras_serializable(package="tfdist")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned vector per sequence position (the inputs are (batch, length, width))."""

    def build(self, input_shape):
        self.positions = self.add_weight(shape=tuple(input_shape[1:]), initializer="zeros", name="positions")

    def call(self, inputs):
        return inputs + self.positions


def build(config: ModelConfig, *, input_shape: tuple[int, ...], num_classes: int) -> keras.Model:
    """Builds the configured model (call under a strategy's scope)."""
    layers = keras.layers
    if ModelName(config.name) == ModelName.TRANSFORMER:
        return _transformer(config, input_shape, num_classes)
    if ModelName(config.name) == ModelName.DIGITS_CNN:
        body = [
            layers.Conv2D(config.width, 3, padding="same", activation="relu"),
            layers.Conv2D(2 * config.width, 3, padding="same", activation="relu"),
            layers.MaxPooling2D(),
            layers.Flatten(),
            layers.Dense(4 * config.width, activation="relu"),
        ]
    elif ModelName(config.name) == ModelName.PIXEL_EMBEDDING:
        # Each (position, intensity) token gets its own vector: the embedding
        # table is the large variable that parameter servers can hold in shards.
        body = [
            PixelTokens(),
            ShardedEmbedding(math.prod(input_shape) * INTENSITY_LEVELS, config.width),
            layers.Flatten(),
            layers.Dense(2 * config.width, activation="relu"),
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


def _transformer(config: ModelConfig, input_shape: tuple[int, ...], num_classes: int) -> keras.Model:
    """Image rows as a sequence, pre-norm Transformer blocks, mean-pooled classifier.

    The attention and MLP blocks split over the tensor-parallel group in scope
    (and follow the scope when called: each replica and pipeline stage uses
    its own group); with none (any other strategy) they are plain layers on
    one device. Every layer is named, so a placement by name
    (`placement.layers`) is stable.
    """
    if current_group() is None:
        with DeviceGroup([tf.config.list_logical_devices()[0].name]).scope():
            return _transformer(config, input_shape, num_classes)
    layers = keras.layers
    inputs = keras.Input(input_shape, name="image")
    x = layers.Reshape((input_shape[0], math.prod(input_shape[1:])), name="rows")(inputs)
    x = PositionEmbedding(name="positions")(layers.Dense(config.width, name="embed")(x))
    for block in range(config.depth):
        y = layers.LayerNormalization(name=f"block{block}_attention_norm")(x)
        y = ParallelMultiHeadAttention(
            config.heads, config.width // config.heads, name=f"block{block}_attention"
        )(y, y)
        x = layers.Add(name=f"block{block}_attention_residual")([x, y])
        y = layers.LayerNormalization(name=f"block{block}_mlp_norm")(x)
        y = ParallelMLP(4 * config.width, name=f"block{block}_mlp")(y)
        x = layers.Add(name=f"block{block}_mlp_residual")([x, y])
    x = layers.GlobalAveragePooling1D(name="pool")(layers.LayerNormalization(name="final_norm")(x))
    x = layers.Dropout(config.dropout, name="dropout")(x)
    logits = layers.Dense(num_classes, name="classifier")(x)
    outputs = layers.Activation("softmax", dtype="float32", name="softmax")(logits)
    return keras.Model(inputs, outputs, name=ModelName.TRANSFORMER.value)
