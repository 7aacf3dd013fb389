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


ATTACHED = [patch.target for patch in patches() if patch.attached]


def test_an_installed_patch_keeps_its_targets_name_signature_and_docstring(reinstalled):
    keras_functions = {target: registry.resolve(target)[2] for target in TARGETS}
    install_patches()
    assert registry.installed() == TARGETS and not registry.refused()
    for target, keras_function in keras_functions.items():
        patched = registry.resolve(target)[2]
        if target in ATTACHED:  # the class keeps Keras's function
            assert patched is keras_function
            continue
        assert patched is not keras_function and patched.tfdist_patch.target == target
        assert inspect.signature(patched) == inspect.signature(keras_function), target
        assert (patched.__name__, patched.__doc__) == (keras_function.__name__, keras_function.__doc__), target
    registry.remove_all()
    assert all(registry.resolve(target)[2] is keras_function for target, keras_function in keras_functions.items())


def test_gradient_accumulation_is_attached_to_the_optimizers_a_tfdist_strategy_is_given_alone(reinstalled):
    """As optax's MultiSteps wraps an optimizer: tfdist's accumulation is a method of each optimizer that
    accumulates (or overwrites its weights with their moving average) compiled under a tfdist strategy, with Keras's
    name, signature and docstring; every other optimizer and the class keep Keras's."""
    import keras
    import tensorflow as tf

    install_patches()
    (target,) = ATTACHED
    name = target.rsplit(".", 1)[1]

    def compiled(strategy, **options):
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
            model.compile(optimizer=keras.optimizers.Adam(**options), loss="mse")
        return model.optimizer

    accumulating = compiled(tfdist.MirroredStrategy(["/cpu:0", "/cpu:1"]), gradient_accumulation_steps=2)
    attached = vars(accumulating)[name]
    keras_method = getattr(keras.optimizers.Adam(), name)
    assert attached.tfdist_patch.target == target and attached.__self__ is accumulating
    assert inspect.signature(attached) == inspect.signature(keras_method)
    assert (attached.__name__, attached.__doc__) == (keras_method.__name__, keras_method.__doc__)
    overwriting = compiled(tfdist.MirroredStrategy(["/cpu:0", "/cpu:1"]), use_ema=True, ema_overwrite_frequency=2)
    assert name in vars(overwriting)
    untouched = [compiled(tfdist.MirroredStrategy(["/cpu:0", "/cpu:1"])),
                 compiled(tf.distribute.get_strategy(), gradient_accumulation_steps=2),
                 compiled(tensorflow_mirrored(), gradient_accumulation_steps=2)]
    assert not any(name in vars(optimizer) for optimizer in untouched)
    registry.remove_all()
    assert name not in vars(accumulating) and name not in vars(overwriting)


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
