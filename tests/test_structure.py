"""The import structure of src/fastkda, read from the source (the AST of every module, imports at
module level and inside functions alike): no import circles, and library code does not import the
test helpers of fastkda.testing; and no test, tool or benchmark assigns a module-level variable of
fastkda (monkeypatching included): overrides go through the library's own per-call means.""" 

from __future__ import annotations

import ast
import pathlib

import pytest

import fastkda

PACKAGE = pathlib.Path(fastkda.__file__).resolve().parent
TESTING = "fastkda.testing"

# Modules that import fastkda.testing by design: the `fastkda check` command compares the operators
# against its float64 reference.
TEST_HARNESSES = {"fastkda.cli"}


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    """{dotted name: (file, is a package)} of every module under src/fastkda."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


MODULES = _modules()


def _packages(name: str) -> set[str]:
    """The packages above ``name``: importing it runs their __init__ modules first."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _imported(module: str, source: str, is_package: bool, known) -> set[str]:
    """The modules of ``known`` that ``module`` (of this source) names in its import statements,
    wherever they stand (a function's body too), relative imports resolved; ``from a import b``
    names a.b when that is a module, else a."""
    here = module if is_package else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = here.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module
            names.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    found = set()
    for name in names:
        while name and name not in known:  # an attribute of a module, or a module outside the package
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)
    return found


IMPORTED = {m: _imported(m, path.read_text(), is_package, MODULES) for m, (path, is_package) in MODULES.items()}


def _graph(imported: dict[str, set[str]]) -> dict[str, set[str]]:
    """{module: the modules importing it runs}: what it imports and the packages above those, less
    the packages above itself (they are loaded before it)."""
    return {m: {p for t in targets for p in {t} | _packages(t)} - _packages(m) - {m} for m, targets in imported.items()}


def _way_back(graph: dict[str, set[str]], comp: set[str], start: str) -> list[str]:
    """A shortest circle from ``start`` through the modules of ``comp``, ``start`` at both ends."""
    came_from, frontier = {start: None}, [start]
    while True:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    return path[::-1] + [start]
                if w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt


def _components(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module: each holds one circle or more."""
    index, low, stack, on_stack, comps = {}, {}, [], set(), []

    def visit(v):  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through every component of :func:`_components`."""
    return [_way_back(graph, comp, min(comp)) for comp in _components(graph)]


def test_the_graph_sees_every_kind_of_import():
    """Imports inside functions, relative ones, ``from a import b`` of a module or of a name, and
    the packages a submodule import runs; circles through those."""
    known = {"p", "p.a", "p.b", "p.q", "p.q.c", "p.q.d"}
    source = """
from .. import a
from .c import name
import torch
def f():
    from ..b import thing
    import p.q.d
"""
    assert _imported("p.q.x", source, False, known) == {"p.a", "p.q.c", "p.b", "p.q.d"}
    assert _imported("p.q", "from .c import name\nfrom . import d\n", True, known) == {"p.q.c", "p.q.d"}
    assert _imported("p.a", "from . import a, b\n", False, known) == {"p.b"}  # not itself
    graph = _graph({"p": {"p.a"}, "p.a": {"p.q.c"}, "p.q": {"p.a"}, "p.q.c": set(), "p.b": set()})
    assert graph["p.a"] == {"p.q", "p.q.c"}  # p.q's __init__ runs first; p is above p.a itself
    assert _cycles(graph) == [["p.a", "p.q", "p.a"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    """No module imports (even lazily, inside a function) a module that imports it back, directly or
    through others."""
    graph = _graph(IMPORTED)
    comps = _components(graph)
    assert not comps, "import circles (one shown per group of modules that reach each other):\n" + "\n".join(
        f"{' -> '.join(_way_back(graph, comp, min(comp)))}  (the group: {', '.join(sorted(comp))})" for comp in comps)


def test_the_exceptions_are_modules():
    gone = TEST_HARNESSES - set(MODULES)
    assert not gone, f"not modules of fastkda (remove them from the sets): {sorted(gone)}"


@pytest.mark.parametrize("module", sorted(set(MODULES) - {TESTING}))
def test_library_code_does_not_import_testing(module):
    imports = TESTING in IMPORTED[module]
    if module not in TEST_HARNESSES:
        assert not imports, f"{module} imports {TESTING}, the test helpers (float64 reference included)"


def test_the_package_does_not_reach_testing():
    """No import in what ``import fastkda`` loads, at module level or in a function, leads to
    fastkda.testing, other than through the modules named above."""
    graph, seen, todo = _graph(IMPORTED), set(), ["fastkda"]
    while todo:
        m = todo.pop()
        if m in seen or m in TEST_HARNESSES:
            continue
        seen.add(m)
        todo.extend(graph[m])
    assert TESTING not in seen


REPO = PACKAGE.parent.parent
SCRIPTS = sorted(p for d in ("tests", "tools", "benchmarks") for p in (REPO / d).glob("*.py")) if (REPO / "tests").is_dir() else []


def _module_aliases(tree: ast.AST) -> set[str]:
    """Names bound to fastkda modules in a script: ``import fastkda.x as n``, ``from fastkda.x import
    module``, ``from fastkda import module``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "fastkda":
                    names.add(a.asname or "fastkda")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fastkda":
            for a in node.names:
                if f"{node.module}.{a.name}" in MODULES:
                    names.add(a.asname or a.name)
    return names


def _module_assignments(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    mods = _module_aliases(tree)
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for t in targets:
            for e in ast.walk(t):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id in mods:
                    found.append(f"{path.name}:{node.lineno}: {e.value.id}.{e.attr} = ...")
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("setattr", "delattr", "setitem") and node.args:
                a0 = node.args[0]
                if (isinstance(a0, ast.Name) and a0.id in mods) or (
                        isinstance(a0, ast.Constant) and isinstance(a0.value, str) and a0.value.startswith("fastkda.")):
                    found.append(f"{path.name}:{node.lineno}: {name}({ast.unparse(a0)}, ...)")
    return found


@pytest.mark.skipif(not SCRIPTS, reason="the repository's tests, tools and benchmarks are not beside the package")
def test_no_module_variable_assigned_from_outside():
    """Tests, tools and benchmarks change no module-level variable of fastkda (no monkeypatching of
    its modules): the Triton backend's tuning goes through plan.tuned, recorded launches through
    common.recorded_launches, caches through their own clear functions."""
    found = [f for p in SCRIPTS for f in _module_assignments(p)]
    assert not found, "\n".join(found)
