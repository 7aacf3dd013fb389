"""Config -> tf.distribute.Strategy: every translation from config to a strategy's arguments.

The strategies themselves take plain arguments and know nothing of the config;
here is one builder per `strategy.kind` (`_BUILDERS`), and the process group of
`strategy.data_parallel` comes from the strategy its own builder makes.

Example:

    >>> import tfdist
    >>> cfg = tfdist.load_config(None, ["strategy.logical_devices=2"])
    >>> strategy = tfdist.make_strategy(cfg)
    >>> strategy.num_replicas_in_sync
    2
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Optional, Sequence

import keras
import tensorflow as tf

from tfdist import _compat, precision
from tfdist.cluster.loopback import accepts_connections
from tfdist.cluster.resolver import cluster_resolver, listening_as
from tfdist.cluster.servers import LocalCluster, serve
from tfdist.config.kinds import DATA_PARALLEL, RANKS
from tfdist.config.schema import AllReduce, Config, GradientCompression
from tfdist.config.validation import (
    check_batch_split,
    check_pipeline_devices,
    check_tensor_parallel_devices,
    devices_key,
    placement_pairs,
    tensor_parallel_size,
)
from tfdist.contract import contract
from tfdist.errors import ClusterError, ConfigError
from tfdist.parallel.layout import DATA, MODEL, Layout, LayoutError
from tfdist.strategies.data_parallel import MirroredStrategy
from tfdist.strategies.devices import configure_runtime, local_devices
from tfdist.strategies.horovod import AdasumWithoutMpiError, HorovodStrategy
from tfdist.strategies.layout import LayoutStrategy
from tfdist.strategies.host_allocator import restore_allocator
from tfdist.strategies.multi_worker import MultiWorkerMirroredStrategy
from tfdist.strategies.parameter_server import ParameterServerStrategy
from tfdist.strategies.pipeline import PipelineStrategy
from tfdist.strategies.process_group import ProcessGroup
from tfdist.strategies.replica_groups import ProcessLayoutError, make_process_group
from tfdist.strategies.tensor_parallel import TensorParallelStrategy
from tfdist.user_code import call_function

__all__ = ["layout_of", "make_strategy", "serves_only"]

# The strategy, and its config, with which this process joined its cluster: TensorFlow joins a process to
# one cluster once (a second multi-worker strategy resets the collectives of the first; its first broadcast
# fails with "Delete called on non-empty BufRendezvous"), and Horovod reads its options at its one `hvd.init`.
_JOINED: dict = {}


def make_strategy(config: Config) -> tf.distribute.Strategy:
    """Configures the runtime and precision policy, then builds the strategy, and sets the host
    allocator back from TensorFlow's trimming (`host_allocator`) unless `runtime.trim_freed_memory`.

    Call it before running any TensorFlow op: logical CPU devices and thread
    pools can only be set before TensorFlow initialises. A strategy that
    joins a cluster (multi-worker, parameter servers, Horovod, multi-worker
    or Horovod data parallelism) is made once per process: asked again with the same
    `strategy` and `cluster` config (a script that makes its strategy in
    each function, as Keras's guide does), it returns the first.

    Raises:
      ConfigError: the machine cannot honour the config (missing devices, no
        TPU, nccl without GPUs), the global batch does not split evenly
        over the replicas, or this process has joined its cluster under
        another `strategy` or `cluster` config.
      ClusterError: the cluster's tasks did not start.
    """
    joins = _joins_a_cluster(config)
    if joins and _JOINED:
        return _joined_again(config)
    gpus = configure_runtime(config)
    strategy = _builder(config.strategy.kind)(config, gpus)
    check_batch_split(config, strategy.num_replicas_in_sync // contract(strategy).model_axis)  # copies of the model
    precision.apply_policy(config.precision)
    if not config.runtime.trim_freed_memory:  # once the strategy has started TensorFlow: it runs a dataset
        restore_allocator()
    if joins:
        _JOINED.update(sections=(config.strategy, config.cluster), strategy=strategy)
    return strategy


def _joins_a_cluster(config: Config) -> bool:
    """Whether the strategy joins this process to a cluster of others (not one of its own making): Horovod's
    ranks always (a job of one rank too), TensorFlow's when the cluster config lists tasks."""
    processes = config.strategy.launched_as.processes
    if processes is RANKS:
        return True
    return processes.resolves_cluster and bool(cluster_resolver(config).cluster_spec().jobs)


def _joined_again(config: Config) -> tf.distribute.Strategy:
    if _JOINED["sections"] != (config.strategy, config.cluster):
        raise ConfigError("strategy", "cannot change in a process that has joined its cluster: TensorFlow joins a "
                          "process once, so make_strategy returns the first strategy for the same `strategy` and "
                          "`cluster` config only.", config.strategy.kind)
    precision.apply_policy(config.precision)
    return _JOINED["strategy"]


def serves_only(config: Config) -> bool:
    """On a parameter-server job's worker or ps task, serves until the chief is done and returns True;
    False on every task that trains."""
    if not config.strategy.spec.processes.coordinated:
        return False
    resolver = cluster_resolver(config)
    if resolver.cluster_spec().jobs and resolver.task_type in ("worker", "ps"):
        with listening_as(resolver):
            serve(resolver.cluster_spec().as_dict(), resolver.task_type, resolver.task_id,
                  threads=config.parameter_server.threads_per_task)
        return True
    return False


def _one_device(config: Config, gpus: int) -> tf.distribute.Strategy:
    return tf.distribute.OneDeviceStrategy(local_devices(config, gpus)[0])


def _mirrored(config: Config, gpus: int) -> MirroredStrategy:
    s = config.strategy
    if s.all_reduce == AllReduce.NCCL and not gpus:
        raise ConfigError("strategy.all_reduce", "nccl needs GPUs and this machine has none; use auto, "
                          "hierarchical_copy or reduction_to_one_device.", s.all_reduce.value)
    cross_device_ops = {
        AllReduce.AUTO: lambda: None,
        AllReduce.NCCL: lambda: tf.distribute.NcclAllReduce(num_packs=s.num_packs),
        AllReduce.HIERARCHICAL_COPY: lambda: tf.distribute.HierarchicalCopyAllReduce(num_packs=s.num_packs),
        AllReduce.REDUCTION_TO_ONE_DEVICE: tf.distribute.ReductionToOneDevice,
    }[s.all_reduce]()
    return MirroredStrategy(devices=local_devices(config, gpus), cross_device_ops=cross_device_ops,
                            shard_optimizer=s.shard_optimizer, keep_whole_below=s.keep_whole_below,
                            prefetch_weights=s.prefetch_weights)


_WIRE_DTYPES = {GradientCompression.NONE: None, GradientCompression.FP16: "float16",
                GradientCompression.BF16: "bfloat16"}


def _multi_worker(config: Config, gpus: int = 0) -> MultiWorkerMirroredStrategy:
    """With CommunicationOptions (implementation, packing, timeout) and the cluster's start-up and
    heartbeat timeouts; a task that does not start in time is a ClusterError naming it."""
    s = config.strategy
    implementations = tf.distribute.experimental.CommunicationImplementation
    options = tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=s.bytes_per_pack,
        timeout_seconds=s.collective_timeout_seconds,
        implementation={AllReduce.AUTO: implementations.AUTO, AllReduce.RING: implementations.RING,
                        AllReduce.NCCL: implementations.NCCL}[s.all_reduce],
    )
    resolver = cluster_resolver(config)
    if resolver.cluster_spec().jobs:
        _compat.configure_coordination_service(
            resolver.cluster_spec(),
            startup_timeout_seconds=config.cluster.startup_timeout_seconds,
            heartbeat_timeout_seconds=config.cluster.heartbeat_timeout_seconds,
        )
    try:
        with listening_as(resolver):
            return MultiWorkerMirroredStrategy(cluster_resolver=resolver, communication_options=options,
                                               gradient_compression=_WIRE_DTYPES[s.gradient_compression],
                                               shard_optimizer=s.shard_optimizer,
                                               keep_whole_below=s.keep_whole_below,
                                               prefetch_weights=s.prefetch_weights)
    except tf.errors.DeadlineExceededError:
        spec = resolver.cluster_spec().as_dict()
        missing = [f"/job:{job}/replica:0/task:{i}" for job, addresses in spec.items()
                   for i, address in enumerate(addresses) if not accepts_connections(address)]
        raise ClusterError(
            f"tasks {', '.join(missing) or '(unknown)'} did not start within "
            f"cluster.startup_timeout_seconds={config.cluster.startup_timeout_seconds:g}."
        ) from None


def _parameter_server(config: Config, gpus: int = 0) -> ParameterServerStrategy:
    """The chief's strategy: on the cluster from TF_CONFIG or the `cluster` section, or, when neither
    names one, on a `LocalCluster` started here (`strategy.local_cluster`)."""
    p = config.parameter_server
    resolver = cluster_resolver(config)
    jobs = resolver.cluster_spec().as_dict()
    cluster = None
    if not jobs:
        cluster = LocalCluster(p.num_workers, p.num_ps, threads=p.threads_per_task, restart_workers=p.restart_workers)
        cluster.start()
        resolver = cluster.resolver()
    elif not jobs.get("ps") or not jobs.get("worker"):
        raise ConfigError("cluster", "needs `ps` and `worker` tasks for strategy.kind=parameter_server.", jobs)
    elif resolver.task_type != "chief":
        raise ConfigError("cluster.task_type", "must be chief to coordinate; workers and parameter servers serve "
                          "(`tfdist train` does that).", resolver.task_type)
    partitioner = None
    if p.min_shard_bytes:
        partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=p.min_shard_bytes, max_shards=p.max_shards)
    with listening_as(resolver):
        strategy = ParameterServerStrategy(resolver, variable_partitioner=partitioner,
                                           steps_per_execution=p.steps_per_execution,
                                           gradient_compression=_WIRE_DTYPES[config.strategy.gradient_compression])
    strategy.local_cluster = cluster
    return strategy


def _horovod(config: Config, gpus: int = 0) -> HorovodStrategy:
    h = config.horovod
    try:
        return HorovodStrategy(
            op=h.op.value,
            fp16_compression=h.fp16_compression,
            fusion_threshold_bytes=h.fusion_threshold_bytes,
            # Horovod 0.28 crashes re-forming an elastic job when both of these are fixed (validation).
            cycle_time_ms=None if h.elastic else h.cycle_time_ms,
            timeline=h.timeline,
            stall_check_seconds=h.stall_check_seconds,
            stall_shutdown_seconds=h.stall_shutdown_seconds,
            backward_passes_per_step=h.backward_passes_per_step,
            elastic_commit_batches=h.elastic_commit_batches if h.elastic else None,
            shard_optimizer=config.strategy.shard_optimizer,
            keep_whole_below=config.strategy.keep_whole_below,
            prefetch_weights=config.strategy.prefetch_weights,
        )
    except ImportError as error:
        raise ConfigError("strategy.kind", f"horovod needs Horovod: {error}", config.strategy.kind) from None
    except AdasumWithoutMpiError:
        raise ConfigError("horovod.op", "adasum needs Horovod's MPI controller: launch with `horovodrun --mpi` "
                          "(this job runs on Gloo, where Horovod has no Adasum).", "adasum") from None


def _pipeline(config: Config, gpus: int) -> PipelineStrategy:
    devices = local_devices(config, gpus)
    check_pipeline_devices(config, devices)
    p = config.pipeline
    with _same_layout_in_every_process(config):
        return PipelineStrategy(
            p.num_stages,
            p.num_micro_batches,
            schedule=p.schedule.value,
            devices=devices,
            boundaries=list(p.boundaries) or None,
            balance_by=p.balance_by.value,
            recompute=p.recompute,
            tensor_parallel_size=tensor_parallel_size(config, len(devices)),
            data_parallel=_process_group(config),
            shard_optimizer=config.strategy.shard_optimizer,
            keep_whole_below=config.strategy.keep_whole_below,
            prefetch_weights=config.strategy.prefetch_weights,
        )


def _tensor_parallel(config: Config, gpus: int) -> TensorParallelStrategy:
    devices = local_devices(config, gpus)
    check_tensor_parallel_devices(config, devices)
    with _same_layout_in_every_process(config):
        return TensorParallelStrategy(devices, group_size=tensor_parallel_size(config, len(devices)),
                                      placement=placement_pairs(config),
                                      balance_by_memory=config.placement.balance_by_memory,
                                      data_parallel=_process_group(config),
                                      shard_optimizer=config.strategy.shard_optimizer,
                                      keep_whole_below=config.strategy.keep_whole_below,
                                      prefetch_weights=config.strategy.prefetch_weights)


def _layout(config: Config, gpus: int) -> LayoutStrategy:
    """The first `layout.data_devices` x `layout.model_devices` devices as the mesh, data-major, split by the
    rules or by the LayoutMap the user's function returns for that mesh."""
    settings = config.layout
    size = settings.data_devices * settings.model_devices
    devices = local_devices(config, gpus)[:size]
    if len(devices) < size:
        raise ConfigError(devices_key(config), f"must give at least layout.data_devices x layout.model_devices "
                          f"({settings.data_devices} x {settings.model_devices}) devices. This config gives "
                          f"{len(devices)}.", list(config.strategy.devices) or config.strategy.logical_devices)
    layout, key = layout_of(config, devices)
    try:
        with _same_layout_in_every_process(config):
            return LayoutStrategy(layout, devices, data_parallel=_process_group(config), config_key=key,
                                  shard_optimizer=config.strategy.shard_optimizer,
                                  keep_whole_below=config.strategy.keep_whole_below,
                                  prefetch_weights=config.strategy.prefetch_weights)
    except LayoutError as error:
        raise _layout_error(key, error, settings) from None


def _layout_error(key: str, error: LayoutError, settings) -> ConfigError:
    """The ConfigError of a layout that does not fit: the LayoutError's line names the variable, rule and shapes
    it received; the config's own value is the user's layout_map function, if one made it."""
    if settings.layout_map:
        return ConfigError(key, str(error), settings.layout_map)
    return ConfigError(key, str(error))


def layout_of(config: Config, devices: Sequence[str]) -> tuple[Layout, str]:
    """The config's layout over `devices` (the mesh's, data-major), and the config key it came from: the rules,
    or the LayoutMap the user's function returns for the mesh. `tfdist plan` reads it too.

    Raises:
      ConfigError: the user's function fails or returns no layout this version runs.
    """
    settings = config.layout
    shape = (settings.data_devices, settings.model_devices)
    key = "layout.layout_map" if settings.layout_map else "layout.rules" if settings.rules else "layout.megatron"
    try:
        if settings.layout_map:
            mesh = keras.distribution.DeviceMesh(shape, (DATA, MODEL), devices=[d.lstrip("/") for d in devices])
            layout = Layout.from_keras(call_function(settings.layout_map, key, device_mesh=mesh))
            return dataclasses.replace(layout, megatron=settings.megatron), key
        return Layout(model=shape[1], data=shape[0], rules=settings.rules, megatron=settings.megatron), key
    except LayoutError as error:
        raise _layout_error(key, error, settings) from None


def _tpu(config: Config, gpus: int = 0) -> tf.distribute.TPUStrategy:
    """TPUStrategy when TPUClusterResolver finds a TPU; else a ConfigError."""
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=config.strategy.tpu or None)
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
    except (ValueError, RuntimeError, tf.errors.OpError) as e:
        raise ConfigError("strategy.kind", f"tpu needs a TPU, and none was found ({str(e).splitlines()[0]}). "
                          "Set strategy.tpu to its name or address, or choose another kind.", "tpu") from None
    return tf.distribute.TPUStrategy(resolver)


# Each kind's builder; what a kind is (processes, options, launchers) is its row in tfdist.config.kinds.
_BUILDERS: dict[str, Callable[[Config, int], tf.distribute.Strategy]] = {
    "one_device": _one_device,
    "mirrored": _mirrored,
    "multi_worker_mirrored": _multi_worker,
    "pipeline": _pipeline,
    "parameter_server": _parameter_server,
    "horovod": _horovod,
    "tensor_parallel": _tensor_parallel,
    "tpu": _tpu,
    "layout": _layout,
}


def _builder(kind: str) -> Callable[[Config, int], tf.distribute.Strategy]:
    if kind not in _BUILDERS:
        raise ConfigError("strategy.kind", f"{kind} is in the kinds table but has no builder in "
                          "tfdist/strategies/factory.py.", kind)
    return _BUILDERS[kind]


def _process_group(config: Config) -> Optional[ProcessGroup]:
    """The processes of `strategy.data_parallel`'s backend, which a pipeline or tensor-parallel job trains
    across: made by that kind's own builder."""
    backend = DATA_PARALLEL.get(config.strategy.data_parallel.value)
    return make_process_group(_builder(backend.kind)(config, 0)) if backend else None


@contextlib.contextmanager
def _same_layout_in_every_process(config: Config):
    """A ProcessLayoutError as the ConfigError of the key that gave this process its devices."""
    try:
        yield
    except ProcessLayoutError as error:
        s = config.strategy
        raise ConfigError(devices_key(config), f"must give every process as many devices: {error}",
                          list(s.devices) or s.logical_devices) from None
