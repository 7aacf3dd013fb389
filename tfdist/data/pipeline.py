"""tf.data pipelines for training and validation from in-memory arrays.

Training data repeats forever and drops the remainder batch, so every step has a
full global batch (every replica gets the same share) and `steps_per_epoch`
decides where epochs end. Validation keeps every example. In-memory data has
no files to shard, so multi-worker strategies shard it by element (DATA).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

__all__ = ["steps_per_epoch", "training_dataset", "validation_dataset"]


def _from_arrays(x: np.ndarray, y: np.ndarray) -> tf.data.Dataset:
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return tf.data.Dataset.from_tensor_slices((x, y)).with_options(options)


def training_dataset(x: np.ndarray, y: np.ndarray, global_batch_size: int, *, seed: int):
    """Shuffled, repeated, full global batches, prefetched."""
    ds = _from_arrays(x, y).shuffle(len(x), seed=seed, reshuffle_each_iteration=True).repeat()
    return ds.batch(global_batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


def validation_dataset(x: np.ndarray, y: np.ndarray, global_batch_size: int):
    """Every validation example once, in global batches."""
    return _from_arrays(x, y).batch(global_batch_size).prefetch(tf.data.AUTOTUNE)


def steps_per_epoch(num_examples: int, global_batch_size: int) -> int:
    """Full global batches in one pass over the data (at least one)."""
    return max(1, num_examples // global_batch_size)
