"""`TensorParallelStrategy`: model replicas, each spread over a group of devices.

The devices form groups of `group_size`; each group holds one model replica
and the replicas train data parallel. Two ways to use a group's devices:

- tensor parallelism (no placement): Megatron-LM's split, found in the model
  (`tfdist.parallel.layout.Layout(megatron=True)`: every MultiHeadAttention on
  its heads, every Dense pair and `tfdist.layers`' blocks column then row),
  each group a row of a layout's mesh (`SplitsByLayout`, as `LayoutStrategy`
  runs it: one replica per device, the split layers' collectives within the
  group);
- model parallelism: `placement` maps layer names to devices of the first
  group; a placed layer's variables are created there (matched by the Keras
  name scope they are built in) and its forward and backward run there; each
  group is one replica (`ReplicaGroupsStrategy`), whose first device holds
  everything that is not placed.

`model.fit` is plain Keras; with one group the numerics are single-device
training's, with several they are data parallel training's.

Example:

    >>> strategy = TensorParallelStrategy(["/cpu:0"])
    >>> with strategy.scope():
    ...     layer = tfdist.layers.ParallelMLP(8)  # doctest: +SKIP
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import keras
import tensorflow as tf
from tfdist._compat.tf_distribute import ops

from tfdist.errors import ConfigError
from tfdist.parallel.device_group import split_into_groups
from tfdist.parallel.layout import Layout
from tfdist.parallel.mesh_groups import MeshGroups
from tfdist.parallel.placement import balance_by_memory, device_for_scope, place_computation, unknown_layers
from tfdist.parallel.weight_shards import KEEP_WHOLE_BELOW
from tfdist.strategies.devices import default_devices, split_cpu
from tfdist.strategies.replica_groups import ReplicaGroupsStrategy, make_process_group
from tfdist.strategies.split_by_layout import SplitsByLayout

__all__ = ["TensorParallelStrategy"]


class TensorParallelStrategy(SplitsByLayout, ReplicaGroupsStrategy):
    """Replicas of `group_size` devices each; the model split over a group (Megatron's split), or its layers
    placed on a group's devices.

    Args:
      devices: every device; group g is devices[g*S:(g+1)*S] for group size
        S, in shard order. Default: every GPU, else every logical
        CPU (on a CPU-only host not yet split, at least `group_size` of them).
      group_size: devices per group (S); None puts all devices in one group.
      placement: layer name -> device of the first group, for layers built in
        this strategy's scope (see `tfdist.parallel.placement`); the other
        groups place the same layers at the same positions.
      balance_by_memory: before `tfdist train` builds the model, place its
        layers over the first group by their memory (from a throwaway build).
      data_parallel: `local`, `multi_worker`, `horovod` or a strategy for
        them: train the groups of every process of a multi-process job data
        parallel (see `PipelineStrategy`).
      shard_optimizer: 1 splits the optimizer's state over the groups (ZeRO
        stage 1), over the groups of every process with `data_parallel`: a
        placed model's each slice beside its variable, a split model's each
        device's own shard (the mesh's data axis); 2 also reduce-scatters the
        gradients; 3 splits the weights too (not a placed model's in this
        version).
      keep_whole_below, prefetch_weights: at stage 3, as for `MirroredStrategy`.

    Raises:
      ValueError: a device that does not exist or is named twice, a group size
        that does not divide the device count, a placement device outside
        the first group, or `shard_optimizer` 3 with a placed model.
    """

    def __init__(
        self,
        devices: Optional[Sequence[str]] = None,
        *,
        group_size: Optional[int] = None,
        placement: Optional[Mapping[str, str]] = None,
        balance_by_memory: bool = False,
        data_parallel: Union[str, tf.distribute.Strategy] = "local",
        shard_optimizer: int = 0,
        keep_whole_below: int = KEEP_WHOLE_BELOW,
        prefetch_weights: bool = True,
    ):
        if devices is None:
            split_cpu(group_size or 1)
        processes = make_process_group(data_parallel)  # joining a cluster must come before TensorFlow starts
        devices = list(devices or default_devices(group_size or 1))
        size = group_size or len(devices)
        if size < 1 or len(devices) % size:
            raise ValueError(
                f"`group_size` must divide the {len(devices)} devices into whole groups. Received: {group_size}"
            )
        self.groups = split_into_groups(devices, size)
        splits = size > 1 and not placement and not balance_by_memory
        if shard_optimizer == 3 and not splits:  # a placed layer's gradient op would read a split weight whole
            raise ValueError("`shard_optimizer` 3 (the weights split) does not apply to a placed model in this "
                             "version; use 2, or split the model (no placement). Received: 3")
        replicas = [[device] for device in devices] if splits else [group.devices for group in self.groups]
        super().__init__(replicas, processes=processes, shard_optimizer=shard_optimizer,
                         keep_whole_below=keep_whole_below, prefetch_weights=prefetch_weights)
        if splits:  # each group a row of the mesh, the groups its data axis
            self._start_splitting(Layout(model=size, data=len(self.groups), megatron=True),
                                  config_key="strategy.tensor_parallel_size")
            self._mesh_groups = MeshGroups(self, size)
        self.placement: dict[str, str] = {}
        self.place(placement or {})
        self.balance_by_memory = balance_by_memory

    @property
    def mesh_groups(self) -> Optional[MeshGroups]:
        return self._mesh_groups if self.layout is not None else None

    def variable_device(self) -> Optional[str]:
        """The user's `tf.device`, else a placed layer's."""
        return super().variable_device() or device_for_scope(self.placement, ops.get_name_scope())

    def place(self, placement: Mapping[str, str]) -> None:
        """Sets layer name -> device for the layers built in this scope from now on.

        Raises:
          ValueError: a device outside the strategy's first group.
        """
        first = self.groups[0]
        outside = sorted({d for d in placement.values() if first.index(d) is None})
        if outside:
            raise ValueError(f"`placement` must use the devices of the first group {first.devices}. Received: {outside}")
        self.placement = dict(placement)

    def before_build(self, build_model: Callable[[], keras.Model]) -> None:
        """With `balance_by_memory`, places the layers of a throwaway build (for `tfdist train`)."""
        if self.balance_by_memory:
            with tf.device(self.groups[0].devices[0]):
                probe = build_model()  # on one device: only its layers' names and sizes are wanted
            self.place(balance_by_memory(probe, self.groups[0].devices))

    def check_model(self, model: keras.Model) -> None:
        """Raises ConfigError when `placement.layers` names a layer the model does not have, or (split) when
        Megatron's split does not fit it."""
        unknown = unknown_layers(model, self.placement)
        if unknown:
            names = ", ".join(sorted(layer.name for layer in model.layers))
            raise ConfigError("placement.layers", f"must name layers of the {model.name} model ({names}).", unknown)
        super().check_model(model)

    def job_report(self, model: keras.Model) -> dict[str, Any]:
        """The groups layers split over (when they hold more than one device) and where placed layers went."""
        report: dict[str, Any] = {"layout": self.device_layout(tensor_parallel_size=self.groups[0].size,
                                                              split_by_layout=self.layout is not None)}
        if self.groups[0].size > 1:
            report["tensor_parallel_groups"] = [list(group.devices) for group in self.groups]
        if self.placement:
            per_device = collections.Counter(self.placement.values())
            report["placement"] = ", ".join(f"{n} layer(s) on {d}" for d, n in sorted(per_device.items()))
        return {**report, **super().job_report(model)}  # the optimizer's split, if any

    def local_keras_hooks(self, model: keras.Model) -> dict[str, Any]:
        """Places the named layers' computation before Keras makes its step functions."""
        place_computation(model, self.placement, resolve=self.local_device)
        return super().local_keras_hooks(model)
