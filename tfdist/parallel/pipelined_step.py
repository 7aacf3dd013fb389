"""One replica's pipelined training step, built op by op in the order a schedule gives.

`PipelineStrategy` runs this in place of Keras's `train_step`: the batch is
split into micro-batches (`split_micro_batches`), each stage runs the forward
(F) and backward (B) of each micro-batch where the schedule puts it, and the
variables' gradients are summed over micro-batches, each micro-batch's loss
weighted by its share of the batch, so the update equals one full-batch step.

Each stage keeps a gradient tape per micro-batch from its forward to its
backward (or, with recompute, only the stage's inputs, and runs the forward
again in the backward). A stage's backward seeds its tape with the gradients
later stages computed for the tensors it produced; control dependencies keep
each stage's work in schedule order, so 1F1B really holds at most K
micro-batches of activations.

A stage's forward holds back its variable updates: BatchNormalization's
moving statistics move once per step by the whole batch's moments, as on one
device, instead of once per micro-batch.
"""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from tfdist import _compat
from tfdist.parallel import partition as partition_lib

__all__ = ["PipelinedStep", "split_micro_batches"]


class PipelinedStep:
    """The tensors of one replica's pipelined step while its graph is built.

    Args:
      model: the Keras model being trained.
      partition: its stages.
      strategy: the `PipelineStrategy`; its `stage_scope(k)` places stage k's
        work and its `recompute` says whether activations are kept.
    """

    def __init__(self, model, partition: partition_lib.Partition, strategy):
        self.model = model
        self.partition = partition
        self.strategy = strategy
        self.recompute = strategy.recompute
        self.live: dict[int, dict[int, tf.Tensor]] = {}  # micro-batch -> KerasTensor id -> value
        self.out_grads: dict[int, dict[int, tf.Tensor]] = {}  # gradients w.r.t. those values
        self.records: dict[tuple[int, int], dict] = {}
        self.last_done: list[list] = [[] for _ in partition.stages]
        self.var_grads: dict[int, tf.Tensor] = {}
        self.losses: list[tf.Tensor] = []
        self.predictions_by_micro_batch: dict[int, list] = {}
        # BatchNormalization layer -> (layer, its stage, per micro-batch (share, new moving mean, new moving variance)).
        self.statistics: dict[int, tuple] = {}

    @contextlib.contextmanager
    def _on_stage(self, stage_index: int):
        """On the stage's (first) device, its group in scope, after the stage's previous work."""
        with self.strategy.stage_scope(stage_index), tf.control_dependencies(self.last_done[stage_index]):
            yield

    def _is_last(self, stage_index: int) -> bool:
        return stage_index == len(self.partition.stages) - 1

    def _run_stage(self, stage_index: int, m: int, inputs: list, keep_state: bool = True):
        """Stage forward (and, on the last stage, the weighted scaled loss).

        The stage's variable updates are held back (a Keras `StatelessScope`):
        BatchNormalization's moving statistics are combined over the
        micro-batches once per step (`update_statistics`); other state, such
        as Dropout's seeds, is written at once. A forward run again for
        recompute keeps nothing: the first forward already did.
        """
        stage = self.partition.stages[stage_index]
        with keras.StatelessScope(collect_losses=True, initialize_variables=False) as scope:
            outputs = tf.nest.flatten(stage.model(inputs, training=True))
        if scope.losses:
            raise ValueError(
                f"PipelineStrategy cannot train stage {stage.index} ({', '.join(stage.layer_names)}): a layer "
                "adds a loss in its call (an activity regularizer or `add_loss`), and a pipeline cannot tell how "
                "that loss combines over micro-batches. Use weight regularizers, or another strategy."
            )
        if keep_state:
            self._keep_state(stage, scope, self.records[(stage_index, m)]["share"])
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

    def _keep_state(self, stage: partition_lib.Stage, scope, share) -> None:
        statistics = {}
        for layer in _compat.nested_layers(stage.model):
            if isinstance(layer, keras.layers.BatchNormalization) and not layer.renorm and layer.trainable:
                statistics[id(layer.moving_mean)] = statistics[id(layer.moving_variance)] = layer
        for variable in stage.model.variables:
            value = scope.get_current_value(variable)
            if value is None or id(variable) in statistics:
                continue
            variable.assign(value)
        for layer in {id(layer): layer for layer in statistics.values()}.values():
            mean, variance = scope.get_current_value(layer.moving_mean), scope.get_current_value(layer.moving_variance)
            if mean is not None:
                self.statistics.setdefault(id(layer), (layer, stage.index, []))[2].append((share, mean, variance))

    def update_statistics(self) -> None:
        """Moves each BatchNormalization layer's statistics once, by the whole batch's moments.

        Each micro-batch's held-back update is old * momentum + its moments *
        (1 - momentum). Weighted by the micro-batches' shares, the means give
        the whole batch's mean; the variances miss the spread of the
        micro-batch means, added back (law of total variance).
        """
        for layer, stage_index, parts in self.statistics.values():
            with self._on_stage(stage_index):
                weights = [tf.cast(share, mean.dtype) for share, mean, _ in parts]
                mean = tf.add_n([tf.math.multiply_no_nan(m, w) for w, (_, m, _) in zip(weights, parts)])
                spread = tf.add_n([tf.math.multiply_no_nan(tf.square(m - mean), w) for w, (_, m, _) in zip(weights, parts)])
                variance = tf.add_n([tf.math.multiply_no_nan(v, w) for w, (_, _, v) in zip(weights, parts)])
                layer.moving_mean.assign(mean)
                layer.moving_variance.assign(variance + spread / (1.0 - layer.momentum))
        self.statistics.clear()

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
                    outputs, loss = self._run_stage(stage_index, m, record["inputs"], keep_state=False)
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
            grads = tape.gradient(targets, sources + variables, output_gradients=seeds)
            # Zeros where a source is unconnected (a layer holding another stage's layer lists its variables too),
            # made here: TensorFlow's own take the source's dtype, for a Keras variable a string, and fail.
            grads = [tf.zeros_like(x) if g is None else g for x, g in zip(sources, grads[:len(sources)])] + [
                tf.zeros(v.shape, v.dtype) if g is None else g for v, g in zip(variables, grads[len(sources):])]
            # Sums over micro-batches stay on the stage too: a stage's gradients never gather elsewhere.
            for t, g in zip(self._sources(stage_index), grads[: len(sources)]):
                previous = self.out_grads[m].get(id(t))
                self.out_grads[m][id(t)] = g if previous is None else previous + g
            for v, g in zip(variables, grads[len(sources) :]):
                previous = self.var_grads.get(id(v))
                self.var_grads[id(v)] = g if previous is None else previous + g
        del self.records[(stage_index, m)]  # its activations may now be freed
        self.last_done[stage_index] = [tf.group(grads)]

    def add_regularization_gradients(self) -> None:
        """Adds the weight penalties' gradients of every stage but the last.

        The last stage's `compute_loss` includes every penalty (Keras's
        `model.losses`), so the logged loss is Keras's; but its gradient tape
        reaches only the last stage's variables. Each other stage
        differentiates its own penalties once per step, on its device, scaled
        as Keras scales additional losses.
        """
        replicas = tf.distribute.get_replica_context().num_replicas_in_sync
        for stage in self.partition.stages[:-1]:
            variables = [v for v in stage.trainable_variables if v.regularizer is not None]
            if not variables:
                continue
            with self._on_stage(stage.index):
                with tf.GradientTape() as tape:
                    penalty = tf.add_n([v.regularizer(v) for v in variables]) / replicas
                    scaled = self.model.optimizer.scale_loss(penalty)
                for v, g in zip(variables, tape.gradient(scaled, variables)):
                    self.var_grads[id(v)] = self.var_grads[id(v)] + g if id(v) in self.var_grads else g

    def variable_gradients(self) -> list:
        # A variable no stage computes with gets zeros made from its shape (not its value, which may be elsewhere).
        return [self.var_grads.get(id(v), tf.zeros(v.shape, v.dtype)) for v in self.model.trainable_variables]

    @property
    def total_loss(self) -> tf.Tensor:
        return tf.add_n(self.losses)

    def predictions(self):
        per_output = zip(*(self.predictions_by_micro_batch[m] for m in sorted(self.predictions_by_micro_batch)))
        merged = [tf.concat(list(parts), axis=0) for parts in per_output]
        return merged[0] if len(merged) == 1 else merged


def split_micro_batches(batch, num_micro_batches: int):
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
