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
alone. The first then keeps its output split, the second takes it as it is,
and the pair costs one sum forward (the second's) and one backward (the first's
`copy`). Two pairings are known to be safe: a column-split layer whose output
only a row-split layer consumes (`Pairing`, from a functional model's graph),
and a `MultiHeadAttention` whose query, key, value and output kernels are all
split on the heads (`split_attention_call`: each replica attends with its own
heads, and an input that the query, key and value share is copied once).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import threading
from typing import Callable, Optional

import keras
import tensorflow as tf

from tfdist.contract import contract

__all__ = ["SPLIT_LAYERS", "Pairing", "copy", "gather", "in_replica", "reduce", "scatter", "split_attention_call",
           "split_call"]


@dataclasses.dataclass(frozen=True)
class Pairing:
    """How a split layer meets its neighbours in a Megatron pair.

    Attributes:
      keeps_shards: the output keeps this replica's part of a split axis (its consumer contracts it).
      takes_shards: the input is already this replica's part of the axis the layer contracts.
    """

    keeps_shards: bool = False
    takes_shards: bool = False


UNPAIRED = Pairing()
_IN_BLOCK = Pairing(keeps_shards=True, takes_shards=True)


class _Block(threading.local):
    """The paired block (a split `MultiHeadAttention`) this replica's thread is computing, if any: its inputs'
    copies, so that an input that several projections share is copied (summed backward) once."""

    def __init__(self):
        self.copies: Optional[dict] = None


_block = _Block()


@contextlib.contextmanager
def _paired_block():
    _block.copies = {}
    try:
        yield
    finally:
        _block.copies = None


def _copied(x: tf.Tensor) -> tf.Tensor:
    if _block.copies is None:
        return copy(x)
    if id(x) not in _block.copies:
        _block.copies[id(x)] = (x, copy(x))  # holds `x`, so that its id is not reused
    return _block.copies[id(x)][1]


def _groups():
    """The mesh's collectives (`MeshGroups`) of the strategy of the current replica, if it splits a model."""
    context = tf.distribute.get_replica_context()
    return None if context is None else contract(context.strategy).mesh_groups


def in_replica() -> bool:
    """Whether this runs in a replica of a strategy that splits a model (where a split variable reads as this
    replica's shard)."""
    groups = _groups()
    return groups is not None and groups.model > 1


def _part(t: tf.Tensor, axis: int) -> tf.Tensor:
    groups = _groups()
    return tf.split(t, groups.model, axis=axis)[groups.model_index()]


def _concatenated(t: tf.Tensor, axis: int) -> tf.Tensor:
    groups = _groups()
    axis %= t.shape.rank
    whole = groups.model_gather(t, axis)
    whole.set_shape(t.shape[:axis].concatenate([t.shape[axis] * groups.model]).concatenate(t.shape[axis + 1:]))
    return whole


@tf.custom_gradient
def copy(t: tf.Tensor):
    return tf.identity(t), lambda dy: _groups().model_sum(dy)


@tf.custom_gradient
def reduce(t: tf.Tensor):
    return _groups().model_sum(t), lambda dy: dy


def gather(t: tf.Tensor, axis: int) -> tf.Tensor:
    @tf.custom_gradient
    def gathered(t):
        return _concatenated(t, axis), lambda dy: _part(dy, axis)
    return gathered(t)


def scatter(t: tf.Tensor, axis: int) -> tf.Tensor:
    @tf.custom_gradient
    def scattered(t):
        return _part(t, axis), lambda dy: _concatenated(dy, axis)
    return scattered(t)


def _value(variable, axis: Optional[int], needed: Optional[int]) -> tf.Tensor:
    """A variable as the computation needs it: split along `needed` (None: whole), from its own split `axis`."""
    value = tf.convert_to_tensor(variable)
    if axis == needed:
        return value
    whole = value if axis is None else gather(value, axis)
    return whole if needed is None else scatter(whole, needed)


def _contract(equation: str, x, kernel, kernel_axis: int, pairing: Pairing = UNPAIRED):
    """`einsum(equation, x, kernel)` with `kernel` this replica's shard along `kernel_axis`, and where the output
    keeps that axis (None: the layer contracted it, and the partial results are summed over the replicas)."""
    x = tf.convert_to_tensor(x)
    equation = _without_ellipsis(equation, x.shape.rank)
    in_spec, rest = equation.split(",")
    kernel_spec, out_spec = rest.split("->")
    letter = kernel_spec[kernel_axis]
    if letter not in in_spec:
        x = _copied(x)
    elif not pairing.takes_shards:
        x = scatter(x, in_spec.index(letter) - len(in_spec))
    y = tf.einsum(equation, x, tf.convert_to_tensor(kernel))
    if letter in out_spec:
        return y, out_spec.index(letter) - len(out_spec)
    return reduce(y), None


def _without_ellipsis(equation: str, rank: int) -> str:
    """`equation` with its `...` spelled out for an input of `rank`: TensorFlow's einsum gradient with an
    ellipsis that the kernel lacks builds the outer product of every axis before summing it (an 8 GiB tensor
    for a (8, 128, 512) input and a (4096, 512) table)."""
    if "..." not in equation:
        return equation
    free = [c for c in "zyxwvutsrqponmlkjihgfedcba" if c not in equation]
    return equation.replace("...", "".join(free[: rank - (len(equation.split(",")[0]) - 3)]))


def _einsum(layer, axes: dict[str, Optional[int]], equation: str, inputs, kernel_name: str, pairing: Pairing):
    """An einsum layer's output with its kernel split along `axes[kernel_name]`: the letter of that axis
    decides the collectives (kept in the output: gathered, unless its consumer takes shards; contracted:
    summed)."""
    y, out_axis = _contract(equation, inputs, getattr(layer, kernel_name), axes[kernel_name], pairing)
    bias = getattr(layer, "bias", None)
    if bias is not None:  # aligned with the output's last axes, of size 1 where it broadcasts
        rank = len(bias.shape)
        bias_axis = None if axes.get("bias") is None else axes["bias"] - rank
        spans = out_axis is not None and out_axis >= -rank and bias.shape[out_axis] > 1
        y = y + _value(bias, bias_axis, out_axis if spans else None)
    if layer.activation is not None:
        y = layer.activation(y)
    return y if out_axis is None or pairing.keeps_shards else gather(y, out_axis)


def _dense(layer, axes, inputs, pairing, **unused):
    return _einsum(layer, axes, "...a,ab->...b", inputs, "kernel", pairing)


def _einsum_dense(layer, axes, inputs, pairing, **unused):
    return _einsum(layer, axes, re.sub(r"\s", "", layer.equation), inputs, "kernel", pairing)


def _embedding(layer, axes, inputs, pairing, reverse=False):
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
    if layer.reverse_dtype is not None:
        inputs, kernel = tf.cast(inputs, layer.reverse_dtype), tf.cast(kernel, layer.reverse_dtype)
    if axis is None:
        inputs = tf.convert_to_tensor(inputs)
        equation = _without_ellipsis(equation, inputs.shape.rank)
        logits, out_axis = tf.einsum(equation, inputs, tf.convert_to_tensor(kernel)), None
    else:
        logits, out_axis = _contract(equation, inputs, kernel, axis)
    if layer.logit_soft_cap is not None:
        logits = tf.tanh(logits / layer.logit_soft_cap) * layer.logit_soft_cap
    return logits if out_axis is None else gather(logits, out_axis)


# The layers whose variables a layout may split, and the variable each call splits by.
SPLIT_LAYERS: dict[type, tuple[str, Callable]] = {
    keras.layers.Dense: ("kernel", _dense),
    keras.layers.EinsumDense: ("kernel", _einsum_dense),
    keras.layers.Embedding: ("embeddings", _embedding),
}


def split_call(layer: keras.layers.Layer, axes: dict[str, Optional[int]], pairing: Pairing = UNPAIRED) -> Callable:
    """The call of `layer` with its variables split as `axes` says (attribute -> split axis or None); in a
    replica of several, on this replica's shards, else `layer`'s own call on whole weights. `pairing`: how it
    meets its neighbours (in a paired block, as the block says).

    Raises:
      ValueError: a layer of a kind `SPLIT_LAYERS` does not cover, or whose main variable is whole while
        another is split.
    """
    kind = next((k for k in type(layer).__mro__ if k in SPLIT_LAYERS), None)
    if kind is None:
        raise ValueError(f"Layer {layer.name!r} ({type(layer).__name__}) has split variables, and only "
                         f"{', '.join(k.__name__ for k in SPLIT_LAYERS)} layers can be split in this version.")
    main, compute = SPLIT_LAYERS[kind]
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        raise ValueError(f"Layer {layer.name!r} is quantized or has LoRA weights; split it before either.")
    if axes.get(main) is None:
        raise ValueError(f"Layer {layer.name!r} splits {', '.join(a for a, x in axes.items() if x is not None)} "
                         f"but not its {main}; split the {main} (the bias follows it).")
    own_call = layer.call

    def call(inputs, *args, **kwargs):
        if not in_replica():
            return own_call(inputs, *args, **kwargs)
        return compute(layer, axes, inputs, _IN_BLOCK if _block.copies is not None else pairing, **kwargs)

    return call


def split_attention_call(layer: keras.layers.MultiHeadAttention) -> Callable:
    """The call of a `MultiHeadAttention` whose query, key, value and output kernels are split on the heads
    (`split_call` each): in a replica, each replica attends with its own heads between one copy of each input
    and one sum of the output (unless asked for the attention scores, which need every head)."""
    own_call = layer.call

    def call(*args, **kwargs):
        if not in_replica() or kwargs.get("return_attention_scores"):
            return own_call(*args, **kwargs)
        with _paired_block():
            return own_call(*args, **kwargs)

    return call
