"""`DistributedOptimizer` for custom loops: a Keras 3 optimizer's gradients all-reduced before it applies them."""

from __future__ import annotations

__all__ = ["DistributedOptimizer"]


def DistributedOptimizer(optimizer, *args, **kwargs):
    """For a Keras 3 optimizer, `apply_gradients` all-reduces the gradients first
    (`tfdist.horovod.tensorflow.keras.DistributedOptimizer`, same arguments as Horovod's);
    a `tf.compat.v1.train.Optimizer` gets Horovod's own wrapper."""
    import keras

    if isinstance(optimizer, keras.optimizers.Optimizer):
        from tfdist.horovod.tensorflow.keras.optimizer import DistributedOptimizer as KerasDistributedOptimizer

        return KerasDistributedOptimizer(optimizer, *args, **kwargs)
    import horovod.tensorflow as hvd

    return hvd.DistributedOptimizer(optimizer, *args, **kwargs)
