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
from horovod.common.util import is_version_greater_equal_than  # noqa: E402,F401  (Horovod's module has it)
from horovod.tensorflow import (  # noqa: E402
    Average,
    Sum,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from horovod.tensorflow.mpi_ops import ProcessSet, add_process_set, global_process_set, remove_process_set  # noqa: E402

from tfdist.horovod.tensorflow.compression import Compression  # noqa: E402
from tfdist.horovod.tensorflow import broadcast_global_variables  # noqa: E402
from tfdist.horovod.tensorflow.keras import callbacks, elastic  # noqa: E402
from tfdist.horovod.tensorflow.keras.callbacks import (  # noqa: E402
    BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
)
from tfdist.horovod.tensorflow.keras.optimizer import DistributedOptimizer, load_model  # noqa: E402


# Horovod Keras's collectives take a tensor-compatible value (a number, an array, a Keras 3 variable) where
# horovod.tensorflow's take a tensor; each returns a tensor.
def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none):
    """All-reduces a tensor-compatible value (average by default), as Horovod Keras does."""
    return _hvd.allreduce(_hvd_tensor(value), name=name, average=average, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, op=Average if op is None and average is None else op,
                          compression=compression)


def allgather(value, name=None):
    """Concatenates every rank's tensor-compatible value along the first dimension, as Horovod Keras does."""
    return _hvd.allgather(_hvd_tensor(value), name=name)


def broadcast(value, root_rank, name=None):
    """`root_rank`'s tensor-compatible value on every rank, as Horovod Keras does."""
    return _hvd.broadcast(_hvd_tensor(value), root_rank, name=name)


def reducescatter(value, name=None, op=Average):
    """Reduces a tensor-compatible value (average by default) and gives each rank its slice of the first
    dimension, as Horovod Keras does."""
    return _hvd.reducescatter(_hvd_tensor(value), name=name, op=op)


def _hvd_tensor(value):
    import tensorflow as tf

    from tfdist.horovod.tensorflow.variables import as_tf_variable

    return tf.convert_to_tensor(as_tf_variable(value))


# Every public name of Horovod 0.28.1's `horovod.tensorflow.keras` (tests/horovod/test_port_names.py compares them),
# and its callbacks (docs/api.md says why).
__all__ = [
    "Average", "BroadcastGlobalVariablesCallback", "Compression", "DistributedOptimizer",
    "LearningRateScheduleCallback", "LearningRateWarmupCallback", "MetricAverageCallback", "ProcessSet", "Sum",
    "add_process_set", "allgather", "allreduce", "broadcast", "broadcast_global_variables", "callbacks",
    "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "elastic", "global_process_set",
    "gloo_built", "gloo_enabled", "init", "is_initialized", "is_version_greater_equal_than", "join", "load_model",
    "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank",
    "reducescatter", "remove_process_set", "rocm_built", "shutdown", "size", "start_timeline", "stop_timeline",
]
