"""tfdist._compat: the trainer hooks strategies use to supply Keras's step functions."""

import keras
import pytest
import tensorflow as tf

from tfdist.strategies.base import StrategyContract


def test_trainer_hooks_are_made_again_after_a_recompile():
    made = []

    class Strategy(StrategyContract, tf.distribute.OneDeviceStrategy):  # installs the patches when made
        def keras_hooks(self, model):
            made.append(model.optimizer)
            return {}

    with Strategy("/cpu:0").scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    model.make_train_function()
    model.make_test_function()
    assert len(made) == 1  # once per compile, shared by every step function
    model.compile(optimizer="adam", loss="mse")
    model.make_train_function()
    assert len(made) == 2 and made[1] is model.optimizer


def test_versions_outside_the_tested_ones_warn_once_naming_them():
    import warnings

    from tfdist import _compat

    assert _compat.check_versions({"tensorflow": "2.21.0", "keras": "3.15.1"}) == []
    with pytest.warns(UserWarning, match=r"tested with tensorflow 2\.21, keras 3\.15; this environment has keras 3\.16\.0"):
        assert _compat.check_versions({"tensorflow": "2.21.0", "keras": "3.16.0"}) == ["keras 3.16.0"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _compat.check_versions() == []  # the environment the suite runs in is the tested one
