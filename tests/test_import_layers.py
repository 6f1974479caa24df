"""No import circles inside spanattn: the lower file never imports the upper one. Static, so that
a function-local import (which runs only when called, and so hides a circle from an import at
start-up) counts like any other: every ``import`` and ``from ... import`` of every module,
relative ones resolved, makes an edge to the deepest spanattn module it names (modules loaded by
name through importlib, the backends' registry, are not imports)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "spanattn"


def modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the package (a package is its ``__init__.py``)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(name: str, path: Path, known: dict) -> set[str]:
    """The spanattn modules that module ``name`` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # ``from X import y``: the submodule X.y where y is one, else X itself
            targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    edges = set()
    for target in targets:
        while target and target not in known:  # a name inside a module: that module
            target = target.rpartition(".")[0]
        if target and target != name:
            edges.add(target)
    return edges


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as a path (its first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_spanattn_has_no_import_circle():
    known = modules()
    graph = {name: imported(name, path, known) for name, path in known.items()}
    assert len(graph) > 50 and "spanattn.backends.triton.decode" in graph["spanattn.backends.triton"]
    found = cycle(graph)
    assert found is None, "import circle: " + " -> ".join(found)


def test_the_walk_sees_local_and_relative_imports():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert cycle(graph) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None
    known = modules()
    tiles = imported("spanattn.tiles", known["spanattn.tiles"], known)
    assert {"spanattn.plan", "spanattn.tiles_triton"} <= tiles  # tiles_triton: imported in a function
