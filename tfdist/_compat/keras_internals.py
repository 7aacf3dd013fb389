"""Keras's private state that tfdist reads: a model's layer graph, its loss tracker, the global seed, the
reduction of a step's logs, the build before training; and the optimizer's build, slot creation and
distributed update, which an optimizer state split over devices takes over."""

from __future__ import annotations

__all__ = ["attention_projections", "build_for_training", "build_without_slots", "graph_nodes", "has_layer_graph",
           "keras_global_seed_state", "keras_reduce_per_replica", "layout_map_of", "loss_tracker",
           "make_slots_where_created", "nested_layers", "optimizer_variables", "replace_update_step",
           "replace_variable_value", "start_at_epoch", "stored_kernel", "variable_index"]


def graph_nodes(model):
    """The layer graph of a Sequential or functional Keras model.

    Keras has no public API for a model's nodes (which layer consumes which
    tensors); pipeline partitioning needs it to know what crosses a stage
    boundary. Returns `(nodes, inputs, outputs)`: `nodes` lists
    `(operation, input KerasTensors, output KerasTensors)` in an order where
    every node comes after the nodes it consumes; `inputs` and `outputs` are
    the model's KerasTensors.

    Raises:
      ValueError: the model is subclassed (it has no layer graph) or unbuilt.
    """
    graph = _layer_graph(model)
    if graph is None:
        raise ValueError(
            f"`model` must be a built Sequential or functional model to be split into "
            f"pipeline stages; a subclassed model has no layer graph. Received: {model.name}"
        )
    nodes = []
    for depth in sorted(graph._nodes_by_depth, reverse=True):
        for node in graph._nodes_by_depth[depth]:
            if node.operation is None or node.is_input:
                continue
            nodes.append((node.operation, list(node.input_tensors), list(node.outputs)))
    return nodes, list(graph.inputs), list(graph.outputs)


def has_layer_graph(model) -> bool:
    """Whether `model` is a built Sequential or functional model, whose layer graph `graph_nodes` reads."""
    return _layer_graph(model) is not None


def _layer_graph(model):
    import keras

    graph = getattr(model, "_functional", None) if isinstance(model, keras.Sequential) else model
    return graph if hasattr(graph, "_nodes_by_depth") else None


def attention_projections(layer) -> tuple:
    """A `MultiHeadAttention`'s query, key, value and output `EinsumDense` layers (Keras keeps them as private
    attributes): Megatron's pairing splits the four on the heads together."""
    return layer._query_dense, layer._key_dense, layer._value_dense, layer._output_dense


def layout_map_of(distribution):
    """The `LayoutMap` a `keras.distribution.ModelParallel` was made with (Keras keeps no public accessor)."""
    return distribution._layout_map

def replace_variable_value(variable, value):
    """Makes the Keras `variable` hold the backend variable `value` instead of its own (a split variable's
    shards), keeping its path, tracking and whole shape: Keras has no public way to give a variable another
    backing store."""
    variable._value = value


def backing_value(variable):
    """The backend variable behind the Keras `variable`, even inside a mixed-precision layer's call (where its
    `value` is a cast tensor); for anything else, itself."""
    return getattr(variable, "_value", variable)

def loss_tracker(model):
    """The `Mean` metric behind the `loss` entry of Keras's training logs.

    A training step written outside `Model.train_step` (the pipelined one)
    must update it as Keras's own step does; Keras keeps it private.
    """
    return model._loss_tracker

def build_for_training(model, epoch_iterator) -> None:
    """Makes every variable `fit` will train with (optimizer slots, metrics) now, from the data's shapes.

    Under a distribution strategy `fit` does this before `on_train_begin`; without
    one Keras waits for the first step's tracing, too late to restore them.
    Shapes only: no batch is read, so the input order stays as it would be.
    """
    spec = epoch_iterator.data_adapter.get_tf_dataset().element_spec
    model._symbolic_build(data_batch=spec)

def keras_global_seed_state():
    """The variable behind Keras's unseeded random ops (`keras.random.normal()` without a seed)."""
    from keras.src.random.seed_generator import global_seed_generator

    return global_seed_generator().state

def keras_reduce_per_replica(outputs, strategy):
    """Keras's reduction of a training step's per-replica outputs to the logs it shows.

    A strategy that builds its own training function (a multi-step loop Keras's
    cannot run) must hand Keras the logs its own function would; Keras keeps
    the reduction private.
    """
    from keras.src.backend.tensorflow.trainer import reduce_per_replica

    return reduce_per_replica(outputs, strategy, reduction="auto")

def build_without_slots(optimizer, variables) -> None:
    """Builds `optimizer` for `variables` as Keras's base optimizer does (its step counter and the
    variables' indices), without the slots its own `build` adds for each variable.

    An optimizer whose slots live elsewhere (split over devices) must still be
    built for Keras's `apply`; the base class's build is not public.
    """
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    BaseOptimizer.build(optimizer, variables)

def make_slots_where_created(optimizer) -> None:
    """Has `optimizer` create its slots wherever variables are being created, not through its strategy.

    Keras's TensorFlow optimizer creates each slot under
    `strategy.extended.colocate_vars_with(variable)`, which refuses a variable
    the strategy did not create (a single-device one inside its scope). The
    base class's method creates the slot like any variable.
    """
    import functools

    from keras.src.optimizers.base_optimizer import BaseOptimizer

    optimizer.add_variable_from_reference = functools.partial(BaseOptimizer.add_variable_from_reference, optimizer)

def replace_update_step(optimizer, update) -> None:
    """Has `optimizer` call `update(grads, trainable_variables, learning_rate)` to apply a step's gradients.

    Keras's optimizer calls this one private method, in replica context, after
    clipping, weight decay and loss scaling; under a tf.distribute strategy the
    TensorFlow optimizer's version all-reduces the gradients there and updates
    every replica's variables. It is the one place where a sharded update (a
    reduce-scatter, slices updated, an all-gather) can take over.
    """
    optimizer._backend_update_step = update


def gradient_accumulators(optimizer) -> list:
    """The variables Keras's gradient accumulation sums each variable's gradients in, in the order of
    `optimizer_variables` (none without `gradient_accumulation_steps`)."""
    return list(getattr(optimizer, "_accumulated_gradients", None) or [])


def updates_replaced(optimizer) -> bool:
    """Whether `replace_update_step` gave `optimizer` (or the optimizer it wraps, for loss scaling) its update."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return "_backend_update_step" in vars(inner)


def replace_clipping(optimizer, clip) -> None:
    """Has `optimizer` clip with `clip(grads, trainable_variables)` instead of its `_clip_gradients(grads)`.

    Keras clips in `_backend_apply_gradients`, by a method that sees the
    gradients without their variables; a clipping that treats some variables
    apart (split ones, whose gradients are slices) needs both.
    """
    apply = optimizer._backend_apply_gradients
    optimizer._clip_gradients = lambda grads: grads
    optimizer._backend_apply_gradients = lambda grads, variables: apply(clip(grads, variables), variables)


def replace_accumulated_update(optimizer, update) -> None:
    """Has `optimizer`, when it accumulates gradients under a strategy (`patches`), call
    `update(distribution, averages, trainable_variables, learning_rate, only_if)` in cross-replica context
    instead of its `update_step` per variable: a split optimizer's update of its slices."""
    optimizer._tfdist_accumulated_update = update


def accumulated_update(optimizer):
    """The update `replace_accumulated_update` gave `optimizer`, or None."""
    return vars(optimizer).get("_tfdist_accumulated_update")


def nested_layers(model) -> list:
    """Every layer inside `model`, nested models' layers included, without the model itself.

    Keras's `model.layers` lists the top level only; its own recursive walk
    (`_flatten_layers`) has no public name. Placement, pipeline stages and
    tensor-parallel reports need the layers a nested model holds."""
    return list(model._flatten_layers(include_self=False, recursive=True))


def keras_call_state():
    """A context manager that puts back, in another call (a layer's backward pass), the Keras state the
    current layer call runs in: its call context (the `training` its inner layers inherit) and its autocast
    scope (mixed precision's compute dtype). Keras keeps both in private thread-local attributes."""
    import contextlib

    from keras.src.backend.common import global_state

    saved = {name: global_state.get_global_attribute(name) for name in ("current_call_ctx", "autocast_scope")}

    @contextlib.contextmanager
    def restored():
        outer = {name: global_state.get_global_attribute(name) for name in saved}
        for name, value in saved.items():
            global_state.set_global_attribute(name, value)
        try:
            yield
        finally:
            for name, value in outer.items():
                global_state.set_global_attribute(name, value)

    return restored


def own_trainable_variables(layer) -> list:
    """The trainable variables `layer` made itself, not its inner layers' (Keras keeps that list privately)."""
    return list(layer._trainable_variables)


def start_at_epoch(model, epoch: int) -> None:
    """Makes the next `fit` of `model` start its epoch loop at `epoch`, as `fit(initial_epoch=epoch)` would.

    A resuming callback learns the epoch in `on_train_begin`, after `fit` read
    its `initial_epoch` argument; Keras reads the loop's start from this
    attribute only after the callbacks' `on_train_begin`."""
    model._initial_epoch = epoch


def optimizer_variables(optimizer) -> list:
    """The model variables `optimizer` was built for, in its slots' order (its `build(variables)` argument).

    Keras keeps them privately; an optimizer split over devices makes one
    slice per variable in this order."""
    return list(optimizer._trainable_variables)


def variable_index(optimizer, variable) -> int:
    """The position of `variable` among `optimizer_variables(optimizer)`, as Keras finds its slots."""
    return optimizer._get_variable_index(variable)


def step_state_update(optimizer):
    """What `optimizer`'s own `_backend_update_step` does once per update beside each variable's `update_step`, as
    `(variable, new_value)` where `new_value(value)` is the variable's next value; None when it does nothing more.

    Accumulating gradients under a strategy (`patches`) runs `update_step` per variable inside a condition, never
    `_backend_update_step`: Nadam's product of its momentum schedule (`_u_product`) would stay 1.0, and its update
    divides by 1 - that product (every weight NaN after the first update).

    Raises:
      ValueError: another optimizer class has its own `_backend_update_step`, which no condition can hold.
    """
    from keras import ops
    from keras.src.backend.tensorflow.optimizer import TFOptimizer
    from keras.src.optimizers.nadam import Nadam

    if isinstance(optimizer, Nadam):
        def next_product(value):
            step = ops.cast(optimizer.iterations + 1, value.dtype)
            return value * optimizer.beta_1 * (1.0 - 0.5 * ops.power(0.96, step))
        return optimizer._u_product, next_product
    if type(optimizer)._backend_update_step is not TFOptimizer._backend_update_step:
        raise ValueError(f"`gradient_accumulation_steps` under a strategy cannot run the own `_backend_update_step` of "
                         f"{type(optimizer).__name__} on update steps only. Received: {type(optimizer).__name__}")
    return None


def weight_decay_of(optimizer, variable):
    """The weight decay `optimizer`'s own `_apply_weight_decay` gives `variable` (one device's value), or None: Muon
    decays the variables Adam updates (those with a velocity) by `adam_weight_decay`. Accumulating gradients under a
    strategy (`patches`) decays each variable inside a condition, per device, where Keras's method cannot run.

    Raises:
      ValueError: another optimizer class has its own `_apply_weight_decay`.
    """
    from keras.src.backend.tensorflow.optimizer import TFOptimizer
    from keras.src.optimizers.base_optimizer import BaseOptimizer
    from keras.src.optimizers.muon import Muon

    keras_own = (TFOptimizer._apply_weight_decay, BaseOptimizer._apply_weight_decay)
    if type(optimizer)._apply_weight_decay not in keras_own and not isinstance(optimizer, Muon):
        raise ValueError(f"`gradient_accumulation_steps` under a strategy cannot run the own `_apply_weight_decay` of "
                         f"{type(optimizer).__name__} on update steps only. Received: {type(optimizer).__name__}")
    if not optimizer._use_weight_decay(variable):
        return None
    if isinstance(optimizer, Muon) and optimizer.adam_velocities[optimizer._get_variable_index(variable)] is not None:
        return optimizer.adam_weight_decay
    return optimizer.weight_decay


def stored_kernel(layer):
    """The kernel variable a `Dense` or `EinsumDense` layer holds: with LoRA enabled, `layer.kernel` is a tensor
    computed from it and the LoRA factors (`lora_kernel_a` @ `lora_kernel_b`, scaled), not a variable."""
    return layer._kernel if getattr(layer, "lora_enabled", False) else layer.kernel
