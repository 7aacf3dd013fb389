"""Data-parallel strategies from config: TensorFlow's own, configured.

What tfdist adds over calling tf.distribute directly: the all-reduce
implementation, packing and timeout chosen by name in config; the cluster taken
from TF_CONFIG or the config's `cluster` section, with loopback enforced for the
unauthenticated gRPC servers; and a clear ConfigError instead of a runtime
failure for choices the machine cannot honour (nccl without GPUs, tpu without
a TPU).
"""

from __future__ import annotations

import json
import os

import tensorflow as tf

from tfdist.config.schema import AllReduce, Config
from tfdist.config.validation import check_address
from tfdist.errors import ConfigError

__all__ = [
    "cluster_resolver",
    "make_mirrored",
    "make_multi_worker_mirrored",
    "make_one_device",
    "make_tpu",
]


def make_one_device(device: str) -> tf.distribute.OneDeviceStrategy:
    return tf.distribute.OneDeviceStrategy(device)


def make_mirrored(config: Config, devices: list[str], gpus: int) -> tf.distribute.MirroredStrategy:
    """MirroredStrategy over `devices` with the configured cross-device ops."""
    s = config.strategy
    if s.all_reduce == AllReduce.NCCL and not gpus:
        raise ConfigError(
            "strategy.all_reduce",
            "nccl needs GPUs and this machine has none; use auto, "
            "hierarchical_copy or reduction_to_one_device.",
            s.all_reduce.value,
        )
    cross_device_ops = {
        AllReduce.AUTO: lambda: None,
        AllReduce.NCCL: lambda: tf.distribute.NcclAllReduce(num_packs=s.num_packs),
        AllReduce.HIERARCHICAL_COPY: lambda: tf.distribute.HierarchicalCopyAllReduce(
            num_packs=s.num_packs
        ),
        AllReduce.REDUCTION_TO_ONE_DEVICE: tf.distribute.ReductionToOneDevice,
    }[s.all_reduce]()
    return tf.distribute.MirroredStrategy(devices=devices, cross_device_ops=cross_device_ops)


def make_multi_worker_mirrored(config: Config) -> tf.distribute.MultiWorkerMirroredStrategy:
    """MultiWorkerMirroredStrategy with CommunicationOptions from config."""
    s = config.strategy
    implementation = {
        AllReduce.AUTO: tf.distribute.experimental.CommunicationImplementation.AUTO,
        AllReduce.RING: tf.distribute.experimental.CommunicationImplementation.RING,
        AllReduce.NCCL: tf.distribute.experimental.CommunicationImplementation.NCCL,
    }[s.all_reduce]
    options = tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=s.bytes_per_pack,
        timeout_seconds=s.collective_timeout_seconds,
        implementation=implementation,
    )
    return tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=cluster_resolver(config), communication_options=options
    )


def cluster_resolver(config: Config) -> tf.distribute.cluster_resolver.ClusterResolver:
    """The cluster from the config's `cluster` section, else from TF_CONFIG.

    Raises:
      ConfigError: both are set, TF_CONFIG is malformed, or an address is off
        loopback without `cluster.allow_non_loopback`.
    """
    c = config.cluster
    tf_config = os.environ.get("TF_CONFIG", "").strip()
    if c.workers and tf_config:
        raise ConfigError(
            "cluster.workers",
            "conflicts with the TF_CONFIG environment variable; describe the cluster in one place.",
            list(c.workers),
        )
    if c.workers:
        spec = tf.train.ClusterSpec({"worker": list(c.workers)})
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            spec, task_type="worker", task_id=c.task_index, rpc_layer="grpc"
        )
    if tf_config:
        for key, address in _tf_config_addresses(tf_config):
            check_address(address, key, c.allow_non_loopback)
    return tf.distribute.cluster_resolver.TFConfigClusterResolver()


def _tf_config_addresses(text: str):
    try:
        cluster = json.loads(text).get("cluster", {})
        items = [
            (f"TF_CONFIG.cluster.{job}[{i}]", address)
            for job, addresses in cluster.items()
            for i, address in enumerate(addresses)
        ]
    except (ValueError, AttributeError, TypeError):
        raise ConfigError(
            "TF_CONFIG", 'must be JSON like {"cluster": {"worker": [...]}, "task": {...}}.', text
        ) from None
    return items


def make_tpu(config: Config) -> tf.distribute.TPUStrategy:
    """TPUStrategy when TPUClusterResolver finds a TPU.

    Raises:
      ConfigError: no TPU could be found or initialised.
    """
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=config.strategy.tpu or None)
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
    except (ValueError, RuntimeError, tf.errors.OpError) as e:
        raise ConfigError(
            "strategy.kind",
            f"tpu needs a TPU, and none was found ({str(e).splitlines()[0]}). "
            "Set strategy.tpu to its name or address, or choose another kind.",
            "tpu",
        ) from None
    return tf.distribute.TPUStrategy(resolver)
