"""Horovod's `horovod.tensorflow.functions` on Keras 3: its object broadcasts and gathers are Horovod's own;
`broadcast_variables` takes Keras 3 variables too."""

from __future__ import annotations

from horovod.tensorflow.functions import *  # noqa: F401,F403  (Horovod's names on objects and tensors)
from horovod.tensorflow.functions import broadcast_variables as _horovod_broadcast_variables

from tfdist.horovod.tensorflow.mpi_ops import broadcast_, global_process_set  # noqa: F401  (Horovod's module has it)
from tfdist.horovod.tensorflow.variables import as_tf_variables as _as_tf_variables


def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Horovod's `broadcast_variables`, for Keras 3 variables too (`model.variables`,
    `optimizer.variables`: a property in Keras 3, not a method).

    Args:
      variables: the variables to set to `root_rank`'s values.
      root_rank: the rank whose values every rank takes.
      process_set: Horovod's process set (default: every rank).
      inplace: broadcast into the variables' memory (Horovod's option).
    """
    return _horovod_broadcast_variables(_as_tf_variables(variables), root_rank, process_set=process_set,
                                        inplace=inplace)

