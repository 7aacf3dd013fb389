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

On SIGTERM (a scheduler's preemption) the current step finishes, a checkpoint
is saved and the process exits with EXIT_PREEMPTED (75, "temporary failure":
retry), saying so in one line; if that takes longer than `grace_seconds`, it
exits with the same code without saving, and the previous checkpoint stands.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings

import keras
import numpy as np
import tensorflow as tf

from tfdist import _compat
from tfdist.checkpoint_store import EXIT_PREEMPTED, CheckpointMismatch, CheckpointStore

__all__ = ["Checkpoint", "EXIT_PREEMPTED", "weights_digest"]


def weights_digest(model: keras.Model) -> str:
    """SHA-256 over the bytes of every weight in `model.weights` order: equal digests, bit-equal models."""
    digest = hashlib.sha256()
    for weight in model.weights:
        digest.update(np.ascontiguousarray(keras.ops.convert_to_numpy(weight)).tobytes())
    return digest.hexdigest()


class Checkpoint(keras.callbacks.Callback):
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
        save, to a scratch directory they delete: reading the metrics (and, in
        some strategies, variables) of a multi-process job is a collective that
        every process must join, at the same step.

    Attributes:
      resumed_from_step: the global step this run resumed from (0: a fresh start).
      preempted: whether SIGTERM stopped training.

    Example:
        >>> model.fit(data, epochs=10, steps_per_epoch=100,  # doctest: +SKIP
        ...           callbacks=[Checkpoint("ckpt", every_steps=50)])
    """

    def __init__(self, directory: str, every_steps: int = 0, every_seconds: float = 0.0, keep: int = 3,
                 grace_seconds: float = 30.0, write: bool = True):
        super().__init__()
        if every_steps < 0 or every_seconds < 0:
            raise ValueError(f"every_steps and every_seconds must be >= 0. Received: {every_steps}, {every_seconds}")
        self.store = CheckpointStore(directory, keep=keep)
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.grace_seconds = grace_seconds
        self.write = write
        self.resumed_from_step = 0
        self.preempted = False
        self._sigterm = threading.Event()
        _compat.install_trainer_hooks()  # before fit makes its epoch iterator, so it can resume

    # What is saved.
    def _metrics_state(self) -> dict:
        # The epoch's running metrics, so the resumed epoch's logs count its steps before the kill too.
        return {f"metric_{i}": v.value for i, v in enumerate(self.model.metrics_variables)}

    def _state(self) -> tf.train.Checkpoint:
        variables = {f"model/{i}": v.value for i, v in enumerate(self.model.variables)}
        variables.update(self._metrics_state())
        if self.model.optimizer is not None:
            variables.update({f"optimizer/{i}": v.value for i, v in enumerate(self.model.optimizer.variables)})
        variables["global_seed"] = _compat.keras_global_seed_state().value
        return tf.train.Checkpoint(**{name.replace("/", "_"): v for name, v in variables.items()})

    def _shape(self) -> dict:
        optimizer = self.model.optimizer.variables if self.model.optimizer is not None else []
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
            self.model._initial_epoch = meta["epoch"]  # Keras starts its epoch loop there
            self._iterator._tfdist_skip_batches = meta["iterator_batches"]
            self._iterator._tfdist_first_step = self._resume_step_in_epoch = meta["step_in_epoch"]
            # fit resets the metrics when the epoch begins; they are read again then.
            self._resumed_metrics = self.store.prefix(meta["step"]) if meta["step_in_epoch"] else None
            if not self._keeps_iterator() and meta["epoch"] > 0:
                warnings.warn("fit makes a new input iterator every epoch (no steps_per_epoch), so a dataset that "
                              "reshuffles every epoch resumes in another order than an uninterrupted run; "
                              "repeat the dataset and pass steps_per_epoch for an exact resume", stacklevel=2)
        self._last_save_time = time.monotonic()
        self._last_saved_step = self._step
        self._previous_handler, self._deadline = None, None
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM, lambda signum, frame: self._on_sigterm())

    def _on_sigterm(self):
        if not self._sigterm.is_set():
            self._sigterm.set()
            self._deadline = threading.Timer(self.grace_seconds, self._exit_without_saving)
            self._deadline.daemon = True
            self._deadline.start()

    def _exit_without_saving(self):  # a step stuck (in a collective, say) must not outlive the grace period
        print(f"tfdist: error: preempted (SIGTERM); the step and checkpoint did not finish within "
              f"checkpoint.grace_seconds={self.grace_seconds:g}; exiting without saving "
              f"(exit {EXIT_PREEMPTED}: run the job again to resume from the last checkpoint)", file=sys.stderr)
        sys.stderr.flush()
        os._exit(EXIT_PREEMPTED)

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
            self._save()
            self.preempted = True
            self.model.stop_training = True
        elif (self.every_steps and self._step - self._last_saved_step >= self.every_steps) or (
                self.every_seconds and time.monotonic() - self._last_save_time >= self.every_seconds):
            self._save()

    def _any_process_preempted(self) -> bool:
        """Whether any process of the job got SIGTERM. A multi-process strategy (`any_process`) agrees on it
        every step, so every process saves at the same step: a scheduler may signal only one of them."""
        agree = getattr(self.model.distribute_strategy, "any_process", None)
        return agree(self._sigterm.is_set()) if agree else self._sigterm.is_set()

    def on_epoch_end(self, epoch, logs=None):
        if not (self.every_steps or self.every_seconds) and not self.preempted:
            self._save()

    def on_train_end(self, logs=None):
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
        if self._deadline is not None:
            self._deadline.cancel()
        if self._step != self._last_saved_step:
            self._save()
        if getattr(self, "_scratch_store", None) is not None:
            shutil.rmtree(self._scratch_store.directory, ignore_errors=True)
            self._scratch_store = None
        if self.preempted:
            print(f"tfdist: preempted (SIGTERM): saved the checkpoint of step {self._step} in {self.store.directory}; "
                  f"exiting {EXIT_PREEMPTED} so that the job is run again, and it resumes there", file=sys.stderr)
            sys.stderr.flush()
            sys.exit(EXIT_PREEMPTED)
        if self._sigterm.is_set():  # it came after the last step: training is done and saved; now obey it
            os.kill(os.getpid(), signal.SIGTERM)

    def _save(self):
        epoch, step_in_epoch = self._epoch, self._step_in_epoch
        if self._steps_per_epoch and step_in_epoch >= self._steps_per_epoch:
            epoch, step_in_epoch = epoch + 1, 0  # the epoch is done: resume at the next one's start
        meta = {"epoch": epoch, "step_in_epoch": step_in_epoch,
                "iterator_batches": self._iterator._tfdist_batches if step_in_epoch or self._keeps_iterator() else 0}
        store = self.store if self.write else self._scratch()
        store.save(self._step, self._state().write, {**meta, **self._shape()})
        self._last_save_time = time.monotonic()
        self._last_saved_step = self._step

    def _scratch(self) -> CheckpointStore:
        if getattr(self, "_scratch_store", None) is None:
            self._scratch_store = CheckpointStore(tempfile.mkdtemp(prefix="tfdist-checkpoint-"), keep=1)
        return self._scratch_store

    def _keeps_iterator(self) -> bool:
        """Whether Keras reads one iterator across epochs (steps_per_epoch given) rather than one per epoch."""
        return self._iterator.steps_per_epoch is not None
