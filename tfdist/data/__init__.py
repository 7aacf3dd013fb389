"""Datasets and input pipelines."""

from tfdist.data.digits import Digits, load_digits
from tfdist.data.files import Examples
from tfdist.data.pipeline import dataset_fn, input_pipeline, steps_per_epoch, training_dataset, validation_dataset
from tfdist.data.sources import Source, Split, load, load_source, shard, with_count

__all__ = [
    "Digits",
    "Examples",
    "Source",
    "Split",
    "dataset_fn",
    "input_pipeline",
    "load",
    "load_digits",
    "load_source",
    "shard",
    "steps_per_epoch",
    "training_dataset",
    "validation_dataset",
    "with_count",
]
