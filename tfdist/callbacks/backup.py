"""`RestoreOnlyBackup`: Keras's BackupAndRestore for processes that are not the chief.

In a multi-process job (Horovod ranks, multi-worker all-reduce) every process
must resume from the same epoch with the same weights, so every process reads
the backup; but only the chief may write or delete it, or the processes race
on the same files. This is BackupAndRestore with its writing hooks left out.
"""

from __future__ import annotations

import keras

__all__ = ["RestoreOnlyBackup"]


class RestoreOnlyBackup(keras.callbacks.BackupAndRestore):
    """Resumes from `backup_dir` at the start of training; never writes or deletes it.

    Args:
      backup_dir: the directory the chief's `BackupAndRestore` writes.
    """

    def on_epoch_end(self, epoch, logs=None):
        pass

    def on_train_batch_end(self, batch, logs=None):
        pass

    def on_train_end(self, logs=None):
        pass
