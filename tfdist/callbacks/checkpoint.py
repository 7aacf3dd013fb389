"""`Checkpoint`: the whole training state, saved atomically, resumed exactly, even mid-epoch.

Keras's BackupAndRestore saves at epoch ends (or every N steps) by writing its
weights file in place, and on restart only sets the initial epoch: a job killed
mid-epoch repeats the epoch from its first batch with the weights it had when
killed, and a kill during a save leaves a file that fails every restart. This
callback saves, every `every_steps` steps or `every_seconds`:

- every variable of the model (weights, BatchNorm statistics, the random
  seed state of Dropout and other random layers) and of the optimizer (slots,
  iteration count, a LossScaleOptimizer's scale), through `tf.train.Checkpoint`;
- Keras's global seed generator;
- where training is: the epoch, the step in it, and the batches read from the
  input iterator.

TensorFlow 2.21 cannot checkpoint the iterator of a distributed dataset (only a
plain `tf.data` iterator is trackable), so the input position is restored by
starting the new iterator that many global batches in (`Dataset.skip`, inside
tf.data, before the strategy shards the batches). For a deterministic dataset
(a seeded shuffle) that is exactly where the killed run was. The checkpoints
themselves are written by `CheckpointStore`: a kill during a save loses
nothing.

On SIGTERM (a scheduler's preemption; `Preemption`, which this extends) the
current step finishes, or the epoch's validation, a checkpoint is saved at
the step every process stops at, and the process exits with EXIT_PREEMPTED
(75, "temporary failure": retry), saying so in one line; if that takes longer
than `grace_seconds`, it exits with the same code without saving, and the
previous checkpoint stands.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
import warnings

import keras
import numpy as np
import tensorflow as tf

from tfdist import _compat
from tfdist.callbacks.preemption import Preemption, say
from tfdist.checkpoint_store import EXIT_PREEMPTED, CheckpointMismatch, CheckpointStore
from tfdist.errors import CheckpointWriteError
from tfdist.parallel.optimizer_shards import checkpointed_variables
from tfdist.contract import install_patches

__all__ = ["Checkpoint", "EXIT_PREEMPTED", "weights_digest"]


def weights_digest(model: keras.Model) -> str:
    """SHA-256 over the bytes of every weight in `model.weights` order: equal digests, bit-equal models."""
    digest = hashlib.sha256()
    for weight in model.weights:
        digest.update(np.ascontiguousarray(keras.ops.convert_to_numpy(weight)).tobytes())
    return digest.hexdigest()


class Checkpoint(Preemption):
    """Saves the training state atomically and resumes from it exactly, mid-epoch included.

    Args:
      directory: where the checkpoints go; the newest readable one is resumed
        at the start of `fit`.
      every_steps: save every this many training steps (0: not by steps).
      every_seconds: save when this long has passed since the last save (0: not by time).
        With neither, a checkpoint is saved at each epoch end.
      keep: how many of the newest checkpoints to keep.
      grace_seconds: after SIGTERM, the time allowed to finish the step and save.
      write: whether this process writes the checkpoints (in a multi-process
        job only the chief does, and every process resumes). The others still
        save, into memory (TensorFlow's `ram://` file system) and delete it at
        once: reading the metrics (and, in some strategies, variables) of a
        multi-process job is a collective that every process must join, at the
        same step, and a process killed meanwhile leaves nothing on disk.

    Attributes:
      resumed_from_step: the global step this run resumed from (0: a fresh start).
      preempted: whether SIGTERM stopped training.

    Example:
        >>> model.fit(data, epochs=10, steps_per_epoch=100,  # doctest: +SKIP
        ...           callbacks=[Checkpoint("ckpt", every_steps=50)])
    """

    def __init__(self, directory: str, every_steps: int = 0, every_seconds: float = 0.0, keep: int = 3,
                 grace_seconds: float = 30.0, write: bool = True):
        super().__init__(grace_seconds)
        if every_steps < 0 or every_seconds < 0:
            raise ValueError(f"every_steps and every_seconds must be >= 0. Received: {every_steps}, {every_seconds}")
        self.store = CheckpointStore(directory, keep=keep)
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.write = write
        self.resumed_from_step = 0
        install_patches()  # before fit makes its epoch iterator, so it can resume

    # What is saved.
    def _metrics_state(self) -> dict:
        # The epoch's running metrics, so the resumed epoch's logs count its steps before the kill too.
        return {f"metric_{i}": v.value for i, v in enumerate(self.model.metrics_variables)}

    def _state(self) -> tf.train.Checkpoint:
        variables = {f"model/{i}": v.value for i, v in enumerate(self.model.variables)}
        variables.update(self._metrics_state())
        if self.model.optimizer is not None:
            variables.update({f"optimizer/{i}": v for i, v in enumerate(checkpointed_variables(self.model.optimizer))})
        variables["global_seed"] = _compat.keras_global_seed_state().value
        return tf.train.Checkpoint(**{name.replace("/", "_"): v for name, v in variables.items()})

    def _shape(self) -> dict:
        optimizer = checkpointed_variables(self.model.optimizer) if self.model.optimizer is not None else []
        return {"model_variables": len(self.model.variables), "optimizer_variables": len(optimizer),
                "metric_variables": len(self.model.metrics_variables)}

    def _restore(self, prefix: str, meta: dict) -> None:
        if {key: meta.get(key) for key in self._shape()} != self._shape():
            found = {key: meta.get(key) for key in self._shape()}
            raise CheckpointMismatch(f"the checkpoints in {self.store.directory} were written for another model "
                                     f"({found}; this one has {self._shape()}): give this job its own checkpoint.dir")
        self._state().read(prefix).assert_consumed()

    def on_train_begin(self, logs=None):
        self._iterator = _compat.training_epoch_iterator()
        _compat.build_for_training(self.model, self._iterator)
        self._steps_per_epoch = getattr(self._iterator, "num_batches", None)
        self._step, self._epoch, self._step_in_epoch, self._resume_step_in_epoch = 0, 0, 0, 0
        self._resumed_metrics = None
        meta = self.store.restore_latest(self._restore)
        if meta is not None:
            self.resumed_from_step = self._step = meta["step"]
            _compat.start_at_epoch(self.model, meta["epoch"])
            self._resume_step_in_epoch = meta["step_in_epoch"]
            _compat.resume_epoch_iterator(self._iterator, skip_batches=meta["iterator_batches"],
                                          first_step=meta["step_in_epoch"])
            # fit resets the metrics when the epoch begins; they are read again then.
            self._resumed_metrics = self.store.prefix(meta["step"]) if meta["step_in_epoch"] else None
            if not self._keeps_iterator() and meta["epoch"] > 0:
                warnings.warn("fit makes a new input iterator every epoch (no steps_per_epoch), so a dataset that "
                              "reshuffles every epoch resumes in another order than an uninterrupted run; "
                              "repeat the dataset and pass steps_per_epoch for an exact resume", stacklevel=2)
        self._last_save_time = time.monotonic()
        self._last_saved_step = self._step
        super().on_train_begin(logs)

    # Preemption: save at the step every process stops at, exit 75 so that the job is run again.
    exit_code = EXIT_PREEMPTED
    agree_every_steps = 1

    def _plan(self) -> str:
        return "saving after this step"

    def _exit_at_deadline(self):
        say(f"tfdist: error: preempted (SIGTERM); the step and checkpoint did not finish within "
            f"checkpoint.grace_seconds={self.grace_seconds:g}; exiting without saving "
            f"(exit {EXIT_PREEMPTED}: run the job again to resume from the last checkpoint)")
        os._exit(EXIT_PREEMPTED)

    def on_preempted(self) -> None:
        try:
            self._save()
        except CheckpointWriteError as error:  # preempted all the same: a rerun resumes from the checkpoint before
            say(f"tfdist: error: preempted (SIGTERM) and {str(error).rstrip('.')}: exiting {EXIT_PREEMPTED} so that "
                "the job is run again")
            sys.exit(EXIT_PREEMPTED)

    def on_stopped(self) -> None:
        if self._step != self._last_saved_step:
            self._save()

    def _exit_line(self) -> str:
        return (f"tfdist: preempted (SIGTERM): saved the checkpoint of step {self._step} in {self.store.directory}; "
                f"exiting {EXIT_PREEMPTED} so that the job is run again, and it resumes there")

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._step_in_epoch, self._resume_step_in_epoch = self._resume_step_in_epoch, 0
        if self._resumed_metrics is not None:
            tf.train.Checkpoint(**self._metrics_state()).read(self._resumed_metrics).expect_partial()
            self._resumed_metrics = None

    def on_train_batch_end(self, batch, logs=None):
        self._step += batch + 1 - self._step_in_epoch  # steps_per_execution steps per call
        self._step_in_epoch = batch + 1
        if self._any_process_preempted():
            self._stop_here()
        elif (self.every_steps and self._step - self._last_saved_step >= self.every_steps) or (
                self.every_seconds and time.monotonic() - self._last_save_time >= self.every_seconds):
            self._save()

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)  # a SIGTERM during validation saves and stops here
        if not (self.every_steps or self.every_seconds) and not self.preempted:
            self._save()

    def _save(self):
        epoch, step_in_epoch = self._epoch, self._step_in_epoch
        if self._steps_per_epoch and step_in_epoch >= self._steps_per_epoch:
            epoch, step_in_epoch = epoch + 1, 0  # the epoch is done: resume at the next one's start
        meta = {"epoch": epoch, "step_in_epoch": step_in_epoch,
                "iterator_batches": _compat.batches_read(self._iterator) if step_in_epoch or self._keeps_iterator() else 0}
        if self.write:
            self.store.save(self._step, self._state().write, {**meta, **self._shape()})
        else:
            scratch = f"ram://tfdist-scratch-{os.getpid()}-{id(self)}"
            self._state().write(f"{scratch}/checkpoint")
            tf.io.gfile.rmtree(scratch)
        self._last_save_time = time.monotonic()
        self._last_saved_step = self._step

    def _keeps_iterator(self) -> bool:
        """Whether Keras reads one iterator across epochs (steps_per_epoch given) rather than one per epoch."""
        return self._iterator.steps_per_epoch is not None
