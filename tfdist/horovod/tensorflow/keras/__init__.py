"""The `horovod.tensorflow.keras` surface, working on Keras 3.

Horovod's own Keras layer fails on Keras 3 at the first `fit` (`'Variable'
object has no attribute 'ref'`): it hands Keras variables to TensorFlow
functions that expect `tf.Variable`s. This module offers what Horovod Keras
scripts use, built on Horovod's collective ops on tensors (which do work), so
such a script runs on Keras 3 by changing only its import line:

    import horovod.tensorflow.keras as hvd   # before
    import tfdist.horovod.tensorflow.keras as hvd   # after (tfdist.horovod_keras, deprecated, is the same module)

The process-level functions (`init`, `size`, `rank`, `allreduce`, ...) are
Horovod's own. `DistributedOptimizer` wraps a Keras 3 optimizer (as Keras's
LossScaleOptimizer does) and all-reduces the gradients before the wrapped
optimizer applies them; the callbacks are in `callbacks` (and re-exported here).
For new code, prefer `tfdist.HorovodStrategy`, which needs no wrapper or callback.

Example (under `horovodrun -np 2 -H localhost:2 --gloo python train.py`):

    >>> import tfdist.horovod.tensorflow.keras as hvd  # doctest: +SKIP
    >>> hvd.init()  # doctest: +SKIP
    >>> opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.001 * hvd.size()))  # doctest: +SKIP
    >>> model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")  # doctest: +SKIP
    >>> model.fit(dataset, steps_per_epoch=500 // hvd.size(),  # doctest: +SKIP
    ...           callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
"""

from tfdist import _compat

_hvd = _compat.horovod()  # one clear line when Horovod is missing

# Horovod's own process-level API (it works on Keras 3: it never sees a Keras variable).
from horovod.tensorflow import (  # noqa: E402
    Average,
    Compression,
    Sum,
    allgather,
    broadcast,
    init,
    is_initialized,
    join,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)

from tfdist.horovod.tensorflow.keras import callbacks, elastic  # noqa: E402
from tfdist.horovod.tensorflow.keras.callbacks import (  # noqa: E402
    BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
)
from tfdist.horovod.tensorflow.keras.optimizer import DistributedOptimizer, load_model  # noqa: E402


def allreduce(value, name=None, op=None, compression=Compression.none):
    """All-reduces a tensor-compatible value (average by default), as Horovod Keras does."""
    return _hvd.allreduce(_hvd_tensor(value), name=name, op=Average if op is None else op,
                          compression=compression)


def _hvd_tensor(value):
    import tensorflow as tf

    return tf.convert_to_tensor(getattr(value, "value", value))


__all__ = [
    "Average",
    "BroadcastGlobalVariablesCallback",
    "Compression",
    "DistributedOptimizer",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
    "Sum",
    "allgather",
    "allreduce",
    "broadcast",
    "callbacks",
    "elastic",
    "init",
    "is_initialized",
    "join",
    "load_model",
    "local_rank",
    "local_size",
    "rank",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
]
