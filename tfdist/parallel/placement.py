"""Placing computation on devices: one function (`on_device`), or whole layers.

`on_device` runs a function's forward and backward on one device; TensorFlow's
tape would otherwise leave the gradient ops without a device, and they piled
up on the first one. Tensor-parallel layers use it for each shard.

A placement maps layer names to devices. Under `tfdist.TensorParallelStrategy`
a placed layer's variables are created on its device (matched by the Keras
name scope they are built in) and its computation, forward and backward, runs
there (`place_computation`). Layers not named stay on the strategy's first
device. `balance_by_memory` proposes a placement: the model's layers in order,
cut into one contiguous run per device with the parameter bytes as even as
possible (the partition the pipeline strategy also uses).

`call_in_context` runs a layer's whole `call` inside a context: a pipeline
stage's device and group, so evaluation and prediction run each layer where
its stage's weights are.

Example:

    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="a"),
    ...                           keras.layers.Dense(8, name="b")])
    >>> balance_by_memory(model, ["/cpu:0", "/cpu:1"])
    {'a': '/cpu:0', 'b': '/cpu:1'}
"""

from __future__ import annotations

import functools
from typing import Callable, ContextManager, Mapping, Optional, Sequence

import keras
import tensorflow as tf

from tfdist import _compat
from tfdist.parallel.partition import balance

__all__ = [
    "balance_by_memory", "call_in_context", "device_for_scope", "on_device", "place_computation", "unknown_layers"
]


def on_device(device: Optional[str], fn: Callable, *inputs):
    """`fn(*inputs)` with its forward and its gradient both placed on `device`."""
    if device is None:
        return fn(*inputs)
    # Only inputs a tape records get gradients: for the model's input data an
    # input gradient would be a matmul per shard that nothing uses. A tensor
    # passed twice (attention's key is its value) is one input, or its
    # gradient would count twice.
    differentiable = list({id(x): x for x in inputs if _compat.needs_gradient(x)}.values())

    @tf.custom_gradient
    def forward(*xs):
        replaced = {id(d): x for d, x in zip(differentiable, xs)}
        with tf.device(device), tf.GradientTape() as tape:
            tape.watch(xs)
            y = fn(*[replaced.get(id(x), x) for x in inputs])

        def backward(dy, variables=None):
            with tf.device(device):
                grads = tape.gradient(y, list(xs) + list(variables or []), output_gradients=dy)
            return grads[: len(xs)], grads[len(xs):]

        return y, backward

    return forward(*differentiable)


def balance_by_memory(model: keras.Model, devices: Sequence[str]) -> dict[str, str]:
    """Every top-level layer of `model` on one of `devices`, contiguous runs, parameter bytes balanced.

    Raises:
      ValueError: fewer layers than devices.
    """
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    if len(layers) < len(devices):
        raise ValueError(
            f"`devices` must not outnumber the model's layers ({len(layers)}) to place them by memory. "
            f"Received: {len(devices)} devices"
        )
    costs = [sum(w.value.dtype.size * int(tf.size(w.value)) for w in layer.weights) for layer in layers]
    starts = [0, *balance(costs, len(devices)), len(layers)]
    return {
        layer.name: device
        for device, start, stop in zip(devices, starts[:-1], starts[1:])
        for layer in layers[start:stop]
    }


def device_for_scope(placement: Mapping[str, str], name_scope: str) -> Optional[str]:
    """The device of the innermost placed layer in a name scope (`model/block1_mlp`), if any."""
    for part in reversed(name_scope.split("/")):
        if part in placement:
            return placement[part]
    return None


def unknown_layers(model: keras.Model, placement: Mapping[str, str]) -> list[str]:
    """The names in `placement` that no layer of `model` has."""
    return sorted(set(placement) - set(_layers_by_name(model)))


def place_computation(
    model: keras.Model, placement: Mapping[str, str], resolve: Callable[[str], str] = lambda device: device
) -> None:
    """Runs each placed layer of `model` on its device, forward and backward. Idempotent.

    `resolve` turns a placement device into the one to use in the step being
    built (a model replica's own device under data parallelism).

    Raises:
      ValueError: the placement names a layer that `model` does not have.
    """
    layers = _layers_by_name(model)
    unknown = unknown_layers(model, placement)
    if unknown:
        raise ValueError(f"`placement` must name layers of the model ({sorted(layers)}). Received: {unknown}")
    for name, device in placement.items():
        layer = layers[name]
        if getattr(layer, "_tfdist_device", None) == device:
            continue
        original = getattr(layer, "_tfdist_original_call", layer.call)

        @functools.wraps(original)
        def call(*args, _original=original, _device=device, **kwargs):
            device = resolve(_device)
            if all(tf.is_tensor(a) for a in args):
                return on_device(device, lambda *xs: _original(*xs, **kwargs), *args)
            with tf.device(device):  # nested inputs: the forward alone is placed
                return _original(*args, **kwargs)

        layer._tfdist_original_call, layer._tfdist_device = original, device
        layer.call = call


def call_in_context(operation, context: Callable[[], ContextManager]) -> None:
    """From now on `operation` (a Keras layer or op) runs its `call` inside a fresh `context()`.

    Calling again replaces the context (and any placement `place_computation` gave it).
    """
    original = getattr(operation, "_tfdist_original_call", operation.call)

    @functools.wraps(original)
    def call(*args, **kwargs):
        with context():
            return original(*args, **kwargs)

    operation._tfdist_original_call, operation._tfdist_device = original, None
    operation.call = call


def _layers_by_name(model: keras.Model) -> dict:
    return {layer.name: layer for layer in _compat.nested_layers(model)}
