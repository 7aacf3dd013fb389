"""A model split over the model axis, run SPMD: every replica runs the whole model, a split layer its shard.

Under `tfdist.LayoutStrategy` each replica runs the unchanged model on its
device, and a split variable's value in a replica is that replica's shard
(Megatron's scheme, with the layout saying which variables are split). Where a
split layer meets the replicated rest of the model, one of four collectives
joins them, each with the gradient that keeps every replicated tensor's
gradient whole and equal on every replica:

- `copy`: identity forward, the replicas' gradients summed backward (a
  replicated input to a layer whose output is split: each shard's part of the
  input's gradient);
- `reduce`: the replicas' partial results summed forward, identity backward
  (a split axis the layer contracts);
- `gather`: the shards concatenated forward, this replica's part of the
  gradient backward (a split axis kept in the output);
- `scatter`: this replica's part forward, the parts' gradients concatenated
  backward (a replicated tensor meeting a split axis).

`split_call(layer, axes)` is the call of a `Dense`, `EinsumDense` or
`Embedding` whose variables `axes` says are split. Outside a replica (Keras
building the model symbolically), the layer computes on whole weights.

Megatron's pairs: a layer that splits its output's axis (a column split)
followed by one that contracts that axis (a row split) need neither the gather
nor the scatter between them, when what runs between them works on each part
alone. The first then keeps its output split (`keeps_shards`), the second
takes an input whose contracted axis has a shard's length as it is (a whole
input has the whole length, so the shape tells), and the pair costs one sum
forward (the second's) and one backward (the first's `copy`). Which layers may
keep their shards is `tfdist.parallel.megatron_pairs`'s to say: in a paired
block (`split_block_call`) every column-split layer keeps them, and an input
that several of them share is copied once.
"""

from __future__ import annotations

import contextlib
import re
import threading
from typing import Callable, Optional

import keras
import tensorflow as tf

from tfdist import _compat
from tfdist.contract import contract

__all__ = ["SPLIT_LAYERS", "block_state", "copy", "einsum_parts", "elementwise", "gather", "in_replica",
           "layer_equation", "reduce", "scatter", "split_block_call", "split_call"]


class _Block(threading.local):
    """The paired block this replica's thread is computing, if any: its inputs' copies and scatters, so that an
    input several split layers share is copied or scattered (and its gradient summed or gathered) once."""

    def __init__(self):
        self.made: Optional[dict] = None
        self.divided: dict = {}  # (sublayer, attribute) -> its count while the block computes on its part


_block = _Block()


@contextlib.contextmanager
def _paired_block(divided: dict):
    """Within: computing a paired block, its sublayers' `divided` attributes set to this replica's part."""
    outer, counts = (_block.made, _block.divided), {key: getattr(*key) for key in divided}
    _block.made, _block.divided = {}, divided
    for (layer, name), count in divided.items():
        setattr(layer, name, count)
    try:
        yield
    finally:
        for (layer, name), count in counts.items():
            setattr(layer, name, count)
        _block.made, _block.divided = outer


def block_state() -> Callable:
    """A context manager factory that enters again the paired block this thread computes in now, if any: a
    layer recomputed in the backward pass (`recompute`) runs outside its block, and must compute as inside."""
    inside, divided = _block.made is not None, dict(_block.divided)
    return (lambda: _paired_block(divided)) if inside else contextlib.nullcontext


def _once_in_block(collective: Callable, x: tf.Tensor, *args) -> tf.Tensor:
    """`collective(x, *args)`, made once per block for each input and arguments (its gradient then sums the
    block's uses of it before its own collective runs)."""
    if _block.made is None:
        return collective(x, *args)
    key = (collective, id(x), *args)
    if key not in _block.made:
        _block.made[key] = (x, collective(x, *args))  # holds `x`, so that its id is not reused
    return _block.made[key][1]


def _groups():
    """The mesh's collectives (`MeshGroups`) of the strategy of the current replica, if it splits a model."""
    context = tf.distribute.get_replica_context()
    return None if context is None else contract(context.strategy).mesh_groups


def in_replica() -> bool:
    """Whether this runs in a replica of a strategy that splits a model (where a split variable reads as this
    replica's shard)."""
    groups = _groups()
    return groups is not None and groups.model > 1


def _part(groups, t: tf.Tensor, axis: int) -> tf.Tensor:
    return tf.split(t, groups.model, axis=axis)[groups.model_index()]


def _concatenated(groups, t: tf.Tensor, axis: int) -> tf.Tensor:
    axis %= t.shape.rank
    whole = groups.model_gather(t, axis)
    whole.set_shape(t.shape[:axis].concatenate([t.shape[axis] * groups.model]).concatenate(t.shape[axis + 1:]))
    return whole


# Each collective's gradient runs in the groups of its forward pass (a pipeline stage's own, say), whatever is in
# scope when the gradient is taken.
def copy(t: tf.Tensor) -> tf.Tensor:
    groups = _groups()

    @tf.custom_gradient
    def copied(t):
        return tf.identity(t), groups.model_sum
    return copied(t)


def reduce(t: tf.Tensor) -> tf.Tensor:
    groups = _groups()

    @tf.custom_gradient
    def reduced(t):
        return groups.model_sum(t), lambda dy: dy
    return reduced(t)


def gather(t: tf.Tensor, axis: int) -> tf.Tensor:
    groups = _groups()

    @tf.custom_gradient
    def gathered(t):
        return _concatenated(groups, t, axis), lambda dy: _part(groups, dy, axis)
    return gathered(t)


def scatter(t: tf.Tensor, axis: int) -> tf.Tensor:
    groups = _groups()

    @tf.custom_gradient
    def scattered(t):
        return _part(groups, t, axis), lambda dy: _concatenated(groups, dy, axis)
    return scattered(t)


def _value(variable, axis: Optional[int], needed: Optional[int]) -> tf.Tensor:
    """A variable as the computation needs it: split along `needed` (None: whole), from its own split `axis`."""
    value = tf.convert_to_tensor(variable)
    if axis == needed:
        return value
    whole = value if axis is None else gather(value, axis)
    return whole if needed is None else scatter(whole, needed)


def _contract(equation: str, x, kernel, kernel_axis: int):
    """`einsum(equation, x, kernel)` with `kernel` this replica's shard along `kernel_axis`, and where the output
    keeps that axis (None: the layer contracted it, and the partial results are summed over the replicas). An
    input whose contracted axis has the shard's length is this replica's part already."""
    x = tf.convert_to_tensor(x)
    equation = _without_ellipsis(equation, x.shape.rank)
    in_spec, kernel_spec, out_spec = einsum_parts(equation)
    letter = kernel_spec[kernel_axis]
    if letter not in in_spec:
        x = _once_in_block(copy, x)
    kernel = tf.convert_to_tensor(kernel)  # this replica's shard
    if letter in in_spec and x.shape[in_spec.index(letter)] == kernel.shape[kernel_axis] * _groups().model:
        x = _once_in_block(scatter, x, in_spec.index(letter) - len(in_spec))  # whole: this replica's part of it
    y = _product(equation, x, kernel)
    if letter in out_spec:
        return y, out_spec.index(letter) - len(out_spec)
    return reduce(y), None


def _product(equation: str, x: tf.Tensor, kernel: tf.Tensor) -> tf.Tensor:
    """`einsum(equation, x, kernel)`, as a matmul where it is one (a Dense layer's: TensorFlow's einsum is
    slower there), else as an einsum."""
    in_spec, kernel_spec, out_spec = einsum_parts(equation)
    if len(kernel_spec) == 2 and in_spec[-1] == kernel_spec[0] and out_spec == in_spec[:-1] + kernel_spec[1]:
        return tf.tensordot(x, kernel, axes=1) if x.shape.rank > 2 else tf.linalg.matmul(x, kernel)
    return tf.einsum(equation, x, kernel)


def layer_equation(layer) -> Optional[str]:
    """The einsum a `Dense` or `EinsumDense` layer computes with its kernel, else None."""
    if isinstance(layer, keras.layers.EinsumDense):
        return re.sub(r"\s", "", layer.equation)
    return "...a,ab->...b" if isinstance(layer, keras.layers.Dense) else None


def einsum_parts(equation: str) -> tuple[str, str, str]:
    """The (input, kernel, output) letters of a two-operand einsum equation."""
    inputs, rest = equation.split(",")
    kernel, output = rest.split("->")
    return inputs, kernel, output


def _without_ellipsis(equation: str, rank: int) -> str:
    """`equation` with its `...` spelled out for an input of `rank`: TensorFlow's einsum gradient with an
    ellipsis that the kernel lacks builds the outer product of every axis before summing it (an 8 GiB tensor
    for a (8, 128, 512) input and a (4096, 512) table)."""
    if "..." not in equation:
        return equation
    free = [c for c in "zyxwvutsrqponmlkjihgfedcba" if c not in equation]
    return equation.replace("...", "".join(free[: rank - (len(equation.split(",")[0]) - 3)]))


def _einsum(layer, axes: dict[str, Optional[int]], equation: str, inputs, kernel_name: str, keeps_shards: bool):
    """An einsum layer's output with its kernel split along `axes[kernel_name]`: the letter of that axis
    decides the collectives (kept in the output: gathered, unless the layer `keeps_shards`; contracted:
    summed)."""
    kernel = _lora_kernel(layer, axes) if getattr(layer, "lora_enabled", False) else getattr(layer, kernel_name)
    y, out_axis = _contract(equation, inputs, kernel, axes[kernel_name])
    bias = getattr(layer, "bias", None)
    if bias is not None:  # aligned with the output's last axes, of size 1 where it broadcasts
        rank = len(bias.shape)
        bias_axis = None if axes.get("bias") is None else axes["bias"] - rank
        spans = out_axis is not None and out_axis >= -rank and bias.shape[out_axis] > 1
        y = y + _value(bias, bias_axis, out_axis if spans else None)
    if layer.activation is not None and out_axis is not None and not elementwise(layer.activation):
        y, out_axis = gather(y, out_axis), None  # a softmax, say, needs the whole axis
    if layer.activation is not None:
        y = layer.activation(y)
    return y if out_axis is None or keeps_shards else gather(y, out_axis)


def lora_axes(layer, kernel_axis: Optional[int]) -> dict[str, Optional[int]]:
    """How a LoRA layer's factors split with its kernel along `kernel_axis`: the kernel is `lora_kernel_a` (the
    kernel's shape but its last axis, then the rank) times `lora_kernel_b` (the rank, then the kernel's last axis),
    so the factor that has the kernel's split axis splits along it and the other stays whole."""
    if kernel_axis is None:
        return {"lora_kernel_a": None, "lora_kernel_b": None}
    last = kernel_axis % len(layer.lora_kernel_a.shape) == len(layer.lora_kernel_a.shape) - 1
    return {"lora_kernel_a": None if last else kernel_axis, "lora_kernel_b": 1 if last else None}


def _lora_kernel(layer, axes: dict[str, Optional[int]]) -> tf.Tensor:
    """This replica's shard of a LoRA layer's kernel, as Keras computes the whole: its own kernel's shard plus the
    scaled product of the factors, one of them this replica's shard (`lora_axes`). The whole factor is copied:
    each replica's gradient of it is the part its shard of the product gives, summed over the replicas."""
    factor_axes = lora_axes(layer, axes["kernel"])  # now: the layer may have had LoRA enabled since it was split
    a, b = (tf.convert_to_tensor(getattr(layer, name)) if factor_axes[name] is not None else copy(
        tf.convert_to_tensor(getattr(layer, name))) for name in ("lora_kernel_a", "lora_kernel_b"))
    delta = (layer.lora_alpha / layer.lora_rank) * keras.ops.matmul(a, b)
    return keras.ops.cast(tf.convert_to_tensor(_compat.stored_kernel(layer)) + delta, layer.compute_dtype)


def elementwise(activation) -> bool:
    """Whether a Keras activation acts on each element alone (not `softmax`, `log_softmax`, `glu`,
    `sparsemax`), so that it may act on a shard."""
    return getattr(activation, "__name__", "") not in ("softmax", "log_softmax", "glu", "sparsemax")


def _dense(layer, axes, inputs, keeps_shards, **unused):  # Dense and EinsumDense
    return _einsum(layer, axes, layer_equation(layer), inputs, "kernel", keeps_shards)


def _embedding(layer, axes, inputs, keeps_shards, reverse=False):
    if reverse:
        return _reverse_embedding(layer, axes, inputs)
    ids = tf.cast(inputs, "int32") if inputs.dtype not in (tf.int32, tf.int64) else inputs
    table = tf.convert_to_tensor(layer.embeddings)
    if axes["embeddings"] == 1:  # each replica its slice of every row
        return tf.cast(gather(tf.gather(table, ids), -1), layer.compute_dtype)
    rows = table.shape[0]  # this replica's rows: the ids of its range, the others zero, summed over replicas
    local = ids - _groups().model_index() * rows
    inside = tf.logical_and(local >= 0, local < rows)
    found = tf.gather(table, tf.where(inside, local, tf.zeros_like(local)))
    return tf.cast(reduce(found * tf.cast(inside, found.dtype)[..., None]), layer.compute_dtype)


def _reverse_embedding(layer, axes, inputs):
    """A `ReversibleEmbedding`'s logits, `inputs` times the transposed table (or its own reverse table)."""
    if layer.tie_weights:
        kernel, axis, equation = layer.embeddings, axes["embeddings"], "...a,ba->...b"
    elif axes.get("reverse_embeddings") is not None:
        kernel, axis, equation = layer.reverse_embeddings, axes["reverse_embeddings"], "...a,ab->...b"
    else:  # the table is split and its own reverse table whole: every replica computes the whole logits
        kernel, axis, equation = layer.reverse_embeddings, None, "...a,ab->...b"
    # Keras's matmul promotes the two (mixed precision's bfloat16 inputs and the table, which an embedding reads
    # uncast, give float32 logits), or casts both to `reverse_dtype`.
    dtype = layer.reverse_dtype or keras.backend.result_type(tf.convert_to_tensor(inputs).dtype.name, kernel.dtype)
    inputs, kernel = tf.cast(inputs, dtype), tf.cast(kernel, dtype)
    if axis is None:
        inputs = tf.convert_to_tensor(inputs)
        equation = _without_ellipsis(equation, inputs.shape.rank)
        logits, out_axis = _product(equation, inputs, tf.convert_to_tensor(kernel)), None
    else:
        logits, out_axis = _contract(equation, inputs, kernel, axis)
    if layer.logit_soft_cap is not None:
        logits = tf.tanh(logits / layer.logit_soft_cap) * layer.logit_soft_cap
    return logits if out_axis is None else gather(logits, out_axis)


# The layers whose variables a layout may split, and the variable each call splits by.
SPLIT_LAYERS: dict[type, tuple[str, Callable]] = {
    keras.layers.Dense: ("kernel", _dense),
    keras.layers.EinsumDense: ("kernel", _dense),
    keras.layers.Embedding: ("embeddings", _embedding),
}


def split_call(layer: keras.layers.Layer, axes: dict[str, Optional[int]], keeps_shards: bool = False) -> Callable:
    """The call of `layer` with its variables split as `axes` says (attribute -> split axis or None); in a
    replica of several, on this replica's shards, else `layer`'s own call on whole weights. `keeps_shards`:
    a column-split layer returns this replica's part of its output (as every one does in a paired block).

    Raises:
      ValueError: a layer of a kind `SPLIT_LAYERS` does not cover, or whose main variable is whole while
        another is split.
    """
    kind = next((k for k in type(layer).__mro__ if k in SPLIT_LAYERS), None)
    if kind is None:
        raise ValueError(f"Layer {layer.name!r} ({type(layer).__name__}) has split variables, and only "
                         f"{', '.join(k.__name__ for k in SPLIT_LAYERS)} layers can be split in this version.")
    main, compute = SPLIT_LAYERS[kind]
    if getattr(layer, "quantization_mode", None):
        raise ValueError(f"Layer {layer.name!r} is quantized; split it before quantizing.")
    if axes.get(main) is None:
        raise ValueError(f"Layer {layer.name!r} splits {', '.join(a for a, x in axes.items() if x is not None)} "
                         f"but not its {main}; split the {main} (the bias follows it).")
    own_call = layer.call

    def call(inputs, *args, **kwargs):
        if not in_replica():
            return own_call(inputs, *args, **kwargs)
        return compute(layer, axes, inputs, keeps_shards or _block.made is not None, **kwargs)

    return call


def split_block_call(block: keras.layers.Layer, divided: Optional[dict] = None, model: int = 1) -> Callable:
    """The call of a layer whose split layers pass shards among themselves (a paired block): in a replica,
    every column-split layer inside keeps its shards, and an input several of them share is copied once.
    `divided`: sublayer -> its attributes that count what is split (heads), divided by `model` meanwhile,
    since the block now computes on this replica's part. Asked for attention scores (which need every head),
    a block computes as a split layer alone would."""
    own_call = block.call
    divided = divided or {}

    def call(*args, **kwargs):
        if not in_replica() or kwargs.get("return_attention_scores"):
            return own_call(*args, **kwargs)
        with _paired_block({(layer, name): getattr(layer, name) // model
                            for layer, names in divided.items() for name in names}):
            return own_call(*args, **kwargs)

    return call
