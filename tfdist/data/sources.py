"""Datasets that need no download: scikit-learn's digits and synthetic images.

Example:

    >>> from tfdist.config import DataConfig
    >>> split = load(DataConfig(), seed=0)
    >>> split.x_train.shape[1:], split.num_classes
    ((8, 8, 1), 10)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tfdist.config.schema import DataConfig, Dataset

__all__ = ["Split", "load"]


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
    """Loads the configured dataset and splits off the validation share."""
    if Dataset(config.dataset) == Dataset.DIGITS:
        x, y, classes = _digits()
    else:
        x, y, classes = _synthetic(config, seed)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_val = max(1, int(round(len(x) * config.validation_fraction)))
    return Split(x[n_val:], y[n_val:], x[:n_val], y[:n_val], classes)


def _digits():
    from sklearn.datasets import load_digits  # ships its data; no download

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    return x, digits.target.astype(np.int32), 10


def _synthetic(config: DataConfig, seed: int):
    rng = np.random.default_rng(seed)
    shape = (config.synthetic_examples, config.image_size, config.image_size, 1)
    x = rng.standard_normal(shape, dtype=np.float32)
    y = rng.integers(0, config.num_classes, config.synthetic_examples, dtype=np.int32)
    return x, y, config.num_classes
