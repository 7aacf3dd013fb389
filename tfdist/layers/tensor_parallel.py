"""Tensor-parallel Keras layers: one layer's matmuls split over a device group.

Megatron-LM's scheme. A column-parallel layer gives device i the columns
i/N..(i+1)/N of the kernel and computes those outputs; a row-parallel layer
gives device i the matching rows and input slice, and the partial products are
summed (the all-reduce). A column layer followed by a row layer (`ParallelMLP`,
the attention heads and output projection of `ParallelMultiHeadAttention`)
needs one sum per block, and the activation in between stays on each device.

Every shard is its own Keras variable, created on its device, so each device
holds 1/N of a sharded kernel. Each shard's forward and backward run on its
device (`tfdist.parallel.placement.on_device`).

Initial values and saved weights are the whole kernels, in the layout of the
Keras layer each one replaces (`Dense`, `MultiHeadAttention`), so they do not
depend on the group size: a model saved from a 2-device run loads under a
1-device group, and `unsharded_weights()` / `set_unsharded_weights()` move
weights to and from the plain Keras layers.

Example:

    >>> from tfdist.parallel import DeviceGroup
    >>> with DeviceGroup(["/cpu:0"]).scope():
    ...     layer = ParallelMLP(hidden_units=8)
    >>> layer(keras.ops.ones((2, 4))).shape
    TensorShape([2, 4])
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfdist import _compat
from tfdist.parallel.device_group import DeviceGroup, current_group
from tfdist.parallel.placement import on_device

__all__ = ["ColumnParallelDense", "ParallelMLP", "ParallelMultiHeadAttention", "RowParallelDense", "split_layers"]


def split_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """The layers of `model`, nested ones too, whose weights split over a device group of more than one device."""
    return [layer for layer in _compat.nested_layers(model)
            if isinstance(layer, _TensorParallelLayer) and layer.group.size > 1]


class _TensorParallelLayer(keras.layers.Layer):
    """Shared parts: the group, sharded weights, saving in the unsharded layout."""

    def __init__(self, group: Optional[DeviceGroup] = None, **kwargs):
        super().__init__(**kwargs)
        self._group_from_scope = group is None
        self.group = group or current_group()
        if self.group is None:
            raise ValueError(
                f"{type(self).__name__} must be made inside a device group: `with "
                "tfdist.parallel.DeviceGroup([...]).scope():` or a `tfdist.TensorParallelStrategy` "
                "scope (a group of one device gives the plain layer, e.g. to load a saved model). "
                "Received: no group in scope."
            )
        # (shards, axis) of every weight, in the unsharded layer's weight order; axis None: not sharded.
        self._parameters: list[tuple[list, Optional[int]]] = []

    @property
    def devices(self) -> list[Optional[str]]:
        """Where each shard computes now; None (no pinning) for a group of one.

        A layer given its `group` always computes there. One that took the
        group from scope computes on the group in scope when called: the
        replica's own under data parallelism, the stage's in a pipeline.

        Raises:
          ValueError: the group in scope has a different size than the layer's.
        """
        group = (current_group() if self._group_from_scope else None) or self.group
        if group.size != self.group.size:
            raise ValueError(
                f"{self.name} has {self.group.size} shard(s) and must be called with a group of as many "
                f"devices in scope. Received: {group}"
            )
        return list(group.devices) if group.size > 1 else [None]

    def _check_divisible(self, argument: str, value: int) -> None:
        if value % self.group.size:
            raise ValueError(
                f"`{argument}` must divide evenly by the group's {self.group.size} devices "
                f"{self.group.devices}. Received: {argument}={value}"
            )

    def _add_sharded(self, name: str, shape: Sequence[int], axis: Optional[int], initializer) -> list:
        """The weight `shape`, initialised whole, then cut along `axis` (None: whole, first device)."""
        with tf.init_scope():  # eager even when the layer is first built inside a traced step
            value = keras.ops.convert_to_numpy(keras.initializers.get(initializer)(tuple(shape), dtype=self.variable_dtype))
        pieces = np.split(value, self.group.size, axis=axis) if axis is not None else [value]
        shards = []
        for i, piece in enumerate(pieces):
            with tf.device(self.group.devices[i] if self.group.size > 1 else None):
                shards.append(self.add_weight(
                    shape=piece.shape, initializer=keras.initializers.Constant(piece),
                    name=name if len(pieces) == 1 else f"{name}_shard_{i}",
                ))
        self._parameters.append((shards, axis))
        return shards

    def unsharded_weights(self) -> list[np.ndarray]:
        """The weights as the plain Keras layer holds them (`Dense`, `MultiHeadAttention`)."""
        return [
            np.concatenate([keras.ops.convert_to_numpy(s) for s in shards], axis=axis)
            if axis is not None else keras.ops.convert_to_numpy(shards[0])
            for shards, axis in self._parameters
        ]

    def set_unsharded_weights(self, weights: Sequence[np.ndarray]) -> None:
        """Sets the weights from the plain Keras layer's list (e.g. its `get_weights()`)."""
        if len(weights) != len(self._parameters):
            raise ValueError(
                f"{self.name}: expected {len(self._parameters)} weights in the unsharded layout. "
                f"Received: {len(weights)}"
            )
        for (shards, axis), value in zip(self._parameters, weights):
            value = np.asarray(value)
            expected = _whole_shape(shards, axis)
            if value.shape != expected:
                raise ValueError(f"{self.name}: a weight has shape {expected}. Received: {value.shape}")
            pieces = np.split(value, len(shards), axis=axis) if axis is not None else [value]
            for shard, piece in zip(shards, pieces):
                shard.assign(piece)

    def save_own_variables(self, store):
        for i, value in enumerate(self.unsharded_weights()):
            store[str(i)] = value

    def load_own_variables(self, store):
        self.set_unsharded_weights([store[str(i)] for i in range(len(store.keys()))])


class _ParallelDense(_TensorParallelLayer):
    """What the column- and row-parallel `Dense` share: Dense's arguments and config."""

    def __init__(self, units: int, activation=None, use_bias: bool = True,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros", group=None, **kwargs):
        super().__init__(group, **kwargs)
        self.units, self.use_bias = units, use_bias
        self.activation = keras.activations.get(activation)
        self.kernel_initializer, self.bias_initializer = kernel_initializer, bias_initializer

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], self.units)

    def get_config(self):
        return {**super().get_config(), "units": self.units, "use_bias": self.use_bias,
                "activation": keras.activations.serialize(self.activation),
                "kernel_initializer": self.kernel_initializer, "bias_initializer": self.bias_initializer}


@keras.saving.register_keras_serializable(package="tfdist")
class ColumnParallelDense(_ParallelDense):
    """`Dense` with its output columns split over the group; outputs gathered.

    Args:
      units: output width, divisible by the group size.
      activation, use_bias, kernel_initializer, bias_initializer: as `Dense`.
      group: the devices; None takes the group in scope.
    """

    def __init__(self, units: int, *args, **kwargs):
        super().__init__(units, *args, **kwargs)
        self._check_divisible("units", units)

    def build(self, input_shape):
        self.kernels = self._add_sharded("kernel", (input_shape[-1], self.units), 1, self.kernel_initializer)
        self.biases = (self._add_sharded("bias", (self.units,), 0, self.bias_initializer) if self.use_bias
                       else [None] * len(self.kernels))

    def call(self, inputs):
        def shard(kernel, bias):
            def fn(x):
                y = tf.matmul(x, kernel) if x.shape.rank == 2 else tf.tensordot(x, kernel, 1)
                return self.activation(y + bias if bias is not None else y)
            return fn

        parts = [on_device(d, shard(k, b), inputs) for d, k, b in zip(self.devices, self.kernels, self.biases)]
        return parts[0] if len(parts) == 1 else tf.concat(parts, axis=-1)


@keras.saving.register_keras_serializable(package="tfdist")
class RowParallelDense(_ParallelDense):
    """`Dense` with its input rows split over the group; partial products summed.

    Args:
      units: output width.
      activation, use_bias, kernel_initializer, bias_initializer: as `Dense`
        (the bias and activation apply after the sum).
      group: the devices; None takes the group in scope. The input width must
        divide by its size.
    """

    def build(self, input_shape):
        self._check_divisible("input width", input_shape[-1])
        self.kernels = self._add_sharded("kernel", (input_shape[-1], self.units), 0, self.kernel_initializer)
        self.bias = self._add_sharded("bias", (self.units,), None, self.bias_initializer)[0] if self.use_bias else None

    def call(self, inputs):
        slices = tf.split(inputs, len(self.kernels), axis=-1)
        parts = [
            on_device(d, lambda x, k=k: tf.tensordot(x, k, 1), x)
            for d, k, x in zip(self.devices, self.kernels, slices)
        ]
        y = tf.add_n(parts)  # the all-reduce
        return self.activation(y + self.bias if self.bias is not None else y)


@keras.saving.register_keras_serializable(package="tfdist")
class ParallelMLP(_TensorParallelLayer):
    """Dense(hidden_units, activation) then Dense(output_units): column- then row-parallel.

    Each device computes its slice of the hidden layer and its partial output;
    the partial outputs are summed once. Weights (unsharded layout): hidden
    kernel, hidden bias, output kernel, output bias.

    Args:
      hidden_units: width of the hidden layer, divisible by the group size.
      output_units: output width; None keeps the input width.
      activation: of the hidden layer.
      group: the devices; None takes the group in scope.
    """

    def __init__(self, hidden_units: int, output_units: Optional[int] = None, activation="gelu",
                 kernel_initializer="glorot_uniform", group=None, **kwargs):
        super().__init__(group, **kwargs)
        self._check_divisible("hidden_units", hidden_units)
        self.hidden_units, self.output_units = hidden_units, output_units
        self.activation = keras.activations.get(activation)
        self.kernel_initializer = kernel_initializer

    def build(self, input_shape):
        width = input_shape[-1]
        out = self.output_units or width
        self.hidden_kernels = self._add_sharded("hidden_kernel", (width, self.hidden_units), 1, self.kernel_initializer)
        self.hidden_biases = self._add_sharded("hidden_bias", (self.hidden_units,), 0, "zeros")
        self.output_kernels = self._add_sharded("output_kernel", (self.hidden_units, out), 0, self.kernel_initializer)
        self.output_bias = self._add_sharded("output_bias", (out,), None, "zeros")[0]

    def call(self, inputs):
        def shard(w1, b1, w2):
            return lambda x: tf.tensordot(self.activation(tf.tensordot(x, w1, 1) + b1), w2, 1)

        parts = [
            on_device(d, shard(w1, b1, w2), inputs)
            for d, w1, b1, w2 in zip(self.devices, self.hidden_kernels, self.hidden_biases, self.output_kernels)
        ]
        return tf.add_n(parts) + self.output_bias

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], self.output_units or input_shape[-1])

    def get_config(self):
        return {**super().get_config(), "hidden_units": self.hidden_units, "output_units": self.output_units,
                "activation": keras.activations.serialize(self.activation),
                "kernel_initializer": self.kernel_initializer}


@keras.saving.register_keras_serializable(package="tfdist")
class ParallelMultiHeadAttention(_TensorParallelLayer):
    """`keras.layers.MultiHeadAttention` with its heads split over the group.

    Device i projects query, key and value for its heads, attends, and
    multiplies by its rows of the output projection; the partial outputs are
    summed once. Weights (unsharded) are in `MultiHeadAttention`'s order and
    shapes, so `set_unsharded_weights(mha.get_weights())` copies a Keras layer.

    Args:
      num_heads: attention heads, divisible by the group size.
      key_dim: size of each head for query and key.
      value_dim: size of each head for value; None: `key_dim`.
      kernel_initializer: of the projections (biases start at zero).
      group: the devices; None takes the group in scope.
    """

    def __init__(self, num_heads: int, key_dim: int, value_dim: Optional[int] = None,
                 kernel_initializer="glorot_uniform", group=None, **kwargs):
        super().__init__(group, **kwargs)
        self._check_divisible("num_heads", num_heads)
        self.num_heads, self.key_dim, self.value_dim = num_heads, key_dim, value_dim or key_dim
        self.kernel_initializer = kernel_initializer

    def build(self, query_shape, value_shape=None, key_shape=None):
        value_shape = value_shape or query_shape
        key_shape = key_shape or value_shape
        h, k, v = self.num_heads, self.key_dim, self.value_dim
        add = self._add_sharded
        self.query = list(zip(add("query_kernel", (query_shape[-1], h, k), 1, self.kernel_initializer),
                              add("query_bias", (h, k), 0, "zeros")))
        self.key = list(zip(add("key_kernel", (key_shape[-1], h, k), 1, self.kernel_initializer),
                            add("key_bias", (h, k), 0, "zeros")))
        self.value = list(zip(add("value_kernel", (value_shape[-1], h, v), 1, self.kernel_initializer),
                              add("value_bias", (h, v), 0, "zeros")))
        self.output_kernels = add("output_kernel", (h, v, query_shape[-1]), 0, self.kernel_initializer)
        self.output_bias = add("output_bias", (query_shape[-1],), None, "zeros")[0]

    def call(self, query, value, key=None, attention_mask=None, use_causal_mask=False):
        key = value if key is None else key
        mask = _attention_mask(query, value, attention_mask, use_causal_mask)
        scale = 1.0 / math.sqrt(float(self.key_dim))

        def shard(q_proj, k_proj, v_proj, out_kernel):
            def fn(q_in, k_in, v_in):
                q = (tf.einsum("bsd,dhk->bshk", q_in, q_proj[0]) + q_proj[1]) * scale
                k = tf.einsum("btd,dhk->bthk", k_in, k_proj[0]) + k_proj[1]
                v = tf.einsum("btd,dhv->bthv", v_in, v_proj[0]) + v_proj[1]
                scores = tf.einsum("bshk,bthk->bhst", q, k)
                if mask is not None:
                    scores += (1.0 - tf.cast(mask[:, None], scores.dtype)) * _large_negative(scores.dtype)
                context = tf.einsum("bhst,bthv->bshv", tf.nn.softmax(scores, axis=-1), v)
                return tf.einsum("bshv,hvo->bso", context, out_kernel)
            return fn

        parts = [
            on_device(d, shard(q, k, v, o), query, key, value)
            for d, q, k, v, o in zip(self.devices, self.query, self.key, self.value, self.output_kernels)
        ]
        return tf.add_n(parts) + self.output_bias

    def compute_output_shape(self, query_shape, value_shape=None, key_shape=None):
        return tuple(query_shape)

    def get_config(self):
        return {**super().get_config(), "num_heads": self.num_heads, "key_dim": self.key_dim,
                "value_dim": self.value_dim, "kernel_initializer": self.kernel_initializer}


def _attention_mask(query, value, attention_mask, use_causal_mask):
    """A (batch, query, key) boolean mask, as MultiHeadAttention combines them; None for none."""
    mask = None if attention_mask is None else tf.cast(attention_mask, tf.bool)
    if use_causal_mask:
        s, t = tf.shape(query)[1], tf.shape(value)[1]
        causal = tf.linalg.band_part(tf.ones((1, s, t), tf.bool), -1, 0)
        mask = causal if mask is None else tf.logical_and(mask, causal)
    return mask


def _large_negative(dtype):
    return -1e9 if dtype in (tf.float32, tf.float64) else -3e4  # float16 cannot hold -1e9


def _whole_shape(shards, axis) -> tuple:
    shape = list(shards[0].shape)
    if axis is not None:
        shape[axis] = sum(s.shape[axis] for s in shards)
    return tuple(shape)

