"""Collectives within one row or one column of a data x model mesh of this process's devices.

A `LayoutStrategy` runs one replica per device of a `data` x `model` mesh,
data-major: replica `r` sits at data index `r // model` and model index
`r % model`. A split layer's collectives join the replicas of one row (a
model group: the devices that hold the shards of one copy of the model); a
split variable's gradients are summed over one column (a data group: the
devices that hold the same shard). TensorFlow's replica context reduces over
every replica, so each group gets TensorFlow's own collective launchers
(`CollectiveReplicaLauncher`, what MultiWorkerMirroredStrategy runs per
device) under a group key of its own.

Example (in a replica of `strategy`, a MirroredStrategy over the mesh's devices):

    groups = MeshGroups(strategy, model=2)  # over /cpu:0-3
    groups.model_sum(partial)   # summed over /cpu:0-1, or over /cpu:2-3
    groups.data_sum(gradient)   # summed over /cpu:0 and /cpu:2, or over /cpu:1 and /cpu:3
"""

from __future__ import annotations

import re
from collections import Counter

import tensorflow as tf
from tfdist._compat.tf_distribute import collective_util, cross_device_utils, device_util

from tfdist._compat import collective_keys, graph_functions, replica_index

__all__ = ["MeshGroups", "collectives_of_a_step"]

class MeshGroups:
    """The collectives of each replica's row (model group) and column (data group) of a mesh.

    Args:
      strategy: a MirroredStrategy with one replica per place of the mesh, data-major; the groups take their
        collective keys from its own.
      model: the devices along the model axis (the length of a row).
      devices: per replica of this process, the device its collectives run on; default: the replica's own
        (a pipeline's replicas give their stage's).
    """

    def __init__(self, strategy: tf.distribute.MirroredStrategy, model: int, devices=None):
        self.devices = [device_util.canonicalize(d) for d in devices or strategy.extended.worker_devices]
        self.model, self.data = model, len(self.devices) // model
        keys = collective_keys(strategy)
        rows = [self.devices[d * model:(d + 1) * model] for d in range(self.data)]
        columns = [self.devices[m::model] for m in range(model)]
        self._rows = [self._launcher(keys, rows[r // model], device) for r, device in enumerate(self.devices)]
        self._columns = [self._launcher(keys, columns[r % model], device) for r, device in enumerate(self.devices)]

    @staticmethod
    def _launcher(keys, group: list[str], device: str):
        if len(group) == 1:  # nothing to exchange
            return None
        return cross_device_utils.CollectiveReplicaLauncher(
            keys.get_group_key(group), len(group), keys, device, collective_util.Options())

    def row(self, r: int):
        """The collective launcher of local replica r's row (None when the row is one device)."""
        return self._rows[r]

    def column(self, r: int):
        """The collective launcher of local replica r's column (None when the column is one device)."""
        return self._columns[r]

    def local_index(self) -> int:
        """The current replica's index among this process's (TensorFlow's counts every process's replicas)."""
        return replica_index() % len(self.devices)

    def model_index(self) -> int:
        """The current replica's place along the model axis: which shard its device holds."""
        return self.local_index() % self.model

    # Each collective is made in a name scope of its group's (`model_group`, `data_group`), where a test or a
    # benchmark counts them in the step's graph.
    def model_sum(self, t: tf.Tensor) -> tf.Tensor:
        launcher = self._rows[self.local_index()]
        if launcher is None:
            return t
        with tf.name_scope("model_group"):
            return _crossing_as_float32(t, launcher.all_reduce)

    def model_gather(self, t: tf.Tensor, axis: int) -> tf.Tensor:
        """The row's tensors concatenated along `axis`, in model order."""
        launcher = self._rows[self.local_index()]
        if launcher is None:
            return t
        with tf.name_scope("model_group"):
            return _crossing_as_float32(t, lambda value: launcher.all_gather(value, axis))

    def data_sum(self, t):
        """`t` (a tensor or an IndexedSlices) summed over the column."""
        launcher = self._columns[self.local_index()]
        if launcher is None:
            return t
        with tf.name_scope("data_group"):
            if isinstance(t, tf.IndexedSlices):  # an embedding's rows, crossing as float32 too
                summed = launcher.all_reduce_indexed_slices(
                    tf.IndexedSlices(_float32_if_bfloat16(t.values), t.indices, t.dense_shape))
                return tf.IndexedSlices(tf.cast(summed.values, t.dtype), summed.indices, summed.dense_shape)
            return _crossing_as_float32(t, launcher.all_reduce)


def _crossing_as_float32(t: tf.Tensor, collective) -> tf.Tensor:
    """`collective(t)`; a bfloat16 tensor (mixed_bfloat16's activations) crosses as float32, which TensorFlow's
    collectives on CPU take where they refuse bfloat16: exact for a gather, and a sum rounds once, at the end."""
    return tf.cast(collective(_float32_if_bfloat16(t)), t.dtype)


def _float32_if_bfloat16(t: tf.Tensor) -> tf.Tensor:
    return tf.cast(t, tf.float32) if t.dtype == tf.bfloat16 else t


def collectives_of_a_step(model, strategy, batch) -> dict[str, int]:
    """The mesh's collectives one training step of `model` makes on the first replica's device, by group and
    op (`"model_group CollectiveReduceV2": 4`), counted in the step's graph. `batch`: one global batch."""
    step = tf.function(lambda data: strategy.run(model.train_step, args=(data,)))
    data = next(iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors(batch))))
    graph = step.get_concrete_function(data).graph
    first = device_util.canonicalize(strategy.extended.worker_devices[0])
    counts = Counter()
    for op in (op for g in (graph, *graph_functions(graph)) for op in g.get_operations()):
        group = re.search(r"(?:^|/)(model_group|data_group)(?:_\d+)?/", op.name)
        if group and op.type.startswith("Collective") and device_util.canonicalize(op.device) == first:
            counts[f"{group[1]} {op.type}"] += 1
    return dict(sorted(counts.items()))
