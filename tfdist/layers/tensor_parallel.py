"""Tensor-parallel Keras layers: Keras's own layers, which say how Megatron-LM splits them.

They hold no split of their own. A strategy with a model axis splits them by
a layout (`tfdist.parallel.layout.Layout(megatron=True)`, what
`tensor_parallel_size` means for `TensorParallelStrategy` and
`PipelineStrategy`): `ParallelMultiHeadAttention` is a
`keras.layers.MultiHeadAttention`, split on its heads like any other;
`ColumnParallelDense` and `RowParallelDense` are `Dense` layers whose kernel
splits on its columns (outputs gathered, or kept split for the row layer that
consumes them) or on its rows (partial products summed); `ParallelMLP` is a
column then a row `Dense`, one sum per block. Under any other strategy they
are the plain layers, so their weights, saved files and checkpoints are those
of `Dense` and `MultiHeadAttention`.

Example:

    >>> layer = ParallelMLP(hidden_units=8)
    >>> layer(keras.ops.ones((2, 4))).shape
    TensorShape([2, 4])
"""

from __future__ import annotations

from typing import Optional

import keras

__all__ = ["ColumnParallelDense", "ParallelMLP", "ParallelMultiHeadAttention", "RowParallelDense"]


@keras.saving.register_keras_serializable(package="tfdist")
class ColumnParallelDense(keras.layers.Dense):
    """`Dense` whose output columns split over the model axis (its kernel's axis 1, and its bias)."""

    megatron_split = {"kernel": 1, "bias": 0}


@keras.saving.register_keras_serializable(package="tfdist")
class RowParallelDense(keras.layers.Dense):
    """`Dense` whose input rows split over the model axis (its kernel's axis 0); the bias stays whole."""

    megatron_split = {"kernel": 0}


@keras.saving.register_keras_serializable(package="tfdist")
class ParallelMLP(keras.layers.Layer):
    """Dense(hidden_units, activation) then Dense(output_units): column- then row-split, one sum per block.

    Args:
      hidden_units: width of the hidden layer (divisible by the model axis when split).
      output_units: output width; None keeps the input width.
      activation: of the hidden layer.
      kernel_initializer: of both kernels (biases start at zero).
    """

    pairs_its_layers = True  # the hidden layer's split output goes to the output layer as it is

    def __init__(self, hidden_units: int, output_units: Optional[int] = None, activation="gelu",
                 kernel_initializer="glorot_uniform", **kwargs):
        super().__init__(**kwargs)
        self.hidden_units, self.output_units = hidden_units, output_units
        self.activation = keras.activations.get(activation)
        self.kernel_initializer = kernel_initializer
        self.hidden = ColumnParallelDense(hidden_units, activation=activation, kernel_initializer=kernel_initializer,
                                          name="hidden")
        self.output_dense = None  # its width is the input's, known at build

    def build(self, input_shape):
        self.output_dense = RowParallelDense(self.output_units or input_shape[-1],
                                             kernel_initializer=self.kernel_initializer, name="output")
        self.hidden.build(input_shape)
        self.output_dense.build((*input_shape[:-1], self.hidden_units))

    def call(self, inputs):
        return self.output_dense(self.hidden(inputs))

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], self.output_units or input_shape[-1])

    def get_config(self):
        return {**super().get_config(), "hidden_units": self.hidden_units, "output_units": self.output_units,
                "activation": keras.activations.serialize(self.activation),
                "kernel_initializer": self.kernel_initializer}


@keras.saving.register_keras_serializable(package="tfdist")
class ParallelMultiHeadAttention(keras.layers.MultiHeadAttention):
    """`keras.layers.MultiHeadAttention`, which a model axis splits on its heads (divisible by it)."""
