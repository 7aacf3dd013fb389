"""`LayoutStrategy`: an unchanged Keras model split over devices by a layout, as Keras's distribution API does on JAX.

Build and compile the model under the strategy's scope, as under any
tf.distribute strategy; its variables that the layout's rules match are split
when the optimizer is built (`tfdist.parallel.split_variables`), each matched
layer then computes on its shards (`tfdist.parallel.spmd`), and the optimizer's
slots of a split variable are split beside it. Every replica runs the whole
model on the whole batch: the layers the layout leaves whole are computed on
each device alike, as in Megatron-LM.

    layout_map = keras.distribution.LayoutMap(keras.distribution.DeviceMesh((1, 2), ("batch", "model")))
    layout_map["dense.*kernel"] = (None, "model")
    strategy = tfdist.LayoutStrategy(layout_map)
    with strategy.scope():
        model = build_model()
        model.compile(...)
    model.fit(...)

The mesh's rows (model groups) train data parallel: each row computes on its
share of the global batch, a split variable's gradients are summed over its
column (`tfdist.parallel.mesh_groups`), every other gradient over all replicas.
A weight that the layout splits over the data axis too (keras-hub's maps do,
for fully-sharded data parallelism) is held whole along it.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Sequence

import keras
import tensorflow as tf

from tfdist.parallel.layout import Layout, LayoutError
from tfdist.parallel.mesh_groups import MeshGroups
from tfdist.parallel.split_variables import is_split
from tfdist.parallel.weight_shards import KEEP_WHOLE_BELOW
from tfdist.strategies.data_parallel import MirroredStrategy
from tfdist.strategies.devices import default_devices
from tfdist.strategies.horovod import HorovodStrategy
from tfdist.strategies.multi_worker import MultiWorkerMirroredStrategy
from tfdist.strategies.replica_groups import ReplicaGroupsStrategy, make_process_group
from tfdist.strategies.split_by_layout import SplitsByLayout

__all__ = ["LayoutStrategy", "launched_data_parallel", "set_distribution", "strategy_from"]


class LayoutStrategy(SplitsByLayout, ReplicaGroupsStrategy):
    """Splits the variables of models built under its scope as `layout` says, over its devices.

    Args:
      layout: a `keras.distribution.LayoutMap` (a keras-hub backbone's `get_layout_map(mesh)` too), a
        `keras.distribution.ModelParallel`, or a `tfdist.parallel.layout.Layout`.
      devices: the mesh's devices, data-major (default: the mesh's, else the first ones of this process).
      data_parallel: `multi_worker`, `horovod` (or a strategy over processes): every process of that job runs
        this mesh on its own devices and the meshes' rows train data parallel, the data axis spanning the
        processes; `local` or None: this process alone.
      config_key: the config key the layout came from (`layout.rules`): a layout that does not fit the
        model is then that key's ConfigError.
      shard_optimizer: 1 splits the optimizer's state over the mesh's rows (the data axis, every process's):
        each replica keeps the slots of its row's slice of its own shard of every variable (ZeRO stage 1), 2
        also reduce-scatters the gradients, 3 splits the weights too (`MeshSlices`); 0 keeps them whole.
      keep_whole_below, prefetch_weights: at stage 3, as for `MirroredStrategy`.

    Raises:
      LayoutError: other than one device per place of the mesh, or more devices than this process has.
    """

    # Clipping by norm would see a split variable's shard as the whole; refused at compile (`after_compile`).
    clips_after_all_reduce = False

    def __init__(self, layout, devices: Optional[Sequence[str]] = None, *, data_parallel=None,
                 config_key: Optional[str] = None, shard_optimizer: int = 0, keep_whole_below: int = KEEP_WHOLE_BELOW,
                 prefetch_weights: bool = True):
        self.layout = layout if isinstance(layout, Layout) else Layout.from_keras(layout)
        size = self.layout.data * self.layout.model
        devices = list(devices or self.layout.devices or _first_devices(size))
        if len(devices) != size:
            mesh = f"{self.layout.data_axis!r}: {self.layout.data}, {self.layout.model_axis!r}: {self.layout.model}"
            raise LayoutError(f"The mesh ({mesh}) has {size} places, and {len(devices)} devices are given: {devices}.")
        super().__init__([[device] for device in devices], processes=make_process_group(data_parallel),
                         shard_optimizer=shard_optimizer, keep_whole_below=keep_whole_below,
                         prefetch_weights=prefetch_weights)
        self._start_splitting(self.layout, config_key)
        self._mesh_groups = MeshGroups(self, self.layout.model)

    @property
    def mesh_groups(self) -> MeshGroups:
        return self._mesh_groups

    def job_report(self, model: keras.Model) -> dict[str, Any]:
        processes, _ = self.input_workers()
        mesh = {self.layout.data_axis: self.layout.data * processes, self.layout.model_axis: self.layout.model}
        split_variables = sum(is_split(v) for v in model.variables)
        text = (f"mesh {' x '.join(f'{axis} {size}' for axis, size in mesh.items())} over {processes} process(es), "
                f"{split_variables} variable(s) split")
        return {"layout": {"mesh": mesh, "processes": processes, "split_variables": split_variables, "text": text,
                           "model_copies": self.layout.data * processes}}


def strategy_from(distribution, data_parallel=None) -> tf.distribute.Strategy:
    """The tfdist strategy of a Keras distribution written for JAX: a `keras.distribution.ModelParallel` (or
    its `LayoutMap`) becomes a `LayoutStrategy`, a `keras.distribution.DataParallel` a `MirroredStrategy` over
    its devices (across the processes of a job, tfdist's `MultiWorkerMirroredStrategy` or `HorovodStrategy`).
    Build and compile the model under the strategy's scope and call `fit`, as with Keras's `distribution.scope()`.

    Args:
      distribution: the Keras distribution (its mesh holds this process's devices: TensorFlow's
        `keras.distribution.list_devices()` lists the local ones).
      data_parallel: `local`, `multi_worker` or `horovod`; None: the launcher's (`launched_data_parallel`).

    Raises:
      LayoutError: a layout this version cannot run (see `LayoutStrategy`).
      ValueError: anything else, such as a DataParallel mesh of several devices in a process of a Horovod job
        (one replica per process) or of several CPUs in a multi-worker job (one per process, or one per GPU).
    """
    data_parallel = data_parallel or launched_data_parallel()
    if data_parallel not in ("local", "multi_worker", "horovod"):
        raise ValueError(f"`data_parallel` must be local, multi_worker or horovod. Received: {data_parallel!r}")
    if isinstance(distribution, keras.distribution.DataParallel):
        devices = ["/" + str(d).lstrip("/") for d in distribution.device_mesh.devices.flatten()]
        if data_parallel == "local":
            return MirroredStrategy(devices)
        gpus = all("GPU" in d.upper() for d in devices)
        if len(devices) > 1 and (data_parallel == "horovod" or not gpus):
            raise ValueError(f"A DataParallel over {len(devices)} devices of one process ({', '.join(devices)}) "
                             f"cannot run under {data_parallel}, which runs one replica per process "
                             f"{'' if data_parallel == 'horovod' else 'on a CPU '}(one per GPU with multi_worker); "
                             "give it one device, or use a ModelParallel mesh with a data axis.")
        if data_parallel == "horovod":
            return HorovodStrategy(device=devices[0])
        return MultiWorkerMirroredStrategy()
    if isinstance(distribution, (keras.distribution.ModelParallel, keras.distribution.LayoutMap)):
        return LayoutStrategy(distribution, data_parallel=data_parallel)
    raise ValueError("`distribution` must be a keras.distribution.ModelParallel, LayoutMap or DataParallel. "
                     f"Received: {distribution!r}")


def launched_data_parallel() -> str:
    """How the launcher started this process: `multi_worker` (a TF_CONFIG of several chief and worker tasks),
    `horovod` (`horovodrun`'s or `mpirun`'s ranks, more than one) or `local`."""
    cluster = json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster", {})
    if len(cluster.get("chief", [])) + len(cluster.get("worker", [])) > 1:
        return "multi_worker"
    ranks = os.environ.get("HOROVOD_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or "1"
    return "horovod" if int(ranks) > 1 else "local"


def set_distribution(distribution, data_parallel=None) -> tf.distribute.Strategy:
    """Keras's `keras.distribution.set_distribution` on TensorFlow: `strategy_from(distribution)` made the
    strategy of everything built after it in this process (TensorFlow's `experimental_set_strategy`), so a
    script written for JAX changes this one line and builds, compiles and fits with no `scope()`. Returns
    the strategy.

    Raises:
      LayoutError, ValueError: as `strategy_from`.
    """
    strategy = strategy_from(distribution, data_parallel)
    tf.distribute.experimental_set_strategy(strategy)
    return strategy


def _first_devices(count: int) -> list[str]:
    """The first `count` GPUs, else logical CPUs (the CPU split into them if TensorFlow has not started)."""
    try:
        devices = default_devices(count)
    except ValueError as error:
        raise LayoutError(f"The mesh has {count} devices: {error}") from None
    if len(devices) < count:
        raise LayoutError(f"The mesh has {count} devices and this process has {len(devices)} ({', '.join(devices)}).")
    return devices[:count]
