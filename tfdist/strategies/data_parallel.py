"""Single-host data-parallel strategies from config: TensorFlow's own, configured.

What tfdist adds over calling tf.distribute directly: the all-reduce
implementation chosen by name in config, and a clear ConfigError instead of a
runtime failure for choices the machine cannot honour (nccl without GPUs, tpu
without a TPU), and a `MirroredStrategy` that can share a process with other
instances, whose gradient clipping sees the all-reduced gradient as on one
device, and whose training function is faster than Keras's and trains with
`steps_per_execution` > 1 (`multi_step_function`).
Multi-worker all-reduce is in `multi_worker.py`.
"""

from __future__ import annotations

import itertools

import tensorflow as tf
from tfdist._compat.tf_distribute import distribute_lib, mirrored_strategy

from typing import Any

import keras

from tfdist import _compat
from tfdist.parallel.optimizer_shards import SplitsOptimizerState, collective_ops_stage
from tfdist.parallel.weight_shards import KEEP_WHOLE_BELOW
from tfdist.contract import StrategyContract
from tfdist.strategies.batch_share import weighted_by_batch_share
from tfdist.strategies.devices import ensure_logical_cpus

__all__ = ["MirroredStrategy", "multi_step_function"]


class MirroredStrategy(SplitsOptimizerState, StrategyContract, tf.distribute.MirroredStrategy):
    """`tf.distribute.MirroredStrategy` that coexists with other instances.

    Every TensorFlow MirroredStrategy numbers its collective groups from the
    same start, so a second instance over a different device set in the same
    process fails at its first all-reduce ("joining a group with size 4, but
    that group has size 2"). Each instance here numbers its groups from its own
    base (TensorFlow's `_collective_key_base` hook), so benchmarks and tests can
    compare 1, 2 and 4 devices in one process.

    With `shard_optimizer=1`, an optimizer compiled under its scope keeps the
    state of 1/N of every variable on each of the N devices instead of all of it
    on each (ZeRO stage 1, `tfdist.parallel.optimizer_shards`); with 2 the
    gradients are also reduce-scattered (stage 2).

    Example:

        >>> strategy = MirroredStrategy(["/cpu:0", "/cpu:1"])
        >>> strategy.num_replicas_in_sync
        2
    """

    # Gradient clipping sees the all-reduced gradient, as on one device (`_compat`).
    clips_after_all_reduce = True
    _key_bases = itertools.count(1)
    _KEYS_PER_INSTANCE = 1_000_000
    _KEYS_PER_PROCESS = 10_000  # up to 100 processes
    # A subclass that places variables its own way gives its MirroredExtended subclass here.
    _extended_type = mirrored_strategy.MirroredExtended

    def __init__(self, devices=None, cross_device_ops=None, *, process_index: int = 0, shard_optimizer: int = 0,
                 keep_whole_below: int = KEEP_WHOLE_BELOW, prefetch_weights: bool = True):
        """`process_index`: this process's index when its local collectives share a cluster's
        collective runtime with other processes (their local groups must not share keys).
        `shard_optimizer`: 1 splits the state of an optimizer compiled under this strategy over its
        devices, 2 also reduce-scatters the gradients, 3 splits the weights too; 0 keeps a whole copy on each.
        `keep_whole_below`: at stage 3, variables with fewer elements stay whole on every device;
        `prefetch_weights`: at stage 3, gather a layer's weights while the layer before it computes."""
        self.shard_optimizer = collective_ops_stage(shard_optimizer)
        self.keep_whole_below, self.prefetch_weights = keep_whole_below, prefetch_weights
        make_named_cpus(devices)
        self._collective_key_base = (next(self._key_bases) * self._KEYS_PER_INSTANCE
                                     + process_index * self._KEYS_PER_PROCESS)
        # tf.distribute.MirroredStrategy.__init__ would make a plain MirroredExtended.
        distribute_lib.Strategy.__init__(
            self, self._extended_type(self, devices=devices, cross_device_ops=cross_device_ops)
        )

    def keras_hooks(self, model: keras.Model) -> dict[str, Any]:
        return multi_step_hooks(self, model)


def make_named_cpus(devices) -> None:
    """Makes the logical CPU devices `devices` names (`/cpu:1`, ...) if TensorFlow has not started yet:
    a replica on a CPU device that does not exist would wait for its peers forever."""
    if not devices or not all(isinstance(d, str) for d in devices):
        return
    specs = [tf.DeviceSpec.from_string(d) for d in devices]
    indices = [s.device_index or 0 for s in specs if (s.device_type or "").upper() == "CPU" and s.job in (None, "localhost")]
    if indices:
        ensure_logical_cpus(max(indices) + 1)


def multi_step_hooks(strategy: tf.distribute.Strategy, model: keras.Model) -> dict[str, Any]:
    """tfdist's training function (`multi_step_function`) in place of Keras's."""
    return {"train_function": multi_step_function(strategy, model)}


def multi_step_function(strategy: tf.distribute.Strategy, model: keras.Model, *, pack_logs: bool = False,
                        step: str = "train_step"):
    """`model.steps_per_execution` training steps per call (`step="test_step"`: evaluation steps, for a
    strategy whose collectives cannot run in a `tf.cond` either), in one `tf.function`, none inside a `tf.cond`.

    Keras's own function is slower and, over several replicas, fails with
    `steps_per_execution` > 1:

    - With one step per call, it wraps the step's function in another and
      returns its logs in a `tf.experimental.Optional` that the host then
      unpacks with two more op calls. Under Horovod (2 ranks, digits CNN, 9 ms
      steps) one run measured it at 0.90 of the samples/sec of the same Keras
      `train_step` in one `tf.function`; a re-run found the two within 1%.
    - With more, its while loop puts each step in a `tf.cond`; a step whose
      optimizer calls `merge_call` fails there when a MirroredStrategy has
      several replicas ("You must feed a value for placeholder tensor ...
      while/cond/Placeholder", keras-team/keras#19246).

    Here the first step runs as is and the rest in a while loop that checks
    for data in its condition; only fetching the next batch is conditional.
    Returns the last step's logs, as Keras's function does. Data that is not
    an iterator (`train_on_batch`) is run a batch at a time, as Keras does.
    With `pack_logs`, each step's logs are averaged over the replicas in one
    reduction (`packed_logs_step`).
    """
    steps = model.steps_per_execution
    model_step = weighted_by_batch_share(model.train_step) if step == "train_step" else getattr(model, step)
    one_step = packed_logs_step(strategy, model, model_step) if pack_logs else (
        lambda data: _compat.keras_reduce_per_replica(strategy.run(model_step, args=(data,)), strategy))
    one_step_function = tf.function(one_step, reduce_retracing=True)

    @tf.function
    def run_steps(iterator):
        outputs = one_step(next(iterator))
        if steps == 1:
            return outputs

        def more(step, outputs, batch):
            return tf.logical_and(step < steps, batch.has_value())

        def next_step(step, outputs, batch):
            outputs = one_step(batch.get_value())
            # Fetch another batch only if another step will run, as Keras does.
            batch = tf.cond(step + 1 < steps, iterator.get_next_as_optional, lambda: batch)
            return step + 1, outputs, batch

        return tf.while_loop(more, next_step, [tf.constant(1), outputs, iterator.get_next_as_optional()])[1]

    def train_function(iterator):
        if not isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            outputs = None
            for _, data in zip(range(steps), iterator):
                outputs = one_step_function(data)
            return outputs
        try:
            return run_steps(iterator)
        except tf.errors.OutOfRangeError:
            raise StopIteration from None

    return train_function


def packed_logs_step(strategy: tf.distribute.Strategy, model: keras.Model, train_step):
    """A training step whose logs (loss and metrics) are averaged over the replicas in one reduction.

    Keras averages each log with its own `strategy.reduce`; across workers each
    is a collective of its own, every step (two for a loss and one metric).
    Here the replicas stack their scalar logs and one `reduce` averages the
    stack: the same means, one collective. Logs that are not all scalars take
    Keras's reduction.
    """
    layout: dict[str, Any] = {}

    def replica_step(data):
        logs = train_step(data)
        flat = tf.nest.flatten(logs)
        layout["packed"] = bool(flat) and all(t.shape.rank == 0 and t.dtype.is_floating for t in flat)
        if not layout["packed"]:
            return logs
        layout.update(structure=logs, dtypes=[t.dtype for t in flat])
        return tf.stack([tf.cast(t, tf.float32) for t in flat])

    def one_step(data):
        outputs = strategy.run(replica_step, args=(data,))
        if not layout["packed"]:
            return _compat.keras_reduce_per_replica(outputs, strategy)
        means = tf.unstack(strategy.reduce(tf.distribute.ReduceOp.MEAN, outputs, axis=None))
        return tf.nest.pack_sequence_as(layout["structure"], [tf.cast(m, d) for m, d in zip(means, layout["dtypes"])])

    return one_step
