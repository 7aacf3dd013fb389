"""Where `tfdist train`'s examples come from: `data.dataset` and `data.validation`.

Built in, needing no download: the handwritten digits tfdist ships and synthetic
images. The user's own: `npz:PATH` arrays, `tfrecord:GLOB` records and
`images:DIR` folders (`tfdist.data.files`), or `MODULE:FUNCTION` returning
`tf.data.Dataset`s. Each
becomes a `Source` of unbatched examples for `tfdist.data.input_pipeline`, and
`shard` decides how a multi-process job splits them: by file where there are at
least as many files as workers, else by record.

Example:

    >>> from tfdist.config import DataConfig
    >>> split = load(DataConfig(), seed=0)
    >>> split.x_train.shape[1:], split.num_classes
    ((8, 8, 1), 10)
"""

from __future__ import annotations

import dataclasses
import os
import zipfile
from typing import Optional

import numpy as np
import tensorflow as tf

from tfdist.config.schema import DataConfig, Dataset
from tfdist.config.sources import DataSource, data_source
from tfdist.data import files
from tfdist.data.digits import load_digits
from tfdist.data.files import Examples
from tfdist.errors import ConfigError

__all__ = ["Source", "Split", "load", "load_source", "shard", "with_count"]


@dataclasses.dataclass(frozen=True)
class Split:
    """Arrays of one dataset, split into training and validation parts.

    Attributes:
      x_train: float32 images, NHWC.
      y_train: int32 labels.
      x_val: float32 validation images.
      y_val: int32 validation labels.
      num_classes: number of classes.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def load(config: DataConfig, *, seed: int) -> Split:
    """Loads a built-in dataset and splits off the validation share."""
    if Dataset(config.dataset) == Dataset.DIGITS:
        x, y, classes = _digits()
    else:
        x, y, classes = _synthetic(config, seed)
    return _split(x, y, classes, config, seed)


def _split(x: np.ndarray, y: np.ndarray, classes: int, config: DataConfig, seed: int) -> Split:
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_val = max(1, int(round(len(x) * config.validation_fraction)))
    return Split(x[n_val:], y[n_val:], x[:n_val], y[:n_val], classes)


@dataclasses.dataclass(frozen=True)
class Source:
    """The training and validation examples of a job.

    Attributes:
      train: the training examples.
      validation: the validation examples, or None (a function that returned
        only training data, with no data.validation).
      num_classes: the number of classes the model must score.
    """

    train: Examples
    validation: Optional[Examples]
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.train.input_shape


def load_source(config: DataConfig, *, seed: int, steps_per_epoch_set: bool = False) -> Source:
    """The examples `data.dataset` (and `data.validation`) name.

    Args:
      config: the data section.
      seed: the job's seed (synthetic data, validation splits).
      steps_per_epoch_set: train.steps_per_epoch is given; with a
        data.shuffle_buffer too, training examples of unknown number are not
        counted (counting TFRecords is a pass over the files).

    Raises:
      ConfigError: on the key at fault: a missing file or folder, a glob that
        matches nothing, a module or function that cannot be imported, arrays
        or datasets of the wrong form, records that do not fit data.features.
    """
    kind, reference = data_source(config.dataset)
    held_out = not config.validation  # the validation examples come from the training source
    if kind == DataSource.BUILTIN:
        source = _arrays(load(config, seed=seed))
    elif kind == DataSource.NPZ:
        source = _npz(reference, config, seed, "data.dataset", split=held_out)
    elif kind == DataSource.TFRECORD:
        train = files.tfrecords(reference, config, part="training" if held_out else "all", key="data.dataset")
        validation = files.tfrecords(reference, config, part="validation", key="data.dataset") if held_out else None
        source = Source(train, validation, config.num_classes)
    elif kind == DataSource.IMAGES:
        train, validation, classes = files.image_folder(reference, config, seed=seed, split=held_out,
                                                        key="data.dataset")
        source = Source(train, validation, len(classes))
    else:
        source = _from_function(reference, "data.dataset", config)
    if config.validation:
        source = dataclasses.replace(source, validation=_validation(config, seed))
    if source.train.count is None and not (steps_per_epoch_set and config.shuffle_buffer):
        source = dataclasses.replace(source, train=_counted(source.train, steps_per_epoch_set))
    return source


def _validation(config: DataConfig, seed: int) -> Examples:
    kind, reference = data_source(config.validation, "data.validation")
    if kind == DataSource.NPZ:
        return _npz(reference, config, seed, "data.validation", split=False).train
    if kind == DataSource.TFRECORD:
        return files.tfrecords(reference, config, part="all", key="data.validation")
    if kind == DataSource.IMAGES:
        return files.image_folder(reference, config, seed=seed, split=False, key="data.validation")[0]
    return _from_function(reference, "data.validation", config).train


def with_count(examples: Examples) -> Examples:
    """`examples` counted in one pass, their dataset stating its size (for consumers that need it)."""
    count = files.count(examples.dataset)
    return dataclasses.replace(examples, count=count,
                               dataset=examples.dataset.apply(tf.data.experimental.assert_cardinality(count)))


def _counted(examples: Examples, steps_per_epoch_set: bool) -> Examples:
    if examples.files:  # records in files: one pass over them
        return dataclasses.replace(examples, count=files.count(examples.dataset))
    key = "data.shuffle_buffer" if steps_per_epoch_set else "train.steps_per_epoch"
    raise ConfigError(key, "must be set when the number of training examples is unknown (a dataset whose "
                           "cardinality TensorFlow cannot tell): set train.steps_per_epoch and data.shuffle_buffer.",
                      0 if steps_per_epoch_set else None)


def _from_arrays(x: np.ndarray, y: np.ndarray) -> Examples:
    return Examples(tf.data.Dataset.from_tensor_slices((x, y)), tuple(x.shape[1:]), len(x))


def _arrays(split: Split) -> Source:
    return Source(_from_arrays(split.x_train, split.y_train), _from_arrays(split.x_val, split.y_val),
                  split.num_classes)


def _npz(path: str, config: DataConfig, seed: int, key: str, *, split: bool) -> Source:
    """Arrays `x` and `y` (and `x_val`, `y_val`) of an .npz file; classes counted from the labels."""
    if not os.path.isfile(path):
        raise ConfigError(key, "must name an existing .npz file after `npz:`.", f"npz:{path}")
    if not zipfile.is_zipfile(path):  # else numpy tries .npy, then pickle, and blames allow_pickle
        raise ConfigError(key, "must name a .npz archive, as numpy.savez or savez_compressed writes (a zip of "
                               ".npy arrays); this file is not one.", f"npz:{path}")
    try:
        with np.load(path, allow_pickle=False) as arrays:
            arrays = dict(arrays)
    except (OSError, ValueError) as e:
        raise ConfigError(key, f"names a file numpy cannot load as .npz ({e}).", f"npz:{path}") from None
    missing = [name for name in ("x", "y") if name not in arrays]
    if missing or ("x_val" in arrays) != ("y_val" in arrays):
        raise ConfigError(key, f"must hold arrays x and y (and optionally both x_val and y_val); it holds "
                               f"{', '.join(sorted(arrays)) or 'none'}.", f"npz:{path}")
    pairs = [("x", "y")] + ([("x_val", "y_val")] if "x_val" in arrays else [])
    for xs, ys in pairs:
        if len(arrays[xs]) != len(arrays[ys]) or arrays[ys].ndim != 1 or not np.issubdtype(arrays[ys].dtype, np.integer):
            raise ConfigError(key, f"must hold {ys} as one integer class per row of {xs}; {xs} has shape "
                                   f"{arrays[xs].shape}, {ys} {arrays[ys].shape} of {arrays[ys].dtype}.",
                              f"npz:{path}")
    x, y = arrays["x"].astype(np.float32), arrays["y"].astype(np.int32)
    classes = int(max(int(arrays[ys].max()) for _, ys in pairs)) + 1
    if "x_val" in arrays:
        return _arrays(Split(x, y, arrays["x_val"].astype(np.float32), arrays["y_val"].astype(np.int32), classes))
    if split:
        return _arrays(_split(x, y, classes, config, seed))
    return Source(_from_arrays(x, y), None, classes)


def _from_function(reference: str, key: str, config: DataConfig) -> Source:
    """`FUNCTION()` returns the training dataset, or (training, validation), of unbatched (x, y)."""
    from tfdist.user_code import call_function

    returned = call_function(reference, key)
    datasets = returned if isinstance(returned, (tuple, list)) else (returned,)
    if not 1 <= len(datasets) <= 2 or not all(isinstance(d, tf.data.Dataset) for d in datasets):
        raise ConfigError(key, "must return a tf.data.Dataset, or a pair of them (training, validation); it "
                               f"returned {type(returned).__name__}.", reference)
    examples = []
    for dataset in datasets:
        spec = dataset.element_spec
        if not isinstance(spec, tuple) or len(spec) != 2 or not isinstance(spec[0], tf.TensorSpec):
            raise ConfigError(key, f"must return datasets of (x, y) pairs; its elements are {spec}.", reference)
        if spec[0].shape.rank is None or None in spec[0].shape.as_list() or spec[1].shape.rank != 0:
            raise ConfigError(key, "must return unbatched examples: x of a fixed shape and y one class each; "
                                   f"its x is {spec[0].shape} and y {spec[1].shape} (batched? tfdist batches).",
                              reference)
        count = int(dataset.cardinality())
        examples.append(Examples(dataset.map(lambda x, y: (tf.cast(x, tf.float32), tf.cast(y, tf.int32))),
                                 tuple(spec[0].shape.as_list()), count if count >= 0 else None))
    return Source(examples[0], examples[1] if len(examples) == 2 else None, config.num_classes)


def shard(examples: Examples, workers: int, index: Optional[int]) -> tuple[tf.data.Dataset, str]:
    """`examples` set up to be split over `workers` input pipelines, and how: `file`, `record` or `none`.

    By file (TensorFlow's `AutoShardPolicy.FILE`, or tfdist's own split of an
    image folder's paths where this process's index is known) when there are at
    least as many files as workers; otherwise by record (`AutoShardPolicy.DATA`).
    """
    policy = tf.data.experimental.AutoShardPolicy
    # DATA also for one process: OFF there broke the split of batches over several local replicas.
    dataset, how, chosen = examples.dataset, "record", policy.DATA
    enough_files = examples.files >= workers
    if workers <= 1:
        how = "none"
    elif enough_files and examples.shard_by == "file":
        how, chosen = "file", policy.FILE
    elif enough_files and examples.shard_by == "paths" and index is not None:
        how, chosen = "file", policy.OFF  # the dataset below is already this worker's share
        dataset = examples.make(workers, index)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = chosen
    return dataset.with_options(options), how


def _digits():
    images, labels = load_digits()
    return (images / 16.0).astype(np.float32)[..., None], labels.astype(np.int32), 10


def _synthetic(config: DataConfig, seed: int):
    rng = np.random.default_rng(seed)
    shape = (config.synthetic_examples, config.image_size, config.image_size, config.channels)
    x = rng.standard_normal(shape, dtype=np.float32)
    y = rng.integers(0, config.num_classes, config.synthetic_examples, dtype=np.int32)
    return x, y, config.num_classes
