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

# Horovod's own, as its package module has them: these take and return tensors, or ask Horovod about the job, and
# Keras 3 does not change them.
from horovod.tensorflow import (  # noqa: E402
    LocalGradientAggregationHelper,
    allreduce,
    check_extension,
    gpu_available,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
    split_list,
)

from tfdist.horovod.tensorflow import (  # noqa: E402
    compression,
    elastic,
    functions,
    gradient_aggregation,
    gradient_aggregation_eager,
    mpi_ops,
    sync_batch_norm,
    util,
)
from tfdist.horovod.tensorflow.compression import Compression  # noqa: E402
from tfdist.horovod.tensorflow.functions import (  # noqa: E402
    allgather_object,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)
from tfdist.horovod.tensorflow.mpi_ops import (  # noqa: E402
    Adasum,
    Average,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    allgather,
    alltoall,
    broadcast,
    broadcast_,
    ccl_built,
    check_num_rank_power_of_2,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    grouped_allgather,
    handle_average_backwards_compatibility,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_rank_op,
    local_size,
    local_size_op,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    process_set_included_op,
    rank,
    rank_op,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    size_op,
    start_timeline,
    stop_timeline,
)
from tfdist.horovod.tensorflow.optimizer import DistributedOptimizer  # noqa: E402
from tfdist.horovod.tensorflow.sync_batch_norm import SyncBatchNormalization  # noqa: E402
from tfdist.horovod.tensorflow.tape import DistributedGradientTape, PartialDistributedGradientTape  # noqa: E402
from tfdist.horovod.tensorflow.util import _executing_eagerly, refs_to_vars, vars_to_refs  # noqa: E402,F401


def broadcast_global_variables(root_rank):
    """Horovod's: broadcasts `tf.compat.v1.global_variables()` in a TensorFlow 1 graph. TensorFlow 2 has none
    (eagerly or in a `tf.function`), so there it raises `RuntimeError` naming what to broadcast instead."""
    import tensorflow as tf

    if tf.compat.v1.executing_eagerly_outside_functions():
        raise RuntimeError("broadcast_global_variables: TensorFlow 2 has no global variables; broadcast the ones "
                           "you train: hvd.broadcast_variables(model.variables + optimizer.variables, root_rank), "
                           "or fit with hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank)")
    from horovod.tensorflow import broadcast_global_variables as horovod_broadcast_global_variables

    return horovod_broadcast_global_variables(root_rank)


# Every public name of Horovod 0.28.1's `horovod.tensorflow` (tests/horovod/test_port_names.py compares them).
__all__ = [
    "Adasum", "Average", "Compression", "DistributedGradientTape", "DistributedOptimizer",
    "LocalGradientAggregationHelper", "Max", "Min", "PartialDistributedGradientTape", "ProcessSet", "Product",
    "Sum", "SyncBatchNormalization", "add_process_set", "allgather", "allgather_object", "allreduce", "alltoall",
    "broadcast", "broadcast_", "broadcast_global_variables", "broadcast_object", "broadcast_object_fn",
    "broadcast_variables", "ccl_built", "check_extension", "check_num_rank_power_of_2", "compression", "cross_rank",
    "cross_size", "cuda_built", "ddl_built", "elastic", "functions", "global_process_set", "gloo_built",
    "gloo_enabled", "gpu_available", "gradient_aggregation", "gradient_aggregation_eager", "grouped_allgather",
    "grouped_allreduce", "grouped_reducescatter", "handle_average_backwards_compatibility", "init",
    "is_homogeneous", "is_initialized", "join", "local_rank", "local_rank_op", "local_size", "local_size_op",
    "mpi_built", "mpi_enabled", "mpi_ops", "mpi_threads_supported", "nccl_built", "process_set_included_op", "rank",
    "rank_op", "reducescatter", "refs_to_vars", "remove_process_set", "rocm_built", "shutdown", "size", "size_op",
    "split_list", "start_timeline", "stop_timeline", "sync_batch_norm", "util", "vars_to_refs",
]
