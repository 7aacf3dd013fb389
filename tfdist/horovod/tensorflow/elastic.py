"""Elastic Horovod (`hvd.elastic`) on Keras 3 models and optimizers.

Under `horovodrun --min-np/--max-np --host-discovery-script`, a function
decorated with `run` trains with whichever ranks are alive. A rank that dies
makes the others' next collective fail; they restore the `state` they last
committed, re-form Horovod with the survivors, take rank 0's state and call the
function again. Horovod's own versions fail on Keras 3: its Keras state calls
`optimizer.variables()` (a property in Keras 3) and broadcasts Keras variables
as `tf.Variable`s, its `TensorFlowState` broadcasts eagerly once when it is made
and never on a reset, and its `run` only recognises failed collectives by the op
names in the error text, which misses Keras's grouped all-reduce.

    @hvd.elastic.run
    def train(state):
        ...  # a custom loop that calls state.commit() every few steps, or model.fit

    train(hvd.elastic.TensorFlowKerasState(model, optimizer, batch=0, epoch=0))
"""

from __future__ import annotations

import tensorflow as tf

from tfdist import _compat

_compat.horovod()  # one clear line when Horovod is missing

from horovod.common.elastic import ObjectState, run_fn  # noqa: E402
from horovod.common.exceptions import HorovodInternalError  # noqa: E402
from horovod.tensorflow import broadcast_object, broadcast_object_fn, init, rank, shutdown  # noqa: E402,F401
import horovod.tensorflow as _hvd  # noqa: E402

from tfdist.horovod.tensorflow.functions import broadcast_variables  # noqa: E402
from tfdist.horovod.liveness import collectives_are_down as _collectives_are_down  # noqa: E402

__all__ = ["TensorFlowKerasState", "TensorFlowState", "run"]


def run(func):
    """Horovod's `hvd.elastic.run`: runs `func(state, ...)` again with the surviving ranks after a rank is
    lost, from the state last committed; the ranks first take rank 0's state.

    A failed step counts as a lost rank when Horovod's collectives are down
    (asked of Horovod, as `tfdist.HorovodStrategy` does), whatever the op.
    """

    def attempt(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as error:
            if _collectives_are_down(_hvd):
                raise HorovodInternalError(error) from error
            raise

    def reset():
        _hvd.shutdown()
        _hvd.init()

    return run_fn(attempt, reset)


class TensorFlowState(ObjectState):
    """Horovod's state of a list of variables (Keras 3 variables or `tf.Variable`s) plus any keyword properties,
    committed in host memory and taken from rank 0 after every reset.

    Args:
      variables: the variables to commit and synchronise. Horovod's default, `tf.compat.v1.global_variables()`, is
        empty in TensorFlow 2, so they must be given.
      session: accepted for Horovod's signature; TensorFlow 2 has no sessions.
      **kwargs: properties to commit and synchronise, as attributes of the state.
    """

    def __init__(self, variables=None, session=None, **kwargs):
        if not variables:
            raise ValueError("TensorFlowState needs its variables under TensorFlow 2 (it has no global variables): "
                             "TensorFlowState(model.variables + optimizer.variables), or TensorFlowKerasState(model)")
        self.variables = list(variables)
        self._save_model()
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def save(self):
        self._save_model()
        super().save()

    def restore(self):
        for variable, value in zip(self.variables, self._saved):
            variable.assign(value)
        super().restore()

    def sync(self):
        broadcast_variables(self.variables, root_rank=0)
        self._save_model()
        super().sync()

    def _save_model(self):
        self._saved = [tf.identity(variable) for variable in self.variables]


class TensorFlowKerasState(TensorFlowState):
    """The model's and optimizer's variables plus any keyword properties (`batch=0, epoch=0`), committed
    in host memory and synchronised from rank 0 after every reset.

    Args:
      model: a built Keras 3 model.
      optimizer: its optimizer (default: the one it was compiled with). It is
        built now if it is not, so that every rank, old or new, has the same
        variables to synchronise.
      backend: accepted for Horovod's signature; unused on TensorFlow 2.
      **kwargs: properties to commit and synchronise, as attributes of the state.
    """

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        if not model.built:
            raise ValueError("the model must be built first: call it on a batch or `model.build(input_shape)`")
        self.model = model
        self.optimizer = optimizer or model.optimizer
        if self.optimizer is None:
            raise ValueError("no optimizer: pass one, or compile the model with it")
        if not self.optimizer.built:
            with model.distribute_strategy.scope():  # where the model's variables are
                self.optimizer.build(model.trainable_variables)
        super().__init__([*model.variables, *self.optimizer.variables], **kwargs)
