"""Horovod's `DistributedGradientTape` and `PartialDistributedGradientTape` on Keras 3 variables.

Horovod's tape keys gradients by `variable.ref()`, which a Keras 3 variable
does not have. The tape here is Horovod's own (same all-reduce, compression,
grouping, local sources), handed the `tf.Variable` behind each Keras variable;
the gradients come back in the structure of the sources the caller gave.
"""

from __future__ import annotations

import tensorflow as tf

from tfdist.horovod.tensorflow.variables import as_tf_variable, as_tf_variables

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape"]


class _KerasVariablesTape:
    """Horovod's distributed tape, given Keras 3 variables as the `tf.Variable`s behind them."""

    def __init__(self, tape):
        self._tape = tape

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def __getattr__(self, name):  # watch, reset, stop_recording, ...: Horovod's tape (a tf.GradientTape)
        return getattr(self._tape, name)

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False):
        """Gradients of `target` for `sources` (any nest of variables), all-reduced over the ranks."""
        flat = tf.nest.flatten(sources)
        grads = self._tape.gradient(target, as_tf_variables(flat), output_gradients, use_generic_names)
        return tf.nest.pack_sequence_as(sources, grads)

    def register_local_source(self, source):
        """A variable whose gradient stays this rank's own (not all-reduced; scaled as Horovod does)."""
        self._tape.register_local_source(as_tf_variable(source))

    def get_local_and_global_gradients(self, target, sources, output_gradients=None, use_generic_names=False):
        """(local, global) lists of (source, gradient) pairs, with the caller's source objects."""
        flat = tf.nest.flatten(sources)
        local, global_ = self._tape.get_local_and_global_gradients(
            target, as_tf_variables(flat), output_gradients, use_generic_names)
        original = {id(as_tf_variable(s)): s for s in flat}
        return [(original[id(s)], g) for s, g in local], [(original[id(s)], g) for s, g in global_]


def DistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=None, sparse_as_dense=False,
                            op=None, gradient_predivide_factor=1.0, num_groups=0, groups=None, process_set=None,
                            scale_local_gradients=True):
    """Horovod's `DistributedGradientTape` (same arguments), for Keras 3 variables.

    `groups` may name Keras variables. Horovod's defaults apply to the
    arguments left at None (`Compression.none`, `Average`, the global process set).
    """
    import horovod.tensorflow as hvd

    tape = hvd.DistributedGradientTape(
        gradtape, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression or hvd.Compression.none, sparse_as_dense=sparse_as_dense,
        op=hvd.Average if op is None else op, gradient_predivide_factor=gradient_predivide_factor,
        num_groups=num_groups, groups=_tf_groups(groups), process_set=process_set or hvd.global_process_set,
        scale_local_gradients=scale_local_gradients,
    )
    return _KerasVariablesTape(tape)


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=None,
                                   sparse_as_dense=False, op=None, gradient_predivide_factor=1.0, num_groups=0,
                                   groups=None, process_set=None, local_layers=None, scale_local_gradients=True):
    """`DistributedGradientTape` whose `local_layers` (a Keras layer or a list of them) keep their own
    gradients: those are not all-reduced (Horovod's `PartialDistributedGradientTape`)."""
    import keras

    layers = [] if local_layers is None else [local_layers] if isinstance(local_layers, keras.layers.Layer) \
        else list(local_layers)
    if not all(isinstance(layer, keras.layers.Layer) for layer in layers):
        raise ValueError(f"`local_layers` must be Keras layers. Received: {local_layers!r}")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients)
    for layer in layers:
        for variable in layer.trainable_weights:
            tape.register_local_source(variable)
    return tape


def _tf_groups(groups):
    """Horovod's `groups`: a number, or lists of variables (Keras ones as their `tf.Variable`s)."""
    if groups is None or isinstance(groups, int):
        return groups
    return [as_tf_variables(group) for group in groups]
