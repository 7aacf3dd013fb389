"""Training steps whose replicas hold unequal parts of a batch, weighted as one device would.

A batch that does not divide over the replicas (Keras's last, partial batch
of an epoch: 5 examples over 2 replicas are 3 and 2) is split unevenly. Keras
averages each replica's loss over its own examples and then weights every
replica alike (1 / replicas), so such a step's gradient is not the batch's
mean gradient and training drifts from one device's. Here each replica's
gradients are weighted by `replicas x its examples / the step's examples` (one
scalar all-reduce per step), which makes the all-reduced gradient the mean
over the whole batch, as on one device; a replica with no examples weighs 0.
Steps whose batch size is fixed when traced (tfdist's own input pipeline drops
the remainder) divide evenly and are left as they are, at no cost.
Keras's loss and metric trackers already weight each replica by its examples.

Example:

    >>> strategy.run(weighted_by_batch_share(model.train_step), args=(batch,))
"""

from __future__ import annotations

import functools

import tensorflow as tf

from tfdist import _compat

__all__ = ["weighted_by_batch_share"]


def weighted_by_batch_share(train_step):
    """`train_step` (a replica function of one batch) with its gradients weighted by the replica's share.

    `functools.wraps` keeps `__wrapped__`, so a strategy that recognises the
    step it is handed (the pipeline's) can still find it.
    """

    @tf.autograph.experimental.do_not_convert  # a train_step runs unconverted, as under Keras's own step
    @functools.wraps(train_step)
    def replica_step(data):
        context = tf.distribute.get_replica_context()
        first = next(t for t in tf.nest.flatten(data) if t is not None)
        if context is None or context.num_replicas_in_sync == 1 or first.shape[0] is not None:
            return train_step(data)
        examples = tf.cast(tf.shape(first)[0], tf.float32)
        total = context.all_reduce(tf.distribute.ReduceOp.SUM, examples)
        weight = tf.math.divide_no_nan(examples * context.num_replicas_in_sync, total)
        with _compat.gradient_weight(weight):
            return train_step(data)

    return replica_step
