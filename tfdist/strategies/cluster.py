"""Where the tasks of a multi-process job are: the cluster resolver, free loopback ports, liveness."""

from __future__ import annotations

import contextlib
import json
import os

import tensorflow as tf

from tfdist.config.schema import ClusterResolverKind, Config
from tfdist.config.validation import check_address
from tfdist.errors import ClusterError, ConfigError
from tfdist.loopback import accepts_connections, free_loopback_ports

__all__ = ["accepts_connections", "cluster_resolver", "free_loopback_ports", "listening_as"]


def cluster_resolver(config: Config) -> tf.distribute.cluster_resolver.ClusterResolver:
    """The cluster from the config's `cluster` section, else from TF_CONFIG; or from Slurm
    (`cluster.resolver: slurm`) or a Kubernetes pod's environment (`kubernetes`).

    Raises:
      ConfigError: both are set, TF_CONFIG is malformed, or an address is off
        loopback without `cluster.allow_non_loopback`.
    """
    c = config.cluster
    if c.resolver == ClusterResolverKind.SLURM:
        from tfdist import slurm

        return slurm.resolver(config)
    if c.resolver == ClusterResolverKind.KUBERNETES:
        from tfdist import k8s

        return k8s.resolver(config)
    tf_config = os.environ.get("TF_CONFIG", "").strip()
    if c.workers and tf_config:
        raise ConfigError(
            "cluster.workers",
            "conflicts with the TF_CONFIG environment variable; describe the cluster in one place.",
            list(c.workers),
        )
    if c.workers:
        jobs = {"worker": list(c.workers)}
        jobs.update({"chief": [c.chief]} if c.chief else {})
        jobs.update({"ps": list(c.ps)} if c.ps else {})
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(jobs), task_type=c.task_type.value, task_id=c.task_index, rpc_layer="grpc"
        )
    if tf_config:
        for key, address in _tf_config_addresses(tf_config):
            check_address(address, key, c.allow_non_loopback)
    return tf.distribute.cluster_resolver.TFConfigClusterResolver()


@contextlib.contextmanager
def listening_as(resolver: tf.distribute.cluster_resolver.ClusterResolver):
    """Turns TensorFlow's "Could not start gRPC server" into a ClusterError naming the port:
    another process holds this task's address."""
    try:
        yield
    except tf.errors.UnknownError as e:
        if "Could not start gRPC server" not in str(e):
            raise
        address = resolver.cluster_spec().task_address(resolver.task_type, resolver.task_id)
        raise ClusterError(
            f"task {resolver.task_type}:{resolver.task_id} cannot listen on {address}: another process holds "
            "the port. Give the job free ports (under Slurm: cluster.port_base)."
        ) from None


def _tf_config_addresses(text: str) -> list[tuple[str, str]]:
    try:
        cluster = json.loads(text).get("cluster", {})
        return [
            (f"TF_CONFIG.cluster.{job}[{i}]", address)
            for job, addresses in cluster.items()
            for i, address in enumerate(addresses)
        ]
    except (ValueError, AttributeError, TypeError):
        raise ConfigError(
            "TF_CONFIG", 'must be JSON like {"cluster": {"worker": [...]}, "task": {...}}.', text
        ) from None
