"""Config -> tf.distribute.Strategy.

Example:

    >>> import tfdist
    >>> cfg = tfdist.load_config(None, ["strategy.logical_devices=2"])
    >>> strategy = tfdist.make_strategy(cfg)
    >>> strategy.num_replicas_in_sync
    2
"""

from __future__ import annotations

import contextlib
from typing import Optional

import tensorflow as tf

from tfdist import precision
from tfdist.config.schema import Config, DataParallel, StrategyKind
from tfdist.config.validation import (
    check_batch_split,
    check_pipeline_devices,
    check_tensor_parallel_devices,
    placement_pairs,
    tensor_parallel_size,
)
from tfdist.errors import ConfigError
from tfdist.strategies import data_parallel, horovod, multi_worker, parameter_server
from tfdist.strategies.devices import configure_runtime, local_devices
from tfdist.strategies.pipeline import PipelineStrategy
from tfdist.strategies.process_group import HorovodProcesses, ProcessGroup, WorkerProcesses
from tfdist.strategies.replica_groups import ProcessLayoutError
from tfdist.strategies.tensor_parallel import TensorParallelStrategy

__all__ = ["make_strategy"]


def make_strategy(config: Config) -> tf.distribute.Strategy:
    """Configures the runtime and precision policy, then builds the strategy.

    Call it before running any TensorFlow op: logical CPU devices and thread
    pools can only be set before TensorFlow initialises.

    Raises:
      ConfigError: the machine cannot honour the config (missing devices, no
        TPU, nccl without GPUs), or the global batch does not split evenly
        over the replicas.
    """
    gpus = configure_runtime(config)
    kind = config.strategy.kind
    if kind == StrategyKind.ONE_DEVICE:
        strategy = data_parallel.make_one_device(local_devices(config, gpus)[0])
    elif kind == StrategyKind.MIRRORED:
        strategy = data_parallel.make_mirrored(config, local_devices(config, gpus), gpus)
    elif kind == StrategyKind.MULTI_WORKER_MIRRORED:
        strategy = multi_worker.from_config(config)
    elif kind == StrategyKind.PIPELINE:
        devices = local_devices(config, gpus)
        check_pipeline_devices(config, devices)
        p = config.pipeline
        with _same_layout_in_every_process(config):
            strategy = PipelineStrategy(
                p.num_stages,
                p.num_micro_batches,
                schedule=p.schedule.value,
                devices=devices,
                boundaries=list(p.boundaries) or None,
                balance_by=p.balance_by.value,
                recompute=p.recompute,
                tensor_parallel_size=tensor_parallel_size(config, len(devices)),
                data_parallel=_process_group(config),
            )
    elif kind == StrategyKind.PARAMETER_SERVER:
        strategy = parameter_server.from_config(config)
    elif kind == StrategyKind.HOROVOD:
        strategy = _horovod(config)
    elif kind == StrategyKind.TENSOR_PARALLEL:
        devices = local_devices(config, gpus)
        check_tensor_parallel_devices(config, devices)
        with _same_layout_in_every_process(config):
            strategy = TensorParallelStrategy(
                devices, group_size=tensor_parallel_size(config, len(devices)), placement=placement_pairs(config),
                data_parallel=_process_group(config),
            )
    elif kind == StrategyKind.TPU:
        strategy = data_parallel.make_tpu(config)
    else:  # config validation rejects kinds this version cannot build
        raise AssertionError(f"unhandled strategy kind {kind}")
    check_batch_split(config, strategy.num_replicas_in_sync)
    precision.apply_policy(config.precision)
    return strategy


def _process_group(config: Config) -> Optional[ProcessGroup]:
    """The processes a pipeline or tensor-parallel job trains across (`strategy.data_parallel`), if any."""
    data_parallel = config.strategy.data_parallel
    if data_parallel == DataParallel.MULTI_WORKER:
        return WorkerProcesses(multi_worker.from_config(config))
    if data_parallel == DataParallel.HOROVOD:
        return HorovodProcesses(_horovod(config))
    return None


@contextlib.contextmanager
def _same_layout_in_every_process(config: Config):
    """A ProcessLayoutError as the ConfigError of the key that gave this process its devices."""
    try:
        yield
    except ProcessLayoutError as error:
        s = config.strategy
        key = "strategy.devices" if s.devices else "strategy.logical_devices"
        raise ConfigError(key, f"must give every process as many devices: {error}",
                          list(s.devices) or s.logical_devices) from None


def _horovod(config: Config) -> horovod.HorovodStrategy:
    try:
        return horovod.from_config(config)
    except ImportError as error:
        raise ConfigError("strategy.kind", f"horovod needs Horovod: {error}", config.strategy.kind.value) from None
