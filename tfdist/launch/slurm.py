"""`tfdist slurm`: the sbatch script that runs a tfdist job.

One `srun` of `tfdist train` over every task (each finds its cluster with
`cluster.resolver: slurm`, see `tfdist.cluster.slurm`), or, for Horovod,
`horovodrun` over the job's nodes (Gloo; it reaches other nodes by ssh).
With a command of the user's (`tfdist slurm ... -- python train.py`) the
tasks run it instead, told `cluster.resolver: slurm` (and the job's port
and loopback keys) by the environment (`CLUSTER_VARIABLE`); under parameter servers only the chief's task runs it
and the others are `tfdist serve`, unless `every_task`.
"""

from __future__ import annotations

import math
import os
import shlex
import sys
from typing import Optional, Sequence

from tfdist.checkpoint_store import EXIT_PREEMPTED
from tfdist.cluster.roles import multi_process_kinds, roles
from tfdist.config.loading import CLUSTER_VARIABLE, cluster_variable
from tfdist.config.kinds import RANKS
from tfdist.config.schema import Config
from tfdist.errors import ConfigError

__all__ = ["sbatch_script"]

# After the first task ends, the others have checkpoint.grace_seconds (to save, if preempted) and
# this much more to end too; a task that failed is seen by its peers within seconds.
SRUN_WAIT_MARGIN_SECONDS = 30


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
    command: Sequence[str] = (),
    every_task: bool = False,
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
      command: a command of the user's for the tasks to run instead of `tfdist train`.
      every_task: run `command` on a parameter-server job's workers and servers too.

    Raises:
      ConfigError: a kind that does not run on several processes, or counts that do not fit it.
    """
    kind = config.strategy.launched_as
    processes = kind.processes
    if not processes.several:
        raise ConfigError("strategy.kind", f"runs in one process; Slurm jobs take {multi_process_kinds()}.",
                          kind.name)
    if tasks < 1 or (nodes is not None and not 1 <= nodes <= tasks):
        raise ConfigError("--tasks", f"must be at least 1 and at least --nodes ({nodes}).", tasks)
    roles(processes, tasks, config.parameter_server.num_ps)  # refuses too few tasks now, not in the job
    options = [f"--job-name=tfdist-{kind.name}", f"--ntasks={tasks}", "--output=tfdist-%j.out"]
    options += [f"--nodes={nodes}"] if nodes else []
    options += [f"--gpus-per-node={gpus_per_node}"] if gpus_per_node else []
    options += [f"--partition={partition}"] if partition else []
    options += [f"--time={time_limit}"] if time_limit else []
    options += ["--overcommit"] if overcommit else []
    options += ["--requeue", "--open-mode=append"] if requeue else []  # one output file across runs
    tfdist = [sys.executable, "-m", "tfdist.cli"]
    train = list(command) or [*tfdist, "train", *train_args]
    lines = ["#!/bin/bash", *(f"#SBATCH {option}" for option in options), "set -euo pipefail",
             f"cd {shlex.quote(workdir or os.getcwd())}"]
    if command and processes.resolves_cluster:  # how the command's tfdist.make_strategy finds its cluster
        cluster = cluster_variable("slurm", config.cluster.port_base, config.cluster.allow_non_loopback)
        lines.append(f"export {CLUSTER_VARIABLE}={shlex.quote(cluster)}")
    if processes is RANKS:
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
        # Once a task ends, the others get a while to end too, then srun ends them. Not
        # --kill-on-bad-exit: on a preemption every task saves and exits 75, and the first to exit
        # would have the others killed mid-save (srun then returns 143, not 75, and no requeue).
        wait = math.ceil(config.checkpoint.grace_seconds) + SRUN_WAIT_MARGIN_SECONDS
        srun = shlex.join(["srun", "--kill-on-bad-exit=0", f"--wait={wait}"])
        if not command:
            lines.append(f"{srun} {shlex.join([*train, '--set=cluster.resolver=slurm'])}")
        elif processes.coordinated and not every_task:
            # The chief's task (after the parameter servers, `roles`) runs the command; the others serve it.
            serve = shlex.join([*tfdist, "serve", *train_args])
            chief_or_server = f"if [ $SLURM_PROCID -eq {config.parameter_server.num_ps} ]; " \
                              f"then exec {shlex.join(train)}; else exec {serve}; fi"
            lines.append(f"{srun} bash -c {shlex.quote(chief_or_server)}")
        else:
            lines.append(f"{srun} {shlex.join(train)}")
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
