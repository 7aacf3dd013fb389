"""Examples read from files: TFRecords (`tfrecord:GLOB`) and image folders (`images:DIR`).

Both give unbatched `(x, y)` examples for `tfdist.data.input_pipeline` and say
how many files they read, so a multi-process job can shard them by file:

- TFRecords start from the file list (`Dataset.list_files`, in name order) and a
  reader per file, which is what TensorFlow's `AutoShardPolicy.FILE` rewrites,
  so each worker opens only its own files. Without `data.validation`, a record
  is held out for validation by a hash of its bytes, so the split is the same
  however the files are sharded.
- Image folders (one sub-folder per class) are listed, labelled and split by
  `keras.utils.image_dataset_from_directory`. Its dataset starts from an
  in-memory list of paths, which TensorFlow's file sharding cannot split, so
  tfdist decodes the listed paths itself (as Keras does: `decode_image`,
  bilinear resize) and, in a multi-process job, shards the paths before any is
  read.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional, Union

import keras
import numpy as np
import tensorflow as tf

from tfdist.config.schema import DataConfig, FeatureDtype
from tfdist.errors import ConfigError

__all__ = ["Examples", "count", "image_folder", "tfrecords"]

_HASH_BUCKETS = 10_000


@dataclasses.dataclass(frozen=True)
class Examples:
    """Unbatched `(x, y)` examples and what is known of them.

    Attributes:
      dataset: the examples.
      input_shape: the shape of one `x`, or a dict of shapes by name for several inputs.
      count: the number of examples, or None when unknown.
      files: the files they are read from (0 for in-memory data).
      shard_by: `file` when TensorFlow's `AutoShardPolicy.FILE` can split them by
        file, `paths` when tfdist shards their path list itself (`make`), else `record`.
      make: `(num_shards, index) -> dataset` of one shard (`shard_by == "paths"`).
    """

    dataset: tf.data.Dataset
    input_shape: Union[tuple[int, ...], dict[str, tuple[int, ...]]]
    count: Optional[int]
    files: int = 0
    shard_by: str = "record"
    make: Optional[Callable[[int, int], tf.data.Dataset]] = None


def _matching(pattern: str, key: str) -> list[str]:
    files = sorted(tf.io.gfile.glob(pattern))
    if not files:
        raise ConfigError(key, "must match at least one file.", f"tfrecord:{pattern}")
    return files


def tfrecords(pattern: str, config: DataConfig, *, part: str, key: str) -> Examples:
    """The records of the files matching `pattern`: `part` is `all`, `training` or `validation` (the held-out hash share).

    Raises:
      ConfigError: no file matches, or the records do not fit `data.features`.
    """
    files = _matching(pattern, key)
    features = {f.name: f for f in config.features}
    spec = {
        name: tf.io.FixedLenFeature(
            f.shape if f.dtype != FeatureDtype.IMAGE else [],
            tf.string if f.dtype == FeatureDtype.IMAGE else tf.dtypes.as_dtype(f.dtype.value),
        )
        for name, f in features.items()
    }
    inputs = [name for name in features if name != config.label]

    def parse(record):
        parsed = tf.io.parse_single_example(record, spec)
        for name, f in features.items():
            if f.dtype == FeatureDtype.IMAGE:
                image = tf.io.decode_image(parsed[name], channels=f.shape[-1], expand_animations=False)
                parsed[name] = tf.ensure_shape(tf.image.convert_image_dtype(image, tf.float32), f.shape)
            elif f.dtype == FeatureDtype.FLOAT32:
                parsed[name] = tf.cast(parsed[name], tf.float32)
        x = parsed[inputs[0]] if len(inputs) == 1 else {name: parsed[name] for name in inputs}
        return x, tf.cast(parsed[config.label], tf.int32)

    records = tf.data.Dataset.list_files(files, shuffle=False).interleave(
        tf.data.TFRecordDataset, cycle_length=min(len(files), 4), num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True)
    if part != "all":
        # A record is held out by a hash of its bytes: the same split on every worker and for any sharding.
        held_out = round(config.validation_fraction * _HASH_BUCKETS)

        def keep(record):
            in_validation = tf.strings.to_hash_bucket_fast(record, _HASH_BUCKETS) < held_out
            return in_validation if part == "validation" else tf.logical_not(in_validation)

        records = records.filter(keep)
    _check_records(records, parse, pattern, key, part)
    examples = records.map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    shapes = {name: tuple(features[name].shape) for name in inputs}
    input_shape = shapes[inputs[0]] if len(inputs) == 1 else shapes
    return Examples(examples, input_shape, None, files=len(files), shard_by="file")


def _check_records(records: tf.data.Dataset, parse, pattern: str, key: str, part: str) -> None:
    """The first record parses with the feature spec, or one line naming data.features."""
    try:
        for record in records.take(1):
            parse(record)
            return
    except tf.errors.OpError as e:
        reason = e.message.splitlines()[0]
        raise ConfigError("data.features", f"does not match the records of {pattern} ({reason}).",
                          f"tfrecord:{pattern}") from None
    if part == "validation":
        raise ConfigError(key, "holds too few records to hold out data.validation_fraction of them for "
                               "validation; name others in data.validation.", f"tfrecord:{pattern}")
    raise ConfigError(key, "holds no records.", f"tfrecord:{pattern}")


def count(examples: tf.data.Dataset) -> int:
    """The examples in one pass (reads every file once)."""
    return int(examples.reduce(np.int64(0), lambda n, _: n + 1))


def image_folder(directory: str, config: DataConfig, *, seed: int, split: bool,
                 key: str) -> tuple[Examples, Optional[Examples], list[str]]:
    """The images under `directory`, one sub-folder per class: (training, validation or None, class names).

    With `split`, one listing is split by Keras's `validation_split` of
    `data.validation_fraction`, with the job's seed; without, all are training.

    Raises:
      ConfigError: no such folder, or no images in it.
    """
    if not os.path.isdir(directory):
        raise ConfigError(key, "must name an existing folder with one sub-folder of images per class.",
                          f"images:{directory}")
    options = {"validation_split": config.validation_fraction, "subset": "both", "seed": seed} if split else {}
    try:
        listings = keras.utils.image_dataset_from_directory(
            directory, batch_size=None, shuffle=split, image_size=(config.image_size, config.image_size),
            color_mode={1: "grayscale", 3: "rgb", 4: "rgba"}[config.channels], **options)
    except ValueError as e:  # no images, or too few for the split
        raise ConfigError(key, f"holds no images Keras can use ({e}).", f"images:{directory}") from None
    listings = listings if split else [listings]
    classes = list(listings[0].class_names)
    parts = [_images(list(listing.file_paths), classes, directory, config) for listing in listings]
    return parts[0], parts[1] if split else None, classes


def _images(paths: list[str], classes: list[str], directory: str, config: DataConfig) -> Examples:
    """The listed images, each labelled by its class folder, decoded and resized as Keras does."""
    root = os.path.abspath(directory)
    labels = [classes.index(os.path.relpath(os.path.abspath(p), root).split(os.sep)[0]) for p in paths]
    size, channels = config.image_size, config.channels

    def load(path, label):
        image = tf.io.decode_image(tf.io.read_file(path), channels=channels, expand_animations=False)
        image = tf.image.resize(image, (size, size), method="bilinear")
        return tf.ensure_shape(image / 255.0, (size, size, channels)), label

    def make(num_shards: int = 1, index: int = 0) -> tf.data.Dataset:
        listed = tf.data.Dataset.from_tensor_slices((paths, np.asarray(labels, np.int32)))
        if num_shards > 1:
            listed = listed.shard(num_shards, index)
        return listed.map(load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

    return Examples(make(), (size, size, channels), len(paths), files=len(paths), shard_by="paths", make=make)
