"""Which variables a layout splits, and along which of their axes: Keras's distribution API read for TensorFlow.

A layout is a device mesh with a data axis and a model axis, and rules: a
regular expression over a variable's path (`decoder_block_3/ffw_linear/kernel`)
and, for each of the variable's axes, the mesh axis it is split over or None.
It comes from a `keras.distribution.LayoutMap` (as Keras documents it for JAX,
or a keras-hub backbone's `get_layout_map(mesh)`), from a
`keras.distribution.ModelParallel`, or from the config's rules. As in Keras, a
path matches a rule when the whole path matches its expression, and a path
that two rules match is an error.

What this version splits: one axis of a variable over the model axis. A rule
that also names the data axis for a weight (keras-hub's maps do, for
fully-sharded data parallelism) keeps the weight whole along it.

Example:

    >>> layout = Layout(model=2, rules=((".*dense.*kernel", (None, "model")),))
    >>> layout.split_axis("dense/kernel", (8, 16))
    1
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional, Sequence

from tfdist import _compat
from tfdist.errors import LayoutError

__all__ = ["DATA", "MODEL", "Layout", "LayoutError"]

DATA, MODEL = "batch", "model"  # the mesh's axis names, as keras-hub's get_layout_map defaults them


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh of `data` x `model` devices and the rules that split variables over its model axis.

    Attributes:
      model: devices along the model axis (each variable a rule splits is cut into this many shards).
      data: devices along the data axis (model replicas trained data parallel).
      rules: (path expression, mesh axis name or None for each of the variable's axes), in order.
      model_axis, data_axis: the mesh axes' names.
      devices: the mesh's devices, data-major (empty: the process's first ones).
      megatron: also split what Megatron-LM splits, found in the model (every `MultiHeadAttention` on its
        heads, every `Dense` pair column then row: `tfdist.parallel.megatron_pairs.megatron_axes`); a rule
        that matches a variable decides it instead.
    """

    model: int
    data: int = 1
    rules: tuple[tuple[str, tuple[Optional[str], ...]], ...] = ()
    model_axis: str = MODEL
    data_axis: str = DATA
    devices: tuple[str, ...] = ()
    megatron: bool = False

    def __post_init__(self):
        if self.model < 1 or self.data < 1:
            raise LayoutError(f"The mesh must have at least one device on each axis. Received: data={self.data}, "
                              f"model={self.model}")
        for pattern, axes in self.rules:
            try:
                re.compile(pattern)
            except re.error as error:
                raise LayoutError(f"Rule {pattern!r} is not a regular expression ({error}).") from None
            unknown = [a for a in axes if a not in (None, self.model_axis, self.data_axis)]
            if unknown:
                raise LayoutError(f"Rule {pattern!r} names mesh axis {unknown[0]!r}; the mesh has "
                                  f"{self.data_axis!r} and {self.model_axis!r}.")
            if list(axes).count(self.model_axis) > 1:
                raise LayoutError(f"Rule {pattern!r} splits two axes over {self.model_axis!r}: {tuple(axes)}.")

    @classmethod
    def from_keras(cls, layout) -> "Layout":
        """The layout of a `keras.distribution.LayoutMap`, or of a `keras.distribution.ModelParallel`.

        Raises:
          LayoutError: a mesh of other than two axes (data and model).
        """
        import keras

        batch_dim_name = None
        if isinstance(layout, keras.distribution.ModelParallel):
            batch_dim_name, layout = layout.batch_dim_name, _compat.layout_map_of(layout)
        if not isinstance(layout, keras.distribution.LayoutMap):
            raise LayoutError(f"Expected a keras.distribution.LayoutMap or ModelParallel. Received: {layout!r}")
        mesh = layout.device_mesh
        names = list(mesh.axis_names)
        data_axis = batch_dim_name or names[0]  # Keras's default: the mesh's first axis
        others = [n for n in names if n != data_axis]
        if len(others) != 1:
            raise LayoutError(f"The device mesh must have two axes, a data axis ({data_axis!r}) and a model axis. "
                              f"Received: axis_names={names}, shape={list(mesh.shape)}")
        shape = dict(zip(names, mesh.shape))
        rules = tuple((pattern, tuple(layout[pattern].axes)) for pattern in layout)
        order = [names.index(data_axis), names.index(others[0])]  # Keras's "cpu:0" as TensorFlow's "/cpu:0"
        devices = tuple("/" + str(d).lstrip("/") for d in mesh.devices.transpose(order).flatten())
        return cls(model=int(shape[others[0]]), data=int(shape[data_axis]), rules=rules,
                   model_axis=others[0], data_axis=data_axis, devices=devices)

    def rule_for(self, path: str) -> Optional[tuple[str, tuple[Optional[str], ...]]]:
        """The rule whose expression matches the whole `path`, or None.

        Raises:
          LayoutError: two rules match it.
        """
        matching = [(pattern, axes) for pattern, axes in self.rules if re.fullmatch(pattern, path)]
        if len(matching) > 1:
            raise LayoutError(f"Variable {path!r} matches {len(matching)} rules: "
                              f"{', '.join(repr(p) for p, _ in matching)}; a variable must match at most one.")
        return matching[0] if matching else None

    def split_axis(self, path: str, shape: Sequence[int]) -> Optional[int]:
        """The axis of the variable at `path` split over the model axis, or None to keep it whole.

        Raises:
          LayoutError: the rule names more or fewer axes than the variable has, or the split axis does not
            divide by the model axis's devices.
        """
        rule = self.rule_for(path)
        if rule is None:
            return None
        pattern, axes = rule
        shape = tuple(int(n) for n in shape)
        if len(axes) != len(shape):
            raise LayoutError(f"Rule {pattern!r} gives {len(axes)} axes {tuple(axes)} to variable {path!r} of "
                              f"shape {shape}.")
        if self.model_axis not in axes:
            return None
        axis = list(axes).index(self.model_axis)
        if shape[axis] % self.model:
            raise LayoutError(f"Rule {pattern!r} splits axis {axis} of variable {path!r} (shape {shape}) over "
                              f"{self.model} devices, and {shape[axis]} does not divide by {self.model}.")
        return axis

    def axes_of(self, model) -> dict[str, int]:
        """Path -> split axis of every variable of the Keras `model` that the layout splits.

        Raises:
          LayoutError: as `split_axes`, or a Megatron split that does not divide.
        """
        axes = self.split_axes(model.variables)
        if not self.megatron:
            return axes
        from tfdist.parallel.megatron_pairs import megatron_axes  # which imports this module

        matched = {v.path for v in model.variables if self.rule_for(v.path)}
        found = {p: a for p, a in megatron_axes(model, self.model).items() if p not in matched}
        if not found and not self.rules:
            raise LayoutError(f"Model {model.name!r} has no MultiHeadAttention, no Dense pair (a Dense whose output "
                              "only another Dense consumes, in its own graph) and no tfdist.layers for Megatron's "
                              "split to find.")
        return {**found, **axes}

    def split_axes(self, variables) -> dict[str, int]:
        """Path -> split axis of every variable a rule splits.

        Raises:
          LayoutError: a rule that matches none of `variables` (a misspelt path would leave the model whole),
            or any error of `split_axis`.
        """
        matched: set[str] = set()
        axes = {}
        for variable in variables:
            rule = self.rule_for(variable.path)
            if rule is None:
                continue
            matched.add(rule[0])
            axis = self.split_axis(variable.path, variable.shape)
            if axis is not None:
                axes[variable.path] = axis
        unmatched = [pattern for pattern, _ in self.rules if pattern not in matched]
        if unmatched:
            paths = [v.path for v in variables]
            raise LayoutError(f"Rule {unmatched[0]!r} matches no variable of the model; its variables are "
                              f"{', '.join(paths[:4])}{', ...' if len(paths) > 4 else ''} ({len(paths)}).")
        return axes
