"""tfdist: multi-device training for Keras 3 from one config file.

Config loading needs no TensorFlow, so `tfdist config` stays fast; the parts
that do need it, and the subpackages (`tfdist.layers`, `tfdist.callbacks`,
`tfdist.data`, `tfdist.strategies`, ...), are imported on first use (PEP 562).

Example:

    >>> import tfdist
    >>> cfg = tfdist.load_config("configs/default.yaml")
    >>> strategy = tfdist.make_strategy(cfg)  # doctest: +SKIP
"""

from __future__ import annotations

import importlib

from tfdist.config import Config, load_config
from tfdist.errors import ClusterError, ConfigError

__version__ = "0.1.0"

__all__ = [
    "Checkpoint",
    "ClusterError",
    "Config",
    "ConfigError",
    "HorovodStrategy",
    "LayoutStrategy",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "ParameterServerStrategy",
    "PipelineStrategy",
    "TensorParallelStrategy",
    "Throughput",
    "__version__",
    "fix_tensorflow_strategies",
    "is_chief",
    "load_config",
    "make_strategy",
    "prepare",
    "remat",
    "run",
    "set_distribution",
    "strategy_from",
]

_LAZY = {
    "Checkpoint": "tfdist.callbacks",
    "make_strategy": "tfdist.strategies",
    "HorovodStrategy": "tfdist.strategies",
    "LayoutStrategy": "tfdist.strategies",
    "MirroredStrategy": "tfdist.strategies",
    "MultiWorkerMirroredStrategy": "tfdist.strategies",
    "ParameterServerStrategy": "tfdist.strategies",
    "PipelineStrategy": "tfdist.strategies",
    "TensorParallelStrategy": "tfdist.strategies",
    "Throughput": "tfdist.callbacks",
    "fix_tensorflow_strategies": "tfdist.contract",
    "is_chief": "tfdist.training",
    "prepare": "tfdist.training",
    "remat": "tfdist.parallel.recompute",
    "run": "tfdist.training",
    "set_distribution": "tfdist.strategies",
    "strategy_from": "tfdist.strategies",
}


_SUBPACKAGES = (
    "bench", "callbacks", "data", "horovod", "horovod_keras", "layers", "models", "optimizers", "parallel",
    "precision", "strategies", "training",
)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBPACKAGES:
        return importlib.import_module(f"tfdist.{name}")
    raise AttributeError(f"module 'tfdist' has no attribute {name!r}")
