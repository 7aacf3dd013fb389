"""Rematerialization (`tfdist.remat`, `train.remat`): layers that keep only their inputs and run their forward pass
again in the backward pass train the same weights as without, under one device and every in-process strategy, and
the backward pass keeps less."""

import io
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import attention_and_mlp, megatron_layout_map
from tfdist import ConfigError, load_config, remat
from tfdist.parallel.recompute import is_recomputed
from tfdist.plan.profile import _traced_step
from tfdist.strategies import LayoutStrategy, MirroredStrategy, PipelineStrategy
from tfdist.training import run

X = np.random.default_rng(0).normal(size=(64, 6, 16)).astype("float32")
Y = np.random.default_rng(1).integers(0, 5, size=(64,))


def _with_randomness_and_statistics():
    """Dropout inside an attention layer and on its own, and a BatchNormalization: what a second forward
    pass must repeat (the same masks) and must not repeat (the statistics' update)."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6, 16))
    x = keras.layers.Dense(16, name="embed")(inputs)
    h = keras.layers.MultiHeadAttention(num_heads=4, key_dim=8, dropout=0.2, name="attention")(x, x)
    h = keras.layers.LayerNormalization(name="norm")(h + x)
    m = keras.layers.Dropout(0.3, name="drop")(keras.layers.Dense(32, activation="gelu", name="mlp_up")(h))
    m = keras.layers.BatchNormalization(name="statistics")(m)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h + keras.layers.Dense(16, name="mlp_down")(m))
    return keras.Model(inputs, keras.layers.Dense(5, name="head")(h))


def _trained(strategy, build, layers):
    with strategy.scope() if strategy else _nothing():
        model = build()
        chosen = remat(model, layers)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(X, Y, batch_size=16, epochs=3, shuffle=False, verbose=0).history  # 12 steps
    return model, history, chosen


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


STRATEGIES = {
    "one_device": (lambda: None, _with_randomness_and_statistics),
    "mirrored": (lambda: MirroredStrategy(["/cpu:0", "/cpu:1"]), _with_randomness_and_statistics),
    "layout": (lambda: LayoutStrategy(megatron_layout_map(2)), lambda: attention_and_mlp(16)),
    # ZeRO stage 3 with every weight split (`keep_whole_below=0`): a recomputed attention layer holds its
    # projections' split weights inside it; over a 2 x 2 mesh, each shard split over the rows too.
    "mirrored, stage 3": (lambda: MirroredStrategy(["/cpu:0", "/cpu:1"], shard_optimizer=3, keep_whole_below=0),
                          _with_randomness_and_statistics),
    "layout 2x2, stage 3": (lambda: LayoutStrategy(megatron_layout_map(2, data=2), shard_optimizer=3,
                                                   keep_whole_below=0), lambda: attention_and_mlp(16)),
    "pipeline": (lambda: PipelineStrategy(2, 2, devices=["/cpu:0", "/cpu:1"], boundaries=["norm"], verbose=False),
                 lambda: attention_and_mlp(16)),
}


@pytest.mark.parametrize("kind", STRATEGIES)
def test_recomputed_layers_train_the_same_weights(cpus, kind):
    make_strategy, build = STRATEGIES[kind]
    whole, whole_history, _ = _trained(make_strategy(), build, "none")
    again, history, chosen = _trained(make_strategy(), build, "full")
    assert "attention" in chosen and "pool" not in chosen  # the layers with weights
    assert all(is_recomputed(layer) == (layer.name in chosen) for layer in again.layers)  # a layout's split too
    np.testing.assert_allclose(history["loss"], whole_history["loss"], atol=1e-6)
    for a, b in zip(whole.get_weights(), again.get_weights()):  # BatchNormalization's statistics too
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_the_backward_pass_keeps_only_the_recomputed_layers_inputs(cpus):
    """The planner's activation probe: the forward tensors the gradient's ops read, per example, by layer."""
    def kept(layers):
        model = _with_randomness_and_statistics()
        remat(model, layers)
        one, two = (_traced_step(model, tf.TensorSpec((batch, 6, 16), "float32"))[1] for batch in (1, 2))
        return {name: two.get(name, 0) - one.get(name, 0) for name in two}

    whole, again = kept("none"), kept(["attention", "mlp_up"])
    # Softmax scores, their dropout mask and the projections stay behind inside the attention, the
    # pre-activation inside the MLP's first layer: only their inputs, which other layers make, are kept.
    assert whole["attention"] > 0 and whole["mlp_up"] > 0
    assert again.get("attention", 0) == 0 and again.get("mlp_up", 0) == 0
    assert sum(again.values()) < 0.5 * sum(whole.values()), (whole, again)


def test_layers_are_chosen_by_name_or_class_and_an_unknown_one_is_refused(cpus):
    model = _with_randomness_and_statistics()
    assert remat(model, ["attention", "Dense"]) == ["embed", "attention", "mlp_up", "mlp_down", "head"]
    with pytest.raises(ValueError, match="names no layer or layer class of model .*: atention. Its layers: "):
        remat(_with_randomness_and_statistics(), ["atention"])
    with pytest.raises(ValueError, match="`layers` must be 'full', 'none' or a list"):
        remat(model, "all")


def test_a_config_recomputes_and_trains_the_same_loss_or_says_what_it_cannot_find():
    common = ["train.epochs=1", "train.steps_per_epoch=4", "train.verbose=0", "strategy.kind=one_device"]
    whole = run(load_config(None, common), out=io.StringIO())
    again = run(load_config(None, [*common, "train.remat=full"]), out=io.StringIO())
    assert again["final"]["loss"] == pytest.approx(whole["final"]["loss"], abs=1e-6)
    with pytest.raises(ConfigError, match=re.escape("`train.remat` names no layer or layer class of model")):
        run(load_config(None, [*common, "train.remat=[nope]"]), out=io.StringIO())
    with pytest.raises(ConfigError, match=re.escape("`train.remat` must be none, full or a list of layer names")):
        load_config(None, ["train.remat=some"])
