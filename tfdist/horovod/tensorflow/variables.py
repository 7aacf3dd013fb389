"""Keras 3 variables as the `tf.Variable`s Horovod's functions expect."""

from __future__ import annotations

import keras

__all__ = ["as_tf_variable", "as_tf_variables"]


def as_tf_variable(variable):
    """The `tf.Variable` behind a Keras 3 variable; anything else as it is."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def as_tf_variables(variables) -> list:
    return [as_tf_variable(v) for v in variables]
