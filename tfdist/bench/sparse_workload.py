"""A workload whose weights are mostly an embedding table that each batch touches sparsely.

It is where parameter servers and all-reduce part ways: a parameter-server worker
can read and update only the rows its batch looks up, while a dense all-reduce
moves the whole table every step. `tfdist bench network --model sparse_embedding`
trains it; a job of your own can name it too:

    tfdist train --set model.name=tfdist.bench.sparse_workload:model \\
                 --set data.dataset=tfdist.bench.sparse_workload:dataset

Each example is a bag of `IDS_PER_EXAMPLE` ids from a vocabulary of `VOCABULARY`.
Ids are drawn Zipf-like (a few common, most rare, as words or items are), all
from the example's class (id mod classes): the mean of the ids' vectors tells
the class, so the model learns. It trains with plain SGD (`TRAINING`), whose
update of the table touches only the rows looked up.
"""

from __future__ import annotations  # TensorFlow is imported by the functions: `bench network` names them only

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import keras
    import tensorflow as tf

__all__ = ["EMBEDDING_WIDTH", "CLASSES", "IDS_PER_EXAMPLE", "TABLE_BYTES", "TRAINING", "VOCABULARY", "dataset",
           "gradient_slices", "model"]

VOCABULARY = 100_000
IDS_PER_EXAMPLE = 16
EMBEDDING_WIDTH = 32
EXAMPLES = 8192
CLASSES = 10
ZIPF_EXPONENT = 1.2
TABLE_BYTES = VOCABULARY * EMBEDDING_WIDTH * 4  # float32
# Plain SGD: Keras 3's Adam (and every optimizer with slots) decays its slots over the whole
# table each step, so every row changes and each step updates the whole table and its slots.
TRAINING = ["train.optimizer=sgd", "train.learning_rate=0.5"]


def gradient_slices(batch: int) -> tuple[int, int]:
    """The embedding gradient of a batch as IndexedSlices: (bytes of its rows, bytes of its indices).

    A float32 row and an int32 index per id looked up, repeats included (nothing merges them).
    """
    lookups = batch * IDS_PER_EXAMPLE
    return lookups * EMBEDDING_WIDTH * 4, lookups * 4


def dataset(examples: int = EXAMPLES, seed: int = 0) -> tf.data.Dataset:
    """Unbatched `(ids, label)`: int32 ids of shape (IDS_PER_EXAMPLE,), labels 0..CLASSES-1."""
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, examples)
    ranks = (rng.zipf(ZIPF_EXPONENT, (examples, IDS_PER_EXAMPLE)) - 1) % (VOCABULARY // CLASSES)
    ids = (ranks * CLASSES + labels[:, None]).astype("int32")
    return tf.data.Dataset.from_tensor_slices((ids, labels.astype("int32")))


def model(input_shape: tuple[int, ...], num_classes: int) -> keras.Model:
    """Embedding bag (VOCABULARY x EMBEDDING_WIDTH: over 99% of the weights), a hidden layer, the classifier."""
    import keras

    from tfdist.layers import ShardedEmbedding

    ids = keras.Input(input_shape)  # tfdist's input pipeline gives float32; the lookup casts to int32
    vectors = ShardedEmbedding(VOCABULARY, EMBEDDING_WIDTH, name="table")(ids)
    hidden = keras.layers.Dense(4 * EMBEDDING_WIDTH, activation="relu")(keras.layers.GlobalAveragePooling1D()(vectors))
    outputs = keras.layers.Dense(num_classes, activation="softmax", dtype="float32")(hidden)
    return keras.Model(ids, outputs, name="sparse_embedding")
