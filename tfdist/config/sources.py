"""What `model.name` and `data.dataset` refer to: a built-in, a file, or code of the user's.

Parsing needs no TensorFlow and touches no file, so a config is checked the same
on the machine that writes it (`tfdist k8s`, `tfdist slurm`) as on the one that
trains; whether the file exists or the function imports is checked when the job
builds its model and data, with the same one-line `ConfigError`.

Example:

    >>> model_source("keras.applications.ResNet50")
    (<ModelSource.KERAS_APPLICATIONS: 'keras.applications'>, 'ResNet50')
    >>> data_source("tfrecord:/data/train-*.tfrecord")
    (<DataSource.TFRECORD: 'tfrecord'>, '/data/train-*.tfrecord')
"""

from __future__ import annotations

import enum
import re

from tfdist.config.schema import Dataset, ModelName
from tfdist.errors import ConfigError

__all__ = ["DataSource", "ModelSource", "data_source", "model_source"]

_FUNCTION = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_IDENTIFIER = re.compile(r"^[A-Za-z_]\w*$")
_KERAS_APPLICATIONS = "keras.applications."


class ModelSource(str, enum.Enum):
    BUILTIN = "builtin"
    KERAS_APPLICATIONS = "keras.applications"
    FILE = "file"
    FUNCTION = "function"


class DataSource(str, enum.Enum):
    BUILTIN = "builtin"
    NPZ = "npz"
    TFRECORD = "tfrecord"
    IMAGES = "images"
    FUNCTION = "function"


def model_source(name: str, key: str = "model.name") -> tuple[ModelSource, str]:
    """(kind, what follows the prefix) of a `model.name`.

    Raises:
      ConfigError: `name` is none of the four forms.
    """
    if name in {m.value for m in ModelName}:
        return ModelSource.BUILTIN, name
    if name.startswith(_KERAS_APPLICATIONS):
        app = name[len(_KERAS_APPLICATIONS):]
        if not _IDENTIFIER.match(app):
            raise ConfigError(key, "must name a model of keras.applications, e.g. keras.applications.ResNet50.", name)
        return ModelSource.KERAS_APPLICATIONS, app
    if name.startswith("file:"):
        path = name[len("file:"):]
        if not path.endswith(".keras"):
            raise ConfigError(key, "must name a saved Keras model file ending in .keras after `file:`.", name)
        return ModelSource.FILE, path
    if _FUNCTION.match(name):
        return ModelSource.FUNCTION, name
    builtins = ", ".join(m.value for m in ModelName)
    raise ConfigError(key, f"must be a built-in model ({builtins}), keras.applications.NAME, file:PATH.keras "
                           "or MODULE:FUNCTION.", name)


def data_source(name: str, key: str = "data.dataset") -> tuple[DataSource, str]:
    """(kind, what follows the prefix) of a `data.dataset` or `data.validation`.

    Raises:
      ConfigError: `name` is none of the forms, or its path is empty.
    """
    if name in {d.value for d in Dataset}:
        return DataSource.BUILTIN, name
    for source in (DataSource.NPZ, DataSource.TFRECORD, DataSource.IMAGES):
        prefix = f"{source.value}:"
        if name.startswith(prefix):
            if not name[len(prefix):]:
                raise ConfigError(key, f"must name a path after `{prefix}`.", name)
            return source, name[len(prefix):]
    if _FUNCTION.match(name):
        return DataSource.FUNCTION, name
    builtins = ", ".join(d.value for d in Dataset)
    raise ConfigError(key, f"must be a built-in dataset ({builtins}), npz:PATH, tfrecord:GLOB, images:DIR "
                           "or MODULE:FUNCTION.", name)
