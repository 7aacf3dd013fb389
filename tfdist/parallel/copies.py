"""Which variable values a step copies between devices, read from what TensorFlow ran.

Where an op runs is decided when TensorFlow places a function's graph, not
when tfdist builds it: the runtime splits the graph by device and joins the
parts with `_Send`/`_Recv` pairs. This module records those partition graphs
while a step function is first instantiated (`tfdist._compat.partition_graphs`)
and finds every `_Send` whose tensor is a variable's value: a `ReadVariableOp`
(through `Identity` and `Cast`, so a weight cast to float16 counts too, and
through lowered control flow), sized from the variable's handle shape. That is the copy model parallelism must not
make: a weight read on one device and used on another.

Scalar variables are reported apart (`VariableCopy.is_scalar`): they are the
optimizer's step counter and learning rate, which every update reads, and the
loss scale, all held once per replica.

Example:

    >>> copies = variable_copies(lambda: model.fit(x, y, epochs=1, verbose=0))  # doctest: +SKIP
    >>> weight_bytes(copies)                                                  # doctest: +SKIP
    0
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import tensorflow as tf

from tfdist import _compat

__all__ = ["VariableCopy", "variable_copies", "weight_bytes"]

_PASS_THROUGH = ("Identity", "Cast", "Switch", "Enter")  # input 0 flows on (lowered cond and while)


@dataclasses.dataclass(frozen=True)
class VariableCopy:
    """A variable's value sent from one device to another.

    Attributes:
      tensor: the sent tensor's name in the partition graph.
      source: the device that read the variable (`CPU:0`).
      destination: the device that receives it.
      shape: the variable's shape.
      bytes: the size of the value sent (after any cast).
    """

    tensor: str
    source: str
    destination: str
    shape: tuple
    bytes: int

    @property
    def is_scalar(self) -> bool:
        return self.shape == ()


def variable_copies(run: Callable[[], object]) -> list[VariableCopy]:
    """The variable values sent between devices by the functions `run()` instantiates.

    Only functions instantiated during `run()` are seen: call it with the
    first use of a step function (a model's first `fit`, `evaluate` or
    `predict`, or after `make_train_function(force=True)`).

    Raises:
      ValueError: a variable read whose shape the graph does not record.
    """
    copies = []
    for graph in _compat.partition_graphs(run):
        nodes = {node.name: node for node in graph.node}
        for node in graph.node:
            if node.op != "_Send":
                continue
            read = _through(nodes, node.input[0])
            if read is None or read.op != "ReadVariableOp":
                continue
            shape = _variable_shape(_through(nodes, read.input[0]))
            if shape is None:
                raise ValueError(f"cannot size the variable behind {read.name!r}: its handle records no shape")
            copies.append(
                VariableCopy(
                    tensor=node.attr["tensor_name"].s.decode(),
                    source=_short(node.attr["send_device"].s.decode()),
                    destination=_short(node.attr["recv_device"].s.decode()),
                    shape=shape,
                    bytes=tf.as_dtype(node.attr["T"].type).size * math.prod(shape),
                )
            )
    return copies


def weight_bytes(copies: list[VariableCopy]) -> int:
    """Bytes of non-scalar variable values among `copies`: weights and optimizer slots."""
    return sum(copy.bytes for copy in copies if not copy.is_scalar)


def _through(nodes: dict, input_name: str):
    """The node producing `input_name`, looking through `_PASS_THROUGH` ops; None for unknown nodes."""
    node = nodes.get(input_name.lstrip("^").split(":")[0])
    while node is not None and node.op in _PASS_THROUGH:
        node = nodes.get(node.input[0].split(":")[0])
    return node


def _variable_shape(handle):
    """The shape a resource handle (a function argument or VarHandleOp) records, or None."""
    if handle is None:
        return None
    if handle.op == "VarHandleOp":
        shape = handle.attr["shape"].shape
    else:
        shapes = handle.attr["_handle_shapes"].list.shape
        shape = shapes[0] if shapes else None
    if shape is None or shape.unknown_rank:
        return None
    return tuple(int(d.size) for d in shape.dim)


def _short(device: str) -> str:
    spec = tf.DeviceSpec.from_string(device)
    return f"{spec.device_type}:{spec.device_index}"
