"""The processes of a multi-process job, as strategies with several devices per process see them.

`PipelineStrategy` and `TensorParallelStrategy` run their model replicas on
the devices of one process. With `data_parallel` set, every process of a
multi-worker cluster or of a `horovodrun` job runs its own replicas, and the
replicas of all processes train data parallel. A `ProcessGroup` is what such
a strategy needs from the processes:

- `all_reduce`: a list of tensors that all live on one device, reduced across
  the processes on that device (each process passes its counterpart device:
  stage 1's gradients are reduced between the stage-1 devices, and never
  gathered on another device);
- `broadcast`: process 0's initial value of a variable, so every process
  starts from the same weights;
- `reduce_scatter` and `all_gather`: an optimizer state split over the
  replicas of every process (`shard_optimizer`) shares its slices with them;
- `any_process`, `job_error`, `wrap_step`: the agreement, lost-peer errors and
  hang protection of the backend's own strategy.

Two backends, each built on the strategy tfdist already has for it:

- `WorkerProcesses`: TensorFlow's collectives (`CollectiveReduceV2`) over the
  cluster a `MultiWorkerMirroredStrategy` started (from TF_CONFIG or the
  `cluster` section), one collective group per device position;
- `HorovodProcesses`: Horovod's collectives among the ranks `horovodrun`
  started, through `HorovodStrategy`'s configured all-reduce (op, fusion,
  compression) and its step watchdog.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

import tensorflow as tf
from tfdist import _compat
from tfdist._compat.tf_distribute import collective_util, context, cross_device_utils

from tfdist.errors import ClusterError

__all__ = ["HorovodProcesses", "ProcessGroup", "WorkerProcesses"]

# Collective group keys of their own, above the ones MirroredStrategy instances number (int32 keys).
_GROUP_KEY_START = 2_000_000_000


class ProcessGroup:
    """The processes of the job (see the module docstring); `strategy` is the backend's own strategy."""

    name = ""

    def __init__(self, strategy: tf.distribute.Strategy, size: int, index: int):
        self.strategy = strategy
        self.size = size
        self.index = index

    def all_reduce(self, reduce_op: tf.distribute.ReduceOp, tensors: list, device: str) -> list:
        raise NotImplementedError

    def broadcast(self, value: tf.Tensor) -> tf.Tensor:
        """Process 0's `value`, on every process (called eagerly, by every process in the same order)."""
        raise NotImplementedError

    def all_gather(self, tensor: tf.Tensor, device: Optional[str] = None) -> tf.Tensor:
        """Every process's `tensor`, concatenated along axis 0 in process order (on `device`, whose
        counterparts the other processes name; default: the tensor's own)."""
        raise NotImplementedError

    def reduce_scatter(self, tensor: tf.Tensor, device: str, stage: int) -> tf.Tensor:
        """This process's part (the `index`-th of `size`) of the sum over the processes of the 1-D
        `tensor` on `device`: by a reduce-scatter at `stage` 2 or 3, at stage 1 by an all-reduce of which
        it keeps its part (ZeRO's stages, `tfdist.parallel.optimizer_shards`)."""
        raise NotImplementedError

    def any_process(self, flag: bool) -> bool:
        return self.strategy.any_process(flag)

    def job_error(self, error: tf.errors.OpError) -> Optional[ClusterError]:
        return self.strategy.job_error(error)

    def wrap_step(self, function: Callable) -> Callable:
        return function

    def describe(self) -> str:
        return f"{self.size} process(es) ({self.name})"


class WorkerProcesses(ProcessGroup):
    """TensorFlow collectives among the tasks of a multi-worker cluster.

    Args:
      strategy: a `tfdist.strategies.MultiWorkerMirroredStrategy`; making it
        started this task's server, joined the cluster and enabled
        collectives. Its communication options (implementation, timeout) apply.
    """

    name = "multi_worker"

    def __init__(self, strategy):
        workers, index, self._options = _compat.worker_place(strategy)
        super().__init__(strategy, workers, index)
        self._keys = cross_device_utils.CollectiveKeys(group_key_start=_GROUP_KEY_START)
        self._launchers: dict[str, cross_device_utils.CollectiveReplicaLauncher] = {}
        self._lock = threading.Lock()
        self._host = context.context().host_address_space()

    def _launcher(self, device: str) -> cross_device_utils.CollectiveReplicaLauncher:
        """The collective group of this device and its counterparts on the other tasks."""
        spec = tf.DeviceSpec.from_string(device)
        local = f"{self._host}/device:{spec.device_type}:{spec.device_index or 0}"
        with self._lock:
            if local not in self._launchers:
                group = self._keys.get_group_key([local])
                self._launchers[local] = cross_device_utils.CollectiveReplicaLauncher(
                    group, self.size, self._keys, local, self._options
                )
            return self._launchers[local]

    def all_reduce(self, reduce_op, tensors, device):
        launcher = self._launcher(device)
        reduced = launcher.batch_all_reduce([list(tensors)], collective_util.Options())
        if reduce_op == tf.distribute.ReduceOp.MEAN:
            reduced = [r / self.size for r in reduced]
        return reduced

    def broadcast(self, value):
        return _compat.broadcast(self._launcher("/cpu:0"), self._keys, value, self.size, send=self.index == 0)

    def all_gather(self, tensor, device=None):
        return _compat.all_gather(self._launcher(device or tensor.device or "/cpu:0"), tensor)

    def reduce_scatter(self, tensor, device, stage):
        return _compat.slice_of_sum(self._launcher(device), tensor, self.index, stage)


class HorovodProcesses(ProcessGroup):
    """Horovod's collectives among the ranks `horovodrun` started.

    Args:
      strategy: a `tfdist.strategies.HorovodStrategy`; making it initialised
        Horovod with its runtime options. Its all-reduce (op, compression) and
        step watchdog apply.
    """

    name = "horovod"

    def __init__(self, strategy):
        super().__init__(strategy, strategy.size, strategy.rank)
        self._broadcasts = 0

    def all_reduce(self, reduce_op, tensors, device):
        with tf.device(device):
            return self.strategy.horovod_all_reduce.all_reduce_group(reduce_op, list(tensors))

    def broadcast(self, value):
        self._broadcasts += 1  # the same name on every rank: variables are made in the same order
        return self.strategy.hvd.broadcast(tf.convert_to_tensor(value), root_rank=0,
                                           name=f"tfdist_group_initial_value_{self._broadcasts}")

    def all_gather(self, tensor, device=None):
        with tf.device(device or tensor.device):
            return self.strategy.hvd.allgather(tensor)

    def reduce_scatter(self, tensor, device, stage):
        hvd = self.strategy.hvd
        with tf.device(device):
            if stage >= 2:
                return hvd.reducescatter(tensor, op=hvd.Sum)
            length = tensor.shape[0] // self.size
            return hvd.allreduce(tensor, op=hvd.Sum)[self.index * length:(self.index + 1) * length]

    def wrap_step(self, function):
        watchdog = self.strategy._watchdog
        return watchdog.wrap(function) if watchdog else function
