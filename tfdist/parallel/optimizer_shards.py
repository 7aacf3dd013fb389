"""The optimizer state of an in-process data-parallel job, split over its devices (ZeRO stage 1).

Under MirroredStrategy every device holds the whole optimizer state: with Adam,
two slots the size of the model on each. `shard_optimizer_state` gives each of
the N devices the state of 1/N of every variable instead (Rajbhandari et al.
2020, stage 1). Each variable is flattened, padded to a multiple of N and cut
into N slices; device d holds that slice's slots, and a variable for the
slice of the weights that Keras's update writes (filled from the weights each
step, so a change to the weights between steps is seen). A step's all-reduced gradient is applied slice by slice,
each on its own device by Keras's own update for the optimizer (the
`update_step` of a copy of it, built on that device's slices), and the updated
slices are gathered into every device's copy of the weights.

Clipping (`clipnorm`, `global_clipnorm`), weight decay with its exclusions and
loss scaling stay in the optimizer's `apply`, on the whole gradients and
weights, so they act as on one device: the tests train the same weights split
and unsplit (SGD with momentum, Adam, AdamW, RMSprop, Adagrad, and
mixed_float16 with loss scaling, on 2 and 4 devices).

This is the building block of `strategy.shard_optimizer` (issue 32), not yet
reachable from a config. Still to come: saving the split state (`model.save`
refuses it; a `tf.train.Checkpoint` of the optimizer would hold its step and
rate but not the slots), the gather as a collective, stage 2, and
multi-process jobs.

Example:

    >>> strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])  # doctest: +SKIP
    >>> with strategy.scope():  # doctest: +SKIP
    ...     model = build_model()
    ...     optimizer = keras.optimizers.Adam(1e-3)
    ...     shard_optimizer_state(optimizer, strategy)
    ...     model.compile(optimizer=optimizer, loss="mse")
"""

from __future__ import annotations

import contextlib
import math

import keras
import tensorflow as tf

from tfdist import _compat
from tfdist._compat.tf_distribute import numpy_dataset

__all__ = ["ELEMENTWISE_OPTIMIZERS", "OptimizerShards", "shard_optimizer_state"]

# Optimizers whose update of an element depends only on that element's weight, gradient and slots,
# so that updating slices equals updating the whole (each checked in the tests).
ELEMENTWISE_OPTIMIZERS = (keras.optimizers.SGD, keras.optimizers.Adam, keras.optimizers.AdamW,
                          keras.optimizers.RMSprop, keras.optimizers.Adagrad)


def shard_optimizer_state(optimizer: keras.optimizers.Optimizer, strategy: tf.distribute.Strategy) -> OptimizerShards:
    """Splits `optimizer`'s state over `strategy`'s devices; call before the optimizer is built.

    Args:
      optimizer: a Keras optimizer of `ELEMENTWISE_OPTIMIZERS`, or a
        LossScaleOptimizer around one (its inner optimizer is split).
      strategy: the in-process data-parallel strategy it trains under (one
        replica per device).

    Returns:
      The `OptimizerShards` that now build and update it.

    Raises:
      ValueError: the optimizer's update does not split element by element,
        it is already built, or it accumulates gradients or keeps an EMA (not
        checked yet).
    """
    inner = optimizer.inner_optimizer if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else optimizer
    if type(inner) not in ELEMENTWISE_OPTIMIZERS:
        names = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
        raise ValueError(f"`optimizer` must update each element on its own to be split over devices ({names}); "
                         f"{type(inner).__name__} does not or is not checked. Received: {type(inner).__name__}")
    if inner.built:
        raise ValueError("`optimizer` must not be built yet: split its state before `fit` or `build`. "
                         f"Received: a built {type(inner).__name__}")
    if inner.gradient_accumulation_steps or inner.use_ema:
        raise ValueError("`optimizer` with gradient_accumulation_steps or use_ema cannot be split over devices yet. "
                         f"Received: {type(inner).__name__}")
    return OptimizerShards(inner, strategy.extended.worker_devices)


class OptimizerShards:
    """Device d's slice of every variable (`slices[d]`) and the copy of the optimizer that holds its
    slots (`copies[d]`), once the optimizer is built."""

    def __init__(self, optimizer, devices):
        self.optimizer, self.devices = optimizer, tuple(devices)
        self.copies: list[keras.optimizers.Optimizer] = []  # one per device
        self.slices: list[list[keras.Variable]] = []  # [device][variable]: that device's slice of the weights
        optimizer.build = self.build
        optimizer.save_own_variables = self.refuse_saving
        _compat.replace_distributed_update(optimizer, self.update)

    def build(self, variables):
        _compat.build_without_slots(self.optimizer, variables)
        config = self.optimizer.get_config()
        for device in self.devices:
            with _single_device_variables(device):
                copy = type(self.optimizer).from_config(config)
                _compat.make_slots_where_created(copy)
                slices = [keras.Variable(tf.zeros([self._slice_length(v)], v.dtype), trainable=False,
                                         name=f"{v.name}_slice") for v in variables]
                copy.build(slices)
            self.copies.append(copy)
            self.slices.append(slices)

    def update(self, distribution, grads_and_vars, learning_rate):
        """Each device updates its slices with its copy's own rule (the copy's step counter, which
        Adam's bias correction reads, kept with the optimizer's); every device then gathers them."""
        for d, device in enumerate(self.devices):
            copy, slices = self.copies[d], self.slices[d]
            with tf.device(device):
                for (grad, variable), piece in zip(grads_and_vars, slices):
                    local_grad = tf.convert_to_tensor(distribution.experimental_local_results(grad)[d])
                    local_weights = distribution.experimental_local_results(variable)[d]
                    piece.assign(self._slice(local_weights, d, piece.shape[0]))
                    copy.update_step(self._slice(local_grad, d, piece.shape[0]), piece, learning_rate)
                copy.iterations.assign_add(1)
        for i, (_, variable) in enumerate(grads_and_vars):
            distribution.extended.update(variable, self._gather, args=(i,), group=False)

    def _gather(self, variable, i):
        whole = tf.concat([slices[i].value for slices in self.slices], axis=0)
        return variable.assign(tf.reshape(whole[:math.prod(variable.shape)], variable.shape))

    def _slice_length(self, variable) -> int:
        return -(-math.prod(variable.shape) // len(self.devices))

    def _slice(self, tensor, d, length):
        """Slice d of `tensor` flattened, the last padded with zeros to `length`: only the slice is
        copied, not the whole tensor once per device."""
        piece = tf.reshape(tensor, [-1])[d * length:(d + 1) * length]
        return tf.pad(piece, [[0, length - piece.shape[0]]])

    def refuse_saving(self, store):
        raise ValueError("An optimizer whose state is split over devices cannot be saved yet (issue 32): "
                         "its slots are on the devices that update them, not in the optimizer's variables.")


@contextlib.contextmanager
def _single_device_variables(device):
    """Variables created inside a strategy's scope are plain variables on `device`, not mirrored ones:
    MirroredStrategy makes one for a `colocate_with` naming a single device."""

    def on_device(next_creator, **kwargs):
        kwargs["colocate_with"] = numpy_dataset.SingleDevice(device)
        return next_creator(**kwargs)

    with tf.variable_creator_scope(on_device):
        yield
