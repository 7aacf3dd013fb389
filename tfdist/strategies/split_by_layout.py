"""`SplitsByLayout`: replicas that compute a model split by a layout, SPMD, with the mesh's rows data parallel.

What a strategy whose replicas split a model over a model axis adds to a
`ReplicaGroupsStrategy` (`LayoutStrategy`, and `PipelineStrategy` given a
layout, whose stages each split over it):

- input: the replicas of a row (one copy of the model) compute on the same
  examples, the row's share of every global batch;
- splitting: the variables the layout's rules match are split over each row
  (`tfdist.parallel.split_variables`), their layers compute on the shards
  (`tfdist.parallel.spmd`) and an optimizer's slots are split beside them;
- gradients: a split variable's is its replica's own, summed over its column;
  every other is summed over all replicas;
- `predict` returns each row's first replica's predictions, and `evaluate`
  runs tfdist's step function (Keras's puts a step in a `tf.cond`, where the
  mesh's collectives fail).

A strategy mixes it in before `ReplicaGroupsStrategy`, sets `layout` (None:
nothing of this applies) and gives the `MeshGroups` of the replica being
built (`mesh_groups`) and of a variable's devices (`groups_holding`).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Optional

import keras
import tensorflow as tf

from tfdist import _compat
from tfdist.errors import ConfigError
from tfdist.parallel.layout import Layout, LayoutError
from tfdist.parallel.megatron_pairs import functional_pairs, paired_blocks
from tfdist.parallel.mesh_groups import MeshGroups
from tfdist.parallel.recompute import recompute_again
from tfdist.parallel.spmd import SPLIT_LAYERS, lora_axes, split_block_call, split_call
from tfdist.parallel.split_variables import SplitVariable, is_split, split, split_axis
from tfdist.strategies.data_parallel import multi_step_function

__all__ = ["MeshSlices", "SplitsByLayout"]


class MeshSlices:
    """How the replicas of a data x model mesh share an optimizer state split over the data axis (ZeRO; at
    stage 3 the weights too): the collectives `shard_optimizer_state` takes (see `DeviceCollectives`).

    Each replica's own value of a variable (its shard, for one the layout splits; else the whole) is cut
    into a slice per row of the mesh, every process's rows counted, and the replica at (row, m) holds its
    row's slice. Slices are reduced and gathered within a column (the devices that hold the same shard),
    then across the processes on that device. Before the reduction a replica's gradient of a split
    variable counts once per device of its row (each computed on the row's examples, and Keras divided the
    loss by every replica), and a whole variable's is summed over the row, as `reduce_gradients` does.
    """

    def __init__(self, strategy, stage: int):
        self.strategy, self.stage, self.groups = strategy, stage, strategy.mesh_groups
        self.model, self.processes = strategy.layout.model, strategy.processes
        self.devices = tuple(strategy.extended.worker_devices)
        self.rows = len(self.devices) // self.model  # this process's
        processes, index = (self.processes.size, self.processes.index) if self.processes else (1, 0)
        self.parts, self.multi_process = self.rows * processes, processes > 1
        self.ranks = tuple(index * self.rows + r // self.model for r in range(len(self.devices)))

    def local_index(self) -> int:
        return self.groups.local_index()

    def own_gradient(self, d, gradient, split_axis):
        if split_axis is not None:
            return gradient * self.model
        row = self.groups.row(d)
        return gradient if row is None else row.all_reduce(gradient)

    def reduce_scatter(self, d, packed):
        ours = packed if self.processes is None else self.processes.reduce_scatter(packed, self.devices[d],
                                                                                   self.stage)
        column = self.groups.column(d)
        return ours if column is None else _compat.slice_of_sum(column, ours, d // self.model, self.stage)

    def all_gather(self, d, piece):
        column = self.groups.column(d)
        if column is not None:
            piece = _compat.all_gather(column, piece)
        return piece if self.processes is None else self.processes.all_gather(piece, self.devices[d])

    def gather_columns(self, pieces) -> list:
        """Per column of the mesh, its replicas' pieces of every process in slice order (eagerly, on every
        process at once when they are several: each column's own value of a saved variable)."""
        columns = []
        for m in range(self.model):
            with tf.device(self.devices[m]):
                ours = tf.concat([tf.convert_to_tensor(pieces[d * self.model + m]) for d in range(self.rows)], 0)
            columns.append(ours if self.processes is None else self.processes.all_gather(ours, self.devices[m]))
        return columns


class SplitsByLayout:
    """Mixed into a `ReplicaGroupsStrategy` of one replica per place of a data x model mesh (data-major)."""

    layout: Optional[Layout] = None
    config_key: Optional[str] = None  # where the layout came from: a layout that does not fit is its ConfigError
    _keras_steps = 0  # replicas in Keras's training step (`in_keras_step`)

    def _start_splitting(self, layout: Layout, config_key: Optional[str] = None) -> None:
        self.layout, self.config_key = layout, config_key
        self._split_models = weakref.WeakSet()
        self._split_optimizers = weakref.WeakSet()

    @property
    def model_axis(self) -> int:
        return self.layout.model if self.layout is not None else 1

    def groups_holding(self, variable) -> MeshGroups:
        """The mesh groups of the devices that hold `variable`'s shards."""
        return self.mesh_groups

    def split_at_optimizer_build(self, model: keras.Model) -> None:
        """Splits `model` when its optimizer is built, before the optimizer's slots (a pipeline splits later)."""
        self.split(model)

    # --- Input: each row computes on its share of the batch, every replica of a row on the same ---
    def experimental_distribute_dataset(self, dataset, options=None):
        if self.layout is None:
            return super().experimental_distribute_dataset(dataset, options)
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
    def slice_collectives(self):
        """How the replicas share a split optimizer state: over a layout, within the mesh's columns."""
        return super().slice_collectives() if self.layout is None else MeshSlices(self, self.shard_optimizer)

    def after_compile(self, model: keras.Model) -> None:
        if self.layout is None:
            return super().after_compile(model)
        if keras.distribution.distribution() is not None:
            raise ValueError(f"{type(self).__name__}: keras.distribution.set_distribution was called too; the "
                             "first step would fail ('NoneType' object has no attribute 'batch_reduce'): call "
                             "tfdist.set_distribution alone, or keras.distribution.set_distribution(None)")
        optimizer = model.optimizer
        splits_weights = self.layout.model > 1  # a data axis alone splits none: Keras's DataParallel
        if splits_weights and (getattr(optimizer, "clipnorm", None) or getattr(optimizer, "global_clipnorm", None)):
            raise ValueError(f"{type(self).__name__}: clipnorm and global_clipnorm would clip a split variable's "
                             "shard by its own norm in this version; use clipvalue, or no clipping.")
        if splits_weights and getattr(getattr(optimizer, "inner_optimizer", optimizer), "use_ema", False):
            raise ValueError(f"{type(self).__name__}: use_ema would keep each weight's moving average whole where "
                             "the layout splits the weight, in this version; train without use_ema.")
        if self.shard_optimizer == 3 and getattr(optimizer, "clipvalue", None):
            raise ValueError(f"{type(self).__name__}: clipvalue would clip each replica's part of a gradient with "
                             "the weights split (shard_optimizer 3) in this version; use stage 2, or no clipping.")
        if optimizer in self._split_optimizers:  # compiled again with the same optimizer
            return
        super().after_compile(model)  # the optimizer's state split (`shard_optimizer`), before its build is wrapped
        build = optimizer.build

        def build_split(variables):  # the model is built by now
            self.split_at_optimizer_build(model)
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
        """Checks the layout against the built model now, so that a layout that does not fit it is refused
        before training."""
        if self.layout is None:
            return super().check_model(model)
        super().check_model(model)
        try:
            self.split_at_optimizer_build(model)
            self.layout.axes_of(model)
        except LayoutError as error:
            if self.config_key is None:
                raise
            raise ConfigError(self.config_key, f"does not fit the model: {error}") from None

    def local_keras_hooks(self, model: keras.Model) -> dict[str, Any]:
        """tfdist's training and evaluation functions (Keras's put a step in a `tf.cond` with
        `steps_per_execution` > 1, where the mesh's collectives fail), and predictions of each row's first
        replica (Keras would concatenate every replica's, and the replicas of a row compute the same)."""
        if self.layout is None:
            return super().local_keras_hooks(model)
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
        @functools.wraps(train_step)
        def marked(data):
            with self.in_keras_step():
                return train_step(data)

        marked.marks_keras_steps = True
        return marked

    @contextlib.contextmanager
    def in_keras_step(self):
        """Marks a training step of Keras's `fit` (or the pipeline's step that stands for it). A count, not
        thread-local: a LossScaleOptimizer applies from a merge_call, in the strategy's own thread, while the
        replicas wait inside the step."""
        self._keras_steps += 1
        try:
            yield
        finally:
            self._keras_steps -= 1

    def reduce_gradients(self, grads_and_vars) -> list:
        """A split variable's gradient is its replica's own, scaled back from Keras's 1/replicas (every
        replica of a row saw the row's whole batch) and summed over its column, and so is a whole variable's
        sparse one; the others are summed over the replicas.

        Raises:
          ValueError: gradients applied outside Keras's training step (a custom training loop), whose loss
            scaling this version does not know.
        """
        if self.layout is None:
            return super().reduce_gradients(grads_and_vars)
        context = tf.distribute.get_replica_context()
        # A whole variable's sparse gradient (an embedding's rows) is the same on every replica of a row: summed over
        # the model axis, each row would repeat at a fraction of its value, and Adam squares each row apart.
        own = [i for i, (g, v) in enumerate(grads_and_vars)
               if g is not None and (_split_storage(v) is not None or isinstance(g, tf.IndexedSlices))]
        summed = [i for i, (g, _) in enumerate(grads_and_vars) if g is not None and i not in own]
        pairs = list(grads_and_vars)
        if not self._keras_steps and self.layout.model > 1:
            # TensorFlow's guide divides the loss by the global batch and the regularization by the replicas:
            # every device of the model axis computes on the same examples, which would count each of them, and
            # not the regularization, once per device.
            raise ValueError(f"{type(self).__name__} trains a model split over {self.layout.model} devices with "
                             "Keras's fit (or train_on_batch) in this version, not in a custom training loop: its "
                             "loss, divided by the examples of every replica, would count each example once per "
                             "device of the model axis.")
        for i in own:
            holder = _split_storage(pairs[i][1]) or _compat.backing_value(pairs[i][1])
            groups = self.groups_holding(holder)
            gradient = groups.data_sum(_scaled(pairs[i][0], self.layout.model))
            if self.processes is not None:  # and over the same column of every process's mesh
                device = holder.values[groups.local_index()].device
                gradient, = self.processes.all_reduce(tf.distribute.ReduceOp.SUM, [tf.convert_to_tensor(gradient)],
                                                      device)
            pairs[i] = (gradient, pairs[i][1])
        for i, reduced in zip(summed, context.all_reduce(tf.distribute.ReduceOp.SUM, [pairs[i][0] for i in summed])):
            pairs[i] = (reduced, pairs[i][1])
        return pairs

    # --- Splitting -------------------------------------------------------------------------------
    def split(self, model: keras.Model) -> None:
        """Splits `model`'s variables that the layout's rules match, once, and has their layers compute on
        the shards.

        Raises:
          LayoutError: a rule that matches no variable, an axis that does not divide, or a split variable
            of a layer that cannot compute on shards.
        """
        if model in self._split_models:  # LoRA may have been enabled since: a keras-hub task compiles when built
            self._split_new_lora_factors(model)
            return
        axes = self.layout.axes_of(model)
        layers = _compat.nested_layers(model)
        axes_by_layer = {}
        for layer in layers:
            layer_axes = {name: axes.pop(v.path, None) for name, v in _own_variables(layer).items()}
            if getattr(layer, "lora_enabled", False):  # the LoRA factors split as the kernel does
                layer_axes.update(lora_axes(layer, layer_axes["kernel"]))
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
            recompute_again(layer)
            if layer in taking:
                layer.input_spec = None  # Keras's check wants the whole axis the layer may now take split
        for block, divided in blocks.items():
            block.call = split_block_call(block, divided, self.layout.model)
            recompute_again(block)
        self._split_models.add(model)

    def _split_new_lora_factors(self, model: keras.Model) -> None:
        """Splits the LoRA factors of split layers that got them after `split` (`enable_lora`) as the kernel
        splits (`lora_axes`); the layers' split calls read the factors' axes when they compute."""
        for layer in _compat.nested_layers(model):
            if not (getattr(layer, "lora_enabled", False) and is_split(_compat.stored_kernel(layer))):
                continue
            for name, axis in lora_axes(layer, split_axis(_compat.stored_kernel(layer))).items():
                if axis is not None and not is_split(getattr(layer, name)):
                    split(getattr(layer, name), axis, self, self.layout.model)



def _split_storage(variable):
    """The `SplitVariable` of a split variable (a Keras variable's storage, or TensorFlow's variable itself), else
    None: Keras's update hands over either (its gradient accumulation the Keras variables)."""
    storage = variable if isinstance(variable, SplitVariable) else getattr(variable, "value", None)
    return storage if isinstance(storage, SplitVariable) else None


def _scaled(gradient, factor: int):
    if isinstance(gradient, tf.IndexedSlices):  # an embedding's rows
        return tf.IndexedSlices(gradient.values * factor, gradient.indices, gradient.dense_shape)
    return gradient * factor


def _own_variables(layer) -> dict[str, Any]:
    """The variables a layer the layout may split holds itself, by attribute (`kernel`, `bias`, `embeddings`,
    a `ReversibleEmbedding`'s `reverse_embeddings`; with LoRA enabled the stored kernel and the factors)."""
    kind = next((k for k in type(layer).__mro__ if k in SPLIT_LAYERS), None)
    if kind is None:
        return {}
    if kind is keras.layers.Embedding:
        return {name: getattr(layer, name) for name in ("embeddings", "reverse_embeddings")
                if getattr(layer, name, None) is not None}
    own = {"kernel": _compat.stored_kernel(layer), "bias": layer.bias}
    if layer.lora_enabled:
        own.update(lora_kernel_a=layer.lora_kernel_a, lora_kernel_b=layer.lora_kernel_b)
    return {name: variable for name, variable in own.items() if variable is not None}


