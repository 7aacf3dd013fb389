"""Multi-worker all-reduce that Keras 3's `model.fit` can use.

`tf.distribute.MultiWorkerMirroredStrategy` with more than one worker fails in
Keras 3's `fit` (keras-team/keras#20585), because Keras calls
`strategy.reduce` in two ways TensorFlow does not accept across workers:

1. on the whole nested input batch, to build the model before the first step
   (TensorFlow's `reduce` takes one value; its own TODO says "support `value`
   being a nest");
2. on scalar losses and metrics with `axis=0`, which has no axis 0.

`MultiWorkerMirroredStrategy.reduce` here maps over nests and reduces rank-0
values across replicas only (`axis=None`), which is the same mean for a value
that has one element per replica. Its training function
(`data_parallel.multi_step_function`) averages a step's logs across the
workers in one collective instead of one per log, and trains with
`steps_per_execution` > 1, which Keras's own loop cannot do over several
replicas. Everything else is TensorFlow's.

It also builds its cluster from the config (`cluster.cluster_resolver`): the config's
`cluster.workers`, or TF_CONFIG, with every address checked to be on loopback
unless the config opts out (the gRPC servers have no authentication).
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from tfdist._compat import peer_answers
from tfdist.errors import ClusterError, error_reason
from tfdist.parallel.optimizer_shards import SplitsOptimizerState, collective_ops_stage
from tfdist.parallel.weight_shards import KEEP_WHOLE_BELOW
from tfdist.contract import StrategyContract
from tfdist.strategies.data_parallel import multi_step_function
from tfdist.strategies.process_group import WorkerProcesses

__all__ = ["MultiWorkerMirroredStrategy"]

_HEALTH_CHECK_MS = 5000  # a live peer answers in milliseconds


class MultiWorkerMirroredStrategy(SplitsOptimizerState, StrategyContract, tf.distribute.MultiWorkerMirroredStrategy):
    """`tf.distribute.MultiWorkerMirroredStrategy` whose `reduce` takes nests.

    Example:

        >>> strategy = MultiWorkerMirroredStrategy()  # cluster from TF_CONFIG
        >>> with strategy.scope():  # doctest: +SKIP
        ...     model = build_model(); model.compile(...)
        >>> model.fit(dataset, epochs=2, steps_per_epoch=50)  # doctest: +SKIP
    """

    clips_after_all_reduce = True  # gradient clipping sees the all-reduced gradient, as on one device

    def __init__(self, *args, gradient_compression: Optional[str] = None, shard_optimizer: int = 0,
                 keep_whole_below: int = KEEP_WHOLE_BELOW, prefetch_weights: bool = True, **kwargs):
        """Takes TensorFlow's arguments, and `gradient_compression`: `float16` or `bfloat16` sends the
        gradients at half their bytes (cast before the all-reduce and back after it, as Horovod's fp16
        compression does); None sends them as they are. Either way they are all-reduced last layer
        first, so that packs (`CommunicationOptions.bytes_per_pack`) can leave during the backward pass.
        `shard_optimizer`: 1 splits the state of an optimizer compiled under this strategy over every
        worker's replicas (`tfdist.parallel.optimizer_shards`), 2 also reduce-scatters the gradients, 3 splits
        the weights too, all but those of fewer than `keep_whole_below` elements (`tfdist.parallel.weight_shards`);
        0 keeps a whole copy on each; `prefetch_weights`: at stage 3, gather a layer's weights while the layer
        before it computes."""
        if gradient_compression not in (None, "float16", "bfloat16"):
            raise ValueError(f"`gradient_compression` must be None, 'float16' or 'bfloat16'. "
                             f"Received: {gradient_compression!r}")
        stage = collective_ops_stage(shard_optimizer)
        super().__init__(*args, **kwargs)
        self.gradient_all_reduce = gradient_compression or ""
        self.shard_optimizer, self.keep_whole_below, self.prefetch_weights = stage, keep_whole_below, prefetch_weights

    def keras_hooks(self, model):
        # Keras's own train function would reduce every log in a collective of its own, every step.
        return {"train_function": multi_step_function(self, model, pack_logs=True)}

    def reduce(self, reduce_op, value, axis):
        parent = super()

        def reduce_one(v):
            first = v.values[0] if isinstance(v, tf.distribute.DistributedValues) else v
            rank = getattr(getattr(first, "shape", None), "rank", None)
            return parent.reduce(reduce_op, v, None if rank == 0 else axis)

        return tf.nest.map_structure(reduce_one, value)

    multi_process = True

    def any_process(self, flag: bool) -> bool:
        """Whether `flag` is set on any worker (an all-reduced sum); every worker must call it, in step."""
        flags = self.experimental_distribute_values_from_function(lambda context: tf.constant(int(flag)))
        return bool(self.reduce(tf.distribute.ReduceOp.SUM, flags, axis=None).numpy())

    def job_error(self, error: tf.errors.OpError) -> Optional[ClusterError]:
        """A failed step while a peer does not answer is a lost task (one line); None for other errors."""
        lost = self.unreachable_peers()
        if not lost:
            return None
        return ClusterError(f"lost contact with {', '.join(lost)} during training ({error_reason(error.message)}).")

    def process_group(self) -> WorkerProcesses:
        return WorkerProcesses(self)

    def unreachable_peers(self) -> list[str]:
        """The other tasks that do not answer TensorFlow's collective health check."""
        resolver = self.cluster_resolver
        spec = resolver.cluster_spec()
        me = f"/job:{resolver.task_type}/replica:0/task:{resolver.task_id}"
        peers = [f"/job:{job}/replica:0/task:{i}" for job in spec.jobs for i in range(spec.num_tasks(job))]
        return [peer for peer in peers if peer != me and not peer_answers(peer, _HEALTH_CHECK_MS)]
