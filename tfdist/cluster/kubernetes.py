"""Kubernetes: the cluster a pod of a `tfdist k8s` job finds.

Each pod runs `tfdist train` with `cluster.resolver: kubernetes`: its role and
the job's shape come from the environment its manifest gives it (the names
below), its index from `JOB_COMPLETION_INDEX`, and every task's address from
the pods' stable hostnames (`HOST.SUBDOMAIN`, the Service's DNS records).
`TFDIST_K8S_ADDRESSES` (JSON, hostname -> host:port) overrides where a hostname
points: it exists so a job's pods can run as local processes on loopback, as
the tests do.
"""

from __future__ import annotations

import json
import os

from tfdist.config.schema import Config
from tfdist.config.validation import check_address
from tfdist.errors import ConfigError

__all__ = ["ADDRESSES_ENV", "HOST_ENV", "ROLE_ENV", "TASKS_ENV", "resolver"]

ROLE_ENV = "TFDIST_K8S_ROLE"
TASKS_ENV = "TFDIST_K8S_TASKS"  # the job's shape: "ps=1,chief=1,worker=2"
HOST_ENV = "TFDIST_K8S_HOST"  # a pod's hostname: "digits-{role}-{index}.digits"
ADDRESSES_ENV = "TFDIST_K8S_ADDRESSES"


def resolver(config: Config):
    """This pod's cluster resolver, from the environment its manifest gave it.

    Raises:
      ConfigError: not in a pod `tfdist k8s` described, or an address off
        loopback without `cluster.allow_non_loopback`.
    """
    import tensorflow as tf

    missing = [v for v in ("JOB_COMPLETION_INDEX", ROLE_ENV, TASKS_ENV, HOST_ENV) if v not in os.environ]
    if missing:
        raise ConfigError("cluster.resolver", f"kubernetes needs the environment of a pod `tfdist k8s` wrote; "
                          f"{', '.join(missing)} unset.", "kubernetes")
    try:
        overrides = json.loads(os.environ.get(ADDRESSES_ENV) or "{}")
        shape = {role: int(count) for role, count in
                 (part.split("=") for part in os.environ[TASKS_ENV].split(","))}
    except ValueError as e:
        raise ConfigError("cluster.resolver", f"kubernetes: a malformed {TASKS_ENV} or {ADDRESSES_ENV} ({e}).",
                          "kubernetes") from None
    cluster = {}
    for role, count in shape.items():
        hosts = [os.environ[HOST_ENV].format(role=role, index=i) for i in range(count)]
        cluster[role] = [overrides.get(host, f"{host}:{config.cluster.port_base}") for host in hosts]
        for index, address in enumerate(cluster[role]):
            check_address(address, f"the {role} {index} pod", config.cluster.allow_non_loopback)
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type=os.environ[ROLE_ENV],
        task_id=int(os.environ["JOB_COMPLETION_INDEX"]), rpc_layer="grpc",
    )
