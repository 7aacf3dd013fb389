"""An Embedding whose table is cut into row shards, one variable each.

Under tfdist's `ParameterServerStrategy` the shards land on different
parameter servers, so a table larger than one server's memory fits, and a step
reads and updates only the rows its batch looks up (a gather on each server,
IndexedSlices gradients, scatter updates). TensorFlow would cut the variable
into a `ShardedVariable`, but a Keras 3 variable cannot hold one (its gradient
needs a single `handle`); this layer holds one Keras variable per shard instead.

The shard count comes from the strategy's partitioner (config:
`parameter_server.min_shard_bytes` and `max_shards`), else 1: outside a
parameter-server job it is a plain Embedding. Rows are split as
`tf.nn.embedding_lookup`'s "div" strategy expects (the first shards take one
extra row). The initial values and the saved weights are the whole table, so
they do not depend on the shard count: a model saved from a sharded job loads
on one device.

Example:

    >>> layer = ShardedEmbedding(10, 4, num_shards=3)
    >>> layer(keras.ops.convert_to_tensor([[1, 9]])).shape
    TensorShape([1, 2, 4])
    >>> [tuple(shard.shape) for shard in layer.shards]
    [(4, 4), (3, 4), (3, 4)]
"""

from __future__ import annotations

from typing import Optional

import keras
import numpy as np
import tensorflow as tf

from tfdist import _compat
from tfdist.contract import contract

__all__ = ["ShardedEmbedding", "shard_placement", "shard_rows"]


def shard_rows(rows: int, num_shards: int) -> list[int]:
    """Rows per shard in `tf.nn.embedding_lookup`'s "div" layout."""
    return [rows // num_shards + (1 if i < rows % num_shards else 0) for i in range(num_shards)]


@keras.saving.register_keras_serializable(package="tfdist")
class ShardedEmbedding(keras.layers.Layer):
    """`keras.layers.Embedding` with its table in `num_shards` row shards.

    Args:
      input_dim: vocabulary size (rows).
      output_dim: embedding width.
      embeddings_initializer, embeddings_regularizer, embeddings_constraint,
        mask_zero: as for `keras.layers.Embedding` (the regularizer and
        constraint apply to each shard).
      num_shards: fixed shard count; None asks the strategy in scope (its
        `shard_partitioner`), or 1 if it has none.
    """

    def __init__(self, input_dim: int, output_dim: int, embeddings_initializer="uniform",
                 embeddings_regularizer=None, embeddings_constraint=None, mask_zero: bool = False,
                 num_shards: Optional[int] = None, **kwargs):
        super().__init__(**kwargs)
        if input_dim < 1 or output_dim < 1:
            raise ValueError(f"input_dim and output_dim must be positive, got {input_dim} and {output_dim}.")
        if num_shards is not None and not 1 <= num_shards <= input_dim:
            raise ValueError(f"num_shards must be between 1 and input_dim ({input_dim}), got {num_shards}.")
        self.input_dim, self.output_dim = input_dim, output_dim
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.embeddings_regularizer = keras.regularizers.get(embeddings_regularizer)
        self.embeddings_constraint = keras.constraints.get(embeddings_constraint)
        self.mask_zero = mask_zero
        self.supports_masking = mask_zero
        self.num_shards = num_shards
        self.shards: list = []

    def build(self, input_shape=None):
        num_shards = self.num_shards or _shards_from_strategy(self.input_dim, self.output_dim, self.variable_dtype)
        # The whole table once, then each shard its rows: values independent of the shard count.
        table = keras.ops.convert_to_numpy(
            self.embeddings_initializer((self.input_dim, self.output_dim), dtype=self.variable_dtype)
        )
        # Consecutive variables go to consecutive parameter servers (round robin).
        self.shards = [
            self.add_weight(
                shape=rows.shape, initializer=keras.initializers.Constant(rows), name=f"embeddings_shard_{i}",
                regularizer=self.embeddings_regularizer, constraint=self.embeddings_constraint,
                autocast=False,  # lookups read the table's own dtype, as keras.layers.Embedding does
            )
            for i, rows in enumerate(np.split(table, np.cumsum(shard_rows(self.input_dim, num_shards))[:-1]))
        ]
        self.built = True

    @property
    def embeddings(self) -> tf.Tensor:
        """The whole table (a copy: reading it gathers every shard)."""
        return tf.concat([shard.value for shard in self.shards], axis=0)

    def call(self, inputs):
        ids = tf.cast(inputs, "int32") if inputs.dtype not in (tf.int32, tf.int64) else inputs
        outputs = tf.nn.embedding_lookup([shard.value for shard in self.shards], ids)
        return tf.cast(outputs, self.compute_dtype)

    def compute_mask(self, inputs, mask=None):
        return keras.ops.not_equal(inputs, 0) if self.mask_zero else None

    def compute_output_shape(self, input_shape):
        return (*input_shape, self.output_dim)

    def save_own_variables(self, store):
        """Saves the whole table, so the file does not depend on the shard count."""
        store["0"] = keras.ops.convert_to_numpy(self.embeddings)

    def load_own_variables(self, store):
        table = np.asarray(store["0"])
        if table.shape != (self.input_dim, self.output_dim):
            raise ValueError(
                f"{self.name}: saved table has shape {table.shape}, the layer "
                f"({self.input_dim}, {self.output_dim})."
            )
        offsets = np.cumsum([0] + [shard.shape[0] for shard in self.shards])
        for shard, start, stop in zip(self.shards, offsets[:-1], offsets[1:]):
            shard.assign(table[start:stop])

    def get_config(self):
        config = super().get_config()
        config.update(
            input_dim=self.input_dim, output_dim=self.output_dim,
            embeddings_initializer=keras.initializers.serialize(self.embeddings_initializer),
            embeddings_regularizer=keras.regularizers.serialize(self.embeddings_regularizer),
            embeddings_constraint=keras.constraints.serialize(self.embeddings_constraint),
            mask_zero=self.mask_zero, num_shards=self.num_shards,
        )
        return config


def shard_placement(model: keras.Model) -> dict[str, list[str]]:
    """The device of every shard of each `ShardedEmbedding` in `model`, by layer name."""
    return {
        layer.name: [shard.value.device for shard in layer.shards]
        for layer in _compat.nested_layers(model)
        if isinstance(layer, ShardedEmbedding)
    }


def _shards_from_strategy(rows: int, columns: int, dtype) -> int:
    partitioner = contract(tf.distribute.get_strategy()).shard_partitioner
    if partitioner is None:
        return 1
    partitions = partitioner(tf.TensorShape([rows, columns]), tf.as_dtype(dtype))
    return max(1, min(int(partitions[0]), rows))

