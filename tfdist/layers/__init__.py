"""Keras layers that split their variables across devices or parameter servers."""

from tfdist.layers.sharded_embedding import ShardedEmbedding, shard_placement
from tfdist.layers.tensor_parallel import (
    ColumnParallelDense,
    ParallelMLP,
    ParallelMultiHeadAttention,
    RowParallelDense,
)

__all__ = [
    "ColumnParallelDense",
    "ParallelMLP",
    "ParallelMultiHeadAttention",
    "RowParallelDense",
    "ShardedEmbedding",
    "shard_placement",
]
