"""Datasets and input pipelines: the shipped digits, the examples a config's `data` section names, and
the input pipeline tfdist builds from them (public: the names in `__all__`, docs/api.md)."""

from tfdist.data.digits import Digits, load_digits
from tfdist.data.files import Examples
from tfdist.data.pipeline import dataset_fn, input_pipeline, steps_per_epoch, training_dataset, validation_dataset
from tfdist.data.sources import Source, Split, load_source

__all__ = [
    "Digits",
    "Examples",
    "Source",
    "Split",
    "dataset_fn",
    "input_pipeline",
    "load_digits",
    "load_source",
    "steps_per_epoch",
    "training_dataset",
    "validation_dataset",
]
