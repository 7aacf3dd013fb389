"""Weights split over a data-parallel job's replicas (ZeRO stage 3, FSDP's full sharding).

At `shard_optimizer: 3` each of the N replicas holds 1/N of every large
trainable variable: the variable is flattened, padded to a multiple of N and
cut into N slices, the way stages 1 and 2 cut the optimizer state
(`optimizer_shards`), and replica r keeps slice r only. The Keras variable
stays, with its path and whole shape; what backs it becomes a `ShardedWeight`:

- in a replica, a read all-gathers the slices into the whole value, and the
  gradient of that read reduce-scatters: each replica receives the sum over
  the replicas of its own slice's gradient, and the optimizer updates the
  slice where it lies, with no all-gather after the update;
- in the optimizer's update on a device, the variable is that device's slice;
- everywhere else (`get_weights`, `model.save`, a `tf.train.Checkpoint`) it
  reads and writes the whole value, so what is saved is the unsplit model's.

A read gathers. Within a layer's call (`gathered_once`) each weight is
gathered once, however often the layer reads it. When the gathered weights
are made and freed is the layers' business (`recompute`): at stage 3 each
layer that owns split weights gathers them for its forward pass in the layers'
order and again for its backward pass, instead of keeping them in between.

Over a data x model mesh (a layout, `MeshSlices`) the slices are of each
replica's own value, its shard of a variable the layout splits: the replicas
of a column (those holding the same shard) share them, and a read in a
replica gathers the shard the layout computes with.

Keras's gradient accumulator of a split weight (`gradient_accumulation_steps`)
is split with it: a `ShardedWeight` that does not gather, each replica
reading and adding to its own slice, and whole outside the step.

Variables with fewer elements than `keep_whole_below` stay whole on every
replica (DeepSpeed's `stage3_param_persistence_threshold`): biases and norms
are cheap to keep and costly to gather one by one.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Optional

import numpy as np
import tensorflow as tf
from tfdist._compat.tf_distribute import distribute_lib, values

from tfdist import _compat
from tfdist.parallel import split_variables

__all__ = ["KEEP_WHOLE_BELOW", "ShardedWeight", "assign_slices", "contribution", "gathered_once", "hold_in",
           "is_sharded", "joined", "local_index", "own_shape", "shard_weight", "split_weights_of",
           "unshard_weight"]

# DeepSpeed's default `stage3_param_persistence_threshold` (elements).
KEEP_WHOLE_BELOW = 100_000


class ShardedWeight(values.MirroredVariable):
    """A MirroredVariable whose component on each device is that device's flat slice of the whole value.

    Args:
      strategy: the strategy whose replicas hold the components.
      components: this process's slices, one per device, in the order of the collectives' devices.
      shape: the whole variable's shape.
      collectives: how the replicas gather and reduce-scatter the slices (`DeviceCollectives` or Horovod's).
      gathers: False for state that is split as the weights are (a gradient accumulator): a replica reads and
        writes its own slice.
      split_axis: over a data x model mesh, the axis a layout splits the variable along: a replica's own
        value, which its column's slices make, is its shard (None: the whole).
    """

    gradient_reduced = True  # a replica's gradient of it is its slice's, summed over the replicas

    def __init__(self, strategy, components, shape, collectives, gathers=True, split_axis=None):
        super().__init__(strategy, components, aggregation=tf.VariableAggregation.NONE)
        self.whole_shape, self.collectives, self.gathers = tf.TensorShape(shape), collectives, gathers
        # A variable a layout splits along `split_axis` over a mesh's model axis: each replica's own value, which
        # its slices make, is its shard.
        self.split_axis = split_axis
        self.own_shape = own_shape(self.whole_shape, split_axis, getattr(collectives, "model", 1))

    # Where a read happens decides what it reads.
    def value(self):
        if _in_update() or (not self.gathers and _in_replica(self)):
            return super().value()
        return self._gathered() if _in_replica(self) else self._whole()

    def read_value(self):
        return tf.identity(self.value())

    def _dense_var_to_tensor(self, dtype=None, name=None, as_ref=False):
        if _in_update():
            return super()._dense_var_to_tensor(dtype, name, as_ref)
        return tf.convert_to_tensor(self.value(), dtype=dtype, name=name)

    def numpy(self):
        return self._whole().numpy()

    def __array__(self, dtype=None, copy=None):  # what Keras saves (`np.array(variable)`)
        return np.asarray(self.numpy(), dtype=dtype)

    def _whole(self) -> tf.Tensor:
        return joined([component.read_value() for component in self.values], self.whole_shape, self.collectives,
                      self.split_axis)

    def _gathered(self) -> tf.Tensor:
        """This replica's read: gathered once in a layer's call (`gathered_once`), else at each read."""
        cache = _ONCE.gathered
        if cache is not None and id(self) in cache:
            return cache[id(self)][1]
        whole = self.gather(self.local_slice())
        if cache is not None:
            cache[id(self)] = (self, whole)  # holds the variable, so that its id is not reused
        return whole

    def local_slice(self) -> tf.Tensor:
        """This replica's slice, read (a tape records the read: the slice's gradient is the variable's)."""
        piece = self.values[self._local_index()]
        with tf.device(piece.device):
            return piece.read_value()

    def gather(self, local: tf.Tensor) -> tf.Tensor:
        """The whole value from this replica's slice `local`: the slices all-gathered; the gradient,
        reduce-scattered into the slice's (weighted first by this replica's share of a short batch)."""
        collectives, d = self.collectives, self._local_index()
        size, length = self.own_shape.num_elements(), local.shape[0]

        @tf.custom_gradient
        def gather(local):
            whole = tf.reshape(collectives.all_gather(d, local)[:size], self.own_shape)

            def reduce_scatter(upstream, variables=None):
                with tf.device(self.values[d].device):  # among the devices that hold the slices
                    upstream = tf.convert_to_tensor(upstream)  # the slices are reduced dense, a row gradient too
                    upstream = contribution(collectives, d, _compat.weighted_by_batch_share([upstream])[0],
                                            self.split_axis)
                    flat = tf.reshape(upstream, [-1])
                    padded = tf.pad(flat, [[0, length * collectives.parts - size]])
                mine = collectives.reduce_scatter(d, padded)
                # Under a recomputing tape TensorFlow also counts the collectives' ordering tokens as variables.
                return (mine, [None] * len(variables)) if variables is not None else mine
            return whole, reduce_scatter

        with tf.device(self.values[d].device):
            return gather(local)

    def _local_index(self) -> int:
        return local_index(self.collectives)

    def assign(self, value, use_locking=False, name=None, read_value=True):
        if _in_update():
            return super().assign(value, use_locking, name, read_value)
        if not self.gathers and _in_replica(self):
            return self._own_slice().assign(value, use_locking, name, read_value)
        if _in_replica(self):
            raise ValueError(f"Variable {self.name!r} is split over the replicas (shard_optimizer 3): a replica "
                             "cannot assign its whole value. Assign it outside the step.")
        assign_slices(self.values, tf.convert_to_tensor(value, self.dtype), self.collectives, self.split_axis,
                      use_locking=use_locking)
        return self._whole() if read_value else None

    def assign_add(self, delta, use_locking=False, name=None, read_value=True):
        if not self.gathers and _in_replica(self) and not _in_update():
            return self._own_slice().assign_add(delta, use_locking, name, read_value)
        return super().assign_add(delta, use_locking, name, read_value)

    def _own_slice(self):
        """The slice of state a replica writes outside an update (Horovod's: its process's one)."""
        return self.values[0] if len(self.values) == 1 else self.values[self._local_index()]

    # A checkpoint holds the whole value, as one device's would.
    def _serialize_to_tensors(self):
        return {"VARIABLE_VALUE": self._whole()}

    def _restore_from_tensors(self, restored_tensors):
        return self.assign(restored_tensors["VARIABLE_VALUE"])


class _Once(threading.local):
    """The split weights gathered in the layer call this thread runs, if one runs in `gathered_once`."""

    def __init__(self):
        self.gathered: Optional[dict] = None


_ONCE = _Once()


@contextlib.contextmanager
def gathered_once(given=()):
    """Within: each split weight a replica reads is gathered at its first read only (a Keras layer reads its
    kernel more than once), or is the value `given` for it ((ShardedWeight, whole tensor) pairs)."""
    outer, _ONCE.gathered = _ONCE.gathered, {id(weight): (weight, whole) for weight, whole in given}
    try:
        yield
    finally:
        _ONCE.gathered = outer


def shard_weight(variable, strategy, collectives, slices: list) -> None:
    """Makes the built Keras `variable` held as `slices` (this process's Keras variables, one per device
    of `collectives`, each as long as the whole's slice) filled with its value, in place."""
    with tf.init_scope():  # eager, also when called as a step is traced
        assign_slices(slices, tf.convert_to_tensor(variable.numpy()), collectives, split_variables.split_axis(variable))
        hold_in(variable, strategy, collectives, slices)


def hold_in(variable, strategy, collectives, slices: list, gathers=True) -> None:
    """Makes the Keras `variable` held by `slices` as they are (made again elsewhere, with their values);
    `gathers`: as `ShardedWeight`'s."""
    _compat.replace_variable_value(variable, ShardedWeight(strategy, [piece.value for piece in slices], variable.shape,
                                                           collectives, gathers, split_variables.split_axis(variable)))


def unshard_weight(variable) -> None:
    """Makes the Keras `variable`, held by slices, held as before they were made: whole on every replica, or over
    a mesh the layout's shards (`split_variables.split`), in place."""
    held = _compat.backing_value(variable)
    with tf.init_scope(), held.distribute_strategy.scope():
        _compat.replace_variable_value(variable, tf.Variable(held.numpy(), trainable=variable.trainable,
                                                             name=variable.name))
    if held.split_axis is not None:
        split_variables.split(variable, held.split_axis, held.distribute_strategy, held.collectives.model)


def own_shape(shape, split_axis, model: int) -> tf.TensorShape:
    """The shape of each replica's own value of a variable of `shape`: over a mesh's model axis of `model`
    devices, its shard along `split_axis`; else the whole."""
    shape = tf.TensorShape(shape)
    if split_axis is None or model == 1:
        return shape
    dims = shape.as_list()
    dims[split_axis] //= model
    return tf.TensorShape(dims)


def contribution(collectives, d, gradient, split_axis):
    """What local replica d adds to its column's sum of a gradient: the gradient itself, or over a mesh what
    the collectives say (`own_gradient`)."""
    own = getattr(collectives, "own_gradient", None)
    return gradient if own is None else own(d, gradient, split_axis)


def local_index(collectives) -> int:
    """The position, among `collectives.devices`, of the replica whose step is being traced."""
    find = getattr(collectives, "local_index", None)
    return find() if find is not None else collectives.ranks.index(_compat.replica_index())


def is_sharded(variable) -> bool:
    """Whether the Keras `variable` (or the backend variable) is split over the replicas."""
    return isinstance(_compat.backing_value(variable), ShardedWeight)


def split_weights_of(layer) -> list:
    """The `ShardedWeight`s behind the variables of `layer` and of the layers inside it, each once."""
    return list({id(held): held for held in map(_compat.backing_value, layer.variables)
                 if isinstance(held, ShardedWeight)}.values())


def joined(values, shape, collectives, split_axis=None) -> tf.Tensor:
    """The whole value of `shape` from this process's slices of it (`values`, one per device of `collectives`):
    every process's slices gathered (a collective when there are several), the padding dropped. Over a mesh
    (`collectives.model` devices a row) each column's slices make that column's own value: the shard of a
    variable a layout splits along `split_axis`, joined along it; else the whole."""
    shape, model = tf.TensorShape(shape), getattr(collectives, "model", 1)
    if model == 1:
        return tf.reshape(collectives.gather_pieces(list(values))[:shape.num_elements()], shape)
    own = own_shape(shape, split_axis, model)
    columns = [tf.reshape(column[:own.num_elements()], own) for column in collectives.gather_columns(list(values))]
    return columns[0] if split_axis is None else tf.concat(columns, split_axis)


def assign_slices(pieces, value: tf.Tensor, collectives, split_axis=None, **assign_options) -> list:
    """Cuts each replica's own value of `value` (over a mesh, its shard along `split_axis`; else the whole)
    flat, padded to a multiple of the slices, and assigns each of this process's `pieces` (variables, one
    per device of `collectives`) the slice at its rank; returns the assignments."""
    length, model = pieces[0].shape[0], getattr(collectives, "model", 1)
    owns = tf.split(value, model, split_axis) if split_axis is not None and model > 1 else [value]
    flats = [tf.pad(tf.reshape(own, [-1]), [[0, length * collectives.parts - math.prod(own.shape)]]) for own in owns]
    return [piece.assign(flats[r % len(flats)][rank * length:(rank + 1) * length], **assign_options)
            for r, (rank, piece) in enumerate(zip(collectives.ranks, pieces))]


def _in_update() -> bool:
    return distribute_lib.get_update_replica_id() is not None


def _in_replica(variable) -> bool:
    with distribute_lib.enter_or_assert_strategy(variable.distribute_strategy):
        return not distribute_lib.in_cross_replica_context()
