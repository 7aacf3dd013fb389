"""`horovod.elastic: true`: `tfdist train` (strategy.kind=horovod) goes on when ranks are lost or added.

Under an elastic horovodrun (`--min-np/--max-np/--host-discovery-script`),
`model.fit` runs inside `hvd.elastic.run` with the model's and optimizer's
state committed every `horovod.elastic_commit_batches` batches
(`tfdist.horovod.tensorflow.keras.elastic`). When a rank dies, or hosts come
or go, the ranks left restore their last commit, re-form Horovod, take rank
0's state and go on from that batch of that epoch. The global batch stays
`train.global_batch_size`, shared among the ranks there are; the step
functions are traced again, since Keras bakes the number of replicas into them.
"""

from __future__ import annotations

import os
from typing import Callable

import keras

from tfdist import _compat
from tfdist.errors import ClusterError

__all__ = ["fit"]


def fit(model: keras.Model, fit_function: Callable[..., keras.callbacks.History], *, epochs: int,
        callbacks: list, batches_per_commit: int) -> keras.callbacks.History:
    """`fit_function(epochs=..., callbacks=...)` (a partial `model.fit`) run elastically.

    Returns:
      one History of every epoch finished, across resets; `resets` counts them.

    Raises:
      ClusterError: not under an elastic horovodrun.
    """
    if os.environ.get("HOROVOD_ELASTIC") != "1":
        raise ClusterError("horovod.elastic needs an elastic horovodrun: add --min-np, --max-np and "
                           "--host-discovery-script (and --network-interface lo on one machine).")
    from tfdist.horovod.tensorflow.keras import elastic

    state = elastic.KerasState(model, batch=0, epoch=0)
    history = keras.callbacks.History()  # one for every fit: it keeps each finished epoch's logs
    history.resets = 0

    def on_reset():
        history.resets += 1
        _compat.forget_step_functions(model)

    state.register_reset_callbacks([on_reset])
    tracking = [elastic.UpdateEpochStateCallback(state), elastic.UpdateBatchStateCallback(state),
                elastic.CommitStateCallback(state, batches_per_commit)]

    @elastic.run
    def train(state):
        fit_function(epochs=epochs - state.epoch, callbacks=[*callbacks, *tracking, history])

    train(state)
    return history
