"""Reading a YAML file and `--set` overrides into a validated `Config`.

YAML is read with `yaml.safe_load`, so tags that would construct Python objects
are refused. Every value is checked against the schema's type hints and bounds,
and every problem becomes a `ConfigError` naming the dotted key.

Example:

    >>> cfg = load_config(None, overrides=["train.epochs=3"])
    >>> cfg.train.epochs
    3
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import math
import os
import types
import typing
from typing import Any, Iterable, Mapping, Optional, Union

import yaml

from tfdist.config import schema
from tfdist.config import validation
from tfdist.errors import ConfigError

__all__ = ["CLUSTER_VARIABLE", "cluster_variable", "from_dict", "load_config", "parse_override", "to_dict"]

# Where the cluster is, for the tasks of a user's own command that `tfdist slurm` or `tfdist k8s` runs: a JSON
# mapping of `cluster` keys (resolver, allow_non_loopback, port_base) for those the config leaves out.
CLUSTER_VARIABLE = "TFDIST_CLUSTER"


def load_config(path: Optional[str], overrides: Iterable[str] = ()) -> schema.Config:
    """Loads a config file, applies `key=value` overrides and validates it. Where the file leaves
    cluster keys out, the environment's CLUSTER_VARIABLE gives them (a launcher's, for a user's own
    script).

    Args:
      path: a YAML file, or None for the built-in defaults.
      overrides: `dotted.key=value` strings; values are parsed as YAML scalars.

    Returns:
      The validated, frozen `Config`.

    Raises:
      ConfigError: the file is missing, unreadable or not a mapping of known
        keys, or a value breaks the schema.
    """
    raw = {} if path is None else read_yaml(path)
    _fill_in_the_launchers_cluster(raw)
    for override in overrides:
        key, value = parse_override(override)
        _set_dotted(raw, key, value)
    return from_dict(raw)


def cluster_variable(resolver: str, port_base: int, allow_non_loopback: bool) -> str:
    """CLUSTER_VARIABLE's value for a launcher's tasks: where they find their cluster."""
    return json.dumps({"resolver": resolver, "allow_non_loopback": allow_non_loopback, "port_base": port_base})


def _fill_in_the_launchers_cluster(raw: dict) -> None:
    """The `cluster` keys of CLUSTER_VARIABLE that `raw` leaves out."""
    given = os.environ.get(CLUSTER_VARIABLE)
    if not given or not isinstance(raw.setdefault("cluster", {}), dict):
        return
    try:
        keys = json.loads(given)
    except json.JSONDecodeError:
        keys = None
    if not isinstance(keys, dict):
        raise ConfigError(CLUSTER_VARIABLE, "must be a JSON mapping of cluster keys (a launcher sets it).", given)
    for key, value in keys.items():
        raw["cluster"].setdefault(key, value)


def read_yaml(path: str) -> dict:
    """Reads a YAML file whose top level is a mapping (an empty mapping is fine)."""
    if not os.path.isfile(path):
        raise ConfigError("config", "must name an existing YAML file.", path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("config", f"could not be read ({e}).", path) from None
    if not text.strip():
        raise ConfigError("config", "is empty; it must be a YAML mapping of sections.", path)
    try:
        _refuse_duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader), path)
        raw = yaml.safe_load(text)
    except yaml.constructor.ConstructorError as e:
        raise ConfigError(
            "config",
            f"may not use YAML tags that construct objects ({e.problem}).",
            path,
        ) from None
    except yaml.YAMLError as e:
        where = ""
        mark = getattr(e, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError("config", f"is not valid YAML{where}: {problem}.", path) from None
    if raw is None:
        raise ConfigError("config", "holds no settings; it must be a YAML mapping of sections.", path)
    if not isinstance(raw, dict):
        raise ConfigError(
            "config", f"must be a YAML mapping of sections, not a {type(raw).__name__}.", path
        )
    return raw


def _refuse_duplicate_keys(node, path: str, prefix: str = "") -> None:
    """YAML lets a mapping repeat a key and keeps the last value; a config must not."""
    if isinstance(node, yaml.MappingNode):
        seen: dict = {}
        for key, value in node.value:
            dotted = f"{prefix}{key.value}"
            if key.value in seen:
                raise ConfigError(
                    dotted,
                    f"is set twice in {path} (lines {seen[key.value] + 1} and {key.start_mark.line + 1}); "
                    "keep one.",
                    value.value if isinstance(value, yaml.ScalarNode) else "a section",
                )
            seen[key.value] = key.start_mark.line
            _refuse_duplicate_keys(value, path, f"{dotted}.")
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_duplicate_keys(item, path, prefix)


def parse_override(text: str) -> tuple[str, Any]:
    """Splits `a.b=c` into the key and its YAML-parsed value."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key or "." not in key:
        raise ConfigError("--set", "must look like `section.key=value`.", text)
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        raise ConfigError(key, "has a value that is not a valid YAML scalar.", value) from None
    return key, parsed


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise ConfigError(where, "must be a mapping to set a key inside it.", child)
        node = child
    node[parts[-1]] = value


def from_dict(raw: Mapping[str, Any]) -> schema.Config:
    """Builds and validates a `Config` from nested plain data."""
    config = _build(schema.Config, raw, "")
    validation.check(config)
    return config


def to_dict(config) -> dict:
    """Plain data (enums as their values, tuples as lists) for YAML or JSON."""
    return {field.name: _plain(getattr(config, field.name)) for field in dataclasses.fields(config)}


def _plain(value):
    if dataclasses.is_dataclass(value):
        return to_dict(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, str):  # a KindName as the plain string YAML writes
        return str(value)
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    return value


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _build(cls, raw: Any, prefix: str):
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(prefix, "must be a mapping of keys to values.", raw)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            raise _unknown_key(prefix, key, sorted(fields))
    values = {}
    for name, value in raw.items():
        key = _join(prefix, name)
        parse = fields[name].metadata.get("parse")
        values[name] = parse(value, key) if parse else _convert(value, hints[name], key)
        _check_bounds(values[name], fields[name].metadata, key)
        _check_choices(values[name], fields[name].metadata, key)
    return cls(**values)


def _unknown_key(prefix: str, key: Any, allowed: list[str]) -> ConfigError:
    near = difflib.get_close_matches(str(key), allowed, n=1)
    hint = f" Did you mean `{_join(prefix, near[0])}`?" if near else ""
    where = f"`{prefix}`" if prefix else "the top level"
    return ConfigError(
        _join(prefix, str(key)),
        f"is not a known key.{hint} Allowed in {where}: {', '.join(allowed)}.",
        key,
    )


def _convert(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        non_none = [o for o in options if o is not type(None)]
        if len(non_none) == 1:
            return _convert(value, non_none[0], key)
        return _convert_union(value, non_none, key)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _convert_enum(value, hint, key)
    if origin is tuple:
        return _convert_tuple(value, typing.get_args(hint)[0], key)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, "must be true or false.", value)
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, "must be an integer.", value)
        return value
    if hint is float:
        if isinstance(value, str):
            value = _float_from_text(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, "must be a number.", value)
        if not math.isfinite(value):
            raise ConfigError(key, "must be a finite number.", value)
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(key, "must be a string.", value)
        return value
    raise TypeError(f"schema field {key} has unsupported type {hint}")


def _float_from_text(text: str):
    """YAML 1.1 reads `1e-3` as a string; take plain finite decimal numbers."""
    try:
        number = float(text)
    except ValueError:
        return text
    return number if math.isfinite(number) else text


def _convert_union(value: Any, options: list, key: str) -> Any:
    # Only str-or-number (precision.loss_scale) and str-or-list (train.remat) unions exist; validation
    # checks which strings and numbers are allowed.
    if isinstance(value, str) and str in options:
        return value
    listed = next((o for o in options if typing.get_origin(o) is tuple), None)
    if isinstance(value, (list, tuple)) and listed is not None:
        return _convert_tuple(value, typing.get_args(listed)[0], key)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and float in options:
        return float(value)
    names = " or ".join("list" if typing.get_origin(o) is tuple else o.__name__ for o in options)
    raise ConfigError(key, f"must be a {names}.", value)


def _convert_enum(value: Any, enum_cls: type[enum.Enum], key: str) -> enum.Enum:
    allowed = [m.value for m in enum_cls]
    if isinstance(value, str) and value in allowed:
        return enum_cls(value)
    raise _not_one_of(allowed, value, key)


def _check_choices(value: Any, metadata: Mapping, key: str) -> None:
    """A string field whose values are a table's keys (`strategy.kind`: the kinds table)."""
    allowed = list(metadata.get("choices") or ())
    if allowed and value not in allowed:
        raise _not_one_of(allowed, value, key)


def _not_one_of(allowed: list[str], value: Any, key: str) -> ConfigError:
    near = difflib.get_close_matches(str(value), allowed, n=1)
    hint = f" Did you mean {near[0]!r}?" if near else ""
    return ConfigError(key, f"must be one of {', '.join(allowed)}.{hint}", value)


def _convert_tuple(value: Any, item_hint: Any, key: str) -> tuple:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(key, "must be a list.", value)
    return tuple(_convert(v, item_hint, f"{key}[{i}]") for i, v in enumerate(value))


def _check_bounds(value: Any, metadata: Mapping, key: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    low, high, low_open = metadata.get("low"), metadata.get("high"), metadata.get("low_open")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and value > high
    if too_low or too_high:
        parts = []
        if low is not None:
            parts.append(f"{'>' if low_open else '>='} {low}")
        if high is not None:
            parts.append(f"<= {high}")
        raise ConfigError(key, f"must be {' and '.join(parts)}.", value)
