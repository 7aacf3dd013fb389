"""Finding the user's own functions named in a config as `MODULE:FUNCTION`.

Importing the module runs the user's code, as `python -m` would; the module is
looked up on `sys.path` (the working directory and `PYTHONPATH`).

Example:

    >>> import_function("os.path:join", "model.name")("a", "b")
    'a/b'
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Callable

from tfdist.errors import ConfigError

__all__ = ["call_function", "import_function"]


def import_function(reference: str, key: str) -> Callable:
    """The function `MODULE:FUNCTION` names.

    Raises:
      ConfigError: the module cannot be imported, or has no such callable.
    """
    module_name, _, function_name = reference.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m` does: the working directory first
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(key, f"names a module that cannot be imported ({e}); it is looked up on PYTHONPATH.",
                          reference) from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ConfigError(key, f"names no function of module {module_name} ({module.__file__}).", reference)
    return function


def call_function(reference: str, key: str, **kwargs):
    """Calls the function `MODULE:FUNCTION` names with `kwargs`, after checking that it takes them.

    Raises:
      ConfigError: it cannot be imported, or cannot be called with these arguments
        (the message shows the call tfdist makes and the function's signature).
    """
    function = import_function(reference, key)
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # some built-ins have none; the call itself will tell
        signature = None
    if signature is not None:
        try:
            signature.bind(**kwargs)
        except TypeError as e:
            call = ", ".join(f"{name}=..." for name in kwargs)
            raise ConfigError(key, f"must name a function tfdist can call as FUNCTION({call}); "
                                   f"{reference.partition(':')[2]}{signature} cannot be ({e}).", reference) from None
    return function(**kwargs)
