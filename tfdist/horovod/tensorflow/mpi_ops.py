"""Horovod's `horovod.tensorflow.mpi_ops` on Keras 3: its collectives on tensors and its process queries, Horovod's
own, and `broadcast_`, which takes Keras 3 variables too."""

from horovod.tensorflow.mpi_ops import *  # noqa: F401,F403  (Horovod's names: they take and return tensors)
from horovod.tensorflow.mpi_ops import broadcast_ as _horovod_broadcast_, global_process_set

from tfdist.horovod.tensorflow.variables import as_tf_variables as _as_tf_variables


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Horovod's in-place broadcast: `variables` (Keras 3 variables or `tf.Variable`s) take `root_rank`'s values in
    their own memory; returns their new values."""
    return _horovod_broadcast_(_as_tf_variables(variables), root_rank, name=name, process_set=process_set)
