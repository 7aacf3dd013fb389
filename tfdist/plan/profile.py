"""What a configured model costs, read from the model itself: built once on the CPU, never trained.

`profile(config)` builds the config's model with its precision policy and
optimizer and reads, per top-level layer:

- the bytes of its trainable and other weights (exact: the variables' shapes
  and dtypes), and how many trainable variables it has;
- the bytes of its output per example (one small batch run through the model,
  its outputs' shapes read; the compute dtype's size), which a pipeline sends
  between stages;
- the bytes per example the backward pass keeps of its forward tensors (a
  training step's gradient traced at 1 and 2 examples: the layer's tensors
  the gradient's ops read), and the same with every layer that holds
  weights recomputing its forward pass (`train.remat: full`, traced again);
- its forward FLOPs per example (the statistics TensorFlow's profiler
  counts, over the ops its call adds to the traced model, batch 1; einsums,
  which they leave out, counted from their shapes); a
  training step costs about three times that (forward, and the backward's
  two products);
- whether tensor parallelism splits it (tfdist's tensor-parallel layers), and
  with `strategy.kind: layout`, the bytes of its variables the layout splits
  over the mesh's model axis.

The optimizer's slot bytes come from building the configured optimizer on
the model's trainable variables.
"""

from __future__ import annotations

import dataclasses
import math

from tfdist import _compat

__all__ = ["LayerCost", "ModelProfile", "kept_bytes", "profile"]

TRAINING_FLOPS_PER_FORWARD = 3  # forward, then the backward's products for the inputs and for the weights


@dataclasses.dataclass(frozen=True)
class LayerCost:
    name: str
    trainable_bytes: int
    other_bytes: int  # non-trainable weights (BatchNorm's statistics, ...)
    output_bytes_per_example: int
    forward_flops_per_example: float
    kept_bytes_per_example: int  # what the backward pass reads of its forward tensors, per example
    tensor_parallel: bool  # tfdist splits its weights and matmuls over a tensor-parallel group
    trainable_variables: int = 0  # each read and updated by an RPC of its own under parameter servers
    split_bytes: int = 0  # of its trainable bytes, those a layout (`strategy.kind: layout`) splits
    kept_bytes_per_example_remat: int = 0  # the same with `train.remat: full`

    @property
    def split_fraction(self) -> float:
        """The share of its trainable bytes (and, as an estimate, of its work) split over the devices."""
        if self.tensor_parallel:
            return 1.0
        return self.split_bytes / self.trainable_bytes if self.trainable_bytes else 0.0


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
    def trainable_variables(self) -> int:
        return sum(layer.trainable_variables for layer in self.layers)

    @property
    def weight_bytes(self) -> int:
        return sum(layer.trainable_bytes + layer.other_bytes for layer in self.layers)

    @property
    def training_flops_per_example(self) -> float:
        return TRAINING_FLOPS_PER_FORWARD * sum(layer.forward_flops_per_example for layer in self.layers)

    def to_dict(self) -> dict:
        return {"name": self.name, "optimizer": self.optimizer, "compute_dtype": self.compute_dtype,
                "weight_bytes": self.weight_bytes, "trainable_bytes": self.trainable_bytes,
                "trainable_variables": self.trainable_variables,
                "slot_bytes": self.slot_bytes, "training_flops_per_example": self.training_flops_per_example,
                "layers": [dataclasses.asdict(layer) for layer in self.layers]}


def profile(config, *, activations: bool = True) -> ModelProfile:
    """The profile of `config`'s model (call before any strategy is made: it builds on the CPU);
    without `activations`, what the backward pass keeps is left at 0 (one trace instead of two).

    Raises:
      ConfigError: the model or data cannot be built (as `tfdist train` says it).
    """
    import keras
    import numpy as np
    import tensorflow as tf

    from tfdist import data, models, precision
    from tfdist.optimizers import build_optimizer
    from tfdist.parallel.recompute import remat

    precision.apply_policy(config.precision)
    try:
        source = data.load_source(config.data, seed=config.train.seed, steps_per_epoch_set=True)
        keras.utils.set_random_seed(config.train.seed)
        model = models.build(config.model, input_shape=source.input_shape, num_classes=source.num_classes)
        optimizer = precision.wrap_optimizer(build_optimizer(config.train, steps_per_epoch=1), config.precision)
        optimizer.build(model.trainable_variables)
        slot_bytes = sum(_nbytes(v) for v in optimizer.variables if len(v.shape))
        flops, kept_one = _traced_step(model, tf.TensorSpec((1, *source.input_shape), "float32"))
        kept, kept_remat = {}, {}
        if activations:
            kept = _kept_per_example(model, source.input_shape, kept_one)
        outputs = _layer_outputs(model, np.zeros((2, *source.input_shape), "float32"))
        split = _split_paths(config, model)
        if activations:  # last: the layers' calls recompute from here on
            remat(model, "full")
            kept_remat = _kept_per_example(model, source.input_shape)
        layers = tuple(_layer_cost(layer, output, flops, kept, split, kept_remat) for layer, output in outputs)
        compute_dtype = keras.mixed_precision.dtype_policy().compute_dtype
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    return ModelProfile(name=model.name, layers=layers, slot_bytes=slot_bytes, optimizer=type(optimizer).__name__,
                        compute_dtype=compute_dtype)


def _kept_per_example(model, input_shape, kept_one=None) -> dict:
    """What the backward pass keeps per example, by top-level layer: what grows from 1 example to 2."""
    import tensorflow as tf

    one = kept_one if kept_one is not None else _traced_step(model, tf.TensorSpec((1, *input_shape), "float32"))[1]
    two = _traced_step(model, tf.TensorSpec((2, *input_shape), "float32"))[1]
    return {name: two.get(name, 0) - one.get(name, 0) for name in two}


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


def _split_paths(config, model) -> set:
    """The paths of the variables `config`'s layout splits (none for another kind).

    Raises:
      ConfigError: a layout that does not fit the model, as `tfdist train` would say it.
    """
    if config.strategy.kind != "layout":
        return set()
    from tfdist.errors import ConfigError
    from tfdist.parallel.layout import LayoutError
    from tfdist.strategies.factory import layout_of

    places = config.layout.data_devices * config.layout.model_devices
    layout, key = layout_of(config, [f"/cpu:{i}" for i in range(places)])  # the mesh's names; nothing runs on it
    try:
        return set(layout.axes_of(model))
    except LayoutError as error:
        raise ConfigError(key, f"does not fit the model: {error}") from None


def _layer_cost(layer, output, flops: dict, kept: dict, split: set, kept_remat: dict) -> LayerCost:
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
        kept_bytes_per_example=kept.get(layer.name, 0),
        tensor_parallel=isinstance(layer, parallel),
        trainable_variables=len(layer.trainable_weights),
        split_bytes=sum(_nbytes(v) for v in layer.trainable_weights if v.path in split),
        kept_bytes_per_example_remat=kept_remat.get(layer.name, 0),
    )


def kept_bytes(model, spec) -> int:
    """The bytes of forward tensors one training step's backward pass reads (what it keeps), traced on inputs
    of `spec` (a `tf.TensorSpec`, or a structure of them as the model takes); nothing runs."""
    return sum(_traced_step(model, spec)[1].values())


def _traced_step(model, spec) -> tuple[dict[str, float], dict[str, int]]:
    """(forward FLOPs, bytes kept for the backward pass) by top-level layer name, from one training
    step's gradient traced on inputs of `spec` (nothing runs).

    An op belongs to the top-level layer whose `call` created it: each layer's call is wrapped while
    tracing to take the ops it adds to the graph (name scopes would not do: a second trace renames
    them, `conv2d` to `conv2d_1`, the next layer's name). An op's FLOPs are what TensorFlow's
    statistics say (as its profiler counts them), an einsum's (which they leave out) 2 x the product
    of its index sizes. A layer keeps the tensors of its forward ops that the gradient's ops read
    (the model's input counts as the first layer's).
    """
    import tensorflow as tf

    owners: dict[str, str] = {}  # op name: the top-level layer whose call created it

    def owning(layer):
        original = layer.call

        def call(*args, **kwargs):
            graph = tf.compat.v1.get_default_graph()  # the function's graph being traced
            first = len(graph.get_operations())
            outputs = original(*args, **kwargs)
            for op in graph.get_operations()[first:]:
                owners.setdefault(op.name, layer.name)
            return outputs

        return call

    def step(inputs):
        with tf.GradientTape() as tape:
            outputs = model(inputs, training=True)
            loss = tf.add_n([tf.reduce_sum(tf.cast(t, "float32")) for t in tf.nest.flatten(outputs)])
        forward_ops = len(tf.compat.v1.get_default_graph().get_operations())
        return tape.gradient(loss, model.trainable_variables), forward_ops

    traced = {}
    own = {layer: layer.__dict__.get("call") for layer in model.layers}  # a call of its own (recomputed) stays
    for layer in model.layers:
        layer.call = owning(layer)
    try:
        graph = tf.function(lambda x: traced.setdefault("step", step(x))[0]).get_concrete_function(spec).graph
    finally:
        for layer, call in own.items():
            if call is None:
                del layer.call  # the class's own again
            else:
                layer.call = call
    operations = graph.get_operations()
    forward, backward = operations[:traced["step"][1]], operations[traced["step"][1]:]
    first_layer = next((layer.name for layer in model.layers if layer.name in owners.values()), "")
    flops: dict[str, float] = {}
    for op in forward:
        if op.name in owners:
            flops[owners[op.name]] = flops.get(owners[op.name], 0.0) + _op_flops(graph, op)
    forward_names = {op.name for op in forward}
    kept: dict[str, int] = {}
    read = {t.name: t for op in backward for t in op.inputs if t.op.name in forward_names}
    for tensor in read.values():
        if tensor.op.type in ("ReadVariableOp", "Const") or not tensor.shape.is_fully_defined():
            continue  # the weights (counted as weights), constants
        layer = owners.get(tensor.op.name, first_layer)
        kept[layer] = kept.get(layer, 0) + tensor.shape.num_elements() * tensor.dtype.size
    return flops, kept


def _op_flops(graph, op) -> float:
    if op.type == "Einsum":
        inputs, _ = op.get_attr("equation").decode().split("->")
        sizes = {}
        for letters, tensor in zip(inputs.split(","), op.inputs):
            sizes.update(zip(letters, tensor.shape))
        return 2.0 * math.prod(sizes.values())
    return _compat.op_flops(graph, op)
