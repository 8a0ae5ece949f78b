"""The import graph of our packages, read from the source's import statements (tests/foundation/
test_layers.py checks the layers and cycles on it, tests/client/test_client_imports.py the SDK's cycles).

Every import statement counts, wherever it stands: inside a function or under TYPE_CHECKING. A lazy
import defers loading a module, not depending on it: the two modules still change together, and the
import runs the first time the function does.
"""

from __future__ import annotations

import ast
import functools
import importlib
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    """The dotted name of the module at `path`, under the directory `root` that holds its package."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path, name: str) -> set[str]:
    """Every absolute name the module `name` at `path` imports (relative imports resolved): `a.b` for
    `import a.b` and for `from a import b`, whether b is a module or a name in a."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


class ImportGraph:
    """The modules of the given packages, every name each imports, and the edges between them."""

    def __init__(self, *packages: str) -> None:
        paths: dict[str, Path] = {}
        for package in packages:
            directory = Path(importlib.import_module(package).__file__ or "").parent
            paths.update({module_name(p, directory.parent): p for p in sorted(directory.rglob("*.py"))})
        self.paths = paths
        self.names = {name: imported_names(path, name) for name, path in paths.items()}
        self.edges = {
            name: {m for m in map(self._module_of, names) if m and m != name}
            for name, names in self.names.items()
        }

    def _module_of(self, name: str) -> str | None:
        """The module an imported name is, or is in (`a.b.f` -> `a.b`); None outside these packages."""
        while name and name not in self.paths:
            name = name.rpartition(".")[0]
        return name or None

    def reached(self, start: str) -> dict[str, list[str]]:
        """Each module `start` imports directly or through others, with one chain of imports to it."""
        chains = {start: [start]}
        todo = [start]
        while todo:
            name = todo.pop()
            for imported in sorted(self.edges[name]):
                if imported not in chains:
                    chains[imported] = [*chains[name], imported]
                    todo.append(imported)
        del chains[start]
        return chains


@functools.cache
def import_graph(*packages: str) -> ImportGraph:
    """The graph of `packages`, read once per test process."""
    return ImportGraph(*packages)


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules in order, the first repeated at the end), or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return None
        path.append(name)
        for imported in sorted(edges[name]):
            cycle = visit(imported)
            if cycle is not None:
                return cycle
        path.pop()
        done.add(name)
        return None

    return next((c for c in map(visit, sorted(edges)) if c is not None), None)
