"""Horovod all-reduce that Keras 3's `model.fit` can use.

Horovod's own Keras layer (`horovod.tensorflow.keras`) fails on Keras 3 at the
first `fit` (`'Variable' object has no attribute 'ref'`). `HorovodStrategy` is a
`tf.distribute` strategy instead: one replica per process (the process's GPU by
local rank, else its CPU), whose cross-replica reductions are Horovod
collectives across the processes `horovodrun` started. Keras does the rest:

- gradients: Keras's optimizers all-reduce the gradients of a step in one batch
  (`replica_context.all_reduce`), which becomes one `hvd.grouped_allreduce`;
  Horovod fuses the group into buffers of `fusion_threshold_bytes`.
- metrics: Keras's metric variables are sync-on-read, so reading them at the
  end of an epoch or of an evaluation all-reduces them: logs and validation
  metrics cover every rank's examples.
- input: each rank keeps its share of every global batch (TensorFlow's
  auto-sharding, with the rank as the input pipeline), so the ranks run the
  same number of steps whatever the data size.
- initial values: every variable created under the scope takes rank 0's
  initial value (`hvd.broadcast`), so the ranks start identical.
- predict: each rank predicts its share of every batch; the shares are
  gathered (`hvd.allgather`), so every rank returns the whole prediction.
- hangs: a step that runs longer than `stall_shutdown_seconds` (a rank alive
  but stuck) ends the process with one line (`StepWatchdog`).

What it adds to TensorFlow's MirroredStrategy is only the between-process part:
the rank-aware replica count, sharding and variable creation above.

Example (under `horovodrun -np 2 -H localhost:2 --gloo python train.py`):

    >>> strategy = HorovodStrategy()  # doctest: +SKIP
    >>> with strategy.scope():  # doctest: +SKIP
    ...     model = build_model(); model.compile(optimizer="sgd", loss="mse")
    >>> model.fit(x, y, batch_size=64, epochs=2)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Optional

import keras
import tensorflow as tf
from tfdist._compat.tf_distribute import distribute_lib, distribute_utils, mirrored_strategy

from tfdist import _compat
from tfdist.config.schema import HorovodOp
from tfdist.errors import PEER_LOST_UNDER_HOROVOD, ClusterError
from tfdist.horovod.all_reduce import HorovodAllReduce
from tfdist.horovod.liveness import collectives_are_down
from tfdist.horovod.split_collectives import HorovodSliceCollectives
from tfdist.parallel.optimizer_shards import SplitsOptimizerState
from tfdist.parallel.weight_shards import KEEP_WHOLE_BELOW
from tfdist.contract import StrategyContract
from tfdist.strategies.process_group import HorovodProcesses
from tfdist.strategies.process_input import PerProcessInput
from tfdist.strategies.data_parallel import multi_step_function
from tfdist.strategies.step_watchdog import StepWatchdog

__all__ = ["AdasumWithoutMpiError", "HorovodStrategy"]

_OPS = tuple(op.value for op in HorovodOp)
DEFAULT_STEP_TIMEOUT_SECONDS = 600.0  # long enough for a large model's step or a slow evaluation
_HOROVOD_STALL_CHECK_SECONDS = 60.0  # Horovod's own default


class _HorovodExtended(PerProcessInput, mirrored_strategy.MirroredExtended):
    """MirroredStrategy on this process's one device, counted among all ranks."""

    def __init__(self, container_strategy, device: str, cross_device_ops: HorovodAllReduce, hvd):
        self._hvd = hvd
        self._broadcasts = 0
        super().__init__(container_strategy, devices=[device], cross_device_ops=cross_device_ops)

    @property
    def _num_replicas_in_sync(self):
        return self._hvd.size()

    def _use_merge_call(self):
        # One local replica: nothing to merge in-graph. Without merge_call the
        # gradient all-reduce may sit inside a tf.cond (Keras's gradient accumulation).
        return False

    def _get_cross_device_ops(self, value):
        return self._cross_device_ops  # MirroredStrategy would pick its own without merge_call

    def _get_replica_id_in_sync_group(self, replica_id):
        return self._hvd.rank() + replica_id

    def _get_local_replica_id(self, replica_id_in_sync_group):
        return replica_id_in_sync_group - self._hvd.rank()

    @property
    def should_checkpoint(self):
        return self._hvd.rank() == 0

    @property
    def should_save_summary(self):
        return self._hvd.rank() == 0

    def _process_place(self) -> tuple[int, int]:
        return self._hvd.rank(), self._hvd.size()

    def _create_variable(self, next_creator, **kwargs):
        initial_value = kwargs["initial_value"]
        self._broadcasts += 1
        name = f"tfdist_initial_value_{self._broadcasts}"  # the same on every rank: same creation order

        def from_rank_0():
            value = initial_value() if callable(initial_value) else initial_value
            return self._hvd.broadcast(tf.convert_to_tensor(value), root_rank=0, name=name)

        kwargs["initial_value"] = from_rank_0
        return super()._create_variable(next_creator, **kwargs)

    def _reduce_to(self, reduce_op, value, destinations, options):
        # MirroredStrategy reduces values on CPUs locally; these must cross processes.
        if distribute_utils.is_mirrored(value) and reduce_op == tf.distribute.ReduceOp.MEAN:
            return value
        return tf.nest.map_structure(
            lambda v: self._cross_device_ops.reduce(reduce_op, v, destinations, options), value
        )


class HorovodStrategy(SplitsOptimizerState, StrategyContract, distribute_lib.Strategy):
    """A tf.distribute strategy whose cross-replica reductions are Horovod collectives.

    Run one process per device under `horovodrun`. Options that configure
    Horovod's runtime (fusion, cycle time, timeline, stall checks) take effect
    only when this strategy initialises Horovod.

    Args:
      op: how gradients are combined: `average`, `sum` or `adasum`.
      fp16_compression: send float gradients as float16.
      fusion_threshold_bytes: Horovod's tensor-fusion buffer size (0: no fusion).
      cycle_time_ms: how long Horovod collects tensors to fuse.
      timeline: write Horovod's timeline (Chrome trace JSON) to this file.
      stall_check_seconds: Horovod's stall inspector: report a rank missing
        from a collective after this long.
      stall_shutdown_seconds: a step (or the ranks' agreement between steps)
        running longer than this ends the process with a one-line error (tfdist's step watchdog; default 600 s), and
        Horovod's stall inspector shuts down after it too; 0 turns both off.
      device: this process's device; default: its GPU by local rank, else its CPU.
      backward_passes_per_step: batches whose gradients are accumulated before one all-reduce and update.
      elastic_commit_batches: train elastically (under an elastic horovodrun, `fit` goes on when ranks
        are lost or added), committing the state every this many batches; None: not elastic.
      shard_optimizer: 1 or 2 splits the state of an optimizer compiled under this strategy over the
        ranks (ZeRO stage 1: gradients all-reduced; 2: reduce-scattered,
        `tfdist.horovod.split_collectives`), 3 the weights too (`tfdist.parallel.weight_shards`); 0 keeps a
        whole copy on each.
      keep_whole_below: at stage 3, variables of fewer elements stay whole on every rank.
      prefetch_weights: at stage 3, gather a layer's weights while the layer before it computes.

    Raises:
      ImportError: Horovod is not installed (one line saying how to install it).
      ValueError: an unknown `op`, `adasum` launched without MPI, or runtime options
        given after Horovod was initialised elsewhere.
    """

    _collective_key_base = 0  # read by MirroredExtended; TF collectives stay local here

    def __init__(
        self,
        *,
        op: str = "average",
        fp16_compression: bool = False,
        fusion_threshold_bytes: Optional[int] = None,
        cycle_time_ms: Optional[float] = None,
        timeline: Optional[str] = None,
        stall_check_seconds: Optional[float] = None,
        stall_shutdown_seconds: Optional[float] = None,
        device: Optional[str] = None,
        backward_passes_per_step: int = 1,
        elastic_commit_batches: Optional[int] = None,
        shard_optimizer: int = 0,
        keep_whole_below: int = KEEP_WHOLE_BELOW,
        prefetch_weights: bool = True,
    ):
        if op not in _OPS:
            raise ValueError(f"`op` must be one of {', '.join(_OPS)}. Received: {op!r}")
        if shard_optimizer not in (0, 1, 2, 3) or (shard_optimizer and (op == "adasum" or elastic_commit_batches)):
            raise ValueError("`shard_optimizer` must be 0, 1, 2 or 3, and 0 with op adasum (it combines whole "
                             f"gradients) or elastic training. Received: {shard_optimizer}, op {op}, "
                             f"elastic_commit_batches {elastic_commit_batches}")
        timeout = DEFAULT_STEP_TIMEOUT_SECONDS if stall_shutdown_seconds is None else stall_shutdown_seconds
        if timeout < 0:
            raise ValueError(f"`stall_shutdown_seconds` must be >= 0 (0: off). Received: {stall_shutdown_seconds!r}")
        hvd = _compat.horovod()
        if stall_shutdown_seconds:
            # Horovod ignores a shutdown time shorter than its check interval (default 60 s).
            stall_check_seconds = min(stall_check_seconds or _HOROVOD_STALL_CHECK_SECONDS, stall_shutdown_seconds)
        runtime = {
            "HOROVOD_FUSION_THRESHOLD": fusion_threshold_bytes,
            "HOROVOD_CYCLE_TIME": cycle_time_ms,
            "HOROVOD_TIMELINE": timeline,
            "HOROVOD_STALL_CHECK_TIME_SECONDS": stall_check_seconds,
            "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": stall_shutdown_seconds,
        }
        _init_horovod(hvd, {k: v for k, v in runtime.items() if v is not None})
        if op == "adasum" and not hvd.mpi_enabled():
            raise AdasumWithoutMpiError(
                "`op` adasum needs Horovod's MPI controller: launch with `horovodrun --mpi` "
                "(this job runs on Gloo, where Horovod has no Adasum). Received: 'adasum'"
            )
        self.hvd = hvd
        # With op average, gradient clipping sees the all-reduced gradient, as on one process (`_compat`).
        self.clips_after_all_reduce = op == "average"
        self.stall_shutdown_seconds = timeout
        self.accumulation_steps = backward_passes_per_step
        self.elastic_commit_batches = elastic_commit_batches
        self.shard_optimizer, self.keep_whole_below = shard_optimizer, keep_whole_below
        self.prefetch_weights = prefetch_weights
        self._op, self._fp16_compression = op, fp16_compression
        self._elastic_resets = 0
        self._watchdog = StepWatchdog(timeout, f"rank {hvd.rank()}") if timeout else None
        cross_device_ops = HorovodAllReduce(hvd, op=op, fp16_compression=fp16_compression)
        self.horovod_all_reduce = cross_device_ops  # the ranks' collectives, for process groups
        _compat.merge_calls_in_place(_HorovodExtended)  # loss scaling's cond updates a variable by merge_call
        super().__init__(_HorovodExtended(self, device or _local_device(hvd), cross_device_ops, hvd))

    @property
    def rank(self) -> int:
        return self.hvd.rank()

    @property
    def is_chief(self) -> bool:
        """Rank 0 reports (summary, TensorBoard, `--metrics_out`)."""
        return self.rank == 0

    @property
    def size(self) -> int:
        return self.hvd.size()

    @property
    def cluster_resolver(self) -> tf.distribute.cluster_resolver.ClusterResolver:
        """The ranks as TensorFlow's multi-worker guides read a cluster: job `worker`, this process task `rank` of
        `size`, so a script that saves from `task_type == "worker" and task_id == 0` (its chief) runs unchanged.
        The ranks' addresses are Horovod's own: the spec names each by its rank."""
        spec = tf.train.ClusterSpec({"worker": [f"horovod-rank-{rank}" for rank in range(self.size)]})
        return tf.distribute.cluster_resolver.SimpleClusterResolver(spec, task_type="worker", task_id=self.rank)

    multi_process = True

    def input_workers(self) -> tuple[int, Optional[int]]:
        context = self.extended._input_context()
        # Elastic: the ranks change, so tf.distribute shards at each distribution instead.
        return context.num_input_pipelines, None if self.elastic_commit_batches else context.input_pipeline_id

    def fit(self, model: keras.Model, fit: Callable, *, epochs: int, callbacks: list) -> keras.callbacks.History:
        if not self.elastic_commit_batches:
            return fit(epochs=epochs, callbacks=callbacks)
        from tfdist.horovod import elastic_fit

        history = elastic_fit.fit(model, fit, epochs=epochs, callbacks=callbacks,
                                      batches_per_commit=self.elastic_commit_batches)
        self._elastic_resets = history.resets
        return history

    def slice_collectives(self) -> HorovodSliceCollectives:
        return HorovodSliceCollectives(self.hvd, self.extended.worker_devices[0], stage=self.shard_optimizer,
                                       op=self._op, fp16_compression=self._fp16_compression)

    def process_group(self) -> HorovodProcesses:
        return HorovodProcesses(self)

    def job_report(self, model: keras.Model) -> dict[str, Any]:
        report = {"cluster": f"{self.size} Horovod rank(s), one process per device", **super().job_report(model)}
        if self.elastic_commit_batches:
            report["elastic"] = {"resets": self._elastic_resets, "ranks": self.size,
                                 "optimizer_steps": int(model.optimizer.iterations.numpy())}
        return report

    def any_process(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank (an all-reduced maximum); every rank must call it, in step."""
        # Watched like a step: a rank stuck before it leaves this one blocked in the all-reduce.
        with self._watchdog.watching() if self._watchdog else contextlib.nullcontext():
            agreed = self.hvd.allreduce(tf.constant(int(flag)), op=self.hvd.Max, name="tfdist_any_process")
        return bool(agreed.numpy())

    def job_error(self, error: tf.errors.OpError) -> Optional[ClusterError]:
        """One line when a step failed because Horovod's collectives are down; None for other errors.

        Decided by asking Horovod, not by reading the message: a rank that
        died breaks the collectives at once (a Gloo read error, or Horovod's
        "shut down"), one that stopped responding makes Horovod's stall
        inspector shut them down after `stall_shutdown_seconds`.
        """
        if not collectives_are_down(self.hvd):
            return None
        blocked = self._watchdog.last_watched_seconds if self._watchdog else 0.0
        if self.stall_shutdown_seconds and blocked >= self.stall_shutdown_seconds:
            return ClusterError(
                f"{PEER_LOST_UNDER_HOROVOD} stopped responding (alive but stuck, or paused): its "
                f"collective did not start within {self.stall_shutdown_seconds:g} s "
                "(horovod.stall_shutdown_seconds)."
            )
        return ClusterError(
            f"{PEER_LOST_UNDER_HOROVOD} failed or exited (its collective could not complete). "
            "That rank's own error, if it printed one, is in its log."
        )

    def keras_hooks(self, model: keras.Model) -> dict[str, Any]:
        """tfdist's training function and Keras's evaluation and prediction functions, under the step
        watchdog (unless off); predictions gathered from every rank."""
        predict_on_this_rank = _compat.keras_step_function(model, "predict_function")

        def predict_function(data):
            outputs = predict_on_this_rank(data)
            return tf.nest.map_structure(self.hvd.allgather, outputs)

        functions = {
            "train_function": multi_step_function(self, model),
            "test_function": _compat.keras_step_function(model, "test_function"),
            "predict_function": predict_function,
        }
        if self._watchdog is None:
            return functions
        return {name: self._watchdog.wrap(function) for name, function in functions.items()}


def _init_horovod(hvd, runtime: dict) -> None:
    """Sets Horovod's runtime options (read once, at `hvd.init`) and initialises it."""
    if hvd.is_initialized():
        if runtime:
            raise ValueError(
                "Horovod was initialised before HorovodStrategy, so its runtime options "
                f"({', '.join(sorted(runtime))}) can no longer change. Create the strategy "
                "before calling hvd.init()."
            )
        return
    for name, value in runtime.items():
        os.environ[name] = str(value)
    hvd.init()


def _local_device(hvd) -> str:
    """This rank's GPU by local rank (only it made visible), else the CPU."""
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return "/cpu:0"
    try:
        tf.config.set_visible_devices(gpus[hvd.local_rank() % len(gpus)], "GPU")
        return "/gpu:0"
    except RuntimeError:  # TensorFlow already initialised: address the GPU by index
        return f"/gpu:{hvd.local_rank() % len(gpus)}"


class AdasumWithoutMpiError(ValueError):
    """`op` adasum in a job launched without Horovod's MPI controller."""
