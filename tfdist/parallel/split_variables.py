"""A Keras variable split over a strategy's replicas: each replica's device holds one shard.

`split(variable, axis, strategy, shards)` cuts a built Keras variable's value
along `axis` into `shards` shards over the replicas of a MirroredStrategy
(replica `r` holds shard `r % shards`: a data x model mesh, data-major, holds
one whole copy per row) and keeps the Keras
variable, its path and its whole shape: only what it holds changes, to a
`SplitVariable`. In a replica (and in the optimizer's update on a device) the
variable reads as that device's shard. Everywhere else it is the whole
variable: `get_weights`, `set_weights`, `model.save`, `load_weights` and a
`tf.train.Checkpoint` read and write the unsplit value, so a model trained
split saves in the unchanged model's layout and loads on one device, and the
reverse.

Example:

    >>> strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    >>> with strategy.scope():
    ...     kernel = keras.Variable(np.arange(8.0).reshape(2, 4))
    >>> split(kernel, 1, strategy, shards=2)
    >>> kernel.numpy().shape, [s.shape for s in shards(kernel)]
    ((2, 4), [TensorShape([2, 2]), TensorShape([2, 2])])
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tfdist._compat.tf_distribute import distribute_lib, values

from tfdist import _compat

__all__ = ["SplitVariable", "is_split", "shards", "split", "split_axis"]


class SplitVariable(values.MirroredVariable):
    """A MirroredVariable whose components hold `shards` different shards along `axis` (component `r` shard
    `r % shards`), and which reads and writes the whole value outside a replica or a device's update."""

    def __init__(self, strategy, components, axis: int, shards: int):
        super().__init__(strategy, components, aggregation=tf.VariableAggregation.NONE)
        self.split_axis, self.shards = axis, shards

    def _get_cross_replica(self):
        return tf.concat([component.read_value() for component in self.values[:self.shards]], self.split_axis)

    def value(self):
        return self._get_cross_replica() if self._outside_replicas() else super().value()

    def _get(self):  # what converting to a tensor reads: TensorFlow's counts the default replica as replica 0
        return self._get_cross_replica() if self._outside_replicas() else super()._get()

    def __array__(self, dtype=None, copy=None):  # what Keras saves (`np.array(variable)`)
        return np.asarray(self.numpy(), dtype=dtype)

    def assign(self, value, use_locking=False, name=None, read_value=True):
        if not self._outside_replicas():
            return super().assign(value, use_locking, name, read_value)
        pieces = tf.split(tf.convert_to_tensor(value, self.dtype), self.shards, axis=self.split_axis)
        for r, component in enumerate(self.values):
            component.assign(pieces[r % self.shards], use_locking=use_locking)
        return self._get_cross_replica() if read_value else None

    def _outside_replicas(self) -> bool:
        """Neither in a replica nor in a device's update: where reads and writes are whole (outside any
        strategy's scope too, where TensorFlow counts the code as its default replica)."""
        with distribute_lib.enter_or_assert_strategy(self.distribute_strategy):
            return distribute_lib.in_cross_replica_context() and distribute_lib.get_update_replica_id() is None

    def _serialize_to_tensors(self):  # a checkpoint holds the whole value, as one device's would
        return {"VARIABLE_VALUE": self._get_cross_replica()}

    def _restore_from_tensors(self, restored_tensors):
        return self.assign(restored_tensors["VARIABLE_VALUE"])


def split(variable, axis: int, strategy: tf.distribute.Strategy, shards: int) -> None:
    """Cuts the built Keras `variable` along `axis` into `shards` shards over the replicas of `strategy`
    (replica `r` holds shard `r % shards`), in place, each on the device that holds the replica's copy now.

    Raises:
      ValueError: the axis does not divide by `shards`.
    """
    with tf.init_scope():  # eager, also when a pipeline splits its stages as its first step is traced
        whole = variable.numpy()
        if whole.shape[axis] % shards:
            raise ValueError(f"Variable {variable.path!r} of shape {whole.shape} does not split along axis {axis} "
                             f"over {shards} devices.")
        pieces = np.split(whole, shards, axis=axis)
        first = getattr(variable.value, "values", (variable.value,))[0].device  # and its counterparts (a stage's)
        with strategy.scope(), tf.device(first):
            mirrored = tf.Variable(pieces[0], trainable=variable.trainable, name=variable.name)
        for r, component in enumerate(mirrored.values):
            component.assign(pieces[r % shards])
        _compat.replace_variable_value(variable, SplitVariable(strategy, mirrored.values, axis, shards))


def is_split(variable) -> bool:
    """Whether a layout splits the Keras `variable` (held by a `SplitVariable`, or at ZeRO stage 3 by the
    slices of one, `weight_shards.ShardedWeight`)."""
    return split_axis(variable) is not None


def split_axis(variable):
    """The axis a split variable is cut along, or None for a whole one (inside a mixed-precision call too)."""
    return getattr(_compat.backing_value(variable), "split_axis", None)


def shards(variable) -> list:
    """The per-device variables of a split variable, in replica order (each shard once per data index)."""
    return list(variable.value.values)
