"""The `horovod.tensorflow` surface (custom training loops) on Keras 3.

    import horovod.tensorflow as hvd          # before
    import tfdist.horovod.tensorflow as hvd   # after

What Horovod's own module does on tensors is Horovod's own here (`init`,
`size`, `rank`, `allreduce`, `grouped_allreduce`, `allgather`, `broadcast`,
`alltoall`, `join`, process sets, timelines). What it does to variables takes
Keras 3 variables too: `DistributedGradientTape`,
`PartialDistributedGradientTape`, `broadcast_variables`, and
`DistributedOptimizer` for a Keras 3 optimizer (a `tf.compat.v1` optimizer
goes to Horovod's own). `tfdist.horovod.tensorflow.keras` is the
`horovod.tensorflow.keras` surface.

Example (under `horovodrun -np 2 -H localhost:2 --gloo python train.py`):

    >>> import tfdist.horovod.tensorflow as hvd  # doctest: +SKIP
    >>> hvd.init()  # doctest: +SKIP
    >>> with tf.GradientTape() as tape:  # doctest: +SKIP
    ...     loss = loss_fn(y, model(x, training=True))
    >>> tape = hvd.DistributedGradientTape(tape)  # doctest: +SKIP
    >>> grads = tape.gradient(loss, model.trainable_variables)  # doctest: +SKIP
    >>> optimizer.apply_gradients(zip(grads, model.trainable_variables))  # doctest: +SKIP
    >>> hvd.broadcast_variables(model.variables, root_rank=0)  # doctest: +SKIP
    >>> hvd.broadcast_variables(optimizer.variables, root_rank=0)  # a property in Keras 3  # doctest: +SKIP
"""

from tfdist import _compat

_compat.horovod()  # one clear line when Horovod is missing

# Horovod's own: these take and return tensors, which Keras 3 does not change.
from horovod.tensorflow import (  # noqa: E402
    Adasum,
    Average,
    Compression,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    allgather,
    allgather_object,
    allreduce,
    alltoall,
    broadcast,
    broadcast_object,
    cross_rank,
    cross_size,
    gloo_enabled,
    global_process_set,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    init,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_enabled,
    rank,
    reducescatter,
    remove_process_set,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)

from tfdist.horovod.tensorflow import elastic  # noqa: E402
from tfdist.horovod.tensorflow.optimizer import DistributedOptimizer  # noqa: E402
from tfdist.horovod.tensorflow.tape import DistributedGradientTape, PartialDistributedGradientTape  # noqa: E402
from tfdist.horovod.tensorflow.variables import broadcast_variables  # noqa: E402

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "Max",
    "Min",
    "PartialDistributedGradientTape",
    "ProcessSet",
    "Product",
    "Sum",
    "add_process_set",
    "allgather",
    "allgather_object",
    "allreduce",
    "alltoall",
    "broadcast",
    "broadcast_object",
    "broadcast_variables",
    "elastic",
    "cross_rank",
    "cross_size",
    "global_process_set",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_enabled",
    "rank",
    "reducescatter",
    "remove_process_set",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
]
