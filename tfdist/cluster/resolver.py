"""Where the tasks of a multi-process job are: the cluster from the config, TF_CONFIG, Slurm or Kubernetes."""

from __future__ import annotations

import contextlib
import json
import os

import tensorflow as tf

from tfdist.cluster import kubernetes, slurm
from tfdist.config.schema import ClusterResolverKind, Config
from tfdist.config.validation import check_address
from tfdist.errors import ClusterError, ConfigError

__all__ = ["cluster_resolver", "listening_as"]


def cluster_resolver(config: Config) -> tf.distribute.cluster_resolver.ClusterResolver:
    """The cluster from the config's `cluster` section, else from TF_CONFIG; or from Slurm
    (`cluster.resolver: slurm`) or a Kubernetes pod's environment (`kubernetes`).

    Raises:
      ConfigError: both are set, TF_CONFIG is malformed, or an address is off
        loopback without `cluster.allow_non_loopback`.
    """
    c = config.cluster
    if c.resolver == ClusterResolverKind.SLURM:
        return slurm.resolver(config)
    if c.resolver == ClusterResolverKind.KUBERNETES:
        return kubernetes.resolver(config)
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
        _check_tf_config(tf_config, c.allow_non_loopback)
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


def _check_tf_config(text: str, allow_non_loopback: bool) -> None:
    """TF_CONFIG's addresses, and its task, checked as the config's `cluster` section's are."""
    try:
        parsed = json.loads(text)
        cluster, task = parsed.get("cluster", {}), parsed.get("task", {})
        addresses = [(f"TF_CONFIG.cluster.{job}[{i}]", address)
                     for job, listed in cluster.items() for i, address in enumerate(listed)]
        task_type, task_index = task.get("type"), task.get("index", 0)
    except (ValueError, AttributeError, TypeError):
        raise ConfigError(
            "TF_CONFIG", 'must be JSON like {"cluster": {"worker": [...]}, "task": {...}}.', text
        ) from None
    for key, address in addresses:
        check_address(address, key, allow_non_loopback)
    if task_type is None:
        return  # TensorFlow's default: a process outside the cluster (or a single task)
    if task_type not in cluster:
        raise ConfigError("TF_CONFIG.task.type", f"must be a job of TF_CONFIG.cluster ({', '.join(cluster)}).",
                          task_type)
    if not isinstance(task_index, int) or not 0 <= task_index < len(cluster[task_type]):
        raise ConfigError("TF_CONFIG.task.index", f"must be below the number of {task_type} tasks "
                                                  f"({len(cluster[task_type])}).", task_index)
