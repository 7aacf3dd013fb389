"""Slurm: the cluster of a job step, and the sbatch script that runs a tfdist job.

Every task of a job step runs `tfdist train` with `cluster.resolver: slurm`;
TensorFlow's `SlurmClusterResolver` finds each task's node and port from
Slurm's environment. That resolver is GPU-minded: on a CPU-only node it runs
`nvidia-smi` by default (FileNotFoundError), divides by zero with
`gpus_per_task=0`, and with 1 GPU per node and task refuses more than one task
per node. tfdist gives it GPU counts that describe the node: on GPU nodes the
real ones (it then sets each task's CUDA_VISIBLE_DEVICES), on CPU-only nodes
one per task as bookkeeping, with GPU assignment off. Roles are tfdist's, in
task order (SLURM_PROCID): every task is a worker under multi-worker
all-reduce; under parameter servers the first `parameter_server.num_ps` tasks
are ps, the next is the chief and the rest are workers.

`sbatch_script` writes the batch script `tfdist slurm` prints: one `srun` of
`tfdist train` over every task, or, for Horovod, `horovodrun` over the job's
nodes (Gloo; it reaches other nodes by ssh).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from typing import Optional

from tfdist.checkpoint_store import EXIT_PREEMPTED
from tfdist.config.schema import Config, StrategyKind
from tfdist.config.validation import check_address
from tfdist.errors import ConfigError
from tfdist.launch import MULTI_PROCESS_KINDS, cluster_of

__all__ = ["node_gpus", "resolver", "roles", "sbatch_script"]


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
    task_roles = roles(config.strategy.launched_as, num_tasks, config.parameter_server.num_ps)
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


def sbatch_script(
    config: Config,
    train_args: list[str],
    *,
    tasks: int,
    nodes: Optional[int] = None,
    gpus_per_node: Optional[int] = None,
    partition: Optional[str] = None,
    time_limit: Optional[str] = None,
    overcommit: bool = False,
    requeue: bool = False,
    workdir: Optional[str] = None,
) -> str:
    """The sbatch script that trains `config` with `tasks` tasks.

    Args:
      config: the job's config (its kind decides srun or horovodrun).
      train_args: the `tfdist train` flags every task gets (--config, --set, --metrics_out).
      tasks: Slurm tasks (processes); one per GPU on GPU nodes.
      nodes, gpus_per_node, partition, time_limit: the matching #SBATCH options when given.
      overcommit: let more tasks than CPUs share a node (#SBATCH --overcommit).
      requeue: when the job is preempted (its tasks exit 75 after SIGTERM),
        `scontrol requeue` it, so it runs again and resumes from checkpoint.dir.
      workdir: where the tasks run (default: the current directory).

    Raises:
      ConfigError: a kind that does not run on several processes, or counts that do not fit it.
    """
    kind = config.strategy.launched_as
    if kind not in MULTI_PROCESS_KINDS:
        raise ConfigError("strategy.kind", "runs in one process; Slurm jobs take multi_worker_mirrored, "
                          "parameter_server or horovod.", kind.value)
    if tasks < 1 or (nodes is not None and not 1 <= nodes <= tasks):
        raise ConfigError("--tasks", f"must be at least 1 and at least --nodes ({nodes}).", tasks)
    roles(kind, tasks, config.parameter_server.num_ps)  # refuses too few tasks now, not in the job
    options = [f"--job-name=tfdist-{kind.value}", f"--ntasks={tasks}", "--output=tfdist-%j.out"]
    options += [f"--nodes={nodes}"] if nodes else []
    options += [f"--gpus-per-node={gpus_per_node}"] if gpus_per_node else []
    options += [f"--partition={partition}"] if partition else []
    options += [f"--time={time_limit}"] if time_limit else []
    options += ["--overcommit"] if overcommit else []
    options += ["--requeue", "--open-mode=append"] if requeue else []  # one output file across runs
    train = [sys.executable, "-m", "tfdist.cli", "train", *train_args]
    lines = ["#!/bin/bash", *(f"#SBATCH {option}" for option in options), "set -euo pipefail",
             f"cd {shlex.quote(workdir or os.getcwd())}"]
    if kind == StrategyKind.HOROVOD:
        if nodes and tasks % nodes:
            raise ConfigError("--tasks", f"must divide evenly over the {nodes} nodes for horovodrun's host list.",
                              tasks)
        per_node = tasks // (nodes or 1)
        horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
        lines += [
            "# horovodrun over the job's nodes (Gloo; other nodes are reached by ssh).",
            f'hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/$/:{per_node}/" | paste -sd, -)',
            shlex.join([horovodrun, "-np", str(tasks), "--gloo"]) + ' -H "$hosts" ' + shlex.join(train),
        ]
    else:
        if (nodes or 1) > 1 and not config.cluster.allow_non_loopback:
            lines.insert(2 + len(options), _OFF_LOOPBACK_NOTE)
            print(f"tfdist: warning: {_OFF_LOOPBACK_NOTE[2:]}", file=sys.stderr)
        srun = ["srun", "--kill-on-bad-exit=1", *train, "--set=cluster.resolver=slurm"]
        lines.append(shlex.join(srun))
    if requeue:
        lines[-1] += " || code=$?"
        lines += [f'if [ "${{code:-0}}" -eq {EXIT_PREEMPTED} ]; then',
                  '  echo "tfdist: preempted; requeueing job $SLURM_JOB_ID"',
                  '  scontrol requeue "$SLURM_JOB_ID"',
                  "fi",
                  'exit "${code:-0}"']
    return "\n".join(lines) + "\n"


_OFF_LOOPBACK_NOTE = (
    "# Tasks on several nodes talk over the nodes' network, and tf.distribute's gRPC servers have no "
    "authentication: tfdist refuses addresses off loopback until the job sets "
    "cluster.allow_non_loopback=true (add --set cluster.allow_non_loopback=true on a network you trust)."
)
