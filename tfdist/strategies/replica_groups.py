"""`ReplicaGroupsStrategy`: data parallelism over model replicas that each span several devices.

The base of `TensorParallelStrategy` and `PipelineStrategy`. It is a
`MirroredStrategy` over each replica's first device, so batch splitting,
variable mirroring and the gradient all-reduce stay TensorFlow's own. What it
adds is where a variable lives:

- a variable made under a device of the first replica (a `tf.device` scope,
  as tensor-parallel layers do for each shard, or a layer placement) is
  mirrored onto that device's counterpart in every replica, where
  MirroredStrategy would put every copy on the replicas' first devices;
- `move_variables` makes existing variables again on other devices, once,
  with their current values; the optimizer slots made beside them go with
  them. A pipeline needs this: its stages are known only once the model is
  built, and by then Keras may have built the optimizer too.

Optimizer slots are made beside their variable and updates run where the
variable lives (MirroredStrategy's own `update`), so each device holds and
updates only its own part. Gradients are all-reduced between the copies of
one variable, that is between counterpart devices.

With a `ProcessGroup` (`processes`), every process of a multi-worker or
Horovod job runs such replicas on its own devices and all of them train data
parallel: the replica count and ids span the processes, each process reads its
own shard of every global batch, every variable starts from process 0's value,
and each reduction is done in two steps: among this process's copies (as
above), then across the processes on the device that holds the first copy,
with the process group's collectives.

Example:

    >>> strategy = ReplicaGroupsStrategy([["/cpu:0"]])
    >>> strategy.mirrored_devices("/cpu:0")
    ['/cpu:0']
"""

from __future__ import annotations

import weakref
from typing import Optional, Sequence

import keras
import tensorflow as tf
from tfdist._compat.tf_distribute import (cross_device_ops_lib, cross_device_utils, device_util,
                                          distribute_utils, mirrored_strategy, numpy_dataset, values)

from tfdist import _compat
from tfdist.parallel.device_group import DeviceGroup, current_replica
from tfdist.parallel import weight_shards
from tfdist.parallel.optimizer_shards import DeviceCollectives, shards_of
from tfdist.contract import contract
from tfdist.strategies.data_parallel import MirroredStrategy, make_named_cpus
from tfdist.strategies.horovod import HorovodStrategy
from tfdist.strategies.multi_worker import MultiWorkerMirroredStrategy
from tfdist.strategies.process_group import ProcessGroup
from tfdist.strategies.process_input import PerProcessInput

__all__ = ["ProcessLayoutError", "ReplicaGroupsStrategy", "bytes_by_device", "make_process_group"]

# `data_parallel` by name: the strategy over processes whose process group the replicas train across.
_BACKENDS = {"multi_worker": MultiWorkerMirroredStrategy, "horovod": HorovodStrategy}


class _OnDevices:
    """What MirroredExtended reads from `colocate_with`: the devices of the copies."""

    def __init__(self, devices: Sequence[str]):
        self._devices = tuple(devices)


class _AcrossProcesses(tf.distribute.CrossDeviceOps):
    """Reductions among this process's copies of a value, on the device of its first copy (where
    MirroredStrategy's collectives would use each replica's first device), then across the
    processes on that device, then copied to the other local copies."""

    def __init__(self, processes: ProcessGroup):
        super().__init__()
        self.local = tf.distribute.ReductionToOneDevice()  # onto the destination's first device
        self.processes = processes

    @property
    def _num_between_graph_workers(self):
        return self.processes.size  # never take TensorFlow's one-device shortcut

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        return self.batch_reduce_implementation(reduce_op, [(per_replica_value, destinations)], options)[0]

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        local = self.local.batch_reduce(reduce_op, value_destination_pairs, options)
        # Dense: collectives take tensors. One local copy comes back as a plain tensor.
        firsts = [tf.convert_to_tensor(getattr(value, "values", (value,))[0]) for value in local]
        by_device: dict[str, list[int]] = {}
        for i, tensor in enumerate(firsts):
            by_device.setdefault(tensor.device, []).append(i)
        reduced = [None] * len(firsts)
        for device, indices in by_device.items():
            for i, result in zip(indices, self.processes.all_reduce(reduce_op, [firsts[i] for i in indices], device)):
                reduced[i] = result
        return [
            cross_device_ops_lib.simple_broadcast(result, destinations, always_mirrored=True)
            for result, (_, destinations) in zip(reduced, value_destination_pairs)
        ]


class _Columns:
    """The collectives of each device of a replica with its counterparts in the others (a column: a stage's
    devices, a placed layer's), for values that live there. TensorFlow's collective launchers (what
    MirroredStrategy runs per device) under a group key of each column's own, so that a split variable's
    slices are gathered where its copies live, not on the replicas' first devices."""

    def __init__(self, strategy: "ReplicaGroupsStrategy"):
        self.firsts = _compat.collective_launchers(strategy)  # the strategy's own, on the replicas' first devices
        self.devices = [[_device_name(device) for device in group.devices] for group in strategy.replicas]
        keys, options = _compat.collective_keys(strategy), self.firsts[0]._options
        self.launchers: dict[str, cross_device_utils.CollectiveReplicaLauncher] = {}
        for position in range(1, len(self.devices[0]) if len(self.devices) > 1 else 0):
            column = [device_util.canonicalize(group.devices[position]) for group in strategy.replicas]
            group_key = keys.get_group_key(column)
            for device in column:
                self.launchers[_device_name(device)] = cross_device_utils.CollectiveReplicaLauncher(
                    group_key, len(column), keys, device, options)

    def device(self, d: int, tensor) -> str:
        """The device of local replica d that `tensor` lies on, else the replica's first."""
        device = _device_name(tensor.device) if tensor.device else None
        return device if device in self.devices[d] else self.devices[d][0]

    def launcher(self, d: int, tensor):
        return self.launchers.get(self.device(d, tensor)) or self.firsts[d]


def _device_name(device: str) -> str:
    spec = tf.DeviceSpec.from_string(device)
    return f"{(spec.device_type or 'CPU').upper()}:{spec.device_index or 0}"


class _SlicesInColumns(DeviceCollectives):
    """How the replicas of one process share split slices: as MirroredStrategy's replicas do, each
    value among the devices that hold its copies (`_Columns`)."""

    def __init__(self, strategy: "ReplicaGroupsStrategy", stage: int):
        super().__init__(strategy, stage)
        self.columns = _Columns(strategy)

    def reduce_scatter(self, d, packed):
        return _compat.slice_of_sum(self.columns.launcher(d, packed), packed, self.ranks[d], self.stage)

    def all_gather(self, d, piece):
        return _compat.all_gather(self.columns.launcher(d, piece), piece)


class _SlicesAcrossProcesses:
    """How the replicas of every process share an optimizer state split over all of them (the
    collectives `shard_optimizer_state` takes; see `DeviceCollectives`).

    Replica r of process p holds slice p x L + r (its replica id in sync, L
    replicas a process) of every variable. A step reduces the packed
    gradients across the processes first, on the device that holds them with
    its counterparts (each process receives the sum of its L slices), then
    among the process's replicas (`_Columns`); the updated slices are gathered
    the other way round. Either step reduce-scatters at stages 2 and 3 and
    all-reduces then keeps its part at stage 1, so the bytes are those of the
    one-level split.
    """

    multi_process = True

    def __init__(self, strategy: "ReplicaGroupsStrategy", processes: ProcessGroup, stage: int):
        self.strategy, self.processes, self.stage = strategy, processes, stage
        self.devices = tuple(strategy.extended.worker_devices)
        self.parts = len(self.devices) * processes.size
        self.ranks = tuple(processes.index * len(self.devices) + d for d in range(len(self.devices)))
        self.columns = _Columns(strategy)

    def reduce_scatter(self, d, packed):
        ours = self.processes.reduce_scatter(packed, self.columns.device(d, packed), self.stage)
        if len(self.devices) == 1:
            return ours
        return _compat.slice_of_sum(self.columns.launcher(d, packed), ours, d, self.stage)

    def all_gather(self, d, piece):
        device = self.columns.device(d, piece)
        if len(self.devices) > 1:
            piece = _compat.all_gather(self.columns.launcher(d, piece), piece)
        return self.processes.all_gather(piece, device)

    def gather_pieces(self, pieces):
        """Every replica's piece of a slot, in slice order: a collective, so every process saves together."""
        with tf.device(self.devices[0]):
            ours = tf.concat([tf.convert_to_tensor(piece) for piece in pieces], axis=0)
        return self.processes.all_gather(ours, self.devices[0])


class _ReplicaGroupsExtended(PerProcessInput, mirrored_strategy.MirroredExtended):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # (variable, the variable it was made beside): optimizer slots, found again by `move_variables`.
        self._made_beside: list[tuple[weakref.ref, weakref.ref]] = []
        self._processes: Optional[ProcessGroup] = None  # set by the strategy for a multi-process job
        self._across: Optional[_AcrossProcesses] = None  # the cross-device ops across them, set with them

    # What changes when the replicas span processes (`ReplicaGroupsStrategy(processes=...)`).

    @property
    def _num_replicas_in_sync(self):
        return len(self._devices) * (self._processes.size if self._processes else 1)

    def _get_replica_id_in_sync_group(self, replica_id):
        return replica_id + (self._processes.index * len(self._devices) if self._processes else 0)

    def _get_local_replica_id(self, replica_id_in_sync_group):
        return replica_id_in_sync_group - (self._processes.index * len(self._devices) if self._processes else 0)

    @property
    def experimental_between_graph(self):
        return self._processes is not None

    @property
    def should_checkpoint(self):
        return self._processes is None or self._processes.index == 0

    @property
    def should_save_summary(self):
        return self.should_checkpoint

    def _get_cross_device_ops(self, value):
        return self._across if self._processes is not None else super()._get_cross_device_ops(value)

    def _reduce_to(self, reduce_op, value, destinations, options):
        if self._processes is None:
            return super()._reduce_to(reduce_op, value, destinations, options)
        # MirroredStrategy reduces values bound for CPUs on its own, locally; these must cross processes.
        if distribute_utils.is_mirrored(value) and reduce_op == tf.distribute.ReduceOp.MEAN:
            return value

        def reduce_one(v):
            if not isinstance(v, values.DistributedValues):
                return cross_device_ops_lib.reduce_non_distributed_value(
                    reduce_op, v, destinations, self._num_replicas_in_sync)
            return self._get_cross_device_ops(v).reduce(reduce_op, v, destinations, options)

        return tf.nest.map_structure(reduce_one, value)

    def _process_place(self) -> Optional[tuple[int, int]]:
        return (self._processes.index, self._processes.size) if self._processes is not None else None

    def _create_variable(self, next_creator, **kwargs):
        reference = kwargs.get("colocate_with")
        # A variable of one device (a split optimizer's slice of this process's) keeps its own value.
        if self._processes is not None and not isinstance(reference, numpy_dataset.SingleDevice):
            initial_value = kwargs["initial_value"]

            def from_process_0():  # every process starts from the same value
                return self._processes.broadcast(initial_value() if callable(initial_value) else initial_value)

            kwargs["initial_value"] = from_process_0
        if reference is None:
            strategy = self._container_strategy()
            device = strategy.variable_device()
            devices = strategy.mirrored_devices(device) if device else None
            if devices:
                kwargs["colocate_with"] = _OnDevices(devices)
        variable = super()._create_variable(next_creator, **kwargs)
        if isinstance(reference, values.DistributedVariable):
            self._made_beside = [pair for pair in self._made_beside if pair[0]() is not None]
            self._made_beside.append((weakref.ref(variable), weakref.ref(reference)))
        return variable

    def made_beside(self) -> dict[int, int]:
        """id of a variable's storage -> id of the storage it was made beside, for live variables."""
        pairs = ((made(), reference()) for made, reference in self._made_beside)
        return {id(made): id(reference) for made, reference in pairs if made is not None and reference is not None}


class ReplicaGroupsStrategy(MirroredStrategy):
    """Model replicas of several devices each, trained data parallel.

    Args:
      replica_devices: per replica, its devices; every replica has as many,
        and a device's counterpart in another replica is the one at the same
        position. A replica's first device runs its step and holds what is
        placed nowhere else.
      shard_optimizer: 1 splits the state of an optimizer compiled under this
        strategy over the replicas (of every process), each slice beside its
        variable's copy, 2 also reduce-scatters the gradients, and 3 splits
        the weights too: each replica's copy of a large variable becomes its
        slice, gathered among the devices that hold the variable's copies
        (a stage's devices) when a layer reads it.
      keep_whole_below, prefetch_weights: at stage 3, as for `MirroredStrategy`.

    Raises:
      ValueError: no replicas, replicas of different sizes, a device that
        does not exist or is named twice.
    """

    _extended_type = _ReplicaGroupsExtended

    def __init__(self, replica_devices: Sequence[Sequence[str]], processes: Optional[ProcessGroup] = None,
                 shard_optimizer: int = 0, keep_whole_below: int = weight_shards.KEEP_WHOLE_BELOW,
                 prefetch_weights: bool = True):
        sizes = {len(devices) for devices in replica_devices}
        if len(sizes) != 1:
            raise ValueError(
                f"`replica_devices` must give every replica the same number of devices. Received: {replica_devices}"
            )
        make_named_cpus([d for devices in replica_devices for d in devices])  # if TensorFlow has not started
        DeviceGroup([d for devices in replica_devices for d in devices])  # one check for missing and repeated devices
        self.replicas = [DeviceGroup(devices) for devices in replica_devices]
        super().__init__(devices=[group.devices[0] for group in self.replicas],
                         process_index=processes.index if processes else 0, shard_optimizer=shard_optimizer,
                         keep_whole_below=keep_whole_below, prefetch_weights=prefetch_weights)
        self.processes = processes
        if processes is not None:
            _check_same_layout(processes, len(self.replicas), len(self.replicas[0].devices))
            self.extended._processes = processes
            self.extended._across = _AcrossProcesses(processes)

    @property
    def is_chief(self) -> bool:
        """Process 0 of a multi-process job reports and checkpoints; a one-process job always."""
        return self.processes is None or self.processes.index == 0

    def slice_collectives(self):
        """How the replicas share a split optimizer state: across processes too, when they span several."""
        if self.processes is None:
            return _SlicesInColumns(self, self.shard_optimizer)
        return _SlicesAcrossProcesses(self, self.processes, self.shard_optimizer)

    @property
    def replicas_per_process(self) -> int:
        return len(self.replicas)

    def device_layout(self, stages: int = 1, tensor_parallel_size: int = 1, split_by_layout: bool = False) -> dict:
        """How the devices are used: processes x model copies per process x stages x tensor-parallel size
        (`split_by_layout`: a layout's model axis, whose replicas (one per device of the axis) make one copy)."""
        processes = self.processes.size if self.processes else 1
        copies = len(self.replicas) // tensor_parallel_size if split_by_layout else len(self.replicas)
        return {
            "processes": processes,
            "data_parallel": self.processes.name if self.processes else "local",
            "replicas_per_process": copies,
            "stages": stages,
            "tensor_parallel_size": tensor_parallel_size,
            "text": f"{processes} process(es) x {copies} replica(s) x {stages} stage(s) x "
                    f"{tensor_parallel_size} {'split by the layout' if split_by_layout else 'tensor-parallel'}",
            **({"model_copies": copies * processes} if split_by_layout else {}),
        }

    @property
    def multi_process(self) -> bool:
        return self.processes is not None

    def input_workers(self) -> tuple[int, int]:
        return (self.processes.size, self.processes.index) if self.processes else (1, 0)

    def any_process(self, flag: bool) -> bool:
        """Whether `flag` is set in any process (every process must call it, in step)."""
        return flag if self.processes is None else self.processes.any_process(flag)

    def job_error(self, error: tf.errors.OpError):
        """One line for a step that failed because another process is gone; None otherwise."""
        return None if self.processes is None else self.processes.job_error(error)

    def local_keras_hooks(self, model: keras.Model) -> dict:
        """The step functions this process's replicas need (subclasses add theirs)."""
        return super().keras_hooks(model)

    def keras_hooks(self, model: keras.Model) -> dict:
        """`local_keras_hooks`; across processes, every step function under the process group's
        hang protection, and predictions gathered from every process (each returns the whole)."""
        hooks = self.local_keras_hooks(model)
        if self.processes is None:
            return hooks
        functions = {name: hooks.get(name) or _compat.keras_step_function(model, name)
                     for name in ("train_function", "test_function", "predict_function")}
        predict_here = functions["predict_function"]

        def predict_function(data):
            return tf.nest.map_structure(self.processes.all_gather, predict_here(data))

        functions["predict_function"] = predict_function
        return {name: self.processes.wrap_step(function) for name, function in functions.items()}

    @property
    def devices(self) -> list[str]:
        """Every device, replica by replica."""
        return [device for group in self.replicas for device in group.devices]

    def variable_device(self) -> Optional[str]:
        """The device a variable made now belongs on: the `tf.device` in scope, if any."""
        return device_util.current()

    def mirrored_devices(self, device: str) -> Optional[list[str]]:
        """A device of the first replica and its counterparts in the others; None for other devices."""
        index = self.replicas[0].index(device)
        return None if index is None else [group.devices[index] for group in self.replicas]

    def local_device(self, device: str) -> str:
        """A device of the first replica, as its counterpart in the replica whose step is being built."""
        index = self.replicas[0].index(device)
        return device if index is None else self.replicas[current_replica()].devices[index]

    def move_variables(
        self, destinations: Sequence[tuple[keras.Variable, str]], optimizer: Optional[keras.optimizers.Optimizer]
    ) -> list[tuple[keras.Variable, keras.Variable]]:
        """Makes each variable again on a device of the first replica and its counterparts.

        The Keras variables stay the same objects (`model.weights`, names and
        checkpoints do not change) and keep their values; the slots `optimizer`
        made beside them move with them. Call it outside any step function,
        before the variables are first read in one.

        Args:
          destinations: (variable, device of the first replica) pairs.
          optimizer: the optimizer training these variables, built or not.

        Returns:
          The (slot, variable) pairs of the slots that moved beside their variable.
        """
        made_beside = self.extended.made_beside()
        by_storage = {id(variable.value): (variable, device) for variable, device in destinations}
        # A variable split over the replicas (stage 3) is held by its slices, which its shards move.
        moves, beside = [(v, device) for v, device in destinations if not weight_shards.is_sharded(v)], []
        for slot in optimizer.variables if optimizer is not None else []:
            reference = made_beside.get(id(slot.value))
            if reference in by_storage:
                variable, device = by_storage[reference]
                moves.append((slot, device))
                beside.append((slot, variable))
        with tf.init_scope(), self.scope():
            _compat.remake_variables([(variable, tf.device(device)) for variable, device in moves], optimizer)
            shards = shards_of(optimizer)
            if shards is not None:  # the optimizer's state split over the replicas: each slice beside its copy
                shards.move_beside([(variable, self.mirrored_devices(device)) for variable, device in destinations])
        return beside


class ProcessLayoutError(ValueError):
    """The processes of a job run different numbers of replicas or devices per replica."""


def _check_same_layout(processes: ProcessGroup, replicas: int, devices_per_replica: int) -> None:
    """Raises ValueError unless every process has as many replicas of as many devices as this one."""
    mine = tf.constant([[replicas, devices_per_replica]], tf.int32)
    with tf.device("/cpu:0"):
        layouts = processes.all_gather(mine).numpy().tolist()
    if any(layout != layouts[0] for layout in layouts):
        # Every process raises; one that exits while another still receives the gather would fail that one
        # with "Socket closed". After this all-reduce every process has its layouts (finishing it needs all of
        # them in it); the last to finish may see the others gone, which no longer matters.
        try:
            processes.any_process(False)
        except tf.errors.OpError:
            pass
        described = ", ".join(f"process {i}: {r} x {d}" for i, (r, d) in enumerate(layouts))
        raise ProcessLayoutError(
            "every process must run as many model replicas of as many devices; replicas x devices per "
            f"replica differ ({described}). Give every process the same devices."
        )


def bytes_by_device(variables: Sequence[keras.Variable]) -> dict[str, int]:
    """Bytes of every copy of `variables`, by the device that holds it (`CPU:1`, `GPU:0`)."""
    held: dict[str, int] = {}
    for variable in variables:
        for copy in getattr(variable.value, "values", (variable.value,)):
            spec = tf.DeviceSpec.from_string(copy.device)
            device = f"{spec.device_type}:{spec.device_index}"
            held[device] = held.get(device, 0) + copy.dtype.size * copy.shape.num_elements()
    return held


def make_process_group(data_parallel) -> Optional[ProcessGroup]:
    """None for `local`; else the process group of `multi_worker` (cluster from TF_CONFIG),
    `horovod`, or of a strategy given for it (its contract's `process_group`).

    Raises:
      ValueError: an unknown name, or a strategy that is not over processes.
    """
    if data_parallel is None or isinstance(data_parallel, ProcessGroup):
        return data_parallel
    if isinstance(data_parallel, str):
        if data_parallel == "local":
            return None
        if data_parallel not in _BACKENDS:
            raise ValueError(f"`data_parallel` must be one of local, {', '.join(_BACKENDS)}, or a strategy over "
                             f"processes. Received: {data_parallel!r}")
        data_parallel = _BACKENDS[data_parallel]()
    return contract(data_parallel).process_group()
