"""`DistributedOptimizer`: a Keras 3 optimizer wrapper that all-reduces gradients with Horovod.

It wraps the user's optimizer as Keras's own LossScaleOptimizer does (no
dynamic subclass, unlike Horovod's): `apply` all-reduces the step's gradients
in groups (Horovod fuses each group), then lets the wrapped optimizer apply
them. With `backward_passes_per_step=k` the gradients of k batches are summed
locally first and all-reduced once, on every k-th batch.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops

from tfdist import _compat

__all__ = ["DistributedOptimizer", "load_model"]


@keras.saving.register_keras_serializable(package="tfdist")
class DistributedOptimizer(keras.optimizers.Optimizer):
    """Averages gradients over Horovod ranks before the wrapped optimizer applies them.

    Args:
      optimizer: the Keras 3 optimizer to wrap.
      name: optimizer name (default `Distributed<Wrapped>`).
      device_dense: accepted for compatibility; Horovod places the ops.
      device_sparse: accepted for compatibility; Horovod places the ops.
      compression: `Compression.none` or `Compression.fp16`.
      sparse_as_dense: all-reduce sparse gradients as dense tensors
        (otherwise Horovod all-gathers them).
      gradient_predivide_factor: divide gradients by this before the sum and
        by size/factor after it (op=Average only).
      op: `Average` or `Sum`.
      backward_passes_per_step: batches whose gradients are summed locally
        before one all-reduce and update.
      average_aggregated_gradients: divide the locally summed gradients by
        `backward_passes_per_step`.
      num_groups: split the gradients into this many all-reduce groups (0: one).
      groups: accepted only as None (explicit variable groups are not supported).
      process_set: only the global process set is supported.
      scale_local_gradients: accepted for compatibility (no local variables here).

    Raises:
      ValueError: unsupported `groups`/`process_set`, or a bad `op` or factor.
    """

    def __init__(self, optimizer, name=None, device_dense="", device_sparse="", compression=None,
                 sparse_as_dense=False, gradient_predivide_factor=1.0, op=None, backward_passes_per_step=1,
                 average_aggregated_gradients=False, num_groups=0, groups=None, process_set=None,
                 scale_local_gradients=True):
        hvd = _compat.horovod()
        op = hvd.Average if op is None else op
        if op not in (hvd.Average, hvd.Sum):
            raise ValueError(f"`op` must be hvd.Average or hvd.Sum. Received: {op!r}")
        if gradient_predivide_factor != 1.0 and op != hvd.Average:
            raise ValueError("`gradient_predivide_factor` needs op=hvd.Average. "
                             f"Received: {gradient_predivide_factor!r}")
        if groups is not None:
            raise ValueError(f"`groups` must be None: use num_groups. Received: {groups!r}")
        if process_set not in (None, hvd.global_process_set):
            raise ValueError(f"`process_set` must be the global process set. Received: {process_set!r}")
        if int(backward_passes_per_step) < 1:
            raise ValueError(f"`backward_passes_per_step` must be >= 1. Received: {backward_passes_per_step!r}")
        super().__init__(learning_rate=0.0, name=name or f"Distributed{type(optimizer).__name__}")
        self.inner_optimizer = optimizer
        self._hvd = hvd
        self.compression = compression or hvd.Compression.none
        self.sparse_as_dense = sparse_as_dense
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.op = op
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.average_aggregated_gradients = average_aggregated_gradients
        self.num_groups = int(num_groups)

    def build(self, var_list):
        if not self.inner_optimizer.built:  # a loaded model's optimizer already is
            self.inner_optimizer.build(var_list)
        if self.backward_passes_per_step > 1:
            self.local_step = self.add_variable((), dtype="int64", initializer="zeros", name="local_step")
            self.summed_gradients = [
                self.add_variable_from_reference(v, name="summed_gradient") for v in var_list
            ]
        super().build(var_list)

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    def apply(self, grads, trainable_variables=None):
        if not self.built:
            self.build(list(trainable_variables))
            self.built = True
        grads = list(grads)
        trainable_variables = list(trainable_variables or self._trainable_variables)
        if self.backward_passes_per_step == 1:
            self.inner_optimizer.apply(self._all_reduce(grads), trainable_variables)
            return
        k = self.backward_passes_per_step
        summed = [self.summed_gradients[self._get_variable_index(v)] for v in trainable_variables]
        for total, grad in zip(summed, grads):
            if grad is not None:
                total.assign_add(ops.convert_to_tensor(grad))
        self.local_step.assign_add(1)

        def update():
            scale = 1.0 / k if self.average_aggregated_gradients else 1.0
            local = [t.value * scale if g is not None else None for t, g in zip(summed, grads)]
            self.inner_optimizer.apply(self._all_reduce(local), trainable_variables)
            for total in summed:
                total.assign(ops.zeros_like(total))

        ops.cond(ops.equal(self.local_step % k, 0), update, lambda: None)

    def _all_reduce(self, grads: list) -> list:
        """The gradients averaged (or summed) over every rank, in `num_groups` fused groups."""
        present = [i for i, g in enumerate(grads) if g is not None]
        tensors = [grads[i] for i in present]
        if self.sparse_as_dense:
            tensors = [tf.convert_to_tensor(t) for t in tensors]
        factor = self.gradient_predivide_factor
        groups = _split(tensors, self.num_groups)
        reduced = [
            r
            for group in groups
            for r in self._hvd.grouped_allreduce(
                group, op=self.op, compression=self.compression,
                prescale_factor=1.0 / factor, postscale_factor=factor,
            )
        ]
        out = list(grads)
        for i, r in zip(present, reduced):
            out[i] = r
        return out

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def get_config(self):
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "op": "sum" if self.op == self._hvd.Sum else "average",
            "compression": "fp16" if self.compression is self._hvd.Compression.fp16 else "none",
            "sparse_as_dense": self.sparse_as_dense,
            "gradient_predivide_factor": self.gradient_predivide_factor,
            "backward_passes_per_step": self.backward_passes_per_step,
            "average_aggregated_gradients": self.average_aggregated_gradients,
            "num_groups": self.num_groups,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        hvd = _compat.horovod()
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("optimizer"), custom_objects=custom_objects)
        config["op"] = {"sum": hvd.Sum, "average": hvd.Average}[config.get("op", "average")]
        config["compression"] = {"fp16": hvd.Compression.fp16, "none": hvd.Compression.none}[
            config.get("compression", "none")
        ]
        return cls(inner, **config)


def _split(tensors: list, num_groups: int) -> list:
    if num_groups <= 1 or len(tensors) <= 1:
        return [tensors] if tensors else []
    size = -(-len(tensors) // num_groups)
    return [tensors[i:i + size] for i in range(0, len(tensors), size)]


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=None, legacy_opts=False):
    """Loads a saved Keras model with its optimizer wrapped in a DistributedOptimizer.

    Args:
      filepath: a `.keras` file.
      custom_optimizers: optimizer classes the file may name.
      custom_objects: other custom classes or functions.
      compression: the DistributedOptimizer's compression.
      legacy_opts: accepted for compatibility (Keras 3 has no legacy optimizers).
    """
    objects = dict(custom_objects or {})
    objects.update({c.__name__: c for c in custom_optimizers or []})
    model = keras.models.load_model(filepath, custom_objects=objects)
    if model.optimizer is not None and not isinstance(model.optimizer, DistributedOptimizer):
        # Keras 3 restores the optimizer's variables with the model; wrap it for training.
        model.optimizer = DistributedOptimizer(model.optimizer, compression=compression)
    return model
