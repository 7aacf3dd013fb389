"""Cutting a Keras model's layer graph into pipeline stages.

A stage is a run of consecutive nodes of the model's graph (in execution
order). Whatever tensors cross a cut, one or many (skip connections, branches),
travel to the next stage; a tensor that skips a stage passes through it. Each
stage becomes a Keras sub-model over the same layers (shared weights), so
Keras still runs the layers (training flag, masks, dtype policy).

Boundaries are explicit (the layer that starts each stage after the first, by
name or index) or balanced: by measured forward+backward time of every layer
on a sample micro-batch, or by parameter count when the time cannot be measured.

Example:

    >>> partition = split(model, num_stages=2)                      # doctest: +SKIP
    >>> [s.layer_names for s in partition.stages]                   # doctest: +SKIP
    [['dense', 'dense_1'], ['dense_2', 'dense_3']]
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Callable, Optional, Sequence, Union

import keras
import tensorflow as tf

from tfdist import _compat

__all__ = ["Partition", "Stage", "balance", "draws_random_numbers", "forward_backward", "random_inputs", "split"]

BALANCE_BASES = ("time", "params")


@dataclasses.dataclass
class Stage:
    """One pipeline stage.

    Attributes:
      index: position in the pipeline.
      operations: its layers (and Keras ops), in execution order.
      consumes: KerasTensors the stage reads from earlier stages or the inputs.
      produces: KerasTensors it hands on (to later stages or as model outputs).
      passes: KerasTensors that only travel through it to later stages.
      model: a Keras sub-model mapping `consumes` to `produces`.
      predicted_ms: its layers' measured times, each without the cost of a call, plus that cost once
        (None when not timed).
      measured_ms: measured forward+backward time of the whole stage.
    """

    index: int
    operations: list
    consumes: list
    produces: list
    passes: list
    model: keras.Model
    predicted_ms: Optional[float] = None
    measured_ms: Optional[float] = None

    @property
    def layer_names(self) -> list[str]:
        return [op.name for op in self.operations]

    @property
    def trainable_variables(self) -> list:
        return self.model.trainable_variables

    @property
    def num_params(self) -> int:
        return sum(int(math.prod(v.shape)) for v in self.model.weights)


@dataclasses.dataclass
class Partition:
    """A model cut into stages.

    Attributes:
      stages: the stages, first to last.
      inputs: the model's input KerasTensors.
      outputs: the model's output KerasTensors.
      basis: how boundaries were chosen: `explicit`, `time` or `params`.
    """

    stages: list[Stage]
    inputs: list
    outputs: list
    basis: str

    def report(self) -> dict:
        """Stage layers, parameters and predicted / measured times, for logs and JSON."""
        return {
            "basis": self.basis,
            "stages": [
                {
                    "layers": s.layer_names,
                    "params": s.num_params,
                    "predicted_ms": s.predicted_ms,
                    "measured_ms": s.measured_ms,
                }
                for s in self.stages
            ],
        }


def draws_random_numbers(operation) -> bool:
    """Whether a layer draws random numbers when it runs (Dropout and the like), so running it again differs."""
    return hasattr(operation, "seed_generator")


def balance(costs: Sequence[float], num_stages: int) -> list[int]:
    """Start positions of stages 1..K-1 that minimise the costliest stage.

    Stages are contiguous and non-empty (dynamic programming over cut points).
    """
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest max-stage cost putting the first i nodes in k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    starts, i = [], n
    for k in range(num_stages, 1, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def check_stage_count(layers: list, num_stages: int) -> None:
    """Raises the ValueError of `num_stages` that the model's `layers` (its graph's, in order) cannot fill."""
    if num_stages < 1:
        raise ValueError(f"`num_stages` must be >= 1. Received: {num_stages}")
    if num_stages > len(layers):
        raise ValueError(f"`num_stages` must not exceed the model's {len(layers)} layers "
                         f"({', '.join(layer.name for layer in layers)}). Received: {num_stages}")


def split(
    model: keras.Model,
    num_stages: int,
    *,
    boundaries: Optional[Sequence[Union[str, int]]] = None,
    balance_by: str = "time",
    micro_batch_size: int = 32,
    agree: Optional[Callable[[list[int]], list[int]]] = None,
) -> Partition:
    """Cuts `model` into `num_stages` stages.

    Args:
      model: a built Sequential or functional model.
      num_stages: number of stages.
      boundaries: the layer (name, or index in execution order) that starts
        each stage after the first: `num_stages - 1` entries. None: balanced.
      balance_by: `time` (measured per-layer forward+backward time, falling
        back to parameters if shapes are not fully known) or `params`.
      micro_batch_size: batch of the sample used for timing.
      agree: given the first layer index of each stage after the first,
        returns the ones to use: in a multi-process job, process 0's, since
        each process measures its own layer times.

    Raises:
      ValueError: more stages than layers, bad boundaries, a subclassed model,
        or a shared layer whose uses would land in different stages.
    """
    nodes, inputs, outputs = _compat.graph_nodes(model)
    ops = [op for op, _, _ in nodes]
    check_stage_count(ops, num_stages)
    if boundaries is None and balance_by not in BALANCE_BASES:
        raise ValueError(f"`balance_by` must be one of {BALANCE_BASES}. Received: {balance_by!r}")
    # Timing runs layers in training mode on random data, which moves BatchNorm
    # statistics and Dropout seeds: every variable gets its value back after.
    state = [(v, v.numpy()) for v in model.variables]
    try:
        costs = None
        if boundaries is not None:
            starts, basis = _explicit_starts(ops, num_stages, boundaries), "explicit"
        else:
            timed = _node_costs_ms(nodes, micro_batch_size) if balance_by == "time" else None
            costs, overhead = timed if timed is not None else (None, 0.0)
            basis = "time" if costs is not None else "params"
            weights = costs if costs is not None else [_param_cost(op) for op in ops]
            starts = balance(weights, num_stages)
        starts = agree(starts) if agree else starts
        stages = _build_stages(model, nodes, inputs, outputs, starts)
        if costs is not None:
            for stage, (lo, hi) in zip(stages, _ranges(starts, len(nodes))):
                stage.predicted_ms = overhead + sum(costs[lo:hi])
        for stage in stages:
            stage.measured_ms = _time_ms(stage.model, stage.consumes, micro_batch_size)
    finally:
        for variable, value in state:
            variable.assign(value)
    return Partition(stages=stages, inputs=inputs, outputs=outputs, basis=basis)


def _ranges(starts: list[int], n: int) -> list[tuple[int, int]]:
    edges = [0, *starts, n]
    return list(zip(edges[:-1], edges[1:]))


def _explicit_starts(ops, num_stages: int, boundaries) -> list[int]:
    boundaries = list(boundaries)
    if len(boundaries) != num_stages - 1:
        raise ValueError(
            f"`boundaries` must name {num_stages - 1} layer(s), the first of each stage after "
            f"the first. Received: {boundaries}"
        )
    names = [op.name for op in ops]
    starts = []
    for b in boundaries:
        if isinstance(b, str):
            if b not in names:
                raise ValueError(f"`boundaries` names a layer the model does not have. Received: {b!r}; layers: {names}")
            starts.append(names.index(b))
        elif isinstance(b, int) and not isinstance(b, bool) and 0 < b < len(ops):
            starts.append(b)
        else:
            raise ValueError(
                f"`boundaries` entries must be layer names or indices from 1 to {len(ops) - 1}. Received: {b!r}"
            )
    if any(b <= a for a, b in zip(starts, starts[1:])) or starts[0] == 0:
        raise ValueError(
            f"`boundaries` must be in execution order and leave no stage empty. Received: {boundaries} "
            f"(positions {starts} in {names})"
        )
    return starts


def _build_stages(model, nodes, inputs, outputs, starts) -> list[Stage]:
    n = len(nodes)
    produced_at = {id(t): -1 for t in inputs}
    consumed_at: dict[int, list[int]] = {}
    tensors = {id(t): t for t in inputs}
    for pos, (_, node_inputs, node_outputs) in enumerate(nodes):
        for t in node_inputs:
            consumed_at.setdefault(id(t), []).append(pos)
        for t in node_outputs:
            produced_at[id(t)] = pos
            tensors[id(t)] = t
    for t in outputs:
        consumed_at.setdefault(id(t), []).append(n)

    ranges = _ranges(starts, n)
    stage_of_op: dict[int, int] = {}
    for index, (lo, hi) in enumerate(ranges):
        for pos in range(lo, hi):
            op = nodes[pos][0]
            if stage_of_op.setdefault(id(op), index) != index:
                raise ValueError(
                    f"layer {op.name!r} is used in stages {stage_of_op[id(op)]} and {index}: a shared "
                    "layer's uses must fall in one stage. Move the boundary."
                )

    def live(after: int) -> list:
        return [
            tensors[i]
            for i, pos in produced_at.items()
            if pos < after and any(c >= after for c in consumed_at.get(i, ()))
        ]

    stages = []
    for index, (lo, hi) in enumerate(ranges):
        live_in = live(lo)
        consumes = [t for t in live_in if any(lo <= c < hi for c in consumed_at.get(id(t), ()))]
        live_out = live(hi) if hi < n else list(outputs)
        produces = [t for t in live_out if lo <= produced_at[id(t)] < hi]
        passes = [t for t in live_out if produced_at[id(t)] < lo]
        try:
            sub_model = keras.Model(consumes, produces, name=f"{model.name}_stage{index}")
        except ValueError as e:
            raise ValueError(
                f"cannot cut {model.name!r} into stage {index} ({nodes[lo][0].name} .. "
                f"{nodes[hi - 1][0].name}): {e}"
            ) from None
        stages.append(
            Stage(
                index=index,
                operations=[op for op, _, _ in nodes[lo:hi]],
                consumes=consumes,
                produces=produces,
                passes=passes,
                model=sub_model,
            )
        )
    return stages


def _param_cost(op) -> float:
    # Layers without weights still cost something; count them as one parameter.
    return float(sum(int(math.prod(v.shape)) for v in getattr(op, "weights", ())) or 1)


def random_inputs(tensors, batch: int) -> Optional[list]:
    """A random batch of `batch` examples for `tensors` (KerasTensors); None if a shape is not all known."""
    values = []
    for t in tensors:
        if any(d is None for d in t.shape[1:]):
            return None
        shape = (batch, *t.shape[1:])
        if tf.as_dtype(t.dtype).is_floating:
            values.append(tf.random.normal(shape, dtype=t.dtype))
        else:
            values.append(tf.zeros(shape, dtype=t.dtype))
    return values


def forward_backward(model: keras.Model, sample: list) -> list:
    """One training-mode forward and backward of `model` on `sample`: the gradients of its outputs' sum
    with respect to the sample's floating-point tensors and the model's trainable weights (what a stage
    sends back and what it updates), those that exist. The call is stateless, on the weights' values read
    once: it moves no BatchNormalization statistic, and works on a model whose variables a strategy
    distributes (built inside `strategy.scope()`), whose variables a tape outside a replica cannot watch."""
    floats = [x for x in sample if x.dtype.is_floating]
    trainable = [tf.convert_to_tensor(v.value) for v in model.trainable_variables]
    non_trainable = [tf.convert_to_tensor(v.value) for v in model.non_trainable_variables]
    with tf.GradientTape() as tape:
        tape.watch(floats + trainable)
        outputs, _ = model.stateless_call(trainable, non_trainable, sample, training=True)
        total = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32)) for o in tf.nest.flatten(outputs)])
    return [g for g in tape.gradient(total, floats + trainable) if g is not None]


def _time_ms(fn_model: keras.Model, input_tensors, batch: int, repeats: int = 3) -> Optional[float]:
    """Median eager forward+backward time of `fn_model` on a random batch."""
    sample = random_inputs(input_tensors, batch)
    if sample is None:
        return None

    def step():
        grads = forward_backward(fn_model, sample)
        if grads:
            grads[0].numpy()  # reading a value waits for the work (eager ops may run ahead)

    step()  # warm-up: kernels, caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def _call_overhead_ms(inputs, batch: int) -> float:
    """What timing one call costs with nothing to compute: an identity model's forward+backward.

    Every layer is timed as a model of its own, eagerly, and each such call
    carries a fixed cost (Keras's call, the tape, the wait for the result): about
    1.4 ms here for a Dense layer whose work takes far less. Summed over a stage
    of many small layers that cost dwarfed the stage's own time (MobileNetV2:
    263 ms predicted where 87 were measured), so it is taken off each layer's
    time and added back once per stage, as a stage's measured call pays it once.
    """
    first = [t for t in inputs if tf.as_dtype(t.dtype).is_floating][:1]
    if not first:
        return 0.0
    identity = keras.Model(first, keras.layers.Identity()(first[0]))
    return _time_ms(identity, first, batch) or 0.0


def _node_costs_ms(nodes, batch: int) -> Optional[tuple[list[float], float]]:
    """Each node's forward+backward time without the per-call cost, and that cost."""
    costs = []
    for op, node_inputs, node_outputs in nodes:
        node_inputs = list({id(t): t for t in node_inputs}.values())  # self-attention takes x twice
        try:
            single = keras.Model(node_inputs, node_outputs)
        except ValueError:
            return None
        cost = _time_ms(single, node_inputs, batch)
        if cost is None:
            return None
        costs.append(cost)
    overhead = _call_overhead_ms(nodes[0][1], batch)
    return [max(cost - overhead, 0.0) for cost in costs], overhead
