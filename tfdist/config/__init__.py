"""tfdist configuration: schema, loading and validation."""

from tfdist.config.loading import from_dict, load_config, parse_override, to_dict
from tfdist.config.schema import (
    AllReduce,
    CallbacksConfig,
    ClusterConfig,
    Config,
    DataConfig,
    Dataset,
    ModelConfig,
    ModelName,
    Optimizer,
    PrecisionConfig,
    PrecisionPolicy,
    RuntimeConfig,
    StrategyConfig,
    StrategyKind,
    TrainConfig,
)

__all__ = [
    "AllReduce",
    "CallbacksConfig",
    "ClusterConfig",
    "Config",
    "DataConfig",
    "Dataset",
    "ModelConfig",
    "ModelName",
    "Optimizer",
    "PrecisionConfig",
    "PrecisionPolicy",
    "RuntimeConfig",
    "StrategyConfig",
    "StrategyKind",
    "TrainConfig",
    "from_dict",
    "load_config",
    "parse_override",
    "to_dict",
]
