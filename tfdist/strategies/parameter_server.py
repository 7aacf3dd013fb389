"""Parameter-server training that Keras 3's `model.fit` can use.

TensorFlow's `ParameterServerStrategy` keeps every variable on parameter
servers; a `ClusterCoordinator` on the chief schedules training steps onto
workers, which pull the variables, compute gradients on their own shard of the
data and push updates asynchronously. Keras 3 has no coordinator support: its
`fit` iterates the dataset on the chief, which fails with "you need to pass this
dataset to ClusterCoordinator.create_per_worker_dataset". This module supplies
what `fit`, `evaluate` and `predict` need, with no change to user code:

- `experimental_distribute_dataset` returns a `CoordinatedDataset`: on the
  workers it becomes a per-worker dataset, sharded by worker index and repeated
  (steps are counted globally, so a worker never runs dry); on the chief it is
  the plain dataset, for evaluation and prediction.
- Keras's trainer asks the strategy for its step functions (`keras_hooks`):
  a training step is `coordinator.schedule`d onto whichever worker is free and
  returns at once; its logs are the model's metrics read from the parameter
  servers, which costs the workers nothing. The epoch's final logs wait for
  every scheduled step (`coordinator.join`). Evaluation and prediction run on
  the chief against the parameter servers' variables, so validation is exact
  (every example once) even while a worker is down.

A worker that dies is ClusterCoordinator's business: its steps are rescheduled
on the others and it rejoins when restarted. A parameter server that dies loses
the variables: the next step raises `ClusterError`; rerun the job with
`callbacks.backup_dir` to resume from the last epoch's backup.

Example:

    >>> strategy = ParameterServerStrategy(resolver)  # doctest: +SKIP
    >>> with strategy.scope():  # doctest: +SKIP
    ...     model = keras.Sequential([...])
    ...     model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    >>> model.fit(dataset, epochs=5, steps_per_epoch=100)  # doctest: +SKIP
"""

from __future__ import annotations

import collections
import inspect
import functools
import logging
import time
from typing import Any, Optional

import keras
import tensorflow as tf
from tfdist._compat.tf_distribute import cluster_coordinator

from tfdist import _compat
from tfdist.errors import ClusterError, error_reason
from tfdist.layers.sharded_embedding import shard_placement
from tfdist.contract import StrategyContract
from tfdist.cluster.loopback import accepts_connections
from tfdist.cluster.servers import LocalCluster

__all__ = ["ParameterServerStrategy", "CoordinatedDataset"]

IN_FLIGHT_STEPS_PER_WORKER = 2
# What a scheduled step can raise when a task is lost.
_COORDINATOR_ERRORS = (
    tf.errors.OpError, cluster_coordinator.ClosureInputError, cluster_coordinator.ClosureAbortedError
)
LOG_INTERVAL_SECONDS = 0.25  # how often a training step's logs are read from the parameter servers


class ParameterServerStrategy(StrategyContract, tf.distribute.experimental.ParameterServerStrategy):
    """`tf.distribute.experimental.ParameterServerStrategy` that Keras 3's `fit` can use.

    Args:
      cluster_resolver: the cluster (chief, workers, parameter servers).
      variable_partitioner: a TensorFlow partitioner (e.g.
        `tf.distribute.experimental.partitioners.MinSizePartitioner`) that
        decides how many shards each `tfdist.layers.ShardedEmbedding` table is
        cut into. Other variables stay whole: a Keras 3 variable cannot hold
        TensorFlow's `ShardedVariable` (its gradient needs a single `handle`).
      steps_per_execution: training steps per scheduled function.
      gradient_compression: `float16` or `bfloat16` sends each worker's
        gradients to the parameter servers in that dtype (half the bytes of
        float32); None sends them as they are. The variables read each step
        keep their dtype.
    """

    input_built_by_chief = True  # the chief builds what every worker reads

    def __init__(self, cluster_resolver, variable_partitioner=None, steps_per_execution: int = 1,
                 gradient_compression: Optional[str] = None):
        if gradient_compression not in (None, "float16", "bfloat16"):
            raise ValueError(f"`gradient_compression` must be None, 'float16' or 'bfloat16'. "
                             f"Received: {gradient_compression!r}")
        self.gradients_sent_as = gradient_compression
        super().__init__(cluster_resolver)  # no partitioner: TF would cut every Keras variable
        self.shard_partitioner = variable_partitioner
        self.steps_per_execution = steps_per_execution
        self._coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(self)
        self.cluster_jobs: dict = cluster_resolver.cluster_spec().as_dict()
        self.num_workers = len(self.cluster_jobs.get("worker", []))
        self.local_cluster: Optional[LocalCluster] = None  # set when tfdist started the cluster
        _hold_back_coordinator_logs()

    @property
    def coordinator(self) -> tf.distribute.experimental.coordinator.ClusterCoordinator:
        return self._coordinator

    def input_workers(self) -> tuple[int, None]:
        return self.num_workers, None

    def wait_for_steps(self) -> None:
        """Returns once every scheduled step has finished (`Throughput` times completed steps with it).

        Raises:
          ClusterError: a parameter server was lost.
        """
        _with_cluster_errors(self._coordinator.join, self.cluster_jobs.get("ps", []))()

    def job_error(self, error: tf.errors.OpError) -> Optional[ClusterError]:
        """One line for an error outside a step (a checkpoint read the variables of a lost parameter
        server, say); None when every parameter server still answers."""
        return _lost_parameter_server(error, self.cluster_jobs.get("ps", []))

    def job_report(self, model: keras.Model) -> dict[str, Any]:
        """The cluster, and where sharded embedding tables went, for the summary and `--metrics_out`."""
        local = " (local processes)" if self.local_cluster else ""
        report = {
            "cluster": f"{len(self.cluster_jobs['worker'])} worker(s), {len(self.cluster_jobs['ps'])} "
            f"parameter server(s){local}"
        }
        tables = shard_placement(model)
        if tables:
            report["sharded_tables"] = "; ".join(
                f"{name} in {len(devices)} shard(s) on ps "
                f"{', '.join(str(tf.DeviceSpec.from_string(d).task) for d in devices)}"
                for name, devices in tables.items()
            )
        return report

    def experimental_distribute_dataset(self, dataset, options=None):
        return CoordinatedDataset(self, dataset)

    @tf.autograph.experimental.do_not_convert  # a user's tf.function calls it: its error, not converted code
    def run(self, fn, args=(), kwargs=None, options=None):
        """Runs `fn` in a step `ClusterCoordinator.schedule` sends to a worker; refuses a step of a custom
        loop called on the chief (TensorFlow's custom-loop guide), which would train on the chief alone."""
        if not _compat.scheduled_by_coordinator(self):
            name = getattr(inspect.unwrap(fn), "__name__", "fn")
            raise NotImplementedError(
                f"tfdist: parameter servers: strategy.run({name}) was called on the chief, where it would train "
                "on the chief instead of the workers; schedule the step onto them with "
                "strategy.coordinator.schedule(step, args=(per_worker_iterator,)), as "
                "examples/guide_parameter_server.py does, or use model.fit")
        return super().run(fn, args=args, kwargs=kwargs, options=options)

    def keras_hooks(self, model: keras.Model) -> dict[str, Any]:
        """The step functions Keras's trainer uses for `model` (see `tfdist._compat.patches`)."""
        train_function, read_logs = _train_function(self, model)

        def metrics_result():
            self._coordinator.join()  # the epoch's logs count every scheduled step
            return read_logs(fresh_epoch=True)

        hooks = {
            "train_function": train_function,
            "test_function": _local_function(model, model.test_step),
            "predict_function": _local_predict_function(model),
            "metrics_result": metrics_result,
        }
        ps_addresses = self.cluster_jobs.get("ps", [])
        return {name: _with_cluster_errors(function, ps_addresses) for name, function in hooks.items()}


class CoordinatedDataset:
    """A Keras input dataset: per-worker (sharded, repeated) for training, local otherwise."""

    def __init__(self, strategy: ParameterServerStrategy, dataset: tf.data.Dataset):
        self._strategy = strategy
        self.dataset = dataset
        self._per_worker_iterator = None

    def __iter__(self):
        return _CoordinatedIterator(self)

    def per_worker_iterator(self):
        """One iterator per worker, made once: the repeated shards never run out."""
        if self._per_worker_iterator is None:
            num_workers = self._strategy.num_workers
            spec = self.dataset.element_spec
            # A dataset made on the chief reaches the workers as its graph.
            graph = tf.raw_ops.DatasetToGraphV2(
                input_dataset=tf.data.experimental.to_variant(self.dataset),
                external_state_policy=1,  # warn about state (e.g. an unseeded shuffle), go on
                strip_device_assignment=True,
            )

            options = self.dataset.options()
            by_file = options.experimental_distribute.auto_shard_policy == tf.data.experimental.AutoShardPolicy.FILE

            def shard(_context):
                dataset = tf.data.experimental.from_variant(tf.raw_ops.DatasetFromGraph(graph_def=graph), spec)
                index = tf.distribute.coordinator.experimental_get_current_worker_index()
                if by_file:  # each worker opens only its own files (TensorFlow's FILE auto-sharding)
                    shard = _compat.auto_shard(dataset.with_options(options), num_workers, index)
                else:  # each worker takes every n-th batch
                    shard = dataset.shard(num_workers, index)
                # With fewer batches than workers a shard is empty, and repeating it gives nothing:
                # such a worker trains on the whole dataset instead.
                empty = shard.take(1).reduce(True, lambda empty, _: False)
                choice = tf.data.Dataset.from_tensors(tf.cast(empty, tf.int64)).repeat()
                return tf.data.Dataset.choose_from_datasets([shard.repeat(), dataset.repeat()], choice)

            @tf.function
            def per_worker_dataset_fn():
                return self._strategy.distribute_datasets_from_function(shard)

            per_worker = self._strategy.coordinator.create_per_worker_dataset(per_worker_dataset_fn)
            self._per_worker_iterator = iter(per_worker)
        return self._per_worker_iterator


class _CoordinatedIterator:
    """What Keras's epoch loop passes to the step functions; `next` reads on the chief."""

    def __init__(self, source: CoordinatedDataset):
        self.source = source
        self._local = None
        self.steps_in_group: Optional[int] = None  # set by Keras's epoch loop before each train call

    def on_step_group(self, first: int, last: int, steps_per_epoch: Optional[int]) -> None:
        if not steps_per_epoch:
            raise ValueError(
                "ParameterServerStrategy needs to know how many steps an epoch has, and this dataset's "
                "size is unknown (e.g. after `filter`): pass `steps_per_epoch` to fit, or state the size "
                "with `dataset.apply(tf.data.experimental.assert_cardinality(n))`."
            )
        # The epoch's last group may be short of steps_per_execution.
        self.steps_in_group = min(last, steps_per_epoch - 1) - first + 1

    def __iter__(self):
        return self

    def __next__(self):
        if self._local is None:
            self._local = iter(self.source.dataset)
        return next(self._local)


def _train_function(strategy: ParameterServerStrategy, model: keras.Model):
    """Keras's train function for `model`, and the reader of its logs."""
    # Steps queued ahead of the workers: enough that none waits for the chief,
    # few enough that the progress bar and step times follow real progress.
    window = IN_FLIGHT_STEPS_PER_WORKER * strategy.num_workers
    in_flight: collections.deque = collections.deque()
    last_read = [float("-inf"), {}]  # time, logs

    step_functions = {}  # steps per call (steps_per_execution, or an epoch's short last group) -> function

    def worker_steps(steps: int):
        if steps not in step_functions:
            @tf.function
            def run_steps(iterator):
                for _ in range(steps):
                    strategy.run(train_step, args=(next(iterator),))
                # No output: waiting on it must not copy a tensor from a worker that may have died since.

            step_functions[steps] = run_steps
        return step_functions[steps]

    def metric_variables() -> list:
        return [variable for metric in model.metrics for variable in metric.variables]

    def train_step(batch):
        # The metrics' updates run in the reverse of the order `metric_values` reads them.
        with _compat.parameter_server_writes_in_reverse(metric_variables()):
            return model.train_step(batch)

    @tf.function
    def metric_values():
        # Workers update the metrics' variables while this reads them. Read
        # all at once, a total and its count (maybe on different parameter
        # servers) came from different moments: accuracy showed 1.08. Read
        # one after another, first to last, while `train_step` updates them
        # last to first, a step counted in a total is counted in its count,
        # so a mid-epoch value lags by at most the steps in flight.
        values, previous = {}, []
        for metric in model.metrics:
            snapshot = []
            for variable in metric.variables:
                with tf.control_dependencies(previous):
                    previous = [tf.identity(variable.value)]
                snapshot.append(previous[0])
            result = metric.stateless_result(snapshot)
            values.update(result if isinstance(result, dict) else {metric.name: result})
        return values

    def read_logs(fresh_epoch: bool = False) -> dict:
        logs = {name: float(value) for name, value in metric_values().items()}
        # A new epoch shows no logs until its first read: not the last epoch's, not the reset zeros.
        last_read[:] = [time.monotonic(), {} if fresh_epoch else logs]
        return logs

    def train_function(iterator):
        if not isinstance(iterator, _CoordinatedIterator):
            raise ValueError(
                "ParameterServerStrategy trains from `model.fit` on a dataset or arrays; "
                "`train_on_batch` is not supported (the step would run on the chief)."
            )
        run_steps = worker_steps(iterator.steps_in_group or model.steps_per_execution)
        in_flight.append(strategy.coordinator.schedule(run_steps, args=(iterator.source.per_worker_iterator(),)))
        while len(in_flight) > window:
            in_flight.popleft().fetch()
        # Reads cost the parameter servers, so at most one per interval; but an epoch's first
        # step always reads: Keras keeps an epoch's final logs only when the last step's logs
        # name the same metrics, and a short epoch may end before the interval does.
        if not last_read[1] or time.monotonic() - last_read[0] >= LOG_INTERVAL_SECONDS:
            read_logs()  # as the parameter servers hold them now
        return last_read[1]

    return train_function, read_logs


def _local_function(model: keras.Model, step):
    """Evaluation on the chief: steps read the parameter servers' variables."""
    run_step = tf.function(step, reduce_retracing=True)

    def function(iterator):
        outputs = None
        for _ in range(model.steps_per_execution):
            try:
                data = next(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                if outputs is None:
                    raise StopIteration
                break
            outputs = run_step(data)
        return outputs

    return function


def _local_predict_function(model: keras.Model):
    run_step = tf.function(model.predict_step, reduce_retracing=True)

    def function(data: list):
        outputs = [run_step(batch) for batch in data]
        if len(outputs) == 1:
            return outputs[0]
        return tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0), *outputs)

    return function


def _with_cluster_errors(function, ps_addresses: list[str]):
    """`function`, with a lost parameter server turned into a one-line ClusterError."""

    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except _COORDINATOR_ERRORS as error:
            lost = _lost_parameter_server(error, ps_addresses)
            if lost is not None:
                raise lost from error
            raise

    return wrapped


def _lost_parameter_server(error: Exception, ps_addresses: list[str]) -> Optional[ClusterError]:
    """The one line for `error` if a parameter server is lost; None otherwise.

    The coordinator reports a lost parameter server in several guises (an
    UnavailableError, a step cancelled or aborted because of it, an error from a
    worker that could not reach it), so the parameter servers are also probed.
    """
    cause = getattr(error, "original_exception", error)  # unwrap ClosureInput/AbortedError
    message = getattr(cause, "message", None) or str(cause)
    lost = [f"ps {i} at {a}" for i, a in enumerate(ps_addresses) if not accepts_connections(a)]
    if not lost and not isinstance(cause, tf.errors.UnavailableError):
        return None
    return ClusterError(
        f"lost a parameter server, {', '.join(lost) or 'unreachable'} ({error_reason(message)}). The variables it "
        "held are gone: restart the cluster and rerun the job; with checkpoint.dir set it resumes from the last "
        "checkpoint."
    )


class _CoordinatorLogFilter(logging.Filter):
    """Drops ClusterCoordinator's own error logs unless TensorFlow's logger is at DEBUG.

    A lost task makes the coordinator log every failed step with its gRPC detail
    (70 to 150 lines for one lost parameter server) before tfdist raises the one
    line that says what happened; a lost worker is rescheduled and needs no
    screenful either.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return record.filename != "cluster_coordinator.py" or logging.getLogger("tensorflow").isEnabledFor(logging.DEBUG)


def _hold_back_coordinator_logs() -> None:
    logger = logging.getLogger("tensorflow")  # TensorFlow's Python logging, which the coordinator uses
    if not any(isinstance(f, _CoordinatorLogFilter) for f in logger.filters):
        logger.addFilter(_CoordinatorLogFilter())
