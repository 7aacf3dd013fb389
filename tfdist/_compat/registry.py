"""The registry of tfdist's patches to Keras: what each replaces, why, for whom, and whether this Keras is the one
it was written for.

A patch names its target by its dotted path, says why in one line, names the upstream issue it works around, and
carries a fingerprint of the target's source as it was written against (`versions.TESTED_VERSIONS`). It is
installed only when the versions' major.minor and the fingerprint both match; otherwise it is refused, and
`refused()` says why, in the line tfdist's strategies raise. An installed replacement keeps its target's name,
signature and docstring (`functools.update_wrapper`), and serves only the calls made under a strategy `serves`
accepts: every other call runs Keras's own function, untouched. A patch marked `attached` leaves its class alone:
it replaces the method on the objects tfdist is given (`attach`), as a wrapper of that object's own method.
`remove_all` puts every original back.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import inspect
import types
import weakref
from typing import Callable, Optional

from tfdist._compat import versions

__all__ = ["Patch", "attach", "fingerprint", "install", "installed", "refused", "remove_all", "resolve"]


@dataclasses.dataclass(frozen=True)
class Patch:
    """One replaced function of Keras.

    Attributes:
      target: the dotted path of the function replaced (`keras.src.models.model.Model.save`).
      make: `(Keras's function) -> tfdist's`, called once at install.
      why: what the replacement does that Keras does not, in one line.
      fingerprint: `fingerprint(target)` of the Keras it was written against.
      strategy_of: `(*args, **kwargs) -> the strategy a call runs under`; the replacement serves only the calls
        whose strategy the registry's `serves` accepts. None: every call (a replacement that changes nothing until
        tfdist asks, such as the epoch iterator's resume).
      fixes_tensorflow: the replacement fixes Keras under TensorFlow's own strategies too, after
        `tfdist.fix_tensorflow_strategies()`.
      upstream: the upstream issue it works around, if one is filed.
      attached: installed on no class; `attach(obj, target)` gives it to one object tfdist was given (an optimizer
        compiled under one of its strategies), whose other methods and class stay Keras's.
    """

    target: str
    make: Callable
    why: str
    fingerprint: str
    strategy_of: Optional[Callable] = None
    fixes_tensorflow: bool = False
    upstream: str = ""
    attached: bool = False


# target -> (owner, attribute name, the owner's own attribute before, or _INHERITED)
_INSTALLED: dict[str, tuple] = {}
_REFUSED: dict[str, str] = {}
_INHERITED = object()
# target -> (attribute name, tfdist's function for an object) of each installed `attached` patch
_ATTACHABLE: dict[str, tuple] = {}
# object -> the targets `attach` gave it (once each: tfdist may wrap the attached method further)
_ATTACHED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def resolve(target: str):
    """(owner, attribute name, the function) of a dotted path: a module's function or a class's method."""
    parts = target.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:-1]:
            owner = getattr(owner, name)
        return owner, parts[-1], getattr(owner, parts[-1])
    raise ImportError(f"no module in {target}")


def fingerprint(function) -> str:
    """The first 12 hex digits of the SHA-256 of a function's source."""
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()[:12]


def _fitting(patch: Patch):
    """(owner, name, Keras's function), or the reason the patch's target is not the code it was written for."""
    try:
        owner, name, function = resolve(patch.target)
        found = fingerprint(function)
    except (ImportError, AttributeError, OSError, TypeError) as error:
        return f"{patch.target} is not in this Keras ({type(error).__name__}: {error})"
    if found != patch.fingerprint:
        return (f"{patch.target} is not the code it was written for "
                f"(fingerprint {found}, written for {patch.fingerprint})")
    return owner, name, function


def install(patches: list[Patch], serves: Callable[[Patch, object], bool]) -> None:
    """Installs each patch not installed yet whose target is as it was written for; records the others in
    `refused()`. `serves(patch, strategy)`: whether a call under `strategy` gets tfdist's replacement."""
    other = versions.outside_tested(versions.installed_versions())
    written_for = ", ".join(f"{name} {version}" for name, version in versions.TESTED_VERSIONS.items())
    another_version = f"they were written for {written_for}; this is {', '.join(other)}" if other else None
    for patch in patches:
        if patch.target in _INSTALLED:
            continue
        found = another_version or _fitting(patch)
        if isinstance(found, str):
            _REFUSED[patch.target] = found
            continue
        owner, name, keras_function = found
        _REFUSED.pop(patch.target, None)
        _INSTALLED[patch.target] = (owner, name, vars(owner).get(name, _INHERITED))
        if patch.attached:
            _ATTACHABLE[patch.target] = (name, _dispatching(patch, keras_function, serves))
        else:
            setattr(owner, name, _dispatching(patch, keras_function, serves))


def attach(obj, target: str) -> None:
    """Gives `obj` the installed `attached` patch of `target`, as a method of that object alone (once); nothing where
    the patch is not installed (`refused()` says why, and tfdist's strategies refuse to start)."""
    if target not in _ATTACHABLE:
        return
    given = _ATTACHED.setdefault(obj, set())
    if target not in given:
        name, dispatch = _ATTACHABLE[target]
        setattr(obj, name, types.MethodType(dispatch, obj))
        given.add(target)


def _dispatching(patch: Patch, keras_function, serves):
    replacement = patch.make(keras_function)
    if patch.strategy_of is None:
        def dispatch(*args, **kwargs):
            return replacement(*args, **kwargs)
    else:
        def dispatch(*args, **kwargs):
            if serves(patch, patch.strategy_of(*args, **kwargs)):
                return replacement(*args, **kwargs)
            return keras_function(*args, **kwargs)
    functools.update_wrapper(dispatch, keras_function)
    dispatch.tfdist_patch = patch
    return dispatch


def installed() -> list[str]:
    """The targets patched now."""
    return list(_INSTALLED)


def refused() -> dict[str, str]:
    """Target -> why its patch was not installed."""
    return dict(_REFUSED)


def remove_all() -> None:
    """Puts Keras's own functions back, last installed first, and takes the attached patches off their objects."""
    for obj, targets in list(_ATTACHED.items()):
        for target in targets:
            vars(obj).pop(_ATTACHABLE[target][0], None)
    for target, (owner, name, before) in reversed(list(_INSTALLED.items())):
        if target in _ATTACHABLE:
            continue
        if before is _INHERITED:
            delattr(owner, name)
        else:
            setattr(owner, name, before)
    _INSTALLED.clear()
    _REFUSED.clear()
    _ATTACHABLE.clear()
    _ATTACHED.clear()
