"""Which split layers of a model can pass shards to each other (Megatron's pairs; see `tfdist.parallel.spmd`).

A column-split layer (its kernel split on an axis its output keeps) and a
row-split layer (split on an axis it contracts) that consumes the first's
output skip the gather and the scatter between them, when nothing between them
needs the whole axis. Two shapes are known to be safe:

- in a functional or Sequential model, a column-split `Dense` or `EinsumDense`
  whose output only a row-split one consumes, the kept axis being the one
  contracted (`functional_pairs`);
- a `MultiHeadAttention` whose query, key and value kernels are split on their
  heads and whose output kernel is split on its heads (`paired_attentions`):
  attention works on each head alone.
"""

from __future__ import annotations

import re
from typing import Optional

import keras

from tfdist import _compat
from tfdist.parallel.spmd import Pairing

__all__ = ["functional_pairs", "paired_attentions"]


def _spec(layer) -> Optional[tuple[str, str, str]]:
    """The einsum of a Dense or EinsumDense layer as (input, kernel, output) letters, else None."""
    if isinstance(layer, keras.layers.EinsumDense):
        inputs, rest = re.sub(r"\s", "", layer.equation).split(",")
        return (inputs, *rest.split("->"))
    if isinstance(layer, keras.layers.Dense):
        return "...a", "ab", "...b"
    return None


def _kept_axis(layer, axes) -> Optional[int]:
    """The output axis (negative) that keeps `layer`'s kernel split, if it is column-split."""
    spec = _spec(layer)
    if spec is None or axes.get("kernel") is None:
        return None
    letter = spec[1][axes["kernel"]]
    return spec[2].index(letter) - len(spec[2]) if letter in spec[2] else None


def _contracted_axis(layer, axes) -> Optional[int]:
    """The input axis (negative) `layer` contracts with its kernel's split axis, if it is row-split."""
    spec = _spec(layer)
    if spec is None or axes.get("kernel") is None:
        return None
    letter = spec[1][axes["kernel"]]
    if letter in spec[2] or letter not in spec[0]:
        return None
    return spec[0].index(letter) - len(spec[0])


def functional_pairs(model: keras.Model, axes_by_layer: dict) -> dict:
    """Layer -> `Pairing` for the pairs of `model`'s own layer graph (none for a subclassed model).

    `axes_by_layer`: each split layer's variables' split axes (attribute -> axis or None)."""
    try:
        nodes, _, _ = _compat.graph_nodes(model)
    except ValueError:  # subclassed: no graph to read
        return {}
    calls, consumers = {}, {}
    for operation, inputs, outputs in nodes:
        calls[id(operation)] = calls.get(id(operation), 0) + 1
        for tensor in inputs:
            consumers.setdefault(id(tensor), []).append((operation, inputs))
    keeps, takes = set(), set()
    for operation, _, outputs in nodes:
        axes = axes_by_layer.get(operation)
        kept = None if axes is None else _kept_axis(operation, axes)
        if kept is None or calls[id(operation)] != 1 or len(outputs) != 1:
            continue
        consumed_by = consumers.get(id(outputs[0]), [])
        if len(consumed_by) != 1:
            continue
        consumer, consumer_inputs = consumed_by[0]
        consumer_axes = axes_by_layer.get(consumer)
        if (consumer_axes is None or calls[id(consumer)] != 1 or len(consumer_inputs) != 1
                or _contracted_axis(consumer, consumer_axes) != kept):
            continue
        keeps.add(operation)
        takes.add(consumer)
    return {layer: Pairing(keeps_shards=layer in keeps, takes_shards=layer in takes) for layer in keeps | takes}


def paired_attentions(layers, axes_by_layer: dict) -> list:
    """The `MultiHeadAttention` layers among `layers` whose projections are all split on the heads."""
    paired = []
    for layer in layers:
        if not isinstance(layer, keras.layers.MultiHeadAttention):
            continue
        *projections, output = _compat.attention_projections(layer)
        heads_in = [axes_by_layer.get(p, {}).get("kernel") for p in projections]
        heads_out = axes_by_layer.get(output, {}).get("kernel")
        if heads_in == [1, 1, 1] and heads_out == 0:  # kernels (model, heads, size) and (heads, size, model)
            paired.append(layer)
    return paired
