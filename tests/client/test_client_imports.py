"""The SDK's modules import each other without a circle.

A circle hidden by a lazy import (one inside a function, or under TYPE_CHECKING) still ties the two
modules together, so every import statement counts, wherever it stands.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tinkerrpc

pytestmark = pytest.mark.unit

PACKAGE_DIR = Path(tinkerrpc.__file__).parent
PACKAGE = "tinkerrpc"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports anywhere in its text; `from a import b` names the
    module a.b when that is a module, else a."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {name for name in found if name in modules and name != here}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE_DIR.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imported_modules(p, modules) for p in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules in order, the first repeated at the end), or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return None
        path.append(name)
        for imported in sorted(graph[name]):
            cycle = visit(imported)
            if cycle is not None:
                return cycle
        path.pop()
        done.add(name)
        return None

    return next((c for c in map(visit, sorted(graph)) if c is not None), None)


def test_the_graph_sees_every_kind_of_import() -> None:
    graph = import_graph()
    assert "tinkerrpc._types" in graph["tinkerrpc._convert"]
    assert "tinkerrpc.v1.types_pb2" in graph["tinkerrpc._calls"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_sdk_has_no_import_circle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or ())
