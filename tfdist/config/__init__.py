"""tfdist configuration: schema, loading and validation, and the table of what each strategy kind is."""

from tfdist.config.kinds import KINDS

from tfdist.config.loading import from_dict, load_config, parse_override, to_dict
from tfdist.config.schema import (
    AllReduce,
    BalanceBy,
    CallbacksConfig,
    ClusterConfig,
    Config,
    DataConfig,
    Dataset,
    ModelConfig,
    ModelName,
    Optimizer,
    PipelineConfig,
    PrecisionConfig,
    PrecisionPolicy,
    RuntimeConfig,
    Schedule,
    StrategyConfig,
    TrainConfig,
)

__all__ = [
    "KINDS",
    "AllReduce",
    "BalanceBy",
    "CallbacksConfig",
    "ClusterConfig",
    "Config",
    "DataConfig",
    "Dataset",
    "ModelConfig",
    "ModelName",
    "Optimizer",
    "PipelineConfig",
    "PrecisionConfig",
    "PrecisionPolicy",
    "RuntimeConfig",
    "Schedule",
    "StrategyConfig",
    "TrainConfig",
    "from_dict",
    "load_config",
    "parse_override",
    "to_dict",
]
