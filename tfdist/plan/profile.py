"""What a configured model costs, read from the model itself: built once on the CPU, never trained.

`profile(config)` builds the config's model with its precision policy and
optimizer and reads, per top-level layer:

- the bytes of its trainable and other weights (exact: the variables' shapes
  and dtypes);
- the bytes of its output per example (one small batch run through the model,
  its outputs' shapes read; the compute dtype's size), which a training step
  keeps for the backward pass and a pipeline sends between stages;
- its forward FLOPs per example (the statistics TensorFlow's profiler
  counts, over the ops of the traced model, batch 1, by the layer's name
  scope; einsums, which they leave out, counted from their shapes); a
  training step costs about three times that (forward, and the backward's
  two products);
- whether tensor parallelism splits it (tfdist's tensor-parallel layers).

The optimizer's slot bytes come from building the configured optimizer on
the model's trainable variables.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["LayerCost", "ModelProfile", "measured_flops", "one_device_config", "profile"]

TRAINING_FLOPS_PER_FORWARD = 3  # forward, then the backward's products for the inputs and for the weights


@dataclasses.dataclass(frozen=True)
class LayerCost:
    name: str
    trainable_bytes: int
    other_bytes: int  # non-trainable weights (BatchNorm's statistics, ...)
    output_bytes_per_example: int
    forward_flops_per_example: float
    tensor_parallel: bool  # tfdist splits its weights and matmuls over a tensor-parallel group


@dataclasses.dataclass(frozen=True)
class ModelProfile:
    name: str
    layers: tuple[LayerCost, ...]
    slot_bytes: int  # the optimizer's state for every trainable variable
    optimizer: str
    compute_dtype: str

    @property
    def trainable_bytes(self) -> int:
        return sum(layer.trainable_bytes for layer in self.layers)

    @property
    def weight_bytes(self) -> int:
        return sum(layer.trainable_bytes + layer.other_bytes for layer in self.layers)

    @property
    def training_flops_per_example(self) -> float:
        return TRAINING_FLOPS_PER_FORWARD * sum(layer.forward_flops_per_example for layer in self.layers)

    def to_dict(self) -> dict:
        return {"name": self.name, "optimizer": self.optimizer, "compute_dtype": self.compute_dtype,
                "weight_bytes": self.weight_bytes, "trainable_bytes": self.trainable_bytes,
                "slot_bytes": self.slot_bytes, "training_flops_per_example": self.training_flops_per_example,
                "layers": [dataclasses.asdict(layer) for layer in self.layers]}


def profile(config) -> ModelProfile:
    """The profile of `config`'s model (call before any strategy is made: it builds on the CPU).

    Raises:
      ConfigError: the model or data cannot be built (as `tfdist train` says it).
    """
    import keras
    import numpy as np

    from tfdist import data, models, precision
    from tfdist.optimizers import build_optimizer

    precision.apply_policy(config.precision)
    try:
        source = data.load_source(config.data, seed=config.train.seed, steps_per_epoch_set=True)
        keras.utils.set_random_seed(config.train.seed)
        model = models.build(config.model, input_shape=source.input_shape, num_classes=source.num_classes)
        optimizer = precision.wrap_optimizer(build_optimizer(config.train, steps_per_epoch=1), config.precision)
        optimizer.build(model.trainable_variables)
        slot_bytes = sum(_nbytes(v) for v in optimizer.variables if len(v.shape))
        flops = _forward_flops_by_layer(model, source.input_shape)
        outputs = _layer_outputs(model, np.zeros((2, *source.input_shape), "float32"))
        layers = tuple(_layer_cost(layer, output, flops) for layer, output in outputs)
        compute_dtype = keras.mixed_precision.dtype_policy().compute_dtype
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    return ModelProfile(name=model.name, layers=layers, slot_bytes=slot_bytes, optimizer=type(optimizer).__name__,
                        compute_dtype=compute_dtype)


def _nbytes(variable) -> int:
    import tensorflow as tf

    return math.prod(variable.shape) * tf.as_dtype(variable.dtype).size


def _layer_outputs(model, batch) -> list:
    """(layer, its output on `batch`) for each top-level layer that computes something, in order."""
    import keras

    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    probe = keras.Model(model.inputs, [layer.output for layer in layers])
    values = probe([batch], training=False)
    return list(zip(layers, values if isinstance(values, (list, tuple)) else [values]))


def _layer_cost(layer, output, flops: dict) -> LayerCost:
    import keras
    import tensorflow as tf

    from tfdist.layers import tensor_parallel

    parallel = (tensor_parallel.ColumnParallelDense, tensor_parallel.RowParallelDense, tensor_parallel.ParallelMLP,
                tensor_parallel.ParallelMultiHeadAttention, keras.layers.MultiHeadAttention)
    examples = tf.nest.flatten(output)[0].shape[0]
    return LayerCost(
        name=layer.name,
        trainable_bytes=sum(_nbytes(v) for v in layer.trainable_weights),
        other_bytes=sum(_nbytes(v) for v in layer.non_trainable_weights),
        output_bytes_per_example=sum(math.prod(t.shape) * tf.as_dtype(t.dtype).size
                                     for t in tf.nest.flatten(output)) // examples,
        forward_flops_per_example=flops.get(layer.name, 0.0),
        tensor_parallel=isinstance(layer, parallel),
    )


def _forward_flops_by_layer(model, input_shape) -> dict[str, float]:
    """Forward FLOPs of one example by top-level layer name: each op of the traced model (batch 1)
    costs what TensorFlow's statistics say (as its profiler counts them), an einsum (which they leave
    out) 2 x the product of its index sizes; an op belongs to the layer its name scope names."""
    import tensorflow as tf
    from tensorflow.python.framework import ops

    from tensorflow.python.util import deprecation

    graph = tf.function(lambda x: model(x, training=False)).get_concrete_function(
        tf.TensorSpec((1, *input_shape), "float32")).graph
    names = {layer.name for layer in model.layers}
    by_layer: dict[str, float] = {}
    with deprecation.silence():  # the profiler's statistics call a TF1 helper that warns once
        for op in graph.get_operations():
            scope = op.name.split("/")[1] if op.name.count("/") >= 2 else ""
            layer = scope if scope in names else scope.rsplit("_", 1)[0]  # a second call's scope: name_1
            if layer in names:
                by_layer[layer] = by_layer.get(layer, 0.0) + _op_flops(graph, op, ops)
    return by_layer


def _op_flops(graph, op, ops) -> float:
    if op.type == "Einsum":
        inputs, _ = op.get_attr("equation").decode().split("->")
        sizes = {}
        for letters, tensor in zip(inputs.split(","), op.inputs):
            sizes.update(zip(letters, tensor.shape))
        return 2.0 * math.prod(sizes.values())
    try:
        return float(ops.get_stats_for_node_def(graph, op.node_def, "flops").value or 0)
    except ValueError:  # no statistics registered for the op type: no arithmetic worth counting
        return 0.0


def one_device_config(config, batch: int):
    """`config` as a one-device job of `batch` examples a step: what `measured_flops` times."""
    from tfdist.config import to_dict
    from tfdist.config.loading import from_dict

    raw = to_dict(config)
    raw["strategy"].update(kind="one_device", logical_devices=1, devices=[], shard_optimizer=0)
    raw["train"]["global_batch_size"] = batch
    return from_dict(raw)


def measured_flops(one_device, model: ModelProfile, steps: int = 10) -> float:
    """This machine's sustained FLOP/s in a training step of a one-device job (`one_device_config`):
    the profile's training FLOPs over the median of 3 timed rounds of `steps` steps."""
    import statistics

    from tfdist import training
    from tfdist.bench.timing import fit_round

    batch = one_device.train.global_batch_size
    job = training.prepare(one_device)
    one_round = fit_round(job.model, job.train_data, batch=batch, steps=steps)
    one_round()  # tracing and warm-up
    step_ms = statistics.median(one_round() for _ in range(3))
    return model.training_flops_per_example * batch / (step_ms / 1000)
