"""The only place tfdist patches Keras or TensorFlow, or probes optional packages.

Each function names the public behaviour it needs and why no public API gives it.
(Strategies that extend TensorFlow's own strategy classes import those from
`tensorflow.python.distribute` in their module, and say there what they add.)

Every function here reaches into Keras or TensorFlow internals, and each was
checked against the versions in `TESTED_VERSIONS` (TensorFlow 2.21, Keras
3.15), the ones the test suite runs on. Importing this module warns once when
the installed versions are outside them.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import threading
import warnings
import weakref
from typing import Mapping, Optional

TESTED_VERSIONS = {"tensorflow": "2.21", "keras": "3.15"}  # major.minor

__all__ = [
    "TESTED_VERSIONS",
    "check_versions",
    "configure_coordination_service",
    "forget_step_functions",
    "gradient_weight",
    "graph_nodes",
    "horovod",
    "install_clipping_after_all_reduce",
    "install_atomic_parameter_server_updates",
    "install_trainer_hooks",
    "keras_reduce_per_replica",
    "keras_step_function",
    "loss_tracker",
    "needs_gradient",
    "nvml",
    "partition_graphs",
    "remake_variables",
    "xspace",
]


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


def graph_nodes(model):
    """The layer graph of a Sequential or functional Keras model.

    Keras has no public API for a model's nodes (which layer consumes which
    tensors); pipeline partitioning needs it to know what crosses a stage
    boundary. Returns `(nodes, inputs, outputs)`: `nodes` lists
    `(operation, input KerasTensors, output KerasTensors)` in an order where
    every node comes after the nodes it consumes; `inputs` and `outputs` are
    the model's KerasTensors.

    Raises:
      ValueError: the model is subclassed (it has no layer graph) or unbuilt.
    """
    import keras

    graph = getattr(model, "_functional", None) if isinstance(model, keras.Sequential) else model
    if graph is None or not hasattr(graph, "_nodes_by_depth"):
        raise ValueError(
            f"`model` must be a built Sequential or functional model to be split into "
            f"pipeline stages; a subclassed model has no layer graph. Received: {model.name}"
        )
    nodes = []
    for depth in sorted(graph._nodes_by_depth, reverse=True):
        for node in graph._nodes_by_depth[depth]:
            if node.operation is None or node.is_input:
                continue
            nodes.append((node.operation, list(node.input_tensors), list(node.outputs)))
    return nodes, list(graph.inputs), list(graph.outputs)


def loss_tracker(model):
    """The `Mean` metric behind the `loss` entry of Keras's training logs.

    A training step written outside `Model.train_step` (the pipelined one)
    must update it as Keras's own step does; Keras keeps it private.
    """
    return model._loss_tracker


_STEP_FUNCTION_MAKERS = ("make_train_function", "make_test_function", "make_predict_function")
_TRAINER_HOOKS = _STEP_FUNCTION_MAKERS + ("get_metrics_result", "_maybe_symbolic_build")
_ORIGINAL_TRAINER_METHODS: dict = {}


def install_trainer_hooks() -> None:
    """Lets a strategy supply the step functions Keras 3's TensorFlow trainer runs.

    Keras 3 builds `fit`/`evaluate`/`predict` step functions around
    `strategy.run` on the calling process, and offers no way to schedule them
    elsewhere (tf.keras had `_cluster_coordinator`; Keras 3 dropped it). For a
    model whose strategy has `keras_hooks(model)`, the trainer's
    `make_*_function` install the functions that dict names (`train_function`,
    `test_function`, `predict_function`) instead of Keras's, and
    `get_metrics_result` calls its `metrics_result` if it has one. An
    iterator the strategy hands Keras (`experimental_distribute_dataset`) that
    has `on_step_group(first, last, steps_per_epoch)` hears, before each call
    of the train function, which of the epoch's steps that call is for: Keras
    passes it only the iterator, and a last group of `steps_per_execution` may
    be short. Before its first step, Keras builds the model from the first
    batch averaged over the replicas, which fails when that batch does not
    divide over them (3 validation examples on 2 replicas: "AddN must have the
    same size and shape", keras-team/keras#19246); the build here takes the
    first replica's part, which has the shapes it needs. Everything else keeps
    Keras's own methods. Idempotent.
    """
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer, TFEpochIterator

    if _ORIGINAL_TRAINER_METHODS:
        return
    _ORIGINAL_TRAINER_METHODS.update({name: getattr(TensorFlowTrainer, name) for name in _TRAINER_HOOKS})

    def hooks_of(model):
        # Made once per compile: `compile` makes a new `_compile_config`, and a
        # recompiled model (new optimizer or loss) needs new step functions.
        compiled_as = getattr(model, "_compile_config", None)
        cached = model.__dict__.get("_tfdist_hooks")
        if cached is None or cached[0] is not compiled_as:
            make = getattr(model.distribute_strategy, "keras_hooks", None)
            model.__dict__["_tfdist_hooks"] = (compiled_as, make(model) if make else None)
        return model.__dict__["_tfdist_hooks"][1]

    def step_function_maker(name: str):
        attribute = name.replace("make_", "")

        def make(self, force=False):
            hooks = hooks_of(self)
            if attribute not in (hooks or {}):
                return _ORIGINAL_TRAINER_METHODS[name](self, force=force)
            setattr(self, attribute, hooks[attribute])
            return getattr(self, attribute)

        return make

    def get_metrics_result(self):
        import tensorflow as tf

        hooks = hooks_of(self)
        # In a traced step (Keras's own compute_metrics) the graph reads the metrics itself.
        if "metrics_result" in (hooks or {}) and tf.executing_eagerly():
            return hooks["metrics_result"]()
        return _ORIGINAL_TRAINER_METHODS["get_metrics_result"](self)

    def maybe_symbolic_build(self, iterator=None, data_batch=None):
        import tensorflow as tf

        if iterator is not None and self._distribute_strategy is not None:
            for _, _, batches in iterator:  # as Keras does: the first batch
                local = self._distribute_strategy.experimental_local_results
                data_batch = tf.nest.map_structure(
                    lambda v: local(v)[0] if isinstance(v, tf.distribute.DistributedValues) else v, next(batches))
                break
        return _ORIGINAL_TRAINER_METHODS["_maybe_symbolic_build"](self, data_batch=data_batch)

    next_group = TFEpochIterator.__next__
    init = TFEpochIterator.__init__
    get_iterator = TFEpochIterator._get_iterator

    def init_recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        global _LATEST_EPOCH_ITERATOR
        _LATEST_EPOCH_ITERATOR = weakref.ref(self)

    def get_iterator_resumed(self):
        # Called whenever Keras starts a new iterator over the dataset.
        skip = self.__dict__.pop("_tfdist_skip_batches", 0)
        self.__dict__["_tfdist_batches"] = skip
        if not skip:
            return get_iterator(self)
        dataset = self.data_adapter.get_tf_dataset().skip(skip)  # global batches: before any sharding
        return self._distribute_strategy.experimental_distribute_dataset(dataset)

    def next_group_told(self):
        first, last, iterator = next_group(self)
        resume_at = self.__dict__.pop("_tfdist_first_step", 0)
        while first < resume_at:  # steps a checkpoint already took: Keras's counter moves, no data is read
            first, last, iterator = next_group(self)
        self.__dict__["_tfdist_batches"] += last - first + 1
        if hasattr(iterator, "on_step_group"):
            iterator.on_step_group(first, last, self.num_batches)
        return first, last, iterator

    for name in _STEP_FUNCTION_MAKERS:
        setattr(TensorFlowTrainer, name, step_function_maker(name))
    TensorFlowTrainer.get_metrics_result = get_metrics_result
    TensorFlowTrainer._maybe_symbolic_build = maybe_symbolic_build
    TFEpochIterator.__init__ = init_recorded
    TFEpochIterator._get_iterator = get_iterator_resumed
    TFEpochIterator.__next__ = next_group_told


_LATEST_EPOCH_ITERATOR = None


def build_for_training(model, epoch_iterator) -> None:
    """Makes every variable `fit` will train with (optimizer slots, metrics) now, from the data's shapes.

    Under a distribution strategy `fit` does this before `on_train_begin`; without
    one Keras waits for the first step's tracing, too late to restore them.
    Shapes only: no batch is read, so the input order stays as it would be.
    """
    spec = epoch_iterator.data_adapter.get_tf_dataset().element_spec
    model._symbolic_build(data_batch=spec)


def keras_global_seed_state():
    """The variable behind Keras's unseeded random ops (`keras.random.normal()` without a seed)."""
    from keras.src.random.seed_generator import global_seed_generator

    return global_seed_generator().state


def training_epoch_iterator():
    """The epoch iterator `fit` made last: in a callback's `on_train_begin`, the one training reads.

    tfdist's hooks (install_trainer_hooks) let it resume: set `_tfdist_skip_batches`
    (global batches the next iterator over the dataset skips, inside tf.data) and
    `_tfdist_first_step` (the epoch's first step to run) before the epoch starts;
    `_tfdist_batches` counts the batches read from the current iterator.
    """
    return _LATEST_EPOCH_ITERATOR() if _LATEST_EPOCH_ITERATOR is not None else None


def forget_step_functions(model) -> None:
    """Has the next `fit`/`evaluate`/`predict` make `model`'s step functions again (Keras's, or a strategy's
    hooks): they bake in what they were traced with, such as the number of replicas."""
    model.__dict__.pop("_tfdist_hooks", None)
    model.train_function = model.test_function = model.predict_function = None


def keras_step_function(model, attribute: str):
    """Keras's own step function (`train_function`, ...) for `model`, for a hook to wrap."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    maker = "make_" + attribute
    _ORIGINAL_TRAINER_METHODS.get(maker, getattr(TensorFlowTrainer, maker))(model, force=True)
    return getattr(model, attribute)


def keras_reduce_per_replica(outputs, strategy):
    """Keras's reduction of a training step's per-replica outputs to the logs it shows.

    A strategy that builds its own training function (a multi-step loop Keras's
    cannot run) must hand Keras the logs its own function would; Keras keeps
    the reduction private.
    """
    from keras.src.backend.tensorflow.trainer import reduce_per_replica

    return reduce_per_replica(outputs, strategy, reduction="auto")


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
    copy takes the value of the old copy at its position. Keras optimizers key
    the variables they train by their storage's id (`_var_key`), so
    `optimizer` (and the optimizer it wraps, for loss scaling) is re-keyed.

    Args:
      variables_in_contexts: (Keras variable, context manager) pairs.
      optimizer: the Keras optimizer training these variables, if any.
    """
    optimizers = []
    while optimizer is not None:
        optimizers.append(optimizer)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    remade = [variable for variable, _ in variables_in_contexts]
    old_keys = [{o._var_key(v): v for v in remade} for o in optimizers]
    for variable, context in variables_in_contexts:
        old = variable._value
        with context:
            variable._initialize(old.read_value())
        for new_copy, old_copy in zip(getattr(variable._value, "values", ()), getattr(old, "values", ())):
            new_copy.assign(old_copy.read_value())  # copies of sync-on-read state may differ
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


def install_clipping_after_all_reduce() -> None:
    """Lets a strategy clip gradients after the all-reduce, as one device would.

    Keras 3 clips (`clipnorm`, `global_clipnorm`, `clipvalue`) each replica's
    gradient before its optimizer all-reduces them, so with two replicas a
    step moved a variable by 0.043 where `lr * clipnorm` is 0.025, and TF's
    own strategies do the same. Keras has no hook between the two. Under a
    strategy whose `clips_after_all_reduce` is true, the gradients are
    all-reduced first, clipped, and divided by the number of replicas, so the
    all-reduce Keras runs next gives the clipped global gradient. It costs one
    more all-reduce per step, only when clipping is on. Other strategies keep
    Keras's behaviour. Idempotent.
    """
    import tensorflow as tf
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    if getattr(BaseOptimizer, "_tfdist_clips_after_all_reduce", False):
        return
    keras_clip = BaseOptimizer._clip_gradients

    def _clip_gradients(self, grads):
        weight = getattr(_GRADIENT_WEIGHT, "value", None)
        if weight is not None:
            grads = [_scaled(g, weight) for g in grads]
        context = tf.distribute.get_replica_context()
        clipping = self.clipnorm or self.global_clipnorm or self.clipvalue
        if (
            not clipping
            or context is None
            or context.num_replicas_in_sync == 1
            or not getattr(tf.distribute.get_strategy(), "clips_after_all_reduce", False)
        ):
            return keras_clip(self, grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, [grads[i] for i in present])
        summed = list(grads)
        for i, g in zip(present, reduced):
            summed[i] = g
        replicas = context.num_replicas_in_sync
        return [None if g is None else g / replicas for g in keras_clip(self, summed)]

    BaseOptimizer._clip_gradients = _clip_gradients
    BaseOptimizer._tfdist_clips_after_all_reduce = True


# Set per replica (MirroredStrategy traces each replica in a thread of its own).
_GRADIENT_WEIGHT = threading.local()


@contextlib.contextmanager
def gradient_weight(weight):
    """Within it, this replica's optimizer multiplies its gradients by `weight` before
    they are all-reduced (and clipped). Needs `install_clipping_after_all_reduce`.

    Keras scales each replica's loss by 1 / replicas, which is right only when
    every replica holds as many examples; there is no hook between the gradient
    and its all-reduce but the optimizer's `_clip_gradients`.
    """
    previous = getattr(_GRADIENT_WEIGHT, "value", None)
    _GRADIENT_WEIGHT.value = weight
    try:
        yield
    finally:
        _GRADIENT_WEIGHT.value = previous


def _scaled(gradient, weight):
    import tensorflow as tf

    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values * tf.cast(weight, gradient.values.dtype), gradient.indices,
                                gradient.dense_shape)
    return gradient * tf.cast(weight, gradient.dtype)


def install_atomic_parameter_server_updates() -> None:
    """Makes Keras 3's `assign_add`/`assign_sub` atomic for variables on parameter servers.

    Keras 3 updates a variable by read-modify-write (`assign(self + value)`).
    When two workers update the same parameter-server variable at once, one
    worker's update is overwritten and lost (measured: 16 of 192 optimizer
    steps). TensorFlow's own AssignAdd/AssignSub run on the parameter server
    under the variable's lock, as tf.keras used them. Other variables keep
    Keras's code. Idempotent.
    """
    from keras.src.backend.common.stateless_scope import in_stateless_scope
    from keras.src.backend.tensorflow.core import Variable

    if getattr(Variable, "_tfdist_atomic_updates", False):
        return
    keras_add, keras_sub = Variable.assign_add, Variable.assign_sub

    def on_parameter_server(variable) -> bool:
        return not in_stateless_scope() and "/job:ps/" in (getattr(variable._value, "device", "") or "")

    def assign_add(self, value):
        if on_parameter_server(self):
            return self._value.assign_add(self._convert_to_tensor(value, dtype=self._value.dtype))
        return keras_add(self, value)

    def assign_sub(self, value):
        if on_parameter_server(self):
            return self._value.assign_sub(self._convert_to_tensor(value, dtype=self._value.dtype))
        return keras_sub(self, value)

    Variable.assign_add, Variable.assign_sub = assign_add, assign_sub
    Variable._tfdist_atomic_updates = True


def horovod():
    """`horovod.tensorflow`, or an ImportError that says in one line how to get it.

    Horovod 0.28.1 has no wheel for current TensorFlow; it is built from source
    by `tools/install_horovod.sh` (which `make setup` runs).
    """
    try:
        import horovod.tensorflow as hvd
    except ImportError as error:
        raise ImportError(
            f"Horovod is not installed ({error}); build and install it with "
            "`tools/install_horovod.sh .venv/bin` (make setup does this)."
        ) from None
    return hvd


def nvml():
    """`pynvml` from nvidia-ml-py (NVIDIA's NVML bindings), or an ImportError that says how to get it."""
    try:
        import pynvml
    except ImportError as error:
        raise ImportError(f"nvidia-ml-py is not installed ({error}); pip install 'tfdist[monitor]'.") from None
    return pynvml


def xspace(path: str):
    """A profile written by `tf.profiler` (an `.xplane.pb` file), parsed.

    The profiler has no public reader: TensorBoard's profile plugin reads the
    same protobuf, whose Python module ships with TensorFlow under `tsl`.
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    return space


def check_versions(installed: Optional[Mapping[str, str]] = None) -> list[str]:
    """Warns once if TensorFlow or Keras is not the major.minor version tfdist was tested with.

    Args:
      installed: package -> version; default: what is installed
        (`tensorflow-cpu` counts as `tensorflow`).

    Returns:
      The packages outside `TESTED_VERSIONS`, as `name version`.
    """
    if installed is None:
        installed = {}
        for name, distributions in (("tensorflow", ("tensorflow", "tensorflow-cpu")), ("keras", ("keras",))):
            for distribution in distributions:
                try:
                    installed[name] = importlib.metadata.version(distribution)
                    break
                except importlib.metadata.PackageNotFoundError:
                    pass
    outside = [
        f"{name} {version}"
        for name, version in installed.items()
        if ".".join(version.split(".")[:2]) != TESTED_VERSIONS[name]
    ]
    if outside:
        tested = ", ".join(f"{name} {version}" for name, version in TESTED_VERSIONS.items())
        warnings.warn(
            f"tfdist was tested with {tested}; this environment has {', '.join(outside)}. tfdist reaches into "
            "Keras and TensorFlow internals (tfdist._compat), which may have changed: run its tests, or install "
            "the tested versions (pip install 'tfdist[cpu]').",
            stacklevel=2,
        )
    return outside


check_versions()


def input_workers(strategy) -> tuple[int, Optional[int]]:
    """(input pipelines of the job, this process's index among them, or None where the chief feeds every worker).

    Read from the strategy's own input context (tfdist's Horovod and process-group
    strategies), TensorFlow's multi-worker strategy, or a parameter-server
    strategy's worker count; 1 and 0 for a one-process strategy.
    """
    extended = strategy.extended
    context = getattr(extended, "_input_context", None)
    if callable(context) and getattr(extended, "_processes", True) is not None:
        context = context()
        return context.num_input_pipelines, context.input_pipeline_id
    if hasattr(strategy, "coordinator"):  # parameter servers: the chief builds what every worker reads
        return strategy.num_workers, None
    return getattr(extended, "_num_workers", 1), getattr(extended, "_id_in_cluster", 0)


def auto_shard(dataset, num_shards: int, index):
    """TensorFlow's auto-sharding of `dataset` by its own `auto_shard_policy` (what tf.distribute applies)."""
    from tensorflow.python.distribute import input_ops

    return input_ops.auto_shard_dataset(dataset, num_shards, index, num_shards)
