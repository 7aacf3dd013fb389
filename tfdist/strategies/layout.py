"""`LayoutStrategy`: an unchanged Keras model split over devices by a layout, as Keras's distribution API does on JAX.

Build and compile the model under the strategy's scope, as under any
tf.distribute strategy; its variables that the layout's rules match are split
when the optimizer is built (`tfdist.parallel.split_variables`), each matched
layer then computes on its shards (`tfdist.parallel.spmd`), and the optimizer's
slots of a split variable are split beside it. Every replica runs the whole
model on the whole batch: the layers the layout leaves whole are computed on
each device alike, as in Megatron-LM.

    layout_map = keras.distribution.LayoutMap(keras.distribution.DeviceMesh((1, 2), ("batch", "model")))
    layout_map["dense.*kernel"] = (None, "model")
    strategy = tfdist.LayoutStrategy(layout_map)
    with strategy.scope():
        model = build_model()
        model.compile(...)
    model.fit(...)

The mesh's rows (model groups) train data parallel: each row computes on its
share of the global batch, a split variable's gradients are summed over its
column (`tfdist.parallel.mesh_groups`), every other gradient over all replicas.
A weight that the layout splits over the data axis too (keras-hub's maps do,
for fully-sharded data parallelism) is held whole along it.
"""

from __future__ import annotations

import json
import os
import weakref
from typing import Any, Optional, Sequence

import keras
import tensorflow as tf

from tfdist import _compat
from tfdist.errors import ConfigError
from tfdist.parallel.layout import Layout, LayoutError
from tfdist.parallel.mesh_groups import MeshGroups
from tfdist.parallel.megatron_pairs import functional_pairs, paired_blocks
from tfdist.parallel.spmd import SPLIT_LAYERS, split_block_call, split_call
from tfdist.parallel.split_variables import SplitVariable, is_split, split, split_axis
from tfdist.strategies.data_parallel import MirroredStrategy, multi_step_function
from tfdist.strategies.devices import default_devices
from tfdist.strategies.horovod import HorovodStrategy
from tfdist.strategies.multi_worker import MultiWorkerMirroredStrategy
from tfdist.strategies.replica_groups import ReplicaGroupsStrategy, make_process_group

__all__ = ["LayoutStrategy", "launched_data_parallel", "set_distribution", "strategy_from"]


class LayoutStrategy(ReplicaGroupsStrategy):
    """Splits the variables of models built under its scope as `layout` says, over its devices.

    Args:
      layout: a `keras.distribution.LayoutMap` (a keras-hub backbone's `get_layout_map(mesh)` too), a
        `keras.distribution.ModelParallel`, or a `tfdist.parallel.layout.Layout`.
      devices: the mesh's devices, data-major (default: the mesh's, else the first ones of this process).
      data_parallel: `multi_worker`, `horovod` (or a strategy over processes): every process of that job runs
        this mesh on its own devices and the meshes' rows train data parallel, the data axis spanning the
        processes; `local` or None: this process alone.
      config_key: the config key the layout came from (`layout.rules`): a layout that does not fit the
        model is then that key's ConfigError.

    Raises:
      LayoutError: other than one device per place of the mesh, or more devices than this process has.
    """

    # Clipping by norm would see a split variable's shard as the whole; refused at compile (`after_compile`).
    clips_after_all_reduce = False

    def __init__(self, layout, devices: Optional[Sequence[str]] = None, *, data_parallel=None,
                 config_key: Optional[str] = None):
        self.layout = layout if isinstance(layout, Layout) else Layout.from_keras(layout)
        size = self.layout.data * self.layout.model
        devices = list(devices or self.layout.devices or _first_devices(size))
        if len(devices) != size:
            mesh = f"{self.layout.data_axis!r}: {self.layout.data}, {self.layout.model_axis!r}: {self.layout.model}"
            raise LayoutError(f"The mesh ({mesh}) has {size} places, and {len(devices)} devices are given: {devices}.")
        super().__init__([[device] for device in devices], processes=make_process_group(data_parallel))
        self._mesh_groups = MeshGroups(self, self.layout.model)
        self.config_key = config_key
        self._split_models = weakref.WeakSet()
        self._split_optimizers = weakref.WeakSet()
        # Replicas in Keras's training step (not thread-local: a LossScaleOptimizer applies from a merge_call,
        # in the strategy's own thread, while the replicas wait inside the step).
        self._keras_steps = 0

    # --- Input: each row computes on its share of the batch, every replica of a row on the same ---
    def experimental_distribute_dataset(self, dataset, options=None):
        per_replica = dataset.flat_map(self._replica_batches)  # in replica order, one per replica and step
        return self.distribute_datasets_from_function(lambda _: per_replica, options)

    def _replica_batches(self, *batch):
        """This process's replicas' batches of one global batch: the rows of every process's mesh share it."""
        batch = batch if len(batch) > 1 else batch[0]
        processes, process = self.input_workers()
        rows, model = self.layout.data * processes, self.layout.model
        size = tf.shape(tf.nest.flatten(batch)[0], out_type=tf.int64)[0]

        def row_share(replica):
            row = process * self.layout.data + replica // model
            start, end = row * size // rows, (row + 1) * size // rows
            return tf.nest.map_structure(lambda t: t[start:end], batch)

        return tf.data.Dataset.range(self.layout.data * model).map(row_share)

    # --- The contract ----------------------------------------------------------------------------
    @property
    def mesh_groups(self) -> MeshGroups:
        return self._mesh_groups

    def after_compile(self, model: keras.Model) -> None:
        optimizer = model.optimizer
        if getattr(optimizer, "clipnorm", None) or getattr(optimizer, "global_clipnorm", None):
            raise ValueError("LayoutStrategy: clipnorm and global_clipnorm would clip a split variable's "
                             "shard by its own norm in this version; use clipvalue, or no clipping.")
        if optimizer in self._split_optimizers:  # compiled again with the same optimizer
            return
        build = optimizer.build

        def build_split(variables):  # the model is built by now: split it before the optimizer's slots
            self.split(model)
            return build(variables)

        optimizer.build = build_split
        # A LossScaleOptimizer (mixed_float16) makes no slots; the optimizer it wraps does.
        wraps = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        slot_maker = optimizer.inner_optimizer if wraps else optimizer
        add_slot = slot_maker.add_variable_from_reference

        def add_slot_beside(reference_variable, *args, **kwargs):
            slot = add_slot(reference_variable, *args, **kwargs)
            if is_split(reference_variable):
                split(slot, split_axis(reference_variable), self, self.layout.model)
            return slot

        slot_maker.add_variable_from_reference = add_slot_beside
        self._split_optimizers.add(optimizer)

    def check_model(self, model: keras.Model) -> None:
        """Splits the built model now, so that a layout that does not fit it is refused before training."""
        try:
            self.split(model)
        except LayoutError as error:
            if self.config_key is None:
                raise
            raise ConfigError(self.config_key, f"does not fit the model: {error}", "see above") from None

    def local_keras_hooks(self, model: keras.Model) -> dict[str, Any]:
        """tfdist's training and evaluation functions (Keras's put a step in a `tf.cond` with
        `steps_per_execution` > 1, where the mesh's collectives fail), and predictions of each row's first
        replica (Keras would concatenate every replica's, and the replicas of a row compute the same)."""
        rows, model_devices = self.layout.data, self.layout.model
        if not getattr(model.train_step, "marks_keras_steps", False):  # once, however often it is compiled
            model.train_step = self._marking_keras_steps(model.train_step)

        @tf.function(reduce_retracing=True)
        def predict_function(data):  # Keras's: a list of `steps_per_execution` batches
            steps = []
            for batch in data:
                replicas = self.experimental_local_results(self.run(model.predict_step, args=(batch,)))
                steps += [replicas[row * model_devices] for row in range(rows)]
            return tf.nest.map_structure(lambda *t: tf.concat(t, axis=0), *steps)

        return {**super().local_keras_hooks(model), "predict_function": predict_function,
                "test_function": multi_step_function(self, model, step="test_step")}

    def _marking_keras_steps(self, train_step):
        def marked(data):
            self._keras_steps += 1
            try:
                return train_step(data)
            finally:
                self._keras_steps -= 1

        marked.marks_keras_steps = True
        return marked

    def reduce_gradients(self, grads_and_vars) -> list:
        """A split variable's gradient is its replica's own, scaled back from Keras's 1/replicas (every
        replica of a row saw the row's whole batch) and summed over its column; the others are summed over
        the replicas.

        Raises:
          ValueError: gradients applied outside Keras's training step (a custom training loop), whose loss
            scaling this version does not know.
        """
        if not self._keras_steps:
            raise ValueError("LayoutStrategy trains with Keras's fit (or train_on_batch) in this version: a custom "
                             "training loop's loss, divided by the examples of every replica, would count each "
                             "example once per device of the model axis.")
        context = tf.distribute.get_replica_context()
        own = [i for i, (g, v) in enumerate(grads_and_vars) if g is not None and isinstance(v, SplitVariable)]
        summed = [i for i, (g, _) in enumerate(grads_and_vars) if g is not None and i not in own]
        pairs = list(grads_and_vars)
        device = self.extended.worker_devices[self.mesh_groups.local_index()]
        for i in own:
            gradient = self.mesh_groups.data_sum(_scaled(pairs[i][0], self.layout.model))
            if self.processes is not None:  # and over the same column of every process's mesh
                gradient, = self.processes.all_reduce(tf.distribute.ReduceOp.SUM, [tf.convert_to_tensor(gradient)],
                                                      device)
            pairs[i] = (gradient, pairs[i][1])
        for i, reduced in zip(summed, context.all_reduce(tf.distribute.ReduceOp.SUM, [pairs[i][0] for i in summed])):
            pairs[i] = (reduced, pairs[i][1])
        return pairs

    def job_report(self, model: keras.Model) -> dict[str, Any]:
        processes, _ = self.input_workers()
        mesh = {self.layout.data_axis: self.layout.data * processes, self.layout.model_axis: self.layout.model}
        split_variables = sum(is_split(v) for v in model.variables)
        text = (f"mesh {' x '.join(f'{axis} {size}' for axis, size in mesh.items())} over {processes} process(es), "
                f"{split_variables} variable(s) split")
        return {"layout": {"mesh": mesh, "processes": processes, "split_variables": split_variables, "text": text,
                           "model_copies": self.layout.data * processes}}

    # --- Splitting -------------------------------------------------------------------------------
    def split(self, model: keras.Model) -> None:
        """Splits `model`'s variables that the layout's rules match, once, and has their layers compute on
        the shards.

        Raises:
          LayoutError: a rule that matches no variable, an axis that does not divide, or a split variable
            of a layer that cannot compute on shards.
        """
        if model in self._split_models:
            return
        axes = self.layout.split_axes(model.variables)
        layers = _compat.nested_layers(model)
        axes_by_layer = {}
        for layer in layers:
            layer_axes = {name: axes.pop(v.path, None) for name, v in _own_variables(layer).items()}
            if any(axis is not None for axis in layer_axes.values()):
                axes_by_layer[layer] = layer_axes
        if axes:  # checked before anything is split: a refused layout leaves the model as it was
            path = next(iter(axes))
            raise LayoutError(f"Variable {path!r} is matched by the layout, and only the kernels, biases and "
                              f"embeddings of {', '.join(k.__name__ for k in SPLIT_LAYERS)} layers can be split "
                              "in this version.")
        pairs = functional_pairs(model, axes_by_layer)
        blocks = paired_blocks(layers, axes_by_layer)
        keeping = {column for column, _ in pairs}
        try:
            calls = {layer: split_call(layer, layer_axes, keeps_shards=layer in keeping)
                     for layer, layer_axes in axes_by_layer.items()}
        except ValueError as error:
            raise LayoutError(str(error)) from None
        taking = {row for _, row in pairs} | {sub for block in blocks for sub in _compat.nested_layers(block)}
        for layer, call in calls.items():
            for name, variable in _own_variables(layer).items():
                if axes_by_layer[layer][name] is not None:
                    split(variable, axes_by_layer[layer][name], self, self.layout.model)
            layer.call = call
            if layer in taking:
                layer.input_spec = None  # Keras's check wants the whole axis the layer may now take split
        for block, divided in blocks.items():
            block.call = split_block_call(block, divided, self.layout.model)
        self._split_models.add(model)


def strategy_from(distribution, data_parallel=None) -> tf.distribute.Strategy:
    """The tfdist strategy of a Keras distribution written for JAX: a `keras.distribution.ModelParallel` (or
    its `LayoutMap`) becomes a `LayoutStrategy`, a `keras.distribution.DataParallel` a `MirroredStrategy` over
    its devices (across the processes of a job, tfdist's `MultiWorkerMirroredStrategy` or `HorovodStrategy`).
    Build and compile the model under the strategy's scope and call `fit`, as with Keras's `distribution.scope()`.

    Args:
      distribution: the Keras distribution (its mesh holds this process's devices: TensorFlow's
        `keras.distribution.list_devices()` lists the local ones).
      data_parallel: `local`, `multi_worker` or `horovod`; None: the launcher's (`launched_data_parallel`).

    Raises:
      LayoutError: a layout this version cannot run (see `LayoutStrategy`).
      ValueError: anything else, such as a DataParallel mesh of several devices in a process of a Horovod job
        (one replica per process) or of several CPUs in a multi-worker job (one per process, or one per GPU).
    """
    data_parallel = data_parallel or launched_data_parallel()
    if data_parallel not in ("local", "multi_worker", "horovod"):
        raise ValueError(f"`data_parallel` must be local, multi_worker or horovod. Received: {data_parallel!r}")
    if isinstance(distribution, keras.distribution.DataParallel):
        devices = ["/" + str(d).lstrip("/") for d in distribution.device_mesh.devices.flatten()]
        if data_parallel == "local":
            return MirroredStrategy(devices)
        gpus = all("GPU" in d.upper() for d in devices)
        if len(devices) > 1 and (data_parallel == "horovod" or not gpus):
            raise ValueError(f"A DataParallel over {len(devices)} devices of one process ({', '.join(devices)}) "
                             f"cannot run under {data_parallel}, which runs one replica per process "
                             f"{'' if data_parallel == 'horovod' else 'on a CPU '}(one per GPU with multi_worker); "
                             "give it one device, or use a ModelParallel mesh with a data axis.")
        if data_parallel == "horovod":
            return HorovodStrategy(device=devices[0])
        return MultiWorkerMirroredStrategy()
    if isinstance(distribution, (keras.distribution.ModelParallel, keras.distribution.LayoutMap)):
        return LayoutStrategy(distribution, data_parallel=data_parallel)
    raise ValueError("`distribution` must be a keras.distribution.ModelParallel, LayoutMap or DataParallel. "
                     f"Received: {distribution!r}")


def launched_data_parallel() -> str:
    """How the launcher started this process: `multi_worker` (a TF_CONFIG of several chief and worker tasks),
    `horovod` (`horovodrun`'s or `mpirun`'s ranks, more than one) or `local`."""
    cluster = json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster", {})
    if len(cluster.get("chief", [])) + len(cluster.get("worker", [])) > 1:
        return "multi_worker"
    ranks = os.environ.get("HOROVOD_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or "1"
    return "horovod" if int(ranks) > 1 else "local"


def set_distribution(distribution, data_parallel=None) -> tf.distribute.Strategy:
    """Keras's `keras.distribution.set_distribution` on TensorFlow: `strategy_from(distribution)` made the
    strategy of everything built after it in this process (TensorFlow's `experimental_set_strategy`), so a
    script written for JAX changes this one line and builds, compiles and fits with no `scope()`. Returns
    the strategy.

    Raises:
      LayoutError, ValueError: as `strategy_from`.
    """
    strategy = strategy_from(distribution, data_parallel)
    tf.distribute.experimental_set_strategy(strategy)
    return strategy


def _scaled(gradient, factor: int):
    if isinstance(gradient, tf.IndexedSlices):  # an embedding's rows
        return tf.IndexedSlices(gradient.values * factor, gradient.indices, gradient.dense_shape)
    return gradient * factor


def _own_variables(layer) -> dict[str, Any]:
    """The variables a layer the layout may split holds itself, by attribute (`kernel`, `bias`, `embeddings`,
    a `ReversibleEmbedding`'s `reverse_embeddings`)."""
    kind = next((k for k in type(layer).__mro__ if k in SPLIT_LAYERS), None)
    if kind is None:
        return {}
    names = ("embeddings", "reverse_embeddings") if kind is keras.layers.Embedding else ("kernel", "bias")
    return {name: getattr(layer, name) for name in names if getattr(layer, name, None) is not None}


def _first_devices(count: int) -> list[str]:
    """The first `count` GPUs, else logical CPUs (the CPU split into them if TensorFlow has not started)."""
    try:
        devices = default_devices(count)
    except ValueError as error:
        raise LayoutError(f"The mesh has {count} devices: {error}") from None
    if len(devices) < count:
        raise LayoutError(f"The mesh has {count} devices and this process has {len(devices)} ({', '.join(devices)}).")
    return devices[:count]
