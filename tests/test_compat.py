"""tfdist._compat: the trainer hooks strategies use to supply Keras's step functions."""

import keras
import tensorflow as tf

from tfdist import _compat


def test_trainer_hooks_are_made_again_after_a_recompile():
    made = []

    class Strategy(tf.distribute.OneDeviceStrategy):
        def keras_hooks(self, model):
            made.append(model.optimizer)
            return {}

    _compat.install_trainer_hooks()
    with Strategy("/cpu:0").scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    model.make_train_function()
    model.make_test_function()
    assert len(made) == 1  # once per compile, shared by every step function
    model.compile(optimizer="adam", loss="mse")
    model.make_train_function()
    assert len(made) == 2 and made[1] is model.optimizer
