"""ShardedEmbedding on one process: the math, the sparse gradients, saving, errors.

Placement on parameter servers is tested with real processes in
strategies/test_parameter_server.py.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist.layers import ShardedEmbedding, shard_placement
from tfdist.layers.sharded_embedding import shard_rows

IDS = np.array([[0, 3, 9], [4, 4, 8]], dtype="int32")


def _pair(num_shards, rows=10, width=4):
    """A sharded layer and a keras Embedding holding the same table."""
    keras.utils.set_random_seed(0)
    sharded = ShardedEmbedding(rows, width, num_shards=num_shards)
    sharded.build()
    whole = keras.layers.Embedding(rows, width)
    whole.build()
    whole.embeddings.assign(sharded.embeddings)
    return sharded, whole


def test_rows_split_as_embedding_lookup_div_expects():
    assert shard_rows(10, 3) == [4, 3, 3]
    assert shard_rows(4, 4) == [1, 1, 1, 1]
    assert sum(shard_rows(1088, 2)) == 1088


@pytest.mark.parametrize("num_shards", [1, 2, 3, 10])
def test_lookups_and_gradients_equal_a_whole_embedding(num_shards):
    sharded, whole = _pair(num_shards)
    assert [int(s.shape[0]) for s in sharded.shards] == shard_rows(10, num_shards)
    with tf.GradientTape(persistent=True) as tape:
        out_sharded = sharded(IDS)
        out_whole = whole(IDS)
        loss_sharded = tf.reduce_sum(out_sharded ** 2)
        loss_whole = tf.reduce_sum(out_whole ** 2)
    np.testing.assert_allclose(out_sharded, out_whole, atol=1e-7)
    shard_grads = tape.gradient(loss_sharded, [s.value for s in sharded.shards])
    # Sparse: only the looked-up rows travel and are updated.
    assert all(isinstance(g, tf.IndexedSlices) for g in shard_grads if g is not None)
    dense = tf.concat([tf.convert_to_tensor(g) if g is not None else tf.zeros(s.shape)
                       for g, s in zip(shard_grads, sharded.shards)], axis=0)
    np.testing.assert_allclose(dense, tf.convert_to_tensor(tape.gradient(loss_whole, whole.embeddings.value)),
                               atol=1e-6)


def test_initial_values_do_not_depend_on_the_shard_count():
    tables = [_pair(n)[0].embeddings.numpy() for n in (1, 2, 5)]  # exact: the same draws, only placed apart
    np.testing.assert_array_equal(tables[0], tables[1])
    np.testing.assert_array_equal(tables[0], tables[2])


def _model(num_shards):
    return keras.Sequential([
        keras.Input((3,), dtype="int32"),
        ShardedEmbedding(10, 4, num_shards=num_shards, name="table"),
        keras.layers.Flatten(),
        keras.layers.Dense(2),
    ])


def test_fit_trains_and_weights_move_between_shard_counts(tmp_path):
    keras.utils.set_random_seed(0)
    model = _model(3)
    model.compile(optimizer="adam", loss="mse")
    before = model.layers[0].embeddings.numpy()
    model.fit(IDS, np.ones((2, 2)), epochs=3, verbose=0)
    assert not np.allclose(before, model.layers[0].embeddings.numpy())
    untouched = [1, 2, 5, 6, 7]  # never looked up: no gradient, so they keep their initial values (exact)
    np.testing.assert_array_equal(before[untouched], model.layers[0].embeddings.numpy()[untouched])

    model.save_weights(tmp_path / "w.weights.h5")
    other = _model(2)
    other.load_weights(tmp_path / "w.weights.h5")
    # exact: loading copies the saved bytes
    np.testing.assert_array_equal(other.layers[0].embeddings.numpy(), model.layers[0].embeddings.numpy())

    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    np.testing.assert_allclose(loaded.predict(IDS, verbose=0), model.predict(IDS, verbose=0), atol=1e-6)
    assert shard_placement(loaded).keys() == {"table"}


def test_a_table_of_another_shape_is_refused_on_load(tmp_path):
    model = _model(2)
    model.save_weights(tmp_path / "w.weights.h5")
    wider = keras.Sequential([keras.Input((3,), dtype="int32"), ShardedEmbedding(10, 5, name="table"),
                              keras.layers.Flatten(), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match=r"saved table has shape \(10, 4\), the layer \(10, 5\)"):
        wider.load_weights(tmp_path / "w.weights.h5")


def test_mask_zero_masks_id_zero():
    layer = ShardedEmbedding(10, 4, mask_zero=True, num_shards=2)
    np.testing.assert_array_equal(layer.compute_mask(tf.constant(IDS)), IDS != 0)  # exact: booleans


def test_one_shard_without_a_partitioning_strategy():
    layer = ShardedEmbedding(10, 4)
    layer.build()
    assert len(layer.shards) == 1


@pytest.mark.parametrize("kwargs, message", [
    ({"num_shards": 11}, "num_shards must be between 1 and input_dim \\(10\\)"),
    ({"num_shards": 0}, "num_shards must be between 1"),
])
def test_bad_shard_counts_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ShardedEmbedding(10, 4, **kwargs)
