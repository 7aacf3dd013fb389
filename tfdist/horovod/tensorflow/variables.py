"""Keras 3 variables as the `tf.Variable`s Horovod's functions expect."""

from __future__ import annotations

import keras

__all__ = ["as_tf_variable", "as_tf_variables", "broadcast_variables"]


def as_tf_variable(variable):
    """The `tf.Variable` behind a Keras 3 variable; anything else as it is."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def as_tf_variables(variables) -> list:
    return [as_tf_variable(v) for v in variables]


def broadcast_variables(variables, root_rank, process_set=None, inplace=False):
    """Horovod's `broadcast_variables`, for Keras 3 variables too (`model.variables`,
    `optimizer.variables`: a property in Keras 3, not a method).

    Args:
      variables: the variables to set to `root_rank`'s values.
      root_rank: the rank whose values every rank takes.
      process_set: Horovod's process set (default: every rank).
      inplace: broadcast into the variables' memory (Horovod's option).
    """
    from horovod.tensorflow import broadcast_variables as horovod_broadcast, global_process_set

    return horovod_broadcast(as_tf_variables(variables), root_rank,
                             process_set=process_set or global_process_set, inplace=inplace)
