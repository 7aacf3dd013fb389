"""RestoreOnlyBackup: resumes from the chief's backup, never touches it."""

import os

import keras
import numpy as np

from tfdist.callbacks import RestoreOnlyBackup


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_it_resumes_where_the_chief_left_off_and_leaves_the_backup_alone(tmp_path):
    x, y = np.ones((8, 3), "float32"), np.zeros((8, 1), "float32")
    backup = str(tmp_path / "backup")
    chief = _model()
    chief.fit(x, y, epochs=2, verbose=0, callbacks=[keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False)])
    files = {name: os.stat(os.path.join(backup, name)).st_mtime_ns for name in os.listdir(backup)}

    other = _model()
    history = other.fit(x, y, epochs=4, verbose=0, callbacks=[RestoreOnlyBackup(backup)])
    assert len(history.history["loss"]) == 2  # epochs 3 and 4: resumed after the chief's epoch 2
    assert {name: os.stat(os.path.join(backup, name)).st_mtime_ns for name in os.listdir(backup)} == files
