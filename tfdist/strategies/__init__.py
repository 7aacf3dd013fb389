"""Distribution strategies, and the factory that builds them from config.

Imported on first use (PEP 562): `import tfdist.strategies` loads no strategy
until one is named.
"""

from __future__ import annotations

import importlib

__all__ = [
    "HorovodStrategy",
    "LayoutStrategy",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "ParameterServerStrategy",
    "PipelineStrategy",
    "TensorParallelStrategy",
    "make_strategy",
    "set_distribution",
    "strategy_from",
]

_MODULES = {
    "HorovodStrategy": "horovod",
    "LayoutStrategy": "layout",
    "MirroredStrategy": "data_parallel",
    "MultiWorkerMirroredStrategy": "multi_worker",
    "ParameterServerStrategy": "parameter_server",
    "PipelineStrategy": "pipeline",
    "TensorParallelStrategy": "tensor_parallel",
    "make_strategy": "factory",
    "set_distribution": "layout",
    "strategy_from": "layout",
}


def __getattr__(name: str):
    if name in _MODULES:
        return getattr(importlib.import_module(f"tfdist.strategies.{_MODULES[name]}"), name)
    raise AttributeError(f"module 'tfdist.strategies' has no attribute {name!r}")
