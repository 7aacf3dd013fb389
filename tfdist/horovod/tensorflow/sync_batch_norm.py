"""Horovod's `SyncBatchNormalization` on Keras 3: batch normalization with the moments of the global batch.

Horovod's own subclasses Keras 2's layer (its `fused` argument and `_moments` signature) and fails on Keras 3. This
one subclasses Keras 3's `BatchNormalization`: in training, each rank's sum, sum of squares and count per channel are
summed over the ranks, so every rank normalises with the mean and variance of the whole global batch, even when the
ranks' batches (or masks) differ in size. Its gradients flow through the sum, so ranks that average their gradients
train as one process with `BatchNormalization` on the global batch does.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from horovod.tensorflow.mpi_ops import Sum, rank, size  # noqa: F401  (Horovod's module has them)
import horovod.tensorflow as _hvd

__all__ = ["SyncBatchNormalization"]


@keras.saving.register_keras_serializable(package="tfdist.horovod")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """`keras.layers.BatchNormalization` whose training moments are those of every rank's batch together.

    Args:
      fused: Horovod's argument; only `False` (its default) is accepted, as in Horovod.
      **kwargs: `keras.layers.BatchNormalization`'s arguments.
    """

    def __init__(self, fused=False, **kwargs):
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        super().__init__(**kwargs)

    def _moments(self, inputs, mask):
        mean, variance = super()._moments(inputs, mask)
        if size() == 1:
            return mean, variance
        if mask is None:
            count = tf.cast(tf.size(inputs) // tf.size(mean), mean.dtype)
        else:
            count = tf.reduce_sum(tf.cast(mask, mean.dtype))
        # E[x^2] = Var[x] + E[x]^2 per rank; sums weighted by each rank's count give the global moments (a rank with
        # no examples adds 0, not its NaN moments). One collective for the three.
        counts = tf.ones_like(mean) * count
        sums = _hvd.allreduce(tf.stack([tf.math.multiply_no_nan(mean, counts),
                                        tf.math.multiply_no_nan(variance + tf.square(mean), counts), counts]), op=Sum)
        global_mean = sums[0] / sums[2]
        return global_mean, sums[1] / sums[2] - tf.square(global_mean)
