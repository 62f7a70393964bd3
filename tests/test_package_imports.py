"""The package's import graph, read from the source with ``ast`` (module-level and function-level
imports alike, nothing executed): no circles, no ``_private`` name taken from another module, and
data flows one way, front door -> ``autoshard.passes`` -> ``autoshard.runtime``:

- ``autoshard.passes`` imports neither ``autoshard.runtime`` nor the front door;
- ``autoshard.runtime`` does not import the front door;
- nothing imports ``autoshard.testing`` (the tests' and benchmarks' support; it may import anything);
- inside ``autoshard.passes`` the stages run in order, capture -> sharding -> cost -> solve ->
  pipeline: a stage imports the vocabulary (the loose modules, ``layout``) and the stages before
  it, never one after it, and the vocabulary imports no stage;
- the runtime never reaches a planner (``PLANNERS``), even through other modules: it runs plans, it
  makes none.

The front door is ``autoshard`` itself and every module of it outside ``passes``, ``runtime`` and
``testing`` (``api``, ``compiled``, ``drawing``, ``profiling``, ...). Also: every package's
``__init__`` has a docstring that says what the package is for and what it may import.
``test_the_checks_catch_each_kind_of_violation`` runs the checks on a made-up package, so a check
that silently passes everything fails there.
"""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import NamedTuple

ROOTS = ("autoshard", "autoshard.passes", "autoshard.runtime")
LAYERS = ("frontdoor", "passes", "runtime", "testing")
#: layer -> the layers it must not import
FORBIDDEN = {"passes": {"runtime", "frontdoor", "testing"}, "runtime": {"frontdoor", "testing"},
             "frontdoor": {"testing"}, "testing": set()}


#: the modules that choose plans (the ILPs, the searches and re-planning): the runtime reaches none
PLANNERS = ("autoshard.passes.solve.planner", "autoshard.passes.solve.ilp", "autoshard.passes.pipeline.stages.planner",
            "autoshard.passes.pipeline.stages.search", "autoshard.passes.pipeline.stages.stage_ilp",
            "autoshard.passes.pipeline.stages.retrace")


class Module(NamedTuple):
    source: str
    is_package: bool
    path: str


class Edge(NamedTuple):
    """``source`` imports ``target`` (a module of the package) at ``line``; ``name`` is the name taken
    by a ``from target import name`` that is not itself a module, else None."""
    source: str
    target: str
    name: str | None
    line: int


def read_package() -> dict[str, Module]:
    """Every module of the installed package by dotted name, found through its package directories
    (``passes/`` and ``runtime/`` install as ``autoshard.passes`` and ``autoshard.runtime``)."""
    modules: dict[str, Module] = {}
    for root in ROOTS:
        base = Path(importlib.util.find_spec(root).submodule_search_locations[0])
        for init in sorted(base.rglob("__init__.py")):
            rel = init.parent.relative_to(base)
            if not all((base / Path(*rel.parts[:k]) / "__init__.py").exists() for k in range(len(rel.parts) + 1)):
                continue  # a folder below one that is not a package
            package = ".".join((root, *rel.parts))
            for file in sorted(init.parent.glob("*.py")):
                name = package if file.name == "__init__.py" else f"{package}.{file.stem}"
                modules[name] = Module(file.read_text(), file.name == "__init__.py", str(file))
    return modules


def _absolute(module: str, is_package: bool, target: str | None, level: int) -> str:
    if not level:
        return target or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[:len(parts) - (level - 1)]
    return ".".join(parts + ([target] if target else []))


def import_edges(modules: dict[str, Module]) -> list[Edge]:
    """Every import anywhere in each module's body (functions included) of another module of the package."""
    edges = []
    for name, module in modules.items():
        for node in ast.walk(ast.parse(module.source, module.path)):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules:
                        edges.append(Edge(name, alias.name, None, node.lineno))
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(name, module.is_package, node.module, node.level)
                for alias in node.names:
                    if f"{base}.{alias.name}" in modules:
                        edges.append(Edge(name, f"{base}.{alias.name}", None, node.lineno))
                    elif base in modules:
                        edges.append(Edge(name, base, alias.name, node.lineno))
    return edges


def circles(edges: list[Edge]) -> list[list[str]]:
    """One circle (``[a, b, ..., a]``) per strongly connected group of modules (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph[v]:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_circle_through(min(group), group, graph) for group in groups]


def _circle_through(start: str, group: set[str], graph: dict[str, set[str]]) -> list[str]:
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start] + path[::-1][1:] + [start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle through {start}")  # unreachable for a strongly connected group


def private_imports(edges: list[Edge]) -> list[str]:
    return [f"{e.source}:{e.line} takes {e.name} from {e.target}" for e in edges
            if e.name and e.name.startswith("_") and not e.name.startswith("__") and e.target != e.source]


def layer(module: str) -> str:
    for prefix in ("autoshard.passes", "autoshard.runtime", "autoshard.testing"):
        if module == prefix or module.startswith(prefix + "."):
            return prefix.split(".")[1]
    return "frontdoor"


def layer_violations(edges: list[Edge]) -> list[str]:
    return [f"{e.source}:{e.line} ({layer(e.source)}) imports {e.target} ({layer(e.target)})" for e in edges
            if layer(e.target) in FORBIDDEN[layer(e.source)]]


#: the stages of ``autoshard.passes``, in the order a plan is made; every other module is vocabulary
STAGES = ("capture", "sharding", "cost", "solve", "pipeline")


def stage(module: str) -> str | None:
    """The stage of a ``passes`` module ("vocabulary" for the shared modules), None outside passes."""
    parts = module.split(".")
    if parts[:2] != ["autoshard", "passes"]:
        return None
    return parts[2] if len(parts) > 2 and parts[2] in STAGES else "vocabulary"


def stage_order_violations(edges: list[Edge]) -> list[str]:
    def late(source: str, target: str) -> bool:
        if target == "vocabulary" or source == target:
            return False
        return source == "vocabulary" or STAGES.index(target) > STAGES.index(source)

    return [f"{e.source}:{e.line} ({stage(e.source)}) imports {e.target} ({stage(e.target)}), a later stage"
            for e in edges if stage(e.source) and stage(e.target) and late(stage(e.source), stage(e.target))]


def runtime_reaching_planners(edges: list[Edge]) -> list[str]:
    """``runtime module -> planner`` for each planner a runtime module imports, directly or not."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
    found = []
    for start in sorted(m for m in graph if layer(m) == "runtime"):
        seen, todo = set(), [start]
        while todo:
            for target in graph.get(todo.pop(), ()):
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        found += [f"{start} -> {p}" for p in PLANNERS if p in seen]
    return found


# ---- the package ---------------------------------------------------------------------------------

def test_the_walk_sees_every_stage_and_function_level_imports():
    modules = read_package()
    for name in ("autoshard", "autoshard.api", "autoshard.drawing.dot", "autoshard.passes.capture.export",
                 "autoshard.passes.sharding.rules.matmul", "autoshard.runtime.pipeline.interpreter",
                 "autoshard.testing.models"):
        assert name in modules, name
    edges = import_edges(modules)
    assert len(edges) > 200 and {layer(e.source) for e in edges} == set(LAYERS)


def test_no_import_circles():
    found = circles(import_edges(read_package()))
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_private_names_from_another_module():
    found = private_imports(import_edges(read_package()))
    assert not found, "\n".join(found)


def test_front_door_then_passes_then_runtime():
    found = layer_violations(import_edges(read_package()))
    assert not found, "\n".join(found)


def test_passes_stages_import_only_earlier_stages_and_the_vocabulary():
    found = stage_order_violations(import_edges(read_package()))
    assert not found, "\n".join(found)


def test_the_runtime_never_reaches_a_planner():
    modules = read_package()
    assert all(p in modules for p in PLANNERS), [p for p in PLANNERS if p not in modules]
    found = runtime_reaching_planners(import_edges(modules))
    assert not found, "\n".join(found)


def test_every_package_says_what_it_is_for_and_what_it_may_import():
    packages = {name: ast.get_docstring(ast.parse(m.source)) or ""
                for name, m in read_package().items() if m.is_package}
    assert len(packages) >= 15
    missing = [name for name, doc in packages.items() if not doc.strip()]
    assert not missing, f"packages without a docstring: {missing}"
    silent = [name for name, doc in packages.items() if "may import" not in doc.lower()]
    assert not silent, f"package docstrings that do not say what the package may import: {silent}"


# ---- the checks themselves, on a made-up package --------------------------------------------------

def _fake(sources: dict[str, str]) -> list[Edge]:
    packages = {"autoshard", "autoshard.passes", "autoshard.runtime", "autoshard.testing"}
    return import_edges({name: Module(text, name in packages, name) for name, text in sources.items()})


def test_the_checks_catch_each_kind_of_violation():
    edges = _fake({
        "autoshard": "",
        "autoshard.api": "",
        "autoshard.passes": "",
        "autoshard.passes.spec": "def f():\n    from autoshard.passes.solve import plan\n",  # function-level
        "autoshard.passes.solve": "from .spec import _helper, __doc__\nfrom autoshard.runtime import lower\n",
        "autoshard.runtime": "",
        "autoshard.runtime.lower": "import autoshard.api\nfrom autoshard.testing import models\n",
        "autoshard.testing": "",
        "autoshard.testing.models": "import autoshard.api\n",
        "autoshard.passes.capture": "from autoshard.passes.sharding import schema\nfrom autoshard.passes import spec\n",
        "autoshard.passes.sharding": "",
        "autoshard.passes.sharding.schema": "",
        "autoshard.passes.layout": "from autoshard.passes.cost import model\n",
        "autoshard.passes.cost": "from autoshard.passes.sharding import schema\n",
        "autoshard.passes.cost.model": "",
        "autoshard.runtime.pipeline": "from autoshard.passes.solve import helper\n",
        "autoshard.passes.solve.helper": "from autoshard.passes.solve import planner\n",
        "autoshard.passes.solve.planner": "",
    })
    assert circles(edges) == [["autoshard.passes.solve", "autoshard.passes.spec", "autoshard.passes.solve"]]
    assert private_imports(edges) == ["autoshard.passes.solve:1 takes _helper from autoshard.passes.spec"]
    assert stage_order_violations(edges) == [
        "autoshard.passes.spec:2 (vocabulary) imports autoshard.passes.solve (solve), a later stage",
        "autoshard.passes.capture:1 (capture) imports autoshard.passes.sharding.schema (sharding), a later stage",
        "autoshard.passes.layout:1 (vocabulary) imports autoshard.passes.cost.model (cost), a later stage",
    ]
    assert layer_violations(edges) == [
        "autoshard.passes.solve:2 (passes) imports autoshard.runtime.lower (runtime)",
        "autoshard.runtime.lower:1 (runtime) imports autoshard.api (frontdoor)",
        "autoshard.runtime.lower:2 (runtime) imports autoshard.testing.models (testing)",
    ]
    assert runtime_reaching_planners(edges) == ["autoshard.runtime.pipeline -> autoshard.passes.solve.planner"]
