"""The models `tfdist train` can build from config.

`model.name` is one of tfdist's built-in models, each ending in a float32
softmax so that mixed-precision policies keep the loss in float32 (the Keras
mixed-precision guide's advice); or a model of `keras.applications` (no
weights: nothing is downloaded), a saved `.keras` file, or the user's own
function. Whatever the source, the model must output one score per class.

Example:

    >>> from tfdist.config import ModelConfig
    >>> model = build(ModelConfig(), input_shape=(8, 8, 1), num_classes=10)
    >>> model.output_shape
    (None, 10)
"""

from __future__ import annotations

import math
import os

import keras


from tfdist.config.schema import ModelConfig, ModelName
from tfdist.config.sources import ModelSource, model_source
from tfdist.errors import ConfigError
from tfdist.layers import ParallelMLP, ParallelMultiHeadAttention, ShardedEmbedding

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
    """Builds (or loads) the configured model, uncompiled; call under a strategy's scope.

    Raises:
      ConfigError: on `model.name`: an unknown keras.applications model, a
        missing or unreadable file, a function that cannot be imported or does
        not return a Keras model, a model Keras cannot build for the data's
        input shape, or one whose output is not one score per class.
    """
    source, reference = model_source(config.name)
    if isinstance(input_shape, dict) and source != ModelSource.FUNCTION:
        raise ConfigError("model.name", f"takes one input, and the data has several ({', '.join(input_shape)}): "
                                        "give a model of your own (MODULE:FUNCTION), called with a dict of shapes.",
                          config.name)
    if source == ModelSource.BUILTIN:
        model = _builtin(config, input_shape, num_classes)
    elif source == ModelSource.KERAS_APPLICATIONS:
        model = _keras_application(reference, input_shape, num_classes)
    elif source == ModelSource.FILE:
        model = _saved(reference)
    else:
        model = _from_function(reference, input_shape, num_classes)
    _check_output(model, config.name, input_shape, num_classes)
    return model


def _keras_application(name: str, input_shape: tuple[int, ...], num_classes: int) -> keras.Model:
    constructor = getattr(keras.applications, name, None)
    if not callable(constructor) or name[0].islower():
        raise ConfigError("model.name", "must name a model of keras.applications (e.g. ResNet50, MobileNetV2).",
                          f"keras.applications.{name}")
    try:  # weights=None: randomly initialised, nothing downloaded
        return constructor(weights=None, input_shape=input_shape, classes=num_classes)
    except ValueError as e:
        raise ConfigError("model.name", f"cannot be built for inputs of shape {input_shape} ({e}).",
                          f"keras.applications.{name}") from None


def _saved(path: str) -> keras.Model:
    if not os.path.isfile(path):
        raise ConfigError("model.name", "must name an existing .keras file after `file:`.", f"file:{path}")
    try:  # compiled again from the config, so the saved optimizer is not restored
        model = keras.models.load_model(path, compile=False)
    except (ValueError, OSError, TypeError) as e:
        raise ConfigError("model.name", f"names a file Keras cannot load ({e}).", f"file:{path}") from None
    return _with_global_policy(model, f"file:{path}")


def _with_global_policy(model: keras.Model, name: str) -> keras.Model:
    """The model again, its layers computing in the global dtype policy (its outputs stay as saved).

    A saved model keeps the policy it was trained with in each layer's config;
    `precision.policy` decides here, as for a model built from code.
    """
    policy = keras.mixed_precision.global_policy()
    if all(layer.dtype_policy.name == policy.name for layer in model.layers):
        return model
    outputs = {id(layer) for layer in model.layers if any(layer.output is o for o in model.outputs)}

    def with_policy(layer):
        if id(layer) in outputs or isinstance(layer, keras.layers.InputLayer):
            return layer.__class__.from_config(layer.get_config())
        return layer.__class__.from_config({**layer.get_config(), "dtype": policy.name})

    try:
        clone = keras.models.clone_model(model, clone_function=with_policy)
    except ValueError as e:  # a subclassed model has no layer graph to rebuild
        raise ConfigError("precision.policy", f"{policy.name} needs a functional or Sequential model to apply to a "
                                              f"saved one ({e}).", name) from None
    clone.set_weights(model.get_weights())
    return clone


def _from_function(reference: str, input_shape: tuple[int, ...], num_classes: int) -> keras.Model:
    from tfdist.user_code import call_function

    model = call_function(reference, "model.name", input_shape=input_shape, num_classes=num_classes)
    if not isinstance(model, keras.Model):
        raise ConfigError("model.name", f"must return a keras.Model; it returned a {type(model).__name__}.",
                          reference)
    return model


def _check_output(model: keras.Model, name: str, input_shape: tuple[int, ...], num_classes: int) -> None:
    if getattr(model, "outputs", None):  # functional or Sequential
        outputs = model.outputs
    else:  # subclassed: trace its call on a symbolic batch (which also builds it)
        batch = ({feature: keras.KerasTensor((None, *shape)) for feature, shape in input_shape.items()}
                 if isinstance(input_shape, dict) else keras.KerasTensor((None, *input_shape)))
        outputs = keras.tree.flatten(model.compute_output_spec(batch))
    shape = tuple(outputs[0].shape) if len(outputs) == 1 else tuple(tuple(o.shape) for o in outputs)
    if len(outputs) != 1 or len(shape) != 2 or shape[-1] != num_classes:
        raise ConfigError("model.name", f"must output one score per class, shape (batch, {num_classes}), for "
                                        f"the data's {num_classes} classes; its output is {shape}.", name)


def _builtin(config: ModelConfig, input_shape: tuple[int, ...], num_classes: int) -> keras.Model:
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
    else:  # named, so that a layout's rules (`hidden0/kernel`) and a placement by name are stable
        body = [layers.Flatten()]
        body += [layers.Dense(config.width, activation="relu", name=f"hidden{i}") for i in range(config.depth)]
    head = [
        layers.Dropout(config.dropout),
        layers.Dense(num_classes, name="classifier"),
        layers.Activation("softmax", dtype="float32"),
    ]
    return keras.Sequential(
        [keras.Input(input_shape), *body, *head], name=ModelName(config.name).value
    )


def _transformer(config: ModelConfig, input_shape: tuple[int, ...], num_classes: int) -> keras.Model:
    """Image rows as a sequence, pre-norm Transformer blocks, mean-pooled classifier.

    The attention and MLP blocks are `tfdist.layers`' (Keras's own layers),
    which a strategy with a model axis splits (`tensor_parallel_size`); under
    any other they are plain layers. Every layer is named, so a placement by
    name (`placement.layers`) is stable.
    """
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
