"""Keras's BackupAndRestore and ModelCheckpoint in a multi-process job: every process resumes from the backup, the
chief alone writes and deletes it (`tfdist._compat.patches`); two processes writing one file failed on h5py's lock."""

import os

import keras
import numpy as np

import tfdist


class NotTheChief(tfdist.MirroredStrategy):
    """A process of a multi-process job that is not its chief (a worker, a Horovod rank other than 0)."""

    is_chief = False


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def _files(directory):
    return {name: os.stat(os.path.join(directory, name)).st_mtime_ns for name in os.listdir(directory)}


def test_a_process_that_is_not_the_chief_resumes_from_the_backup_and_never_writes(tmp_path):
    x, y = np.ones((8, 3), "float32"), np.zeros((8, 1), "float32")
    backup, saved = str(tmp_path / "backup"), str(tmp_path / "saved")
    chief = _model()
    chief.fit(x, y, epochs=2, verbose=0, callbacks=[keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False)])
    files = _files(backup)

    with NotTheChief(devices=["/cpu:0"]).scope():
        other = _model()
    callbacks = [keras.callbacks.BackupAndRestore(backup), keras.callbacks.ModelCheckpoint(saved + "/{epoch}.keras")]
    history = other.fit(x, y, epochs=4, verbose=0, callbacks=callbacks)
    assert len(history.history["loss"]) == 2  # epochs 3 and 4: resumed after the chief's epoch 2
    assert _files(backup) == files  # neither written nor deleted at the end
    assert not os.path.exists(saved)

    with tfdist.MirroredStrategy(devices=["/cpu:0"]).scope():  # the chief of its job: Keras's own behaviour
        chief = _model()
    chief.fit(x, y, epochs=4, verbose=0, callbacks=callbacks)
    assert not os.path.exists(backup) and sorted(os.listdir(saved)) == ["3.keras", "4.keras"]
