"""Keras layers that split their variables across devices or parameter servers."""

from tfdist.layers.sharded_embedding import ShardedEmbedding, shard_placement

__all__ = ["ShardedEmbedding", "shard_placement"]
