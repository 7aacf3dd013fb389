"""keras-hub's Gemma and Llama backbones, split by their own `get_layout_map`, and BERT, split by Megatron's pairs,
train as on one device.

Small configurations built from the constructors (random weights: nothing is
downloaded), trained 10 steps as causal LMs on synthetic tokens, on a mesh of
1 x 2, 1 x 4 and 2 x 2 logical CPUs (data x model).
"""

import contextlib
import functools

import keras
import keras_hub  # the `hub` extra, which make setup installs
import numpy as np
import pytest
import tensorflow as tf
from oracle import keras_alone
from references import CAUSAL_LMS, causal_lm

from tfdist.parallel.mesh_groups import collectives_of_a_step
from tfdist.parallel.split_variables import is_split, shards
from tfdist.parallel.layout import Layout
from tfdist.strategies.layout import LayoutStrategy, strategy_from

VOCABULARY, LENGTH, STEPS, BATCH = 64, 16, 10, 8
TOKENS = np.random.default_rng(0).integers(1, VOCABULARY, size=(STEPS * BATCH, LENGTH + 1))
FEATURES = {"token_ids": TOKENS[:, :-1], "padding_mask": np.ones((len(TOKENS), LENGTH), bool)}
# The collectives of a step on one device, per decoder block and for the token embedding, as each backbone's
# own layout map splits it (a gather is two ops: the shapes, then the values):
# - Gemma's attention (heads) and feed-forward (hidden units) blocks are each one Megatron pair: one sum
#   forward, one backward; the tied embedding sums its lookup (vocabulary split) and copies its reverse's
#   input (one sum backward), whose logits it gathers.
# - Llama's map splits the query, key and value kernels on their input: their shared input is scattered
#   once (gathered backward) and each sums its output; the output projection takes whole heads (a scatter)
#   and sums; the feed-forward block is a pair. Its reverse embedding is whole.
COLLECTIVES = {
    "gemma": lambda layers: {"model_group CollectiveGatherV2": 2, "model_group CollectiveReduceV2": 4 * layers + 2},
    "llama": lambda layers: {"model_group CollectiveGatherV2": 2 * 2 * layers,
                             "model_group CollectiveReduceV2": 6 * layers + 1},
}
LAYERS = 1


def _causal_lm(name: str, strategy=None, lora_rank=None):
    with strategy.scope() if strategy else contextlib.nullcontext():
        return causal_lm(name, VOCABULARY, LAYERS, lora_rank)


def _trained(name: str, strategy=None, lora_rank=None):
    model = _causal_lm(name, strategy, lora_rank)
    history = model.fit(FEATURES, TOKENS[:, 1:], batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
    return model, history["loss"]


@functools.cache
def _one_device(name: str, lora_rank=None):
    """The causal LM's weights and losses trained by Keras in a process that never imported tfdist."""
    got = keras_alone("fit", ("causal_lm", dict(name=name, vocabulary=VOCABULARY, layers=LAYERS, lora_rank=lora_rank)),
                      FEATURES, TOKENS[:, 1:], batch_size=BATCH, epochs=1, shuffle=False)
    return got["weights"], got["history"]["loss"]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CAUSAL_LMS))
@pytest.mark.parametrize("data, devices", [(1, 2), (1, 4), (2, 2)], ids=["1x2", "1x4", "data2x2"])
def test_a_keras_hub_backbone_split_by_its_own_layout_map_trains_as_on_one_device(name, data, devices):
    mesh = keras.distribution.DeviceMesh((data, devices), ("batch", "model"),
                                         devices=[f"cpu:{i}" for i in range(data * devices)])
    layout_map = getattr(keras_hub.models, CAUSAL_LMS[name][0]).get_layout_map(mesh)
    strategy = strategy_from(keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    split, loss = _trained(name, strategy)
    one_weights, one_loss = _one_device(name)
    assert loss == pytest.approx(one_loss, abs=1e-5)
    for whole, got in zip(one_weights, split.get_weights()):
        np.testing.assert_allclose(got, whole, atol=1e-5)

    # The largest device's share of the matched variables and their Adam slots.
    matched = [v for v in split.variables + split.optimizer.variables if is_split(v)]
    assert len(matched) == 3 * (7 * LAYERS + 1)  # each with Adam's 2 slots: per layer q, k, v, output and 3
    # feed-forward kernels; the token embedding
    whole_bytes = sum(v.shape.num_elements() for v in matched)
    by_device = {}
    for variable in matched:
        for shard in shards(variable):
            by_device[shard.device] = by_device.get(shard.device, 0) + shard.shape.num_elements()
    assert len(by_device) == data * devices
    assert max(by_device.values()) / whole_bytes <= 1.15 / devices
    if data == 1 and devices == 2:
        assert collectives_of_a_step(split, strategy, (FEATURES, TOKENS[:, 1:])) == COLLECTIVES[name](LAYERS)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CAUSAL_LMS))
def test_lora_on_a_backbone_split_by_its_own_layout_map_trains_as_on_one_device(name):
    """keras.io's distributed tuning of Gemma: LoRA enabled on a backbone split by its own layout map (2 x 2). A
    LoRA factor splits as its kernel does where it has the kernel's split axis; the frozen weights stay split and
    unchanged, and only the LoRA weights get optimizer state."""
    mesh = keras.distribution.DeviceMesh((2, 2), ("batch", "model"), devices=[f"cpu:{i}" for i in range(4)])
    backbone = getattr(keras_hub.models, CAUSAL_LMS[name][0])
    strategy = strategy_from(keras.distribution.ModelParallel(layout_map=backbone.get_layout_map(mesh),
                                                              batch_dim_name="batch"))
    split, loss = _trained(name, strategy, lora_rank=4)
    one_weights, one_loss = _one_device(name, lora_rank=4)
    assert loss == pytest.approx(one_loss, abs=1e-5)
    for whole, got in zip(one_weights, split.get_weights()):
        np.testing.assert_allclose(got, whole, atol=1e-5)
    lora = [v for v in split.trainable_variables if "lora_kernel" in v.path]
    assert len(lora) == 2 * 2 * LAYERS and len(split.trainable_variables) == len(lora)  # query and value: a and b
    assert [v.path for v in lora if is_split(v)] == [v.path for v in lora if v.path.endswith("lora_kernel_a")]
    slots = [v for v in split.optimizer.variables if len(v.shape)]
    assert len(slots) == 2 * len(lora)  # Adam's two for each LoRA weight, none for a frozen one


@pytest.mark.slow
@pytest.mark.parametrize("data", [1, 2], ids=["1x2", "2x2"])
def test_a_bert_encoder_split_by_megatron_trains_with_adam_as_on_one_device(data):
    """keras-hub's BERT (its embeddings whole, its attention and feed-forward blocks split by Megatron's pairs) with
    Adam. Its token, position and segment embeddings' gradients are sparse rows, the same on every replica of a
    row: summed over the model axis they repeated at half their value, and Adam, which squares each row apart,
    moved the weights 40% away from one device's in 3 steps."""
    def classifier(strategy=None):
        keras.utils.set_random_seed(0)
        with strategy.scope() if strategy else contextlib.nullcontext():
            backbone = keras_hub.models.BertBackbone(vocabulary_size=VOCABULARY, num_layers=LAYERS, num_heads=2,
                                                     hidden_dim=16, intermediate_dim=32, max_sequence_length=LENGTH,
                                                     dropout=0.0)
            model = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=3, preprocessor=None,
                                                        dropout=0.0)
            model.compile(optimizer=keras.optimizers.Adam(1e-2),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        features = {"token_ids": TOKENS[:24, :-1], "segment_ids": np.zeros((24, LENGTH), "int32"),
                    "padding_mask": np.ones((24, LENGTH), bool)}
        labels = TOKENS[:24, 0] % 3
        return model, model.fit(features, labels, batch_size=BATCH, shuffle=False, verbose=0).history["loss"]

    one, one_loss = classifier()
    split, loss = classifier(LayoutStrategy(Layout(model=2, data=data, megatron=True)))
    assert loss == pytest.approx(one_loss, abs=1e-6)
    for whole, got in zip(one.get_weights(), split.get_weights()):
        np.testing.assert_allclose(got, whole, atol=1e-5)


def _split_strategy():
    mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"), devices=["cpu:0", "cpu:1"])
    return strategy_from(keras.distribution.ModelParallel(
        layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh), batch_dim_name="batch"))


def _fit(model, steps):
    model.fit(FEATURES, TOKENS[:, 1:], batch_size=BATCH, steps_per_epoch=steps, epochs=1, shuffle=False, verbose=0)


@pytest.mark.slow
def test_a_split_keras_hub_model_saves_as_keras_hubs_own_and_resumes_bit_exact(tmp_path):
    """Saved split, a Gemma loads into keras-hub's own class on one device (`.keras` and weights), one trained
    on one device loads split, and a checkpoint of the split model and its optimizer resumes bit-exact."""
    strategy = _split_strategy()
    split = _causal_lm("gemma", strategy)
    _fit(split, 3)
    split.save(tmp_path / "gemma.keras")
    split.save_weights(tmp_path / "gemma.weights.h5")
    loaded = keras.models.load_model(tmp_path / "gemma.keras")
    assert type(loaded) is keras_hub.models.GemmaCausalLM
    plain = _causal_lm("gemma")
    plain.load_weights(tmp_path / "gemma.weights.h5")
    for saved, *got in zip(split.get_weights(), loaded.get_weights(), plain.get_weights()):
        for weights in got:
            np.testing.assert_array_equal(weights, saved)  # exact: saving and loading copy the bytes
    tokens = {key: value[:4] for key, value in FEATURES.items()}
    np.testing.assert_allclose(split.predict(tokens, verbose=0), plain.predict(tokens, verbose=0), atol=1e-5)

    _fit(plain, 2)  # the reverse: trained on one device, loaded split
    plain.save_weights(tmp_path / "plain.weights.h5")
    again = _causal_lm("gemma", strategy)
    again.load_weights(tmp_path / "plain.weights.h5")
    strategy.split(again)
    for saved, got in zip(plain.get_weights(), again.get_weights()):
        np.testing.assert_array_equal(got, saved)  # exact: loading and splitting copy the bytes

    checkpoint = tf.train.Checkpoint(model=split, optimizer=split.optimizer)
    path = checkpoint.write(str(tmp_path / "ckpt"))
    _fit(split, 2)
    continued = [w.copy() for w in split.get_weights()]
    resumed = _causal_lm("gemma", strategy)
    _fit(resumed, 1)  # built, split and its optimizer's slots made, then overwritten by the checkpoint
    tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer).read(path).assert_consumed()
    _fit(resumed, 2)
    for want, got in zip(continued, resumed.get_weights()):
        # exact: the same steps from the same restored bytes, with the same kernels on the same shapes, in order
        np.testing.assert_array_equal(got, want)
