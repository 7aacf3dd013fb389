"""tfdist's port of Horovod's TensorFlow APIs has every name Horovod's modules have, through their submodules, and
docs/api.md gives a reason for each name that is not Horovod's own."""

import __future__
import importlib
import os
import re
import types

import pytest

from helpers import ROOT

pytestmark = pytest.mark.horovod

PORTS = {"horovod.tensorflow": "tfdist.horovod.tensorflow",
         "horovod.tensorflow.keras": "tfdist.horovod.tensorflow.keras"}
# Private names Horovod's own tests and users import from these modules.
PRIVATE_IN_USE = {"horovod.tensorflow": {"_executing_eagerly"}, "horovod.tensorflow.util": {"_executing_eagerly"}}


def offered(module) -> dict:
    """The names `module` offers: not private, not a module imported from outside Horovod or tfdist, nor what
    `from __future__`/`typing` put there."""
    names = {}
    for name in dir(module):
        value = getattr(module, name)
        if (name.startswith("_") or isinstance(value, __future__._Feature)
                or getattr(value, "__module__", None) == "typing"
                or isinstance(value, types.ModuleType) and not value.__name__.startswith(("horovod.", "tfdist."))):
            continue
        names[name] = value
    return {**names, **{name: getattr(module, name) for name in PRIVATE_IN_USE.get(module.__name__, ())}}


def module_pairs() -> list:
    """(Horovod's module, the port's) for both modules and every Horovod submodule they offer, walked."""
    pairs, seen = [], set()
    todo = [(importlib.import_module(horovod), importlib.import_module(port)) for horovod, port in PORTS.items()]
    while todo:
        horovod, port = todo.pop()
        pairs.append((horovod, port))
        seen.add(horovod.__name__)
        todo += [(value, getattr(port, name)) for name, value in offered(horovod).items()
                 if isinstance(value, types.ModuleType) and hasattr(port, name)
                 and value.__name__ not in seen | set(PORTS)]
    return pairs


def missing_names() -> list[str]:
    """Every name of Horovod's modules (and of their Horovod submodules) that the port lacks."""
    return sorted(f"{horovod.__name__}.{name}" for horovod, port in module_pairs()
                  for name in offered(horovod) if not hasattr(port, name))


def test_the_port_has_every_name_of_horovods_tensorflow_modules_and_their_submodules():
    assert missing_names() == []


def test_a_name_horovod_lacks_is_found_missing(monkeypatch):
    import horovod.tensorflow.compression as compression

    assert missing_names() == []  # the port imported first: made after the name, it would copy it
    monkeypatch.setattr(compression, "NoSuchCompressor", object(), raising=False)
    assert missing_names() == ["horovod.tensorflow.compression.NoSuchCompressor"]


def _documented_differences() -> dict[str, str]:
    """docs/api.md's table of the port's names that are not Horovod's own: name -> reason."""
    page = open(os.path.join(ROOT, "docs", "api.md"), encoding="utf-8").read()
    table = page[page.index("| name | in the port | why |"):].split("\n\n")[0]
    rows = [line.strip("|").split("|") for line in table.splitlines()[2:]]
    return {name: reason.strip() for names, _, reason in rows for name in re.findall(r"`([\w.]+)`", names)}


def test_the_docs_give_a_reason_for_each_name_that_is_not_horovods_own():
    """tfdist's own objects (made for Keras 3) and names Horovod's module lacks each have a row with a reason."""
    differ = set()
    for horovod, port in module_pairs():
        theirs = offered(horovod)
        differ |= {f"{port.__name__}.{name}" for name, value in offered(port).items()
                   if not isinstance(value, types.ModuleType) and theirs.get(name) is not value}
    documented = _documented_differences()
    assert sorted(differ - set(documented)) == []
    assert sorted(set(documented) - differ) == []  # no row for a name that is Horovod's own, or gone
    assert [name for name, reason in documented.items() if len(reason.split()) < 4] == []


@pytest.mark.parametrize("horovod,port", PORTS.items())
def test_the_ports_all_is_horovods_names_and_what_the_docs_add(horovod, port):
    horovod_module, port_module = importlib.import_module(horovod), importlib.import_module(port)
    horovods = {name for name in offered(horovod_module) if not name.startswith("_")} - {"keras"}
    documented = _documented_differences()
    assert sorted(horovods - set(port_module.__all__)) == []
    assert [name for name in set(port_module.__all__) - horovods if f"{port}.{name}" not in documented] == []
