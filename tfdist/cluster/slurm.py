"""Slurm: the cluster of a job step, as a task inside it finds it.

Every task of a job step runs `tfdist train` with `cluster.resolver: slurm`;
TensorFlow's `SlurmClusterResolver` finds each task's node and port from
Slurm's environment. That resolver is GPU-minded: on a CPU-only node it runs
`nvidia-smi` by default (FileNotFoundError), divides by zero with
`gpus_per_task=0`, and with 1 GPU per node and task refuses more than one task
per node. tfdist gives it GPU counts that describe the node: on GPU nodes the
real ones (it then sets each task's CUDA_VISIBLE_DEVICES), on CPU-only nodes
one per task as bookkeeping, with GPU assignment off. Roles are tfdist's
(`roles.roles`), in task order (SLURM_PROCID).
"""

from __future__ import annotations

import os
import shutil
import subprocess

from tfdist.cluster.roles import cluster_of, roles
from tfdist.config.schema import Config
from tfdist.config.validation import check_address
from tfdist.errors import ConfigError

__all__ = ["node_gpus", "resolver"]


def node_gpus() -> int:
    """The GPUs Slurm gave this node's tasks (SLURM_GPUS_ON_NODE), else those nvidia-smi lists, else 0."""
    if os.environ.get("SLURM_GPUS_ON_NODE", "").isdigit():
        return int(os.environ["SLURM_GPUS_ON_NODE"])
    if shutil.which("nvidia-smi") is None:
        return 0
    listing = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True, check=False)
    return sum(line.startswith("GPU ") for line in listing.stdout.splitlines())


def resolver(config: Config):
    """This task's cluster resolver, with tfdist's roles, inside a Slurm job step.

    Raises:
      ConfigError: not inside a job step, too few tasks for the roles, or an
        address off loopback without `cluster.allow_non_loopback`.
    """
    import tensorflow as tf

    step = os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ.get("SLURM_NTASKS")
    if not step or "SLURM_PROCID" not in os.environ:
        raise ConfigError("cluster.resolver", "slurm needs a Slurm job step: run every task with srun "
                          "(`tfdist slurm` writes the sbatch script).", "slurm")
    num_tasks = int(step)
    gpus = node_gpus()
    slurm = tf.distribute.cluster_resolver.SlurmClusterResolver(
        jobs={"worker": num_tasks},
        port_base=config.cluster.port_base,
        # CPU-only: one bookkeeping GPU per task, never assigned. With GPUs: the node's, shared by its tasks.
        gpus_per_node=gpus or num_tasks,
        gpus_per_task=max(1, gpus // _tasks_on_this_node()) if gpus else 1,
        auto_set_gpu=bool(gpus),
    )
    addresses = slurm.cluster_spec().as_dict()["worker"]  # in task order
    for index, address in enumerate(addresses):
        check_address(address, f"Slurm task {index}", config.cluster.allow_non_loopback)
    task_roles = roles(config.strategy.launched_as.processes, num_tasks, config.parameter_server.num_ps)
    cluster = cluster_of(task_roles, addresses)
    me = int(os.environ["SLURM_PROCID"])
    task_type = task_roles[me]
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type=task_type, task_id=task_roles[:me].count(task_type), rpc_layer="grpc"
    )


def _tasks_on_this_node() -> int:
    """SLURM_STEP_TASKS_PER_NODE is like `2(x3),1`; this node's entry is at SLURM_NODEID."""
    counts = []
    for part in os.environ.get("SLURM_STEP_TASKS_PER_NODE", "1").split(","):
        count, _, times = part.partition("(x")
        counts += [int(count)] * int(times.rstrip(")") or 1)
    return counts[min(int(os.environ.get("SLURM_NODEID", "0")), len(counts) - 1)]
