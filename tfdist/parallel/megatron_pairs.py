"""Which split layers of a model may keep their outputs split for the layer that contracts them (Megatron's
pairs; `tfdist.parallel.spmd` says how they compute).

A column-split layer (its kernel split on an axis its output keeps) and a
row-split layer (split on an axis it contracts) that consumes the first's
output skip the gather and the scatter between them, when nothing between them
needs the whole axis. Three shapes are known to be safe:

- in a functional or Sequential model, a column-split `Dense` or `EinsumDense`
  whose output only a row-split one consumes, the kept axis being the one
  contracted (`functional_pairs`);
- a `MultiHeadAttention` whose query, key and value kernels are split on their
  heads and whose output kernel is split on its heads (`paired_blocks`):
  attention works on each head alone;
- keras-hub's decoder blocks of `KNOWN_BLOCKS`, whose split layers are all
  column- or row-split (`paired_blocks`): what runs between their projections
  (rotary embeddings, attention per head, the gated activation) works on each
  head or hidden unit alone.
"""

from __future__ import annotations

from typing import Optional

import keras

from tfdist import _compat
from tfdist.errors import LayoutError
from tfdist.parallel.spmd import einsum_parts, elementwise, layer_equation

__all__ = ["KNOWN_BLOCKS", "functional_pairs", "megatron_axes", "paired_blocks"]

# keras-hub's decoder blocks that may compute on shards, by class name, each with the attributes its attention
# layer counts heads by (and, for Gemma, the hidden size it divides by them), which a replica divides by the
# model axis while its attention computes on its own heads.
KNOWN_BLOCKS = {
    "GemmaDecoderBlock": ("num_query_heads", "num_key_value_heads", "hidden_dim"),
    "LlamaTransformerDecoder": (),  # its attention counts heads by their ratio alone
}


def _spec(layer) -> Optional[tuple[str, str, str]]:
    """The einsum of a Dense or EinsumDense layer as (input, kernel, output) letters, else None."""
    equation = layer_equation(layer)
    return None if equation is None else einsum_parts(equation)


def kept_axis(layer, axes) -> Optional[int]:
    """The output axis (negative) that keeps `layer`'s kernel split, if it is column-split (and its activation
    may act on a shard)."""
    spec = _spec(layer)
    if spec is None or axes.get("kernel") is None or not elementwise(getattr(layer, "activation", None)):
        return None
    letter = spec[1][axes["kernel"]]
    return spec[2].index(letter) - len(spec[2]) if letter in spec[2] else None


def contracted_axis(layer, axes) -> Optional[int]:
    """The input axis (negative) `layer` contracts with its kernel's split axis, if it is row-split."""
    spec = _spec(layer)
    if spec is None or axes.get("kernel") is None:
        return None
    letter = spec[1][axes["kernel"]]
    if letter in spec[2] or letter not in spec[0]:
        return None
    return spec[0].index(letter) - len(spec[0])


def functional_pairs(model: keras.Model, axes_by_layer: dict) -> list[tuple]:
    """The (column-split, row-split) layer pairs of `model`'s own layer graph (none for a subclassed model).

    `axes_by_layer`: each split layer's variables' split axes (attribute -> axis or None)."""
    pairs = []
    for operation, consumer in _sole_consumers(model).items():
        if operation not in axes_by_layer or consumer not in axes_by_layer:  # a whole layer
            continue
        kept = kept_axis(operation, axes_by_layer[operation])
        if kept is not None and contracted_axis(consumer, axes_by_layer[consumer]) == kept:
            pairs.append((operation, consumer))
    return pairs


def _sole_consumers(model: keras.Model) -> dict:
    """Each layer of `model`'s own graph (none for a subclassed model) that is called once, with one output,
    which one layer alone consumes, called once on it alone -> that layer."""
    try:
        nodes, _, model_outputs = _compat.graph_nodes(model)
    except ValueError:  # subclassed: no graph to read
        return {}
    calls, consumers = {}, {id(tensor): [(None, [])] for tensor in model_outputs}  # a model output is whole
    for operation, inputs, _ in nodes:
        calls[id(operation)] = calls.get(id(operation), 0) + 1
        for tensor in inputs:
            consumers.setdefault(id(tensor), []).append((operation, inputs))
    sole = {}
    for operation, _, outputs in nodes:
        if calls[id(operation)] != 1 or len(outputs) != 1 or len(consumers.get(id(outputs[0]), [])) != 1:
            continue
        consumer, consumer_inputs = consumers[id(outputs[0])][0]
        if consumer is not None and calls[id(consumer)] == 1 and len(consumer_inputs) == 1:
            sole[operation] = consumer
    return sole


def megatron_axes(model: keras.Model, devices: int) -> dict[str, int]:
    """Megatron-LM's split of `model` over `devices`, found in it: variable path -> split axis.

    Every `MultiHeadAttention` splits on its heads (query, key and value kernels and biases, and the output
    kernel's rows), every `Dense` whose output only another `Dense` consumes (in the model's own graph)
    splits its columns, the other its rows: one sum per block forward; and `tfdist.layers`' Column- and
    RowParallelDense (of a `ParallelMLP` too) split as they say.

    Raises:
      LayoutError: an attention's heads, a pair's hidden units or a declared axis do not divide by `devices`.
    """
    axes = {}
    for layer in _compat.nested_layers(model):
        for name, axis in getattr(layer, "megatron_split", {}).items():  # tfdist.layers' Column/RowParallelDense
            variable = getattr(layer, name, None)
            if variable is not None:
                if variable.shape[axis] % devices:
                    raise LayoutError(f"Layer {layer.name!r} splits axis {axis} of its {name} (shape "
                                      f"{tuple(variable.shape)}) over {devices} devices, which does not divide it.")
                axes[variable.path] = axis
        if isinstance(layer, keras.layers.MultiHeadAttention):
            if layer.num_heads % devices:
                raise LayoutError(f"Layer {layer.name!r} has {layer.num_heads} heads, which do not divide over "
                                  f"{devices} devices.")
            *projections, output = _compat.attention_projections(layer)
            for projection in projections:
                axes[_compat.stored_kernel(projection).path] = 1
                if projection.bias is not None:
                    axes[projection.bias.path] = 0
            axes[_compat.stored_kernel(output).path] = 0
    for column, row in _sole_consumers(model).items():
        if (type(column) is keras.layers.Dense and type(row) is keras.layers.Dense and elementwise(column.activation)
                and _compat.stored_kernel(column).path not in axes):
            if column.units % devices:
                raise LayoutError(f"Layers {column.name!r} and {row.name!r} pass {column.units} hidden units, which "
                                  f"do not divide over {devices} devices.")
            axes[_compat.stored_kernel(column).path], axes[_compat.stored_kernel(row).path] = 1, 0
            if column.bias is not None:
                axes[column.bias.path] = 0
    return axes


def paired_blocks(layers, axes_by_layer: dict) -> dict:
    """The layers among `layers` that compute as paired blocks, each with the attributes of its sublayers to
    divide by the model axis meanwhile (sublayer -> attribute names)."""
    blocks = {}
    for layer in layers:
        if isinstance(layer, keras.layers.MultiHeadAttention):
            *projections, output = _compat.attention_projections(layer)
            heads_in = [axes_by_layer.get(p, {}).get("kernel") for p in projections]
            if heads_in == [1, 1, 1] and axes_by_layer.get(output, {}).get("kernel") == 0:  # (model, heads, size)
                blocks[layer] = {}
        elif type(layer).__name__ in KNOWN_BLOCKS or getattr(layer, "pairs_its_layers", False):
            inside = _compat.nested_layers(layer)
            split = [sub for sub in inside if sub in axes_by_layer]
            if not split or any(kept_axis(s, axes_by_layer[s]) is None and contracted_axis(s, axes_by_layer[s]) is None
                                for s in split):
                continue
            counted = KNOWN_BLOCKS.get(type(layer).__name__, ())
            blocks[layer] = {sub: counted for sub in inside if counted and _computes_on_split_heads(sub, axes_by_layer)
                             and all(hasattr(sub, name) for name in counted)}
    return blocks


def _computes_on_split_heads(attention, axes_by_layer: dict) -> bool:
    """Whether a layer's own projections keep their outputs split (its heads), so that it attends with a
    replica's heads alone."""
    return any(kept_axis(sub, axes_by_layer[sub]) is not None
               for sub in _compat.nested_layers(attention) if sub in axes_by_layer)
