"""What each strategy kind is, in one table. TensorFlow-free.

A kind's row says how its job runs as processes, which `strategy.*` options
and config sections it takes, and its all-reduce choices. Validation and the
launchers (`tfdist launch`, `slurm`, `k8s`) read only the row, so a new kind is
a row here plus its builder in `tfdist/strategies/factory.py`.

Example:

    >>> KINDS["horovod"].processes.name
    'ranks'
    >>> kinds_taking("tensor_parallel_size")
    ['pipeline', 'tensor_parallel']
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

__all__ = [
    "DATA_PARALLEL", "GATED_OPTIONS", "KINDS", "ONE", "PARAMETER_SERVERS", "RANKS", "WORKERS",
    "Backend", "Kind", "KindName", "Processes", "backends_taking", "kinds_taking", "kinds_where",
]


@dataclasses.dataclass(frozen=True)
class Processes:
    """How a job runs as processes; each launcher knows how to start each of these.

    Attributes:
      name: what the docs and errors call it.
      roles: the task roles, in the order the tasks are numbered (none: one process).
      lockstep: every process runs every step (so they save at the same step).
      resolves_cluster: the tasks find each other through a TensorFlow cluster resolver (the
        `cluster` section, TF_CONFIG, Slurm's or Kubernetes' variables); Horovod's ranks do not.
      launch, slurm, k8s: what `tfdist launch`, `tfdist slurm` and `tfdist k8s` start.
    """

    name: str
    roles: tuple[str, ...]
    lockstep: bool
    resolves_cluster: bool
    launch: str
    slurm: str
    k8s: str

    @property
    def several(self) -> bool:
        return bool(self.roles)

    @property
    def coordinated(self) -> bool:
        """A chief schedules the steps on the workers, which serve with the parameter servers."""
        return "chief" in self.roles


ONE = Processes("one process", (), lockstep=False, resolves_cluster=False,
                launch="one process", slurm="refused: one process", k8s="refused: one process")
WORKERS = Processes("workers", ("worker",), lockstep=True, resolves_cluster=True,
                    launch="`--workers` processes on loopback (and a chief with `--chief`), each with its TF_CONFIG",
                    slurm="`srun`, one task per worker, the cluster from Slurm's variables",
                    k8s="Indexed Jobs, a JobSet or a TFJob of workers, behind a headless Service")
RANKS = Processes("ranks", ("worker",), lockstep=True, resolves_cluster=False,
                  launch="`horovodrun -np N --gloo`",
                  slurm="`horovodrun` over the job's nodes",
                  k8s="an MPIJob (a launcher that runs `horovodrun`, workers running sshd)")
PARAMETER_SERVERS = Processes(
    "parameter servers", ("ps", "chief", "worker"), lockstep=False, resolves_cluster=True,
    launch="the parameter servers, a chief and `--workers` workers; the chief trains, the others serve",
    slurm="`srun`: the parameter servers first, then the chief, then the workers",
    k8s="Jobs (or a JobSet or TFJob) of ps, chief and workers; a worker that fails restarts in place")


@dataclasses.dataclass(frozen=True)
class Kind:
    """One strategy kind.

    Attributes:
      name: the `strategy.kind` value.
      summary: one line for the docs.
      processes: how its job runs (ONE, WORKERS, RANKS, PARAMETER_SERVERS).
      local_devices: it trains on this process's devices (`strategy.devices`, every GPU, or
        `strategy.logical_devices` logical CPUs); otherwise each task uses its own accelerator.
      max_devices: the most `strategy.devices` it takes (None: any number).
      options: the GATED_OPTIONS (`strategy.*` keys) it takes.
      sections: the config sections of its own settings that it takes.
      all_reduce: its `strategy.all_reduce` choices.
      splits_tensors: it splits layers' tensors over devices (by default over all of them).
    """

    name: str
    summary: str
    processes: Processes
    local_devices: bool
    max_devices: Optional[int] = None
    options: tuple[str, ...] = ()
    sections: tuple[str, ...] = ()
    all_reduce: tuple[str, ...] = ("auto",)
    splits_tensors: bool = False


# `strategy.*` keys that only some kinds take; the others (devices aside) apply to every kind or are ignored.
GATED_OPTIONS = ("bytes_per_pack", "gradient_compression", "tensor_parallel_size", "data_parallel", "shard_optimizer",
                 "tpu")

KINDS: dict[str, Kind] = {kind.name: kind for kind in (
    Kind("one_device", "one device, no distribution", ONE, local_devices=True, max_devices=1),
    Kind("mirrored", "data parallel over this machine's devices", ONE, local_devices=True,
         options=("shard_optimizer",),
         all_reduce=("auto", "nccl", "hierarchical_copy", "reduction_to_one_device")),
    Kind("multi_worker_mirrored", "data parallel over processes, TensorFlow's collectives", WORKERS,
         local_devices=False, options=("bytes_per_pack", "gradient_compression", "shard_optimizer"),
         all_reduce=("auto", "ring", "nccl")),
    Kind("tpu", "TensorFlow's TPUStrategy", ONE, local_devices=False, options=("tpu",)),
    Kind("pipeline", "layers in stages over devices, micro-batches in flight", ONE, local_devices=True,
         options=("tensor_parallel_size", "data_parallel", "shard_optimizer"), sections=("pipeline",)),
    Kind("parameter_server", "variables on parameter servers, steps on workers", PARAMETER_SERVERS,
         local_devices=False, options=("gradient_compression",), sections=("parameter_server",)),
    Kind("horovod", "data parallel over horovodrun's ranks, Horovod's collectives", RANKS, local_devices=False,
         options=("shard_optimizer",), sections=("horovod",)),
    Kind("tensor_parallel", "layers split or placed over devices", ONE, local_devices=True,
         options=("tensor_parallel_size", "data_parallel", "shard_optimizer"), sections=("placement",),
         splits_tensors=True),
    Kind("layout", "an unchanged model split by a layout's rules (Keras's distribution API)", ONE,
         local_devices=True, options=("data_parallel", "shard_optimizer"), sections=("layout",)),
)}


class KindName(str):
    """A `strategy.kind` value: the kind's name, with `.value` as the enum it once was had (scripts read
    `config.strategy.kind.value`)."""

    @property
    def value(self) -> str:
        return str(self)


@dataclasses.dataclass(frozen=True)
class Backend:
    """A `strategy.data_parallel` backend: a pipeline or tensor-parallel job run over another kind's processes.

    Attributes:
      kind: the kind whose processes, cluster and launchers the job's are.
      options, sections: what of that kind's settings such a job takes.
    """

    kind: str
    options: tuple[str, ...] = ()
    sections: tuple[str, ...] = ()


DATA_PARALLEL: dict[str, Backend] = {
    "multi_worker": Backend("multi_worker_mirrored", options=("bytes_per_pack",)),
    "horovod": Backend("horovod", sections=("horovod",)),
}


def kinds_where(has: Callable[[Kind], bool]) -> list[str]:
    """The names of the kinds whose row `has` (for error messages and the docs)."""
    return [kind.name for kind in KINDS.values() if has(kind)]


def kinds_taking(name: str) -> list[str]:
    """The kinds that take a `strategy.*` option or a section of their own."""
    return kinds_where(lambda kind: name in kind.options + kind.sections)


def backends_taking(name: str) -> list[str]:
    """The `strategy.data_parallel` backends through which a pipeline or tensor-parallel job takes it."""
    return [backend for backend, b in DATA_PARALLEL.items() if name in b.options + b.sections]
