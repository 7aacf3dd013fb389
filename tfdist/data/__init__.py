"""Datasets and input pipelines."""

from tfdist.data.pipeline import steps_per_epoch, training_dataset, validation_dataset
from tfdist.data.sources import Split, load

__all__ = ["Split", "load", "steps_per_epoch", "training_dataset", "validation_dataset"]
