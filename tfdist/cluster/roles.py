"""The roles of a job's tasks, in task order, and the cluster spec they make. TensorFlow-free.

A job's processes (`tfdist.config.kinds`) name their tasks the same way
wherever they run (`tfdist launch`, Slurm, Kubernetes): all workers under
all-reduce and Horovod; under parameter servers the ps first, then the chief,
then workers.
"""

from __future__ import annotations

from tfdist.config.kinds import Processes, kinds_where
from tfdist.errors import ConfigError

__all__ = ["cluster_of", "multi_process_kinds", "roles"]


def multi_process_kinds() -> str:
    """The kinds whose jobs run as several processes, for an error message (pipeline and tensor parallel
    with data_parallel run as these)."""
    return ", ".join(kinds_where(lambda kind: kind.processes.several))


def roles(processes: Processes, num_tasks: int, num_ps: int = 0) -> list[str]:
    """Each task's role, in task order.

    Raises:
      ConfigError: a parameter-server job with too few tasks for its ps, a chief and a worker.
    """
    if not processes.coordinated:
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
