"""Small data files written by tests: the digits as TFRecord shards and as a folder of PNGs."""

import numpy as np
import tensorflow as tf
from tfdist.data import load_digits

# The feature spec of the records `write_tfrecords` writes (data.features).
FEATURES = "[{name: image, dtype: float32, shape: [8, 8, 1]}, {name: label, dtype: int64, shape: []}]"


def digits():
    pixels, labels = load_digits()
    return (pixels / 16.0).astype(np.float32)[..., None], labels.astype(np.int64)


def write_tfrecords(directory, shards, x, y):
    directory.mkdir(exist_ok=True)
    for shard_index in range(shards):
        with tf.io.TFRecordWriter(str(directory / f"digits-{shard_index}.tfrecord")) as writer:
            for image, label in zip(x[shard_index::shards], y[shard_index::shards]):
                example = tf.train.Example(features=tf.train.Features(feature={
                    "image": tf.train.Feature(float_list=tf.train.FloatList(value=image.ravel())),
                    "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
                }))
                writer.write(example.SerializeToString())
    return str(directory / "digits-*.tfrecord")


def write_image_folder(directory, x, y, classes=(0, 1, 2), per_class=60):
    for c in classes:
        (directory / f"class_{c}").mkdir(parents=True)
        for i, image in enumerate(x[y == c][:per_class]):
            png = tf.io.encode_png(tf.constant((image * 255).astype(np.uint8)))
            tf.io.write_file(str(directory / f"class_{c}" / f"{i}.png"), png)
    return str(directory)
