"""The layout keeps its architecture: imports run down the layers, never in a cycle, and strategies are
asked only through their contract (docs/architecture.md draws the layers)."""

import ast
import os
import re

from helpers import ROOT

# Lowest first: each of tfdist's packages and top-level modules, by name. A module may import from its own
# package's layer and the ones before it, so the folders alone show the layering.
LAYERS = [
    ("foundation", ["errors", "config", "tf_startup", "checkpoint_store", "user_code", "timing", "memory_limit",
                    "_compat"]),
    ("contract", ["contract"]),
    ("parts", ["cluster", "parallel", "layers", "data", "horovod", "precision", "optimizers", "models", "reporting"]),
    ("strategies", ["strategies", "callbacks"]),
    ("training", ["training", "horovod_keras"]),
    ("entry points", ["launch", "bench", "plan", "cli", "__init__"]),
]


def _modules() -> dict[str, str]:
    found = {}
    for directory, _, files in os.walk(os.path.join(ROOT, "tfdist")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[module.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _owner(name: str):
    """The module `name` lives in (`tfdist.cluster.roles.cluster_of` -> `tfdist.cluster.roles`)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[str]:
    """The tfdist modules `module` imports, at any depth of its code (a function's lazy import counts)."""
    found = set()
    for node in ast.walk(ast.parse(open(MODULES[module]).read())):
        if isinstance(node, ast.Import):
            found |= {_owner(alias.name) for alias in node.names if alias.name.startswith("tfdist")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tfdist"):
            found |= {_owner(f"{node.module}.{alias.name}") for alias in node.names}
    return found - {None, module}


GRAPH = {module: _imports(module) for module in MODULES}


def _package(module: str) -> str:
    """`tfdist.strategies.pipeline` -> `strategies`; `tfdist` itself -> `__init__`."""
    return module.split(".")[1] if "." in module else "__init__"


def _layer(module: str) -> int:
    return next(rank for rank, (_, packages) in enumerate(LAYERS) if _package(module) in packages)


def test_every_package_has_one_layer_and_every_layer_names_packages_that_exist():
    listed = [package for _, packages in LAYERS for package in packages]
    assert sorted(listed) == sorted({_package(module) for module in MODULES})


def test_imports_run_down_the_layers():
    upward = [f"{module} ({LAYERS[_layer(module)][0]}) imports {target} ({LAYERS[_layer(target)][0]})"
              for module, targets in GRAPH.items() for target in targets if _layer(target) > _layer(module)]
    assert upward == []


def test_the_runtime_never_imports_the_launchers_nor_horovod_the_strategies():
    crossing = [(module, target) for module, targets in GRAPH.items() for target in targets
                if (module.startswith("tfdist.cluster") and target.startswith("tfdist.launch"))
                or (module.startswith("tfdist.horovod.") and target.startswith("tfdist.strategies"))]
    assert crossing == []


def test_there_are_no_import_cycles():
    cycles, visiting, done = [], [], set()

    def visit(module):
        if module in visiting:
            cycles.append(visiting[visiting.index(module):] + [module])
            return
        if module in done:
            return
        visiting.append(module)
        for target in sorted(GRAPH[module]):
            visit(target)
        visiting.pop()
        done.add(module)

    for module in sorted(GRAPH):
        visit(module)
    assert cycles == []


STRATEGY = re.compile(r"(\b|_)strategy\b|get_strategy\(")  # `strategy`, `model.distribute_strategy`, ...


def test_strategies_are_asked_only_through_the_contract():
    probes = []
    for module, path in MODULES.items():
        if module == "tfdist.contract":
            continue
        source = open(path).read()
        for node in ast.walk(ast.parse(source)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr")
                    and node.args and STRATEGY.search(ast.get_source_segment(source, node.args[0]))):
                probes.append(f"{module}:{node.lineno} {ast.get_source_segment(source, node)}")
    assert probes == []


TREES = {module: ast.parse(open(path).read()) for module, path in MODULES.items()}


def _names_tfdist_defines() -> set[str]:
    """Every function, class and argument tfdist defines, and every attribute it sets on `self` or `cls`."""
    names = set()
    for tree in TREES.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                names.add(node.attr)
    return names


def test_tensorflow_and_keras_internals_are_reached_only_from_compat():
    """Outside `tfdist._compat`: no `tensorflow.python` or `keras.src` import, no `tf.__internal__`, and no
    `x._name` that tfdist does not define itself, so that an upgrade that moves one breaks one package.
    `self._name` is allowed (a class extending one of theirs, from `_compat.tf_distribute`), as are `os._exit`
    and the `_tfdist_*` marks tfdist leaves on Keras's objects."""
    ours, reaches = _names_tfdist_defines(), []
    for module, tree in TREES.items():
        if module.startswith("tfdist._compat"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                named = [getattr(node, "module", None) or ""] + [alias.name for alias in node.names]
                reaches += [f"{module}:{node.lineno} import {name}" for name in named
                            if name.startswith(("tensorflow.python", "keras.src"))]
            elif isinstance(node, ast.Attribute) and node.attr == "__internal__":
                reaches.append(f"{module}:{node.lineno} __internal__")
            elif (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                  and not node.attr.startswith("_tfdist") and node.attr not in ours
                  and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "os"))):
                reaches.append(f"{module}:{node.lineno} .{node.attr}")
    assert reaches == []
