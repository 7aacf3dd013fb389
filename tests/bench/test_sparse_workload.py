"""The sparse-embedding workload of `bench network`: its data, and a gradient that stays rows."""

import keras
import numpy as np
import tensorflow as tf

from tfdist.bench import sparse_workload


def test_each_example_is_a_bag_of_ids_of_its_class_mostly_rare_ones():
    ids, labels = next(iter(sparse_workload.dataset(examples=2000).batch(2000)))
    ids, labels = ids.numpy(), labels.numpy()
    assert ids.shape == (2000, sparse_workload.IDS_PER_EXAMPLE) and ids.dtype == np.int32
    assert ids.min() >= 0 and ids.max() < sparse_workload.VOCABULARY
    assert (ids % sparse_workload.CLASSES == labels[:, None]).all()
    # Zipf-like: a few ids are common, and a batch of 32 touches under 1% of the table.
    assert len(np.unique(ids[:32])) < 0.01 * sparse_workload.VOCABULARY
    assert np.mean(ids < 10 * sparse_workload.CLASSES) > 0.4


def test_the_tables_gradient_is_one_row_and_index_per_id_looked_up():
    model = sparse_workload.model(input_shape=(sparse_workload.IDS_PER_EXAMPLE,), num_classes=10)
    assert model.get_layer("table").count_params() * 4 == sparse_workload.TABLE_BYTES
    assert sparse_workload.TABLE_BYTES > 0.99 * 4 * model.count_params()
    ids, labels = next(iter(sparse_workload.dataset().batch(8)))
    with tf.GradientTape() as tape:
        loss = keras.losses.sparse_categorical_crossentropy(labels, model(tf.cast(ids, tf.float32)))
    table_gradient = tape.gradient(loss, model.get_layer("table").trainable_variables)[0]
    assert isinstance(table_gradient, tf.IndexedSlices)  # never the whole table
    rows, indices = sparse_workload.gradient_slices(8)
    assert table_gradient.values.numpy().nbytes == rows and table_gradient.indices.numpy().nbytes == indices
