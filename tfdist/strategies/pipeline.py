"""Pipeline parallelism for Keras 3 `model.fit`: `PipelineStrategy`.

Devices form pipeline replicas of `num_stages` devices each (4 devices, 2
stages: replicas [d0, d1] and [d2, d3]); with `tensor_parallel_size` T each
stage is a group of T devices that the tensor-parallel layers of
`tfdist.layers` split over (8 devices, 2 stages, T=2: replicas
[[d0, d1], [d2, d3]] and [[d4, d5], [d6, d7]]). The strategy is a
`MirroredStrategy` over the first device of every replica, so data parallelism
across replicas, variable mirroring and gradient all-reduce are TensorFlow's
own. What it adds is the training step inside each replica:

1. the model is cut into stages (`tfdist.parallel.partition`), stage k on the
   replica's device (group) k;
2. the replica's batch is split into `num_micro_batches` micro-batches;
3. every stage runs the forward (F) and backward (B) of each micro-batch in
   the order the schedule gives it (`tfdist.parallel.schedules`), enforced by
   control dependencies, so stage k+1 works on micro-batch m while stage k
   works on m+1, and 1F1B keeps at most K micro-batches of activations alive;
4. gradients are summed over micro-batches, each micro-batch's loss weighted
   by its share of the batch, so the update equals one full-batch step.

Keras calls `strategy.run(model.train_step, ...)` for every training step;
`run` recognises that call and runs the pipelined step instead, so user code is
plain Keras. Evaluation and prediction run each replica's whole model on its
first device. A model with its own `train_step` cannot be pipelined and fails
at the first step with a clear error.

Example:

    >>> strategy = PipelineStrategy(num_stages=2, num_micro_batches=8, schedule="1f1b")
    >>> with strategy.scope():  # doctest: +SKIP
    ...     model = keras.Sequential([...])
    ...     model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    >>> model.fit(x, y, batch_size=256, epochs=5)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Optional, Sequence, Union

import keras
import tensorflow as tf

from tfdist import _compat
from tfdist.parallel import partition as partition_lib
from tfdist.parallel import schedules
from tfdist.parallel.device_group import DeviceGroup, current_replica, split_into_groups
from tfdist.strategies.data_parallel import MirroredStrategy
from tfdist.strategies.devices import default_devices

__all__ = ["PipelineStrategy"]


class PipelineStrategy(MirroredStrategy):
    """Pipeline-parallel training (GPipe or 1F1B) inside data-parallel replicas.

    Args:
      num_stages: stages per pipeline replica (K).
      num_micro_batches: micro-batches per replica batch (M).
      schedule: `gpipe` or `1f1b`.
      devices: all devices, a multiple of `num_stages` x `tensor_parallel_size`;
        replica r uses devices[r*K*T:(r+1)*K*T], stage by stage. Default:
        every GPU, else every logical CPU.
      boundaries: the layer (name or index) starting each stage after the
        first; None balances the stages (see `balance_by`).
      balance_by: `time` (measured per-layer cost) or `params`.
      recompute: keep only each stage's inputs in the forward pass and
        recompute its activations in the backward pass (less memory, more
        compute). Layers that draw random numbers (Dropout) are refused, since
        their recomputed masks would differ.
      verbose: print the chosen partition when the first step is built.
      tensor_parallel_size: devices per stage (T); the tensor-parallel layers
        made in this strategy's scope split over the stage's devices.
        Variables live on each replica's first device, as for every stage.

    Raises:
      ValueError: sizes out of range, an unknown schedule, or a device count
        that is not a multiple of `num_stages` x `tensor_parallel_size`.
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
    ):
        self._orders = schedules.stage_orders(schedule, num_stages, num_micro_batches)
        devices = list(devices or default_devices())
        if tensor_parallel_size < 1:
            raise ValueError(f"`tensor_parallel_size` must be >= 1. Received: {tensor_parallel_size}")
        per_replica = num_stages * tensor_parallel_size
        if len(devices) < per_replica or len(devices) % per_replica:
            sizes = f"`num_stages` ({num_stages})" + (
                f" x `tensor_parallel_size` ({tensor_parallel_size})" if tensor_parallel_size > 1 else ""
            )
            raise ValueError(
                f"`devices` must be a non-zero multiple of {sizes}: each pipeline replica takes "
                f"{per_replica} devices. Received: {len(devices)} device(s) {devices}"
            )
        if balance_by not in partition_lib.BALANCE_BASES:
            raise ValueError(
                f"`balance_by` must be one of {partition_lib.BALANCE_BASES}. Received: {balance_by!r}"
            )
        self.num_stages = num_stages
        self.num_micro_batches = num_micro_batches
        self.schedule = schedule
        self.recompute = recompute
        self.groups = split_into_groups(devices, tensor_parallel_size)  # every stage of every replica
        self.stage_groups = [self.groups[i : i + num_stages] for i in range(0, len(self.groups), num_stages)]
        self.stage_devices = [[group.devices[0] for group in replica] for replica in self.stage_groups]
        self.tensor_parallel_size = tensor_parallel_size
        self._boundaries = boundaries
        self._balance_by = balance_by
        self._verbose = verbose
        self._sequence = schedules.global_order(self._orders)
        self._partitions: dict[int, partition_lib.Partition] = {}
        super().__init__(devices=[group[0] for group in self.stage_devices])

    @property
    def peak_stashed_micro_batches(self) -> list[int]:
        """Per stage, the most micro-batch activations alive at once under the schedule."""
        return [schedules.peak_stash(order) for order in self._orders]

    @property
    def devices(self) -> list[str]:
        """Every device, replica by replica, stage by stage."""
        return [device for group in self.groups for device in group.devices]

    @property
    def tensor_parallel_group(self) -> DeviceGroup:
        """The first stage's group of the replica whose step is being built (the
        pipelined training step puts each stage's own group in scope)."""
        return self.stage_groups[current_replica()][0]

    def partition_of(self, model: keras.Model) -> Optional[partition_lib.Partition]:
        """The partition used for `model`, once its first training step was built."""
        return self._partitions.get(id(model))

    def run(self, fn, args=(), kwargs=None, options=None):
        model = getattr(fn, "__self__", None)
        if isinstance(model, keras.Model) and getattr(fn, "__name__", "") == "train_step":
            if getattr(fn, "__func__", None) is not keras.Model.train_step:
                raise ValueError(
                    f"PipelineStrategy runs Keras's own training step in stages; model "
                    f"{model.name!r} overrides `train_step`, which cannot be split. Use a "
                    "model without a custom train_step, or another strategy."
                )
            partition = self._partition(model, args)
            fn = functools.partial(self._train_step, model, partition)
        return super().run(fn, args=args, kwargs=kwargs, options=options)

    def _partition(self, model: keras.Model, args) -> partition_lib.Partition:
        key = id(model)
        if key not in self._partitions:
            with tf.init_scope():  # plan eagerly, once, outside the traced step
                batch = _static_batch(args[0]) if args else None
                micro = max(1, (batch or 32 * self.num_micro_batches) // self.num_micro_batches)
                partition = partition_lib.split(
                    model,
                    self.num_stages,
                    boundaries=self._boundaries,
                    balance_by=self._balance_by,
                    micro_batch_size=micro,
                )
            if self.recompute:
                _refuse_random_layers(partition)
            self._partitions[key] = partition
            if self._verbose:
                print(self._describe(partition), file=sys.stdout, flush=True)
        return self._partitions[key]

    def _describe(self, partition: partition_lib.Partition) -> str:
        lines = [
            f"tfdist pipeline: {len(self.stage_devices)} replica(s) x {self.num_stages} stages, "
            f"{self.num_micro_batches} micro-batches, {self.schedule}"
            f"{', recompute' if self.recompute else ''}; partition by {partition.basis}"
        ]
        for stage in partition.stages:
            times = ", ".join(
                f"{label} {value:.2f} ms"
                for label, value in (("predicted", stage.predicted_ms), ("measured", stage.measured_ms))
                if value is not None
            )
            group = self.stage_groups[0][stage.index]
            where = group.devices[0] if group.size == 1 else f"{', '.join(group.devices)} (tensor parallel)"
            lines.append(
                f"  stage {stage.index} on {where}: "
                f"{', '.join(stage.layer_names)} ({stage.num_params:,} params{'; ' + times if times else ''})"
            )
        return "\n".join(lines)

    def _train_step(self, model: keras.Model, partition: partition_lib.Partition, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        micro, shares = _split_micro_batches((x, y, sample_weight), self.num_micro_batches)
        step = _PipelinedStep(model, partition, self.stage_groups[current_replica()], self.recompute)
        for stage_index, (kind, m) in self._sequence:
            if kind == "F":
                step.forward(stage_index, m, micro[m], shares[m])
            else:
                step.backward(stage_index, m)
        grads = step.variable_gradients()
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        y_pred = step.predictions()
        _compat.loss_tracker(model).update_state(
            step.total_loss * tf.distribute.get_replica_context().num_replicas_in_sync,
            sample_weight=tf.shape(tf.nest.flatten(x)[0])[0],
        )
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


class _PipelinedStep:
    """The tensors of one replica's pipelined step while its graph is built."""

    def __init__(self, model, partition, groups, recompute):
        self.model = model
        self.partition = partition
        self.groups = groups
        self.recompute = recompute
        self.live: dict[int, dict[int, tf.Tensor]] = {}  # micro-batch -> KerasTensor id -> value
        self.out_grads: dict[int, dict[int, tf.Tensor]] = {}  # gradients w.r.t. those values
        self.records: dict[tuple[int, int], dict] = {}
        self.last_done: list[list] = [[] for _ in partition.stages]
        self.var_grads: dict[int, tf.Tensor] = {}
        self.losses: list[tf.Tensor] = []
        self.predictions_by_micro_batch: dict[int, list] = {}

    @contextlib.contextmanager
    def _on_stage(self, stage_index: int):
        """On the stage's (first) device, its group in scope, after the stage's previous work."""
        group = self.groups[stage_index]
        with tf.device(group.devices[0]), group.scope(), tf.control_dependencies(self.last_done[stage_index]):
            yield

    def _is_last(self, stage_index: int) -> bool:
        return stage_index == len(self.partition.stages) - 1

    def _run_stage(self, stage_index: int, m: int, inputs: list):
        """Stage forward (and, on the last stage, the weighted scaled loss)."""
        stage = self.partition.stages[stage_index]
        outputs = tf.nest.flatten(stage.model(inputs, training=True))
        if not self._is_last(stage_index):
            return outputs, None
        values = {**self.live[m], **{id(t): v for t, v in zip(stage.produces, outputs)}}
        preds = [values[id(t)] for t in self.partition.outputs]
        record = self.records[(stage_index, m)]
        y_pred = preds[0] if len(preds) == 1 else preds
        loss = self.model.compute_loss(
            x=record["x"], y=record["y"], y_pred=y_pred, sample_weight=record["sample_weight"], training=True
        )
        weighted = tf.math.multiply_no_nan(loss, tf.cast(record["share"], loss.dtype))
        return outputs, (weighted, preds)

    def _sources(self, stage_index: int) -> list:
        stage = self.partition.stages[stage_index]
        tensors = stage.consumes + (stage.passes if self._is_last(stage_index) else [])
        model_inputs = {id(t) for t in self.partition.inputs}  # nobody needs their gradient
        return [t for t in tensors if tf.as_dtype(t.dtype).is_floating and id(t) not in model_inputs]

    def forward(self, stage_index: int, m: int, batch, share) -> None:
        stage = self.partition.stages[stage_index]
        x, y, sample_weight = batch
        if stage_index == 0:
            self.live[m] = {id(t): v for t, v in zip(self.partition.inputs, tf.nest.flatten(x))}
            self.out_grads[m] = {}
        self.records[(stage_index, m)] = record = {"x": x, "y": y, "sample_weight": sample_weight, "share": share}
        inputs = [self.live[m][id(t)] for t in stage.consumes]
        with self._on_stage(stage_index):
            if self.recompute:
                outputs, loss = self._run_stage(stage_index, m, inputs)
            else:
                tape = tf.GradientTape(persistent=False)
                with tape:
                    tape.watch([self.live[m][id(t)] for t in self._sources(stage_index)])
                    outputs, loss = self._run_stage(stage_index, m, inputs)
                    if loss is not None:
                        scaled = self.model.optimizer.scale_loss(loss[0])
                record["tape"] = tape
                record["outputs"] = outputs
                if loss is not None:
                    record["scaled_loss"] = scaled
        record["inputs"] = inputs
        for t, v in zip(stage.produces, outputs):
            self.live[m][id(t)] = v
        if loss is not None:
            self.losses.append(loss[0])
            self.predictions_by_micro_batch[m] = loss[1]
        self.last_done[stage_index] = [tf.group(outputs)]

    def backward(self, stage_index: int, m: int) -> None:
        stage = self.partition.stages[stage_index]
        record = self.records[(stage_index, m)]
        sources = [self.live[m][id(t)] for t in self._sources(stage_index)]
        variables = stage.trainable_variables
        with self._on_stage(stage_index):
            if self.recompute:
                with tf.GradientTape() as tape:
                    tape.watch(sources)
                    outputs, loss = self._run_stage(stage_index, m, record["inputs"])
                    scaled = self.model.optimizer.scale_loss(loss[0]) if loss is not None else None
            else:
                tape, outputs, scaled = record["tape"], record["outputs"], record.get("scaled_loss")
            if self._is_last(stage_index):
                targets, seeds = scaled, None
            else:
                targets = outputs
                seeds = [
                    self.out_grads[m].get(id(t), tf.zeros_like(v)) for t, v in zip(stage.produces, outputs)
                ]
            grads = tape.gradient(
                targets,
                sources + variables,
                output_gradients=seeds,
                unconnected_gradients=tf.UnconnectedGradients.ZERO,
            )
        del self.records[(stage_index, m)]  # its activations may now be freed
        source_tensors = self._sources(stage_index)
        for t, g in zip(source_tensors, grads[: len(sources)]):
            previous = self.out_grads[m].get(id(t))
            self.out_grads[m][id(t)] = g if previous is None else previous + g
        for v, g in zip(variables, grads[len(sources) :]):
            previous = self.var_grads.get(id(v))
            self.var_grads[id(v)] = g if previous is None else previous + g
        self.last_done[stage_index] = [tf.group(grads)]

    def variable_gradients(self) -> list:
        return [
            self.var_grads.get(id(v), tf.zeros_like(v)) for v in self.model.trainable_variables
        ]

    @property
    def total_loss(self) -> tf.Tensor:
        return tf.add_n(self.losses)

    def predictions(self):
        per_output = zip(*(self.predictions_by_micro_batch[m] for m in sorted(self.predictions_by_micro_batch)))
        merged = [tf.concat(list(parts), axis=0) for parts in per_output]
        return merged[0] if len(merged) == 1 else merged


def _static_batch(data) -> Optional[int]:
    first = tf.nest.flatten(data)[0]
    if isinstance(first, tf.distribute.DistributedValues):
        first = first.values[0]
    return getattr(first, "shape", [None])[0] if getattr(first, "shape", None) else None


def _refuse_random_layers(partition: partition_lib.Partition) -> None:
    for stage in partition.stages:
        for op in stage.operations:
            if hasattr(op, "seed_generator"):
                raise ValueError(
                    f"`recompute` cannot be used with layer {op.name!r} (stage {stage.index}): it draws "
                    "random numbers, and the recomputed pass would draw different ones than the "
                    "forward pass. Turn recompute off or remove the layer."
                )


def _split_micro_batches(batch, num_micro_batches: int):
    """Splits every tensor of `batch` into M micro-batches; returns them and each one's share.

    A batch whose size is known and does not divide by M is an error. A batch of
    unknown size (Keras's last partial batch) is split as evenly as possible,
    and each micro-batch's loss is weighted by its share of the batch, so the
    step still equals one full-batch step.
    """
    tensors = [t for t in tf.nest.flatten(batch) if t is not None]
    size = tensors[0].shape[0]
    m = num_micro_batches
    if size is not None:
        if size % m:
            raise ValueError(
                f"a batch of {size} examples per replica does not split into {m} micro-batches; "
                f"use a batch size divisible by {m} x the number of replicas."
            )
        sizes = [size // m] * m
        shares = [tf.constant(1.0 / m)] * m
    else:
        total = tf.shape(tensors[0])[0]
        sizes = total // m + tf.cast(tf.range(m) < total % m, tf.int32)
        shares = tf.unstack(tf.cast(sizes, tf.float32) / tf.cast(total, tf.float32), num=m)

    leaves = tf.nest.flatten(batch)
    pieces = [None if t is None else tf.split(t, sizes, num=m, axis=0) for t in leaves]
    micro = [
        tf.nest.pack_sequence_as(batch, [None if p is None else p[i] for p in pieces])
        for i in range(m)
    ]
    return micro, shares
