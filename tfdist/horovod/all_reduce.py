"""`HorovodAllReduce`: tf.distribute cross-device ops whose reductions are Horovod collectives.

`tfdist.HorovodStrategy` reduces through it, and so do the process groups of a
pipeline or tensor-parallel job whose replicas span Horovod's ranks.
"""

from __future__ import annotations

import tensorflow as tf
from tfdist._compat.tf_distribute import cross_device_ops_lib

__all__ = ["HorovodAllReduce"]


class HorovodAllReduce(tf.distribute.CrossDeviceOps):
    """Cross-device ops whose reductions run across Horovod's processes.

    All-reduces of a batch of values are the optimizer's gradient all-reduce:
    they use the configured `op` and compression, in one grouped (fused)
    all-reduce. Single reductions (metric reads, `strategy.reduce`) are exact
    sums or means.

    Args:
      hvd: the initialised `horovod.tensorflow` module.
      op: `average`, `sum` or `adasum` (see `HorovodConfig.op`).
      fp16_compression: send float gradients as float16.
    """

    def __init__(self, hvd, *, op: str = "average", fp16_compression: bool = False):
        super().__init__()
        self._hvd = hvd
        self.op = op
        self._compression = hvd.Compression.fp16 if fp16_compression else hvd.Compression.none

    @property
    def _num_between_graph_workers(self):
        return self._hvd.size()  # never take TensorFlow's one-device shortcut

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        op = self._hvd.Average if reduce_op == tf.distribute.ReduceOp.MEAN else self._hvd.Sum
        reduced = self._hvd.allreduce(_local_value(per_replica_value), op=op)
        return cross_device_ops_lib.simple_broadcast(reduced, destinations, always_mirrored=True)

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        reduced = self.all_reduce_group(reduce_op, [_local_value(v) for v, _ in value_destination_pairs])
        return [
            cross_device_ops_lib.simple_broadcast(r, destinations, always_mirrored=True)
            for r, (_, destinations) in zip(reduced, value_destination_pairs)
        ]

    def _all_reduce(self, reduce_op, value, replica_id, options):
        """The replica-context all-reduce (no merge_call) Keras's optimizers use.

        Sparse gradients (IndexedSlices: an embedding's rows) are all-gathered, as
        Horovod's own `allreduce` does them: made dense, a 100,000-row table's
        gradient would cross the network whole every step for the few rows a
        batch touched. Adasum has no sparse form, so there they go dense.
        """
        flat = tf.nest.flatten(value)
        sparse = [isinstance(v, tf.IndexedSlices) and self.op != "adasum" for v in flat]
        dense = [tf.convert_to_tensor(v) for v, is_sparse in zip(flat, sparse) if not is_sparse]
        reduced = iter(self.all_reduce_group(reduce_op, dense) if dense else [])
        return tf.nest.pack_sequence_as(
            value, [self._all_gather(reduce_op, v) if is_sparse else next(reduced) for v, is_sparse in zip(flat, sparse)]
        )

    def _reduction(self, reduce_op):
        """Horovod's op for a batch of gradients, and the factor each rank's values are scaled by first.

        Keras scales each rank's loss by 1/size, so a sum of the gradients is
        their mean; `sum` and `adasum` want each rank's own gradient.
        """
        if reduce_op == tf.distribute.ReduceOp.MEAN:
            return self._hvd.Average, 1.0
        if self.op == "average":
            return self._hvd.Sum, 1.0
        size = float(self._hvd.size())
        return (self._hvd.Sum if self.op == "sum" else self._hvd.Adasum), size

    def _all_gather(self, reduce_op, slices: tf.IndexedSlices) -> tf.IndexedSlices:
        """Every rank's rows and indices, scaled as `all_reduce_group` reduces dense values."""
        op, prescale = self._reduction(reduce_op)
        scale = prescale / self._hvd.size() if op == self._hvd.Average else prescale
        values = self._hvd.allgather(slices.values)
        if scale != 1:
            values = values * tf.cast(scale, values.dtype)
        return tf.IndexedSlices(values, self._hvd.allgather(slices.indices), slices.dense_shape)

    def all_reduce_group(self, reduce_op, tensors: list) -> list:
        """One grouped (fused) all-reduce of a step's gradients, with the configured op."""
        op, prescale = self._reduction(reduce_op)
        if op == self._hvd.Adasum:
            # horovod 0.28.1's grouped_allreduce fails for Adasum on Python 3 (it reads
            # a list comprehension's variable), so Adasum goes tensor by tensor;
            # Horovod still fuses the tensors that are ready in the same cycle.
            return [
                self._hvd.allreduce(t, op=op, compression=self._compression, prescale_factor=prescale)
                for t in tensors
            ]
        return self._hvd.grouped_allreduce(tensors, op=op, compression=self._compression, prescale_factor=prescale)


def _local_value(value) -> tf.Tensor:
    """The one local replica's value, dense (Horovod reduces dense tensors)."""
    values = value.values if isinstance(value, tf.distribute.DistributedValues) else (value,)
    if len(values) != 1:
        raise ValueError(f"HorovodStrategy runs one replica per process; got {len(values)} local values.")
    return tf.convert_to_tensor(values[0])
