"""The roles of a job's tasks, in task order, and the cluster spec they make. TensorFlow-free.

Every multi-process kind names its tasks the same way wherever it runs
(`tfdist launch`, Slurm, Kubernetes): all workers under all-reduce and
Horovod; under parameter servers the ps first, then the chief, then workers.
"""

from __future__ import annotations

from tfdist.config.schema import StrategyKind
from tfdist.errors import ConfigError

__all__ = ["MULTI_PROCESS_KINDS", "cluster_of", "roles"]

# The kinds whose jobs run as several processes (pipeline and tensor parallel with data_parallel run as these).
MULTI_PROCESS_KINDS = (StrategyKind.MULTI_WORKER_MIRRORED, StrategyKind.PARAMETER_SERVER, StrategyKind.HOROVOD)


def roles(kind: StrategyKind, num_tasks: int, num_ps: int = 0) -> list[str]:
    """Each task's role, in task order.

    Raises:
      ConfigError: a parameter-server job with too few tasks for its ps, a chief and a worker.
    """
    if kind != StrategyKind.PARAMETER_SERVER:
        return ["worker"] * num_tasks
    if num_tasks < num_ps + 2:
        raise ConfigError("parameter_server.num_ps", f"leaves no chief and worker among the job's {num_tasks} "
                          "task(s): a parameter-server job needs num_ps + 2 tasks or more.", num_ps)
    return ["ps"] * num_ps + ["chief"] + ["worker"] * (num_tasks - num_ps - 1)


def cluster_of(roles: list[str], addresses: list[str]) -> dict[str, list[str]]:
    """The cluster spec (role -> addresses, in task order) of tasks with these roles and addresses."""
    cluster: dict[str, list[str]] = {}
    for role, address in zip(roles, addresses):
        cluster.setdefault(role, []).append(address)
    return cluster
