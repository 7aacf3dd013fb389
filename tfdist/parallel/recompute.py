"""Layers whose training step keeps only their inputs: their forward pass runs again in the backward pass.

Rematerialization (Chen et al. 2016) trades one more forward pass of a layer
for the tensors its backward pass would otherwise keep. `recompute(layer)`
wraps the layer's call, in a step that records gradients, in a
`tf.custom_gradient` whose backward pass runs the call again under a tape and
takes the gradients of that second pass. TensorFlow's own `tf.recompute_grad`
does the same but takes no keyword arguments in graph mode (`training=`,
masks: keras-team/keras#21207, which is why `keras.RematScope` fails on the
TensorFlow backend); here they ride along in a closure.

The second pass reads what the first read: a Keras `StatelessScope` gives
every non-trainable variable of the layer (Dropout's seeds, BatchNorm's
statistics) the value it had before the first pass, and drops what the second
pass writes. So a Dropout draws the same mask twice, and BatchNorm's moving
statistics move once. Layers that draw random numbers from Keras's global seed
generator (`keras.random.*` with no seed) would draw new ones: none of Keras's
own layers do.

Weights split over the replicas (`weight_shards`, ZeRO stage 3) are gathered
where a layer reads them; a recomputed layer gathers those of the layers inside
it too, once a pass, and those layers compute inside it unwrapped. A layer that
owns such weights is wrapped too
(`recompute(layer, in_order=True)`), so that its gathered weights are freed after its
forward pass and gathered again in its backward pass, and its gathers are
issued in the layers' order: the forward gather of a layer waits for the
input of the layer before it (one layer ahead: the gather overlaps that
layer's compute), the backward one for the gradient reaching the layer after
it. Without that order TensorFlow would run every gather as early as it can,
and every layer's weights would be whole at once. Likewise every second pass
waits for the backward pass to reach its layer.

`remat(model, "full")` chooses the layers (the config's `train.remat`).

Example:

    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(64, activation="relu"),
    ...                           keras.layers.Dense(1)])
    >>> remat(model, "full")
    ['dense', 'dense_1']
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import keras
import tensorflow as tf

from tfdist import _compat
from tfdist.parallel import spmd, split_variables, weight_shards

__all__ = ["is_recomputed", "recompute", "recompute_again", "remat"]

_WRAPPED = weakref.WeakKeyDictionary()  # each wrapped layer: its own call


def recompute(layer: keras.layers.Layer, *, in_order: bool = False, ahead: bool = True) -> None:
    """Has `layer` keep only its inputs in a training step and run its forward pass again in the backward pass.

    Args:
      layer: a built or unbuilt Keras layer; wrapping it twice changes nothing.
      in_order: issue the gathers of its split weights in the layers' order: its forward pass's wait for the
        previous such layer's input, its backward pass's for the next one's gradient.
      ahead: with `in_order`, one layer ahead as just said (prefetch); False: each gather waits for its own
        layer's input or gradient.
    """
    if is_recomputed(layer):
        _WRAPPED[layer].update(in_order=_WRAPPED[layer]["in_order"] or in_order, ahead=ahead)
        return
    own_call = layer.call
    earlier = _WRAPPED.get(layer, {})
    _WRAPPED[layer] = settings = {"in_order": in_order or earlier.get("in_order", False),
                                  "ahead": earlier.get("ahead", ahead)}

    def call(*args, **kwargs):
        # Inference and Keras's symbolic build keep nothing; inside a recomputed layer its passes cover this one.
        if not _compat.gradients_recorded() or _INSIDE.depth:
            return own_call(*args, **kwargs)
        return _recomputed_call(layer, own_call, settings, args, kwargs)

    call.recomputes = True
    layer.call = call


def recompute_again(layer: keras.layers.Layer) -> None:
    """Wraps `layer`'s call again if it was recomputed and something has since replaced its call (a layout
    splits a layer by giving it a call of its own)."""
    if layer in _WRAPPED and not is_recomputed(layer):
        recompute(layer)


def is_recomputed(layer) -> bool:
    """Whether `layer`'s call is the recomputing one now."""
    return getattr(layer.__dict__.get("call"), "recomputes", False)


def remat(model: keras.Model, layers="full") -> list[str]:
    """Has the chosen layers of `model` recompute their forward pass in the backward pass (`recompute`), under
    any strategy: the layers' calls change, not the model, its weights or what it saves.

    Args:
      model: a built Keras model.
      layers: `"full"` (every layer that holds weights at the model's top level, and inside models nested in
        it, as keras-hub's task models hold their backbone), `"none"`, or a list of layer names and class
        names (a name matches a layer anywhere in the model).

    Returns:
      The names of the layers that now recompute.

    Raises:
      ValueError: `layers` is none of these, or names no layer of the model.
    """
    if layers == "none":
        return []
    if layers == "full":
        chosen = _top_level_with_weights(model)
    elif isinstance(layers, (list, tuple)) and layers and all(isinstance(name, str) for name in layers):
        every = _compat.nested_layers(model)
        chosen = [layer for layer in every if layer.name in layers or type(layer).__name__ in layers]
        unknown = sorted(set(layers) - {layer.name for layer in chosen} - {type(layer).__name__ for layer in chosen})
        if unknown:
            raise ValueError(f"`layers` names no layer or layer class of model {model.name!r}: {', '.join(unknown)}. "
                             f"Its layers: {', '.join(layer.name for layer in every)}.")
    else:
        raise ValueError(f"`layers` must be 'full', 'none' or a list of layer names and class names. "
                         f"Received: {layers!r}")
    for layer in chosen:
        recompute(layer)
    return [layer.name for layer in chosen]


def _top_level_with_weights(model) -> list:
    chosen = []
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            chosen += _top_level_with_weights(layer)
        elif layer.weights:
            chosen.append(layer)
    return chosen


def _recomputed_call(layer, own_call, settings, args, kwargs):
    flat = tf.nest.flatten((args, kwargs))
    at = [i for i, x in enumerate(flat) if isinstance(x, tf.Tensor)]  # the tensors: custom_gradient's arguments
    differentiable = [k for k, i in enumerate(at) if flat[i].dtype.is_floating]
    # Before the first pass writes them: what the second pass must read again. Asked of each variable, not of the
    # layer: a frozen layer (keras-hub's LoRA freezes every block) calls all its variables non-trainable, its
    # trainable LoRA factors among them, whose gradients must reach the variables.
    # A weight the layout split is left out: it reads as its shard here, and no layer that holds one writes it.
    before = [(v, tf.identity(v.value)) for v in layer.variables
              if not v.trainable and not split_variables.is_split(v)]
    # Its split weights, and those of the layers inside it, enter as their slices (gathered inside, so that the
    # gathers can wait and their gradients reach the slices): custom_gradient would read one it finds inside whole.
    split = weight_shards.split_weights_of(layer)
    order, ahead = (_order() if settings["in_order"] else None), settings["ahead"]
    call_state = _compat.keras_call_state()  # the training flag and autocast dtype, for the second pass
    block = spmd.block_state()  # and the layout's paired block the layer computes in (its shards kept)

    def call_on(tensors, slices):
        values = list(flat)
        for i, t in zip(at, tensors):
            values[i] = t
        call_args, call_kwargs = tf.nest.pack_sequence_as((args, kwargs), values)
        whole = [weight.gather(piece) for weight, piece in zip(split, slices)]
        with weight_shards.gathered_once(zip(split, whole)), _inside():
            return own_call(*call_args, **call_kwargs)

    # What waits is only what a pass reads first, copies of its inputs and slices: a control input on the
    # layer's own ops would keep TensorFlow from fusing them (a matmul, its bias and activation), and the
    # second pass would round otherwise than the first.
    @tf.custom_gradient
    def forward(*arguments):
        tensors, slices = arguments[:len(at)], arguments[len(at):]
        with tf.control_dependencies(order.forward(tensors, ahead) if order else []):
            slices_now = [tf.identity(piece) for piece in slices]
        outputs = call_on(tensors, slices_now)

        def backward(*upstream, variables=None):
            variables = list(variables or [])
            # The second pass waits for the backward pass to reach the layer (for the next layer's gradient,
            # in order): TensorFlow would otherwise run every layer's as soon as its inputs exist, during the
            # forward pass, and keep all of them. A tensor passed twice (attention's query and value) gets
            # each argument's own gradient through its own copy.
            reached = order.backward(upstream, ahead) if order else [g for g in upstream[:1] if g is not None]
            with tf.control_dependencies(reached):
                inputs = [tf.identity(t) for t in tensors]
                pieces = [tf.identity(piece) for piece in slices]
            sources = [inputs[k] for k in differentiable] + pieces
            with tf.GradientTape() as tape:
                tape.watch(sources + variables)
                with keras.StatelessScope(state_mapping=before, initialize_variables=False), call_state(), block():
                    again = call_on(inputs, pieces)
            grads = tape.gradient(tf.nest.flatten(again), sources + variables, output_gradients=list(upstream))
            by_tensor = dict(zip(differentiable, grads))
            argument_grads = [by_tensor.get(k) for k in range(len(at))] + grads[len(differentiable):len(sources)]
            return (argument_grads, grads[len(sources):]) if variables else argument_grads

        return outputs, backward

    return forward(*[flat[i] for i in at], *[weight.local_slice() for weight in split])


class _Inside(threading.local):
    """How many recomputed calls this thread is in. A layer inside one computes as it would unwrapped: wrapped
    again, its split weights' gradients (reduce-scattered by its own pass) would reach the outer pass's tape as
    gradients of their whole value, and be reduce-scattered twice."""

    depth = 0


_INSIDE = _Inside()


@contextlib.contextmanager
def _inside():
    _INSIDE.depth += 1
    try:
        yield
    finally:
        _INSIDE.depth -= 1


class _Order(threading.local):
    """Per step being traced and replica thread: the last forward input and backward gradient an in-order layer
    saw, which the next one's gathers wait for."""

    def __init__(self):
        self.graph, self.last_input, self.last_upstream = None, None, None

    def forward(self, tensors, ahead: bool) -> list:
        """A layer's gathers wait for the previous layer's input (`ahead`; the first layer's for its own), or
        for its own."""
        previous, self.last_input = self.last_input, tensors[0] if tensors else None
        return [t for t in (previous if ahead and previous is not None else self.last_input,) if t is not None]

    def backward(self, upstream, ahead: bool) -> list:
        """A layer's gathers wait for the next layer's gradient (`ahead`; the last layer's for its own), or for
        its own."""
        previous, self.last_upstream = self.last_upstream, upstream[0] if upstream else None
        return [t for t in (previous if ahead and previous is not None else self.last_upstream,) if t is not None]


_ORDER = _Order()


def _order() -> _Order:
    """The order of the step being traced (a new graph starts a new order)."""
    graph = tf.compat.v1.get_default_graph()
    if _ORDER.graph is not graph:
        _ORDER.graph, _ORDER.last_input, _ORDER.last_upstream = graph, None, None
    return _ORDER
