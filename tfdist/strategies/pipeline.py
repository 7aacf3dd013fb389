"""Pipeline parallelism for Keras 3 `model.fit`: `PipelineStrategy`.

Devices form pipeline replicas of `num_stages` devices each (4 devices, 2
stages: replicas [d0, d1] and [d2, d3]); with `tensor_parallel_size` T (or a
layout's model axis of T) each stage is split over T devices by a layout
(Megatron's split, found in the model), the replica's T pipelines running
side by side (8 devices, 2 stages, T=2: pipelines [d0, d2] and [d1, d3], and
[d4, d6] and [d5, d7]). The strategy is a
`ReplicaGroupsStrategy`: a `MirroredStrategy` over the first device of every
replica, so data parallelism across replicas, variable mirroring and gradient
all-reduce are TensorFlow's own. What it adds:

1. the model is cut into stages (`tfdist.parallel.partition`), stage k on the
   replica's device k, the first time a step function is built;
2. each stage's variables then move to the stage's device (and, split by a
   layout, are cut into the shards of its devices), in every replica, with the
   optimizer slots made from them; updates run there too, and a variable's
   gradient is all-reduced among its copies only. What no stage owns (the
   optimizer's step counter and learning rate, the loss scale, metrics) stays
   on each replica's first device. So each device holds only its stages'
   weights and optimizer state, and no weight crosses devices during a step;
3. the replica's batch is split into `num_micro_batches` micro-batches;
4. every stage runs the forward (F) and backward (B) of each micro-batch in
   the order the schedule gives it (`tfdist.parallel.schedules`), enforced by
   control dependencies, so stage k+1 works on micro-batch m while stage k
   works on m+1, and 1F1B keeps at most K micro-batches of activations alive;
5. gradients are summed over micro-batches, each micro-batch's loss weighted
   by its share of the batch, so the update equals one full-batch step.

Keras calls `strategy.run(model.train_step, ...)` for every training step;
`run` recognises that call and runs the pipelined step instead, so user code is
plain Keras. Evaluation and prediction run the whole batch stage by stage,
each layer on its stage's device. A model with its own `train_step` cannot be
pipelined and fails at the first step with a clear error.

Example:

    >>> strategy = PipelineStrategy(num_stages=2, num_micro_batches=8, schedule="1f1b")
    >>> with strategy.scope():  # doctest: +SKIP
    ...     model = keras.Sequential([...])
    ...     model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    >>> model.fit(x, y, batch_size=256, epochs=5)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
import threading
from typing import Any, Optional, Sequence, Union

import keras
import tensorflow as tf

from tfdist import _compat
from tfdist.errors import ConfigError
from tfdist.parallel import partition as partition_lib
from tfdist.parallel import schedules
from tfdist.parallel.layout import Layout
from tfdist.parallel.mesh_groups import MeshGroups
from tfdist.parallel.split_variables import is_split, split, split_axis
from tfdist.parallel.device_group import current_replica
from tfdist.parallel.optimizer_shards import held_variables
from tfdist.parallel.weight_shards import KEEP_WHOLE_BELOW
from tfdist.parallel.pipelined_step import PipelinedStep, split_micro_batches
from tfdist.parallel.placement import call_in_context
from tfdist.reporting import megabytes
from tfdist.strategies.batch_share import weighted_by_batch_share
from tfdist.strategies.devices import default_devices, split_cpu
from tfdist.strategies.replica_groups import ReplicaGroupsStrategy, bytes_by_device, make_process_group
from tfdist.strategies.split_by_layout import SplitsByLayout

__all__ = ["PipelineStrategy"]


class PipelineStrategy(SplitsByLayout, ReplicaGroupsStrategy):
    """Pipeline-parallel training (GPipe or 1F1B) inside data-parallel replicas.

    Args:
      num_stages: stages per pipeline replica (K).
      num_micro_batches: micro-batches per replica batch (M).
      schedule: `gpipe` or `1f1b`.
      devices: all devices, a multiple of `num_stages` x `tensor_parallel_size`;
        replica r uses devices[r*K*T:(r+1)*K*T], stage by stage. Default:
        every GPU, else every logical CPU (on a CPU-only host not yet split,
        the CPU is split into K x T logical devices first).
      boundaries: the layer (name or index) starting each stage after the
        first; None balances the stages (see `balance_by`).
      balance_by: `time` (measured per-layer cost) or `params`.
      recompute: keep only each stage's inputs in the forward pass and
        recompute its activations in the backward pass (less memory, more
        compute). Layers that draw random numbers (Dropout) are refused, since
        their recomputed masks would differ.
      verbose: print the chosen partition when the first step is built.
      tensor_parallel_size: devices per stage (T): each stage is split over
        them by Megatron's split, found in the model
        (`tfdist.parallel.layout.Layout(megatron=True)`: attention heads,
        Dense pairs and `tfdist.layers`), as `layout` does.
      place_variables: move each stage's variables and optimizer slots to its
        devices (the default). False leaves every variable on each replica's
        first device, which then must hold the whole model and sends each
        stage its weights every micro-batch; it is there to compare with.
      data_parallel: `local` (this process's replicas only), or train the
        replicas of every process of a multi-process job data parallel:
        `multi_worker` (a cluster from TF_CONFIG, TensorFlow's collectives),
        `horovod` (the ranks `horovodrun` started), or a
        `MultiWorkerMirroredStrategy` / `HorovodStrategy` made with the options
        wanted. Each process passes its own devices; all must have as many.
      shard_optimizer: 1 splits the optimizer's state over the replicas (ZeRO
        stage 1), each slice of a stage's variable on that stage's device of
        its replica, over the replicas of every process with `data_parallel`;
        2 also reduce-scatters the gradients (stage 2); 3 splits the weights
        too, each stage's among the stage's devices of the replicas.
      keep_whole_below, prefetch_weights: at stage 3, as for `MirroredStrategy`.
      layout: a `keras.distribution.LayoutMap` or `ModelParallel` (or a
        `tfdist.parallel.layout.Layout`) that splits every stage over its
        model axis (M devices a stage, in place of `tensor_parallel_size`),
        as `LayoutStrategy` splits a whole model: the M pipelines of a
        replica run SPMD, stage k of each on device k*M + m of the replica's
        K x M. Its mesh's data axis and devices are not used: the replicas are
        the devices' K x M groups. In this version without `shard_optimizer`.

    Raises:
      ValueError: sizes out of range, an unknown schedule, or a device count
        that is not a multiple of `num_stages` x `tensor_parallel_size`
        (including a CPU-only host whose TensorFlow started with fewer).
    """

    def __init__(
        self,
        num_stages: int = 2,
        num_micro_batches: int = 4,
        *,
        schedule: str = "1f1b",
        devices: Optional[Sequence[str]] = None,
        boundaries: Optional[Sequence[Union[str, int]]] = None,
        balance_by: str = "time",
        recompute: bool = False,
        verbose: bool = True,
        tensor_parallel_size: int = 1,
        place_variables: bool = True,
        data_parallel: Union[str, tf.distribute.Strategy] = "local",
        shard_optimizer: int = 0,
        keep_whole_below: int = KEEP_WHOLE_BELOW,
        prefetch_weights: bool = True,
        layout=None,
    ):
        self._orders = schedules.stage_orders(schedule, num_stages, num_micro_batches)
        if tensor_parallel_size < 1:
            raise ValueError(f"`tensor_parallel_size` must be >= 1. Received: {tensor_parallel_size}")
        if layout is not None:
            layout = layout if isinstance(layout, Layout) else Layout.from_keras(layout)
            if tensor_parallel_size != 1:
                raise ValueError("A pipeline split by a `layout` takes its devices per stage from the layout's model "
                                 f"axis, not `tensor_parallel_size`. Received: {tensor_parallel_size}")
        elif tensor_parallel_size > 1:  # Megatron's split, found in each stage (tfdist.layers' too)
            layout = Layout(model=tensor_parallel_size, megatron=True)
        if layout is not None and shard_optimizer:
            raise ValueError("`shard_optimizer` cannot split the optimizer of a pipeline whose stages are split over "
                             "several devices in this version.")
        split_size = layout.model if layout is not None else 1  # devices a stage
        if devices is None:
            split_cpu(num_stages * split_size)
        processes = make_process_group(data_parallel)  # joining a cluster must come before TensorFlow starts
        devices = list(devices or default_devices(num_stages * split_size))
        per_replica = num_stages * split_size
        if len(devices) < per_replica or len(devices) % per_replica:
            sizes = f"`num_stages` ({num_stages})" + (
                f" x `tensor_parallel_size` ({tensor_parallel_size})" if tensor_parallel_size > 1 else
                f" x the layout's model axis ({split_size})" if layout is not None else ""
            )
            raise ValueError(
                f"`devices` must be a non-zero multiple of {sizes}: each pipeline replica takes "
                f"{per_replica} devices. Received: {len(devices)} device(s) {devices}"
            )
        if balance_by not in partition_lib.BALANCE_BASES:
            raise ValueError(
                f"`balance_by` must be one of {partition_lib.BALANCE_BASES}. Received: {balance_by!r}"
            )
        self.tensor_parallel_groups = [devices[i : i + split_size] for i in range(0, len(devices), split_size)]
        if layout is not None:  # each of the M pipelines of a replica's K x M devices, stage by stage
            devices = [devices[r + s * split_size + m] for r in range(0, len(devices), per_replica)
                       for m in range(split_size) for s in range(num_stages)]
        self.num_stages = num_stages
        self.num_micro_batches = num_micro_batches
        self.schedule = schedule
        self.recompute = recompute
        self.place_variables = place_variables
        self.stage_devices = [devices[i : i + num_stages] for i in range(0, len(devices), num_stages)]
        self.tensor_parallel_size = tensor_parallel_size
        self._boundaries = boundaries
        self._balance_by = balance_by
        self._verbose = verbose
        self._sequence = schedules.global_order(self._orders)
        self._partitions: dict[int, partition_lib.Partition] = {}
        self._said_whole = False  # that a custom loop's step runs unpipelined (once)
        self._micro_batch_sizes: dict[int, int] = {}  # per model: the micro-batch its step was traced with
        super().__init__(self.stage_devices, processes=processes, shard_optimizer=shard_optimizer,
                         keep_whole_below=keep_whole_below, prefetch_weights=prefetch_weights)
        self._stage = _CurrentStage()
        if layout is not None:
            self._start_splitting(dataclasses.replace(layout, data=len(self.stage_devices) // layout.model,
                                                      devices=()))
            self._stage_mesh_groups = [MeshGroups(self, layout.model, [replica[s] for replica in self.stage_devices])
                                       for s in range(num_stages)]

    @property
    def devices(self) -> list[str]:
        """Every device, in the order given (a replica's stages, each stage's devices along the model axis)."""
        return [device for group in self.tensor_parallel_groups for device in group]

    @property
    def peak_stashed_micro_batches(self) -> list[int]:
        """Per stage, the most micro-batch activations alive at once under the schedule."""
        return [schedules.peak_stash(order) for order in self._orders]

    @property
    def mesh_groups(self) -> Optional[MeshGroups]:
        """With a layout, the mesh groups of the stage being computed (its devices' rows and columns)."""
        return None if self.layout is None else self._stage_mesh_groups[self._stage.index]

    def groups_holding(self, variable) -> MeshGroups:
        """The mesh groups of the stage whose devices hold `variable`."""
        device = tf.DeviceSpec.from_string(variable.values[0].device)
        first = [tf.DeviceSpec.from_string(d) for d in self.stage_devices[0]]
        return self._stage_mesh_groups[[(d.device_type, d.device_index) for d in first].index(
            (device.device_type, device.device_index))]

    def split_at_optimizer_build(self, model: keras.Model) -> None:
        """Nothing: a pipeline splits its stages once they are placed (`_prepare`)."""

    def after_compile(self, model: keras.Model) -> None:
        self.after_build(model)
        super().after_compile(model)

    def after_build(self, model: keras.Model) -> None:
        # A model of fewer layers than stages is refused in one line, not inside its first step's trace.
        if _compat.has_layer_graph(model):  # a subclassed model is refused at its first step
            partition_lib.check_stage_count([op for op, _, _ in _compat.graph_nodes(model)[0]], self.num_stages)

    def partition_of(self, model: keras.Model) -> Optional[partition_lib.Partition]:
        """The partition used for `model`, once its first training step was built."""
        return self._partitions.get(id(model))

    def run(self, fn, args=(), kwargs=None, options=None):
        keras_step = inspect.unwrap(fn)  # under batch_share's weighting
        model = getattr(keras_step, "__self__", None)
        step = getattr(keras_step, "__name__", "")
        if isinstance(model, keras.Model) and step in ("train_step", "test_step"):
            if step == "train_step" and getattr(keras_step, "__func__", None) is not keras.Model.train_step:
                raise ValueError(
                    f"PipelineStrategy runs Keras's own training step in stages; model "
                    f"{model.name!r} overrides `train_step`, which cannot be split. Use a "
                    "model without a custom train_step, or another strategy."
                )
            partition = self._prepare(model, _static_batch(args[0]) if args else None)
            if step == "train_step":
                pipelined = functools.partial(self._train_step, model, partition)
                fn = weighted_by_batch_share(pipelined) if fn is not keras_step else pipelined
        elif not getattr(keras_step, "__module__", "").startswith("keras.") and not self._said_whole:
            self._said_whole = True  # a custom loop's step: the pipeline cannot schedule a step it did not build
            print(f"tfdist: pipeline: strategy.run({step or 'fn'}) runs a step of your own whole on each replica's "
                  "first device, not in stages: the pipeline schedules the steps Keras builds (model.fit, "
                  "evaluate, predict)", file=sys.stderr, flush=True)
        return super().run(fn, args=args, kwargs=kwargs, options=options)

    def local_keras_hooks(self, model: keras.Model) -> dict:
        """Keras's predict function, preceded by cutting and placing the model if no step did yet
        (Keras hands `run` a closure for predictions, not the model's bound `predict_step`)."""
        hooks = super().local_keras_hooks(model)  # with a layout, each row's first replica's predictions
        predict = hooks.get("predict_function") or _compat.keras_step_function(model, "predict_function")

        def predict_function(data):
            self._prepare(model, _static_batch(data[0]) if data else None)
            return predict(data)

        return {**hooks, "predict_function": predict_function}

    @contextlib.contextmanager
    def stage_scope(self, stage_index: int):
        """Under this strategy, the stage's device, in the replica whose step is being built (the first
        replica outside a step), and its mesh groups with a layout; elsewhere nothing."""
        if tf.distribute.get_strategy() is not self:
            yield
            return
        outer, self._stage.index = self._stage.index, stage_index
        try:
            with tf.device(self.stage_devices[current_replica()][stage_index]):
                yield
        finally:
            self._stage.index = outer

    def _prepare(self, model: keras.Model, batch: Optional[int]) -> partition_lib.Partition:
        """Cuts `model` into stages, once, and puts each stage's variables and layers on its devices."""
        key = id(model)
        if key not in self._partitions:
            with tf.init_scope():  # plan eagerly, once, outside the traced step
                micro = max(1, (batch or 32 * self.num_micro_batches) // self.num_micro_batches)
                if batch:
                    self._micro_batch_sizes[key] = micro
                partition = partition_lib.split(
                    model,
                    self.num_stages,
                    boundaries=self._boundaries,
                    balance_by=self._balance_by,
                    micro_batch_size=micro,
                    agree=self._process_0s_starts if self.processes else None,
                )
            if self.recompute:
                _refuse_random_layers(partition)
            slots = self._place_variables(model, partition) if self.place_variables else []
            if self.layout is not None:  # each stage's variables split over its devices, after they moved there
                with _compat.optimizer_keys_kept(getattr(model, "optimizer", None), model.trainable_variables):
                    self.split(model)
                for slot, variable in slots:
                    if is_split(variable):
                        split(slot, split_axis(variable), self, self.layout.model)
                for stage in partition.stages[1:]:  # a Megatron pair across a boundary passes it a shard
                    stage.model.input_spec = None
            for stage in partition.stages:
                for operation in stage.operations:
                    call_in_context(operation, functools.partial(self.stage_scope, stage.index))
            self._partitions[key] = partition
            if self._verbose and self.is_chief:
                print(self._describe(model, partition), file=sys.stdout, flush=True)
        return self._partitions[key]

    def _process_0s_starts(self, starts: list[int]) -> list[int]:
        """The stage starts process 0 chose: every process must cut the model the same way."""
        return [int(i) for i in self.processes.broadcast(tf.constant(starts, tf.int32)).numpy()]

    def _place_variables(self, model: keras.Model, partition: partition_lib.Partition) -> list[tuple]:
        """Moves every stage's variables (weights, statistics, seeds) and their optimizer slots to its devices;
        returns the (slot, variable) pairs moved beside each other."""
        destinations, owner = [], {}
        for stage in partition.stages:
            for variable in stage.model.variables:
                if owner.setdefault(id(variable), stage.index) != stage.index:
                    # A weight shared by stages (a language model's token embedding, which also makes its logits)
                    # stays with the first; a later stage reads it from there, and each stage's gradient of it
                    # is summed into its one gradient. A layout's split of it would differ per stage.
                    if self.layout is not None:
                        raise ValueError(
                            f"variable {variable.path!r} is used by layers of stages {owner[id(variable)]} and "
                            f"{stage.index}: a weight shared between stages cannot be split by a layout in this "
                            "version. Move the boundary.")
                    continue
                destinations.append((variable, self.stage_devices[0][stage.index]))
        slots = self.move_variables(destinations, getattr(model, "optimizer", None))
        for variable, device in destinations:
            if variable.regularizer is not None:
                variable.regularizer = _RegularizerOnDevice(variable.regularizer, self, device)
        return slots

    def _describe(self, model: keras.Model, partition: partition_lib.Partition) -> str:
        processes = f"{self.processes.describe()} x " if self.processes else ""
        copies = len(self.stage_devices) // (self.layout.model if self.layout else 1)
        lines = [
            f"tfdist pipeline: {processes}{copies} replica(s) x {self.num_stages} stages, "
            f"{self.num_micro_batches} micro-batches, {self.schedule}"
            f"{', recompute' if self.recompute else ''}; partition by {partition.basis}"
        ]
        memory = self.stage_memory(model)
        for stage in partition.stages:
            times = ", ".join(
                f"{label} {value:.2f} ms"
                for label, value in (("predicted", stage.predicted_ms), ("measured", stage.measured_ms))
                if value is not None
            )
            where = self.stage_devices[0][stage.index]
            if self.layout:  # the stage's devices along the model axis
                split = [replica[stage.index] for replica in self.stage_devices[:self.layout.model]]
                where = f"{', '.join(split)} (split by the layout; bytes of the first)"
            held = memory[stage.index]
            lines.append(
                f"  stage {stage.index} on {where}: {_layer_span(stage.layer_names)} ({stage.num_params:,} params, "
                f"holds {megabytes(held['params'])} of weights and {megabytes(held['optimizer'])} of "
                f"optimizer state{'; ' + times if times else ''})"
            )
        return "\n".join(lines)

    def check_model(self, model: keras.Model) -> None:
        """What the first step would refuse, as config errors before any (for `tfdist train`).

        Raises:
          ConfigError: `pipeline.boundaries` names no layer of the model, or
            `pipeline.recompute` with layers that draw random numbers.
        """
        layers = [op for op, _, _ in _compat.graph_nodes(model)[0]]
        names = [op.name for op in layers]
        unknown = [b for b in self._boundaries or () if isinstance(b, str) and b not in names]
        if unknown:
            raise ConfigError(
                "pipeline.boundaries", f"must name layers of the {model.name} model ({', '.join(names)}).", unknown
            )
        random = [op.name for op in layers if partition_lib.draws_random_numbers(op)]
        if self.recompute and random:
            raise ConfigError(
                "pipeline.recompute",
                f"cannot be used with the {model.name} model: its layers {', '.join(random)} draw random numbers, "
                "and a recomputed pass would draw different ones (for the digits models, set model.dropout: 0).",
                True,
            )
        super().check_model(model)  # and a layout's rules, against the model's variables

    def job_report(self, model: keras.Model) -> dict[str, Any]:
        """The pipeline's layout, partition and per-stage bytes, for the summary and `--metrics_out`."""
        partition = self.partition_of(model)
        report: dict[str, Any] = {
            "layout": self.device_layout(self.num_stages, *((self.layout.model, True) if self.layout else
                                                            (self.tensor_parallel_size,))),
            "pipeline": {
                "num_stages": self.num_stages,
                "num_micro_batches": self.num_micro_batches,
                "schedule": self.schedule,
                "recompute": self.recompute,
                "stage_devices": self.stage_devices,
                "peak_stashed_micro_batches": self.peak_stashed_micro_batches,
                "partition": partition.report() if partition else None,
                "stage_memory_bytes": self.stage_memory(model),
            }
        }
        if id(model) in self._micro_batch_sizes:
            report["micro_batch_size"] = self._micro_batch_sizes[id(model)]
        if self.tensor_parallel_size > 1:
            report["tensor_parallel_groups"] = self.tensor_parallel_groups
        return {**report, **super().job_report(model)}  # the optimizer's split, if any

    def stage_memory(self, model: keras.Model) -> list[dict[str, int]]:
        """Per stage, the bytes its devices hold in the first replica: `params` (the model's
        weights) and `optimizer` (the optimizer's variables), read from where each copy lives."""
        held = [{"params": 0, "optimizer": 0} for _ in range(self.num_stages)]
        optimizer = getattr(model, "optimizer", None)
        state = held_variables(optimizer) if optimizer else []
        for kind, variables in (("params", model.weights), ("optimizer", state)):
            for device, size in bytes_by_device(variables).items():
                stage_index = self.replicas[0].index(device)  # the first replica's devices are its stages'
                if stage_index is not None:
                    held[stage_index][kind] += size
        return held

    def _train_step(self, model: keras.Model, partition: partition_lib.Partition, data):
        with self.in_keras_step():  # Keras's training step, run in stages
            return self._stages_step(model, partition, data)

    def _stages_step(self, model: keras.Model, partition: partition_lib.Partition, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        micro, shares = split_micro_batches((x, y, sample_weight), self.num_micro_batches)
        step = PipelinedStep(model, partition, self)
        for stage_index, (kind, m) in self._sequence:
            if kind == "F":
                step.forward(stage_index, m, micro[m], shares[m])
            else:
                step.backward(stage_index, m)
        step.add_regularization_gradients()
        step.update_statistics()
        grads = step.variable_gradients()
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        y_pred = step.predictions()
        _compat.loss_tracker(model).update_state(
            step.total_loss * tf.distribute.get_replica_context().num_replicas_in_sync,
            sample_weight=tf.shape(tf.nest.flatten(x)[0])[0],
        )
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


class _CurrentStage(threading.local):
    """The stage whose layers this replica's thread is computing (`stage_scope`): its mesh groups split them."""

    def __init__(self):
        self.index = 0


class _RegularizerOnDevice:
    """A variable's regularizer, computed where the variable lives: Keras computes weight
    penalties wherever the loss is computed (the last stage), which would copy the weight there."""

    def __init__(self, regularizer, strategy: PipelineStrategy, device: str):
        self.regularizer = regularizer.regularizer if isinstance(regularizer, _RegularizerOnDevice) else regularizer
        self.strategy = strategy
        self.device = device

    def __call__(self, variable):
        with tf.device(self.strategy.local_device(self.device)):
            return self.regularizer(variable)


def _layer_span(names: Sequence[str]) -> str:
    """A stage's layers for the printout: all of a few, else the first and last and how many
    (MobileNetV2's stages hold about 75 each; `--metrics_out` lists them all)."""
    return ", ".join(names) if len(names) <= 4 else f"{names[0]} ... {names[-1]} ({len(names)} layers)"


def _static_batch(data) -> Optional[int]:
    first = tf.nest.flatten(data)[0]
    if isinstance(first, tf.distribute.DistributedValues):
        first = first.values[0]
    return getattr(first, "shape", [None])[0] if getattr(first, "shape", None) else None


def _refuse_random_layers(partition: partition_lib.Partition) -> None:
    for stage in partition.stages:
        for op in stage.operations:
            if partition_lib.draws_random_numbers(op):
                raise ValueError(
                    f"`recompute` cannot be used with layer {op.name!r} (stage {stage.index}): it draws "
                    "random numbers, and the recomputed pass would draw different ones than the "
                    "forward pass. Turn recompute off or remove the layer."
                )
