"""Elastic Horovod for `model.fit` on Keras 3 (`hvd.elastic` of `horovod.tensorflow.keras`).

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state)]   # in this order: the commit sees both updated

    @hvd.elastic.run
    def train(state):
        state.model.fit(dataset, steps_per_epoch=STEPS, epochs=EPOCHS - state.epoch, callbacks=callbacks)

`state.batch` counts the batches finished in the current epoch. After a reset
the first epoch runs only the batches the commit had not finished, so no
committed step is trained twice. (Horovod's own callback stores the last
batch's index, and shortens the epoch through `params["steps"]`, which Keras 3
does not read.)
"""

from __future__ import annotations

import keras

from tfdist.horovod.tensorflow.elastic import TensorFlowKerasState, run

__all__ = ["CommitStateCallback", "KerasState", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]

KerasState = TensorFlowKerasState  # one TensorFlow backend in Keras 3, so the same state


class CommitStateCallback(keras.callbacks.Callback):
    """Commits `state` every `batches_per_commit` batches and at the end of every epoch.

    A commit also checks whether hosts were added or removed (then training
    restarts from it with the new set of ranks).
    """

    def __init__(self, state, batches_per_commit: int = 1):
        super().__init__()
        if batches_per_commit < 1:
            raise ValueError(f"`batches_per_commit` must be >= 1, got {batches_per_commit}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self._remaining = batches_per_commit

    def on_train_begin(self, logs=None):
        self._remaining = self.batches_per_commit  # the same on every rank after a reset

    def on_train_batch_end(self, batch, logs=None):
        self._remaining -= 1
        if self._remaining == 0:
            self.state.commit()
            self._remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps `state.batch` at the number of batches finished in the epoch; after a reset, ends the
    first epoch once the epoch's `steps_per_epoch` batches are finished in all.

    When the epoch's last batch finishes, the state moves on to batch 0 of the
    next epoch (and `state.epoch` on by one, if the state has it), so a commit
    made then never asks a resumed run for an epoch with no batches left. A
    rank lost between that commit and the epoch's end skips the epoch's
    validation on resuming, not a training step.
    """

    def __init__(self, state):
        super().__init__()
        self.state = state
        self._resumed_at = 0  # batches of the current epoch finished before this `fit`
        self._ended_early = False

    def on_train_begin(self, logs=None):
        self._resumed_at = self.state.batch
        if self._resumed_at and not self.params.get("steps"):
            raise ValueError("resuming in the middle of an epoch needs `steps_per_epoch` in `fit`")

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = self._resumed_at + batch + 1
        steps = self.params.get("steps")
        if steps and self.state.batch >= steps:
            self.state.batch = 0
            if hasattr(self.state, "epoch"):
                self.state.epoch += 1
            if self._resumed_at:
                self.model.stop_training = True  # ends this shortened epoch's loop; undone in on_epoch_end
                self._ended_early = True

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0
        self._resumed_at = 0
        if self._ended_early:
            self.model.stop_training = False
            self._ended_early = False


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps `state.epoch` at the number of epochs finished, across resets (pass `epochs=EPOCHS - state.epoch`
    to `fit`)."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self._first_epoch = state.epoch

    def on_train_begin(self, logs=None):
        self._first_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self._first_epoch + epoch + 1
