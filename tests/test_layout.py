"""The layout: the packages import one way, topologies <- twin <- {calibration, backend}; no module
imports itself back through others; twin/ and backend/ keep their modules in subpackages.

Read from the source with ast, nothing imported (a fraction of a second). Every import counts, those
inside functions too, except the ones under `if TYPE_CHECKING:` for the cycles (annotations only: they
never run). What a package adds to another at run time goes through entry points (pyproject.toml:
calibration's `twin calibrate`, `twin validate` and the report's validation), which are not imports.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("topologies", "twin", "backend", "calibration")
# package -> the top-level packages it must not import
FORBIDDEN = {"topologies": {"twin", "backend", "calibration"}, "twin": {"calibration", "backend", "torch"}}
MAX_FLAT = 8  # .py files directly in twin/ and backend/


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (its file, whether it is a package's __init__)."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            init = parts[-1] == "__init__"
            out[".".join(parts[:-1] if init else parts)] = (path, init)
    return out


MODULES = _modules()


@functools.cache
def _tree(name: str) -> ast.Module:
    path = MODULES[name][0]
    return ast.parse(path.read_text(), str(path))


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str, with_type_checking: bool) -> list[str]:
    """The dotted names module `name` imports, anywhere in its file; `from a.b import c` gives a.b.c
    when that is a module, a.b otherwise. Relative imports are resolved."""
    init = MODULES[name][1]
    out = []
    todo = list(_tree(name).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _is_type_checking(node) and not with_type_checking:
            todo += node.orelse
            continue
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                base = name if init else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                mod = f"{base}.{mod}" if mod else base
            out += [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
        todo += ast.iter_child_nodes(node)
    return out


def _ours(dotted: str) -> str | None:
    """The module of ours that `import dotted` runs (its longest known prefix), or None."""
    while dotted and dotted not in MODULES:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_nothing_from_the_packages_above_it(package):
    bad = [f"{name} imports {dotted}" for name in MODULES if name.split(".")[0] == package
           for dotted in _imports(name, with_type_checking=True) if dotted.split(".")[0] in FORBIDDEN[package]]
    assert not bad, "\n".join(bad)


def test_no_module_imports_itself_back_through_others():
    graph = {name: {m for d in _imports(name, with_type_checking=False) if (m := _ours(d)) and m != name}
             for name in MODULES}
    assert not _cycles(graph), _cycles(graph)


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", ["twin", "backend"])
def test_twin_and_backend_keep_their_modules_in_subpackages(package):
    flat = sorted(p.name for p in (ROOT / package).glob("*.py"))
    assert len(flat) <= MAX_FLAT, flat


@pytest.mark.parametrize("package", ["twin", "backend"])
def test_the_subpackages_of_twin_and_backend_import_one_way(package):
    """No subpackage imports another that imports it back (twin.engine and twin.engine.lockstep, say, or
    backend.training and backend.runtime): each folder sits above the ones it uses."""
    def folder(name: str) -> str:
        return ".".join(name.split(".")[:2])

    graph: dict[str, set[str]] = {}
    for name in MODULES:
        if name.split(".")[0] == package and name != package:
            uses = {folder(m) for d in _imports(name, with_type_checking=False)
                    if (m := _ours(d)) and m.split(".")[0] == package and m != package}
            graph.setdefault(folder(name), set()).update(uses - {folder(name)})
    for uses in list(graph.values()):
        for f in uses:
            graph.setdefault(f, set())
    assert not _cycles(graph), _cycles(graph)
