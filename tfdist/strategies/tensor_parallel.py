"""`TensorParallelStrategy`: model replicas, each spread over a group of devices.

The devices form groups of `group_size`; each group holds one model replica
and the replicas train data parallel (a `MirroredStrategy` over the first
device of every group: batch splitting, variable mirroring and the gradient
all-reduce are TensorFlow's own). Inside a group, two ways to use its devices:

- tensor parallelism: the layers of `tfdist.layers` split their kernels over
  the group, each shard created (inside a `tf.device` scope) and computed on
  its device;
- model parallelism: `placement` maps layer names to devices of the first
  group; a placed layer's variables are created there (matched by the Keras
  name scope they are built in) and its forward and backward run there.

Where variables live comes from `ReplicaGroupsStrategy`: a variable made on a
group device is mirrored onto the same position of every group (shard 1 of a
kernel on the second device of each group), optimizer slots live beside their
variables and updates run there. What this adds is which device a variable
belongs on (its shard's, or its placed layer's) and each replica's layers
computing on its own group. Everything else stays on each group's first
device. `model.fit` is plain Keras; with one group the numerics are
single-device training's, with several they are data parallel training's.

Example:

    >>> strategy = TensorParallelStrategy(["/cpu:0"])
    >>> with strategy.scope():
    ...     layer = tfdist.layers.ParallelMLP(8)  # doctest: +SKIP
"""

from __future__ import annotations

import collections
import sys
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import keras
import tensorflow as tf
from tfdist._compat.tf_distribute import ops

from tfdist.errors import ConfigError
from tfdist.layers.tensor_parallel import split_layers
from tfdist.parallel.device_group import DeviceGroup, current_replica, split_into_groups
from tfdist.parallel.placement import balance_by_memory, device_for_scope, place_computation, unknown_layers
from tfdist.strategies.devices import default_devices, split_cpu
from tfdist.strategies.replica_groups import ReplicaGroupsStrategy, make_process_group

__all__ = ["TensorParallelStrategy"]


class TensorParallelStrategy(ReplicaGroupsStrategy):
    """Replicas of `group_size` devices each; tensor-parallel layers split over a group, placed layers go to theirs.

    Args:
      devices: every device; group g is devices[g*S:(g+1)*S] for group size
        S, in shard order. A group's first device also holds everything that
        is neither sharded nor placed. Default: every GPU, else every logical
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
        stage 1), each slice of a shard on its device in the group, over the
        groups of every process with `data_parallel`; 2 also reduce-scatters
        the gradients (stage 2).

    Raises:
      ValueError: a device that does not exist or is named twice, a group size
        that does not divide the device count, or a placement device outside
        the first group.
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
        super().__init__([group.devices for group in self.groups], processes=processes, shard_optimizer=shard_optimizer)
        self.placement: dict[str, str] = {}
        self.place(placement or {})
        self.balance_by_memory = balance_by_memory
        self._said_unsplit: set[str] = set()  # the models it has said so of

    @property
    def tensor_parallel_group(self) -> DeviceGroup:
        """The group of the replica whose step is being built (the first outside a step)."""
        return self.groups[current_replica()]

    def variable_device(self) -> Optional[str]:
        """A shard's device (its layer's `tf.device`, or the user's), else a placed layer's."""
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
            with DeviceGroup(self.groups[0].devices[:1]).scope():
                probe = build_model()  # on one device: only its layers' names and sizes are wanted
            self.place(balance_by_memory(probe, self.groups[0].devices))

    def check_model(self, model: keras.Model) -> None:
        """Raises ConfigError when `placement.layers` names a layer the model does not have."""
        unknown = unknown_layers(model, self.placement)
        if unknown:
            names = ", ".join(sorted(layer.name for layer in model.layers))
            raise ConfigError("placement.layers", f"must name layers of the {model.name} model ({names}).", unknown)

    def job_report(self, model: keras.Model) -> dict[str, Any]:
        """The groups layers split over (when they hold more than one device) and where placed layers went."""
        report: dict[str, Any] = {"layout": self.device_layout(tensor_parallel_size=self.groups[0].size)}
        if self.groups[0].size > 1:
            report["tensor_parallel_groups"] = [list(group.devices) for group in self.groups]
        if self.placement:
            per_device = collections.Counter(self.placement.values())
            report["placement"] = ", ".join(f"{n} layer(s) on {d}" for d, n in sorted(per_device.items()))
        return {**report, **super().job_report(model)}  # the optimizer's split, if any

    def local_keras_hooks(self, model: keras.Model) -> dict[str, Any]:
        """Places the named layers' computation before Keras makes its step functions; says once if nothing of
        the model spreads over a group."""
        place_computation(model, self.placement, resolve=self.local_device)
        size = self.groups[0].size
        if size > 1 and not self.placement and model.name not in self._said_unsplit and not split_layers(model):
            self._said_unsplit.add(model.name)
            print(f"tfdist: tensor_parallel: the {model.name} model has no tensor-parallel layers (tfdist.layers) "
                  f"and no placed layers, so nothing is split: each group of {size} devices trains it whole on its "
                  f"first device, data parallel over {len(self.groups)} group(s)", file=sys.stderr, flush=True)
        return super().local_keras_hooks(model)
