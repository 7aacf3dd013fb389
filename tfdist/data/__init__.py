"""Datasets and input pipelines."""

from tfdist.data.pipeline import dataset_fn, input_pipeline, steps_per_epoch, training_dataset, validation_dataset
from tfdist.data.sources import Split, load

__all__ = [
    "Split",
    "dataset_fn",
    "input_pipeline",
    "load",
    "steps_per_epoch",
    "training_dataset",
    "validation_dataset",
]
