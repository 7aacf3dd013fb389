"""TensorFlow's private APIs that tfdist reads, each with the public behaviour it needs and why no public API
gives it. (The private classes tfdist's strategies extend are in `tf_distribute`.)"""

from __future__ import annotations

import contextlib

__all__ = ["all_gather", "auto_shard", "broadcast", "collective_keys", "collective_launchers",
           "configure_coordination_service", "graph_functions", "maybe_merge_call", "merge_calls_in_place",
           "needs_gradient", "op_flops", "optimizer_keys_kept", "partition_graphs", "peer_answers", "remake_variables",
           "replica_index",
           "scheduled_by_coordinator", "slice_of_sum", "worker_place"]

def peer_answers(peer: str, timeout_ms: int) -> bool:
    """Whether task `peer` (e.g. "/job:worker/replica:0/task:1") answers TensorFlow's
    collective health check: the private check MultiWorkerMirroredStrategy's own
    health thread uses (checked against TF 2.21). An unreachable, restarted or
    silent peer fails it."""
    import tensorflow as tf
    from tensorflow.python.eager import context

    try:
        context.context().check_collective_ops_peer_health(peer, timeout_in_ms=timeout_ms)
        return True
    except (tf.errors.UnavailableError, tf.errors.FailedPreconditionError, tf.errors.DeadlineExceededError):
        return False

def configure_coordination_service(
    cluster_spec, *, startup_timeout_seconds: float, heartbeat_timeout_seconds: float
) -> None:
    """Sets the multi-worker coordination service's timeouts before TF starts.

    MultiWorkerMirroredStrategy configures this service itself with TensorFlow's
    defaults: a peer that never starts is waited for an hour, with no public
    option to change it. Configured here first, the strategy keeps our settings
    (it only configures the service when none is set), so a missing peer fails
    after `startup_timeout_seconds` and a dead one after
    `heartbeat_timeout_seconds`.
    """
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.eager import context

    jobs = cluster_spec.as_dict()
    leader_job = "chief" if "chief" in jobs else "worker"
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=f"/job:{leader_job}/replica:0/task:0",
        cluster_register_timeout_in_ms=int(startup_timeout_seconds * 1000),
        heartbeat_timeout_in_ms=int(heartbeat_timeout_seconds * 1000),
        coordinated_jobs=[
            coordination_config_pb2.CoordinatedJob(name=job, num_tasks=cluster_spec.num_tasks(job))
            for job in ("chief", "worker")
            if job in jobs
        ],
    )
    # Without the barrier, the register timeout is not enforced: the first
    # collective waits for missing tasks forever.
    context.context().coordination_service.cluster_register_with_barrier = True

def needs_gradient(tensor) -> bool:
    """Whether a gradient tape in scope records `tensor` (so something needs its gradient)."""
    from tensorflow.python.eager import record

    return bool(record.should_record_backprop([tensor]))

def remake_variables(variables_in_contexts, optimizer=None) -> None:
    """Makes each Keras variable's TensorFlow storage again, inside its context, keeping its value.

    Keras 3 cannot move a variable once it is made, and a pipeline knows its
    stages only after the model, and often the optimizer, are built. The Keras
    object stays (so `model.weights`, names, checkpoints and optimizer slot
    lists do not change); its storage (`_value`) is made again the way Keras
    makes it, by the variable creators and device of the context, and every
    copy takes the value of the old copy at its position, and `optimizer` is
    re-keyed (`optimizer_keys_kept`).

    Args:
      variables_in_contexts: (Keras variable, context manager) pairs.
      optimizer: the Keras optimizer training these variables, if any.
    """
    with optimizer_keys_kept(optimizer, [variable for variable, _ in variables_in_contexts]):
        for variable, context in variables_in_contexts:
            old = variable._value
            with context:
                variable._initialize(old.read_value())
            for new_copy, old_copy in zip(getattr(variable._value, "values", ()), getattr(old, "values", ())):
                new_copy.assign(old_copy.read_value())  # copies of sync-on-read state may differ


@contextlib.contextmanager
def optimizer_keys_kept(optimizer, variables):
    """Re-keys `optimizer` (and the optimizer it wraps, for loss scaling) for `variables`, whose storage the
    block replaces: Keras optimizers key the variables they train by their storage's id (`_var_key`)."""
    optimizers = []
    while optimizer is not None:
        optimizers.append(optimizer)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    old_keys = [{o._var_key(v): v for v in variables} for o in optimizers]
    yield
    for o, keys in zip(optimizers, old_keys):
        if o.built:
            o._trainable_variables_indices = {o._var_key(v): i for i, v in enumerate(o._trainable_variables)}
        excluded = getattr(o, "_exclude_from_weight_decay", None)
        if excluded:
            o._exclude_from_weight_decay = {o._var_key(keys[k]) if k in keys else k for k in excluded}
        o._exclude_from_weight_decay_cache = {}

def partition_graphs(run) -> list:
    """The graphs TensorFlow's runtime executed for the functions `run()` instantiated, per device.

    A step's cross-device copies exist only after placement: TensorFlow splits
    each function's graph per device and joins the parts with `_Send`/`_Recv`
    pairs. Eager TensorFlow records those partition graphs in its run metadata
    (`tf.compat.v1.RunMetadata.function_graphs`), which has no public switch in
    TF2. Functions instantiated before `run()` are not recorded.
    """
    from tensorflow.python.eager import context

    ctx = context.context()
    ctx.enable_run_metadata()
    try:
        run()
        metadata = ctx.export_run_metadata()
    finally:
        ctx.disable_run_metadata()
    return [graph for function in metadata.function_graphs for graph in function.partition_graphs]


def scheduled_by_coordinator(strategy) -> bool:
    """Whether a parameter-server strategy's `run` is being traced for `ClusterCoordinator.schedule` (which
    runs it on a worker), rather than called on the chief; TensorFlow only warns, on every call, otherwise."""
    return bool(strategy.extended._being_scheduled)


def auto_shard(dataset, num_shards: int, index):
    """TensorFlow's auto-sharding of `dataset` by its own `auto_shard_policy` (what tf.distribute applies)."""
    from tensorflow.python.distribute import input_ops

    return input_ops.auto_shard_dataset(dataset, num_shards, index, num_shards)


def collective_keys(strategy):
    """The `CollectiveKeys` a mirrored strategy numbers its collective groups and instances with: launchers
    for groups of its devices (`tfdist.parallel.mesh_groups`) take their keys from it, so that their group keys
    cannot meet the strategy's own or another instance's. MirroredExtended keeps it as `_collective_keys`."""
    return strategy.extended._collective_keys


def collective_launchers(strategy) -> list:
    """One launcher of the strategy's collectives per local device, in the order of its devices.

    Mirrored and multi-worker strategies all-reduce with TensorFlow's collective
    ops through a `CollectiveAllReduce`, which keeps, per device, the group and
    instance keys and the ordering token every collective of that device must
    use; tf.distribute exposes all-reduce and all-gather but no reduce-scatter.
    """
    extended = strategy.extended
    collectives = getattr(extended, "_collective_ops", None) or extended._cross_device_ops
    launchers = getattr(collectives, "_launchers", None)
    if launchers is None:
        raise ValueError(f"{type(strategy).__name__} does not reduce with TensorFlow's collective ops "
                         f"(its cross-device ops are {type(collectives).__name__}), so nothing can be reduce-scattered.")
    return launchers


def replica_index() -> int:
    """The current replica's index among its strategy's replicas as a Python int, while the step is traced:
    a mirrored replica context keeps it as `_replica_id_in_sync_group`, and its public `replica_id_in_sync_group`
    is a tensor, which cannot pick a Python object per replica (each device's collective launcher)."""
    import tensorflow as tf

    return int(tf.distribute.get_replica_context()._replica_id_in_sync_group)


def reduce_scatter(launcher, tensor, rank: int):
    """Slice `rank` (of as many as the group has devices) of the sum over the group of the 1-D `tensor`,
    with the bytes of a reduce-scatter.

    TensorFlow 2.21's CollectiveReduceScatterV2 has a kernel for NCCL only
    (GPUs): on CPUs the collective registry finds no implementation. Its
    all-to-all has one: device j sends its slice i to device i and receives
    every device's slice j, which it sums. Each device sends and receives
    (n - 1)/n of the tensor, as a ring reduce-scatter does. The collective
    takes the launcher's keys, ordering token and timeout, as its all-reduce
    does.
    """
    import tensorflow as tf
    from tensorflow.python.ops import collective_ops

    options = launcher._options
    with tf.device(launcher._device):
        received = collective_ops.all_to_all_v2(
            tf.reshape(tensor, [launcher._group_size, -1]), launcher._group_size, launcher._group_key,
            launcher._next_instance_key(), communication_hint=options.implementation.value,
            timeout=options.timeout_seconds, ordering_token=launcher._get_ordering_token())
        return tf.math.add_n(tf.unstack(received))  # elementwise: 30% faster than reduce_sum over axis 0


def slice_of_sum(launcher, tensor, rank: int, stage: int):
    """Slice `rank` of the sum over the group of the 1-D `tensor`, as ZeRO's `stage` reduces it:
    `reduce_scatter` at stages 2 and 3, `all_reduced_slice` at stage 1."""
    return (reduce_scatter if stage >= 2 else all_reduced_slice)(launcher, tensor, rank)


def all_reduced_slice(launcher, tensor, rank: int):
    """Slice `rank` of the sum over the group of the 1-D `tensor`, by the launcher's all-reduce: the
    whole sum reaches every device (ZeRO stage 1), with an all-reduce's bytes."""
    import tensorflow as tf

    reduced = launcher.all_reduce(tensor)
    with tf.device(launcher._device):
        length = tensor.shape[0] // launcher._group_size
        return reduced[rank * length:(rank + 1) * length]


def all_gather(launcher, tensor):
    """Every device's 1-D `tensor` (all the same length), concatenated in device order: one collective
    (the launcher's public `all_gather` first gathers the shapes, a second one)."""
    return launcher._all_gather(tensor, None)


def merge_calls_in_place(extended_class) -> None:
    """Lets strategies whose extended class is `extended_class` (one replica per process) run `merge_call`
    where it is called.

    MirroredStrategy runs each replica in a thread of its own and hands a
    `merge_call`'s function to the main thread, which cannot reach a tensor
    made inside a `tf.cond` branch ("`merge_call` called while defining a new
    graph"). Keras's LossScaleOptimizer applies its inner optimizer inside such
    a cond when the strategy does not use merge_call, and that optimizer's step
    counter (an ONLY_FIRST_REPLICA variable) updates through a merge_call. With
    one replica there is no other thread to wait for: the function runs in the
    replica's own thread and graph, in cross-replica mode, as TensorFlow's base
    ReplicaContext runs it, with the values one replica's regrouping leaves as
    they are. Idempotent.
    """
    from tensorflow.python.distribute import distribute_lib, mirrored_run

    if not _MERGE_IN_PLACE:
        handed_over = mirrored_run._MirroredReplicaContext._merge_call

        def _merge_call(self, fn, args, kwargs):
            if type(self._strategy.extended) in _MERGE_IN_PLACE:
                return distribute_lib.ReplicaContext._merge_call(self, fn, args, kwargs)
            return handed_over(self, fn, args, kwargs)

        mirrored_run._MirroredReplicaContext._merge_call = _merge_call
    _MERGE_IN_PLACE.add(extended_class)


_MERGE_IN_PLACE: set = set()


def maybe_merge_call(fn, strategy, *args):
    """`fn(distribution, *args)` in cross-replica context, called from a replica: through `merge_call` where the
    strategy uses it, else directly (Keras's optimizers apply their updates this way; TensorFlow exports it only
    under `tf.__internal__`)."""
    import tensorflow as tf

    return tf.__internal__.distribute.interim.maybe_merge_call(fn, strategy, *args)


def graph_functions(graph) -> list:
    """The graphs of the functions `graph`'s library holds (the bodies of its `tf.function` calls, conds and
    loops), which `graph.get_operations()` does not list and no public API walks."""
    return [function.graph for function in graph._functions.values() if hasattr(function, "graph")]


def broadcast(launcher, keys, value, size: int, send: bool):
    """`value` of the process that `send`s, on every process of `launcher`'s collective group: one collective.
    The launcher's group key and device, which its public methods keep to themselves, name the group."""
    import tensorflow as tf
    from tensorflow.python.ops import collective_ops

    instance = keys.get_instance_key(launcher._group_key, launcher._device)
    value = tf.convert_to_tensor(value)
    with tf.device(launcher._device):
        if send:
            return collective_ops.broadcast_send_v2(value, size, launcher._group_key, instance)
        return collective_ops.broadcast_recv_v2(tf.shape(value), value.dtype, size, launcher._group_key, instance)


def worker_place(strategy) -> tuple[int, int, object]:
    """(the workers of a MultiWorkerMirroredStrategy's cluster, this task's index among them, its
    communication options), which its extended strategy keeps privately."""
    extended = strategy.extended
    return extended._num_workers, extended._id_in_cluster, extended._communication_options


def op_flops(graph, op) -> float:
    """The FLOPs TensorFlow's statistics give `op` (as its profiler counts them; 0 for an op type without
    statistics), without the warning the TF1 helper behind them prints once."""
    from tensorflow.python.framework import ops
    from tensorflow.python.util import deprecation

    with deprecation.silence():
        try:
            return float(ops.get_stats_for_node_def(graph, op.node_def, "flops").value or 0)
        except ValueError:  # no statistics registered for the op type: no arithmetic worth counting
            return 0.0


def gradients_recorded() -> bool:
    """Whether a gradient tape records what runs now, in this thread (TensorFlow asks it privately)."""
    from tensorflow.python.eager import record

    return record.could_possibly_record()
