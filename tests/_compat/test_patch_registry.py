"""The registry of tfdist's patches to Keras: each installed only on the Keras it was written for, keeping its
target's signature and docstring, refused in one line otherwise, and removable."""

import inspect
import os
import sys

import pytest
from helpers import ROOT, tensorflow_mirrored

import tfdist
from tfdist._compat import registry, versions
from tfdist._compat.patches import WRITTEN_AGAINST, KerasNotAsWrittenFor, patches
from tfdist.contract import install_patches

TARGETS = [patch.target for patch in patches()]


@pytest.fixture
def reinstalled():
    """Keras as tfdist found it during the test; tfdist's patches installed again after it."""
    install_patches()
    registry.remove_all()
    try:
        yield
    finally:
        registry.remove_all()
        install_patches()


def test_every_target_is_declared_once_with_its_fingerprint():
    assert len(TARGETS) == len(set(TARGETS)) and set(TARGETS) == set(WRITTEN_AGAINST)
    for patch in patches():
        assert patch.why and "\n" not in patch.why, patch.target


def test_an_installed_patch_keeps_its_targets_name_signature_and_docstring(reinstalled):
    keras_functions = {target: registry.resolve(target)[2] for target in TARGETS}
    install_patches()
    assert registry.installed() == TARGETS and not registry.refused()
    for target, keras_function in keras_functions.items():
        patched = registry.resolve(target)[2]
        assert patched is not keras_function and patched.tfdist_patch.target == target
        assert inspect.signature(patched) == inspect.signature(keras_function), target
        assert (patched.__name__, patched.__doc__) == (keras_function.__name__, keras_function.__doc__), target
    registry.remove_all()
    assert all(registry.resolve(target)[2] is keras_function for target, keras_function in keras_functions.items())


@pytest.mark.parametrize("target", TARGETS)
def test_a_target_whose_code_changed_is_not_patched_and_tfdist_refuses_in_one_line(reinstalled, monkeypatch,
                                                                                   target):
    owner, name, keras_function = registry.resolve(target)

    def renamed_inside(*args, **kwargs):  # what a Keras release that rewrote the function would hold
        return keras_function(*args, **kwargs)

    monkeypatch.setattr(owner, name, renamed_inside)
    with pytest.raises(KerasNotAsWrittenFor) as refused:
        tfdist.MirroredStrategy(["/cpu:0"])
    message = str(refused.value)
    assert "\n" not in message and f"{target} is not the code it was written for" in message
    assert registry.resolve(target)[2] is renamed_inside and target not in registry.installed()


def test_a_target_gone_from_keras_is_named(reinstalled, monkeypatch):
    owner, name, _ = registry.resolve(TARGETS[0])
    monkeypatch.delattr(owner, name)
    registry.install(patches(), lambda patch, strategy: False)
    assert registry.refused()[TARGETS[0]].startswith(f"{TARGETS[0]} is not in this Keras (AttributeError")


def test_another_keras_version_installs_nothing_and_the_strategy_names_the_versions(reinstalled, monkeypatch):
    monkeypatch.setattr(versions, "installed_versions", lambda: {"tensorflow": "2.21.0", "keras": "3.16.0"})
    with pytest.raises(KerasNotAsWrittenFor, match="written for tensorflow 2.21, keras 3.15; this is keras 3.16.0"):
        tfdist.MirroredStrategy(["/cpu:0"])
    assert registry.installed() == []


def test_the_architecture_page_lists_every_patch_as_the_registry_declares_it():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import patches_table

    with open(patches_table.PAGE) as f:
        page = f.read()
    assert patches_table.page_with_table(page) == page, "docs/architecture.md is stale: python tools/patches_table.py"


def test_tensorflows_own_strategies_get_the_fixes_of_keras_bugs_after_one_call_only(monkeypatch):
    """Keras's gradient accumulation fails under TensorFlow's MirroredStrategy (keras-team/keras#20582), with or
    without a tfdist strategy in the process; after `tfdist.fix_tensorflow_strategies()` it trains the weights of
    Keras without a strategy."""
    import keras
    import numpy as np
    import tensorflow as tf

    from tfdist._compat import patches as patches_module

    monkeypatch.setattr(patches_module, "_FIXING_TENSORFLOW", [False])  # this process's setting, back after the test
    tfdist.MirroredStrategy(["/cpu:0"])
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((32, 4)).astype("float32"), rng.standard_normal((32, 1)).astype("float32")

    def trained(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), loss="mse")
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return model.get_weights()

    with pytest.raises(RuntimeError, match="Cond.call"):
        trained(tensorflow_mirrored())
    tfdist.fix_tensorflow_strategies()
    for fixed, keras_alone in zip(trained(tensorflow_mirrored()), trained(tf.distribute.get_strategy())):
        np.testing.assert_allclose(fixed, keras_alone, atol=1e-6, rtol=0)  # 2 replicas' sum: float32 rounding


def test_only_a_model_compiled_under_a_tfdist_strategy_gets_tfdists_memory_check(monkeypatch):
    """The memory check of the optimizer's build (a process memory limit past which `compile` refuses) is
    tfdist's: a plain model, or one under TensorFlow's own strategy, compiles as Keras compiles it."""
    import keras
    import tensorflow as tf

    import tfdist.contract

    checked = []
    monkeypatch.setattr(tfdist.contract, "guard_optimizer_build", lambda optimizer, **how: checked.append(how))

    def compiled(strategy):
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
            model.compile(optimizer="adam", loss="mse")

    compiled(tfdist.MirroredStrategy(["/cpu:0", "/cpu:1"]))
    assert len(checked) == 1 and checked[0]["replicas"] == 2
    compiled(tf.distribute.get_strategy())
    compiled(tensorflow_mirrored())
    assert len(checked) == 1
