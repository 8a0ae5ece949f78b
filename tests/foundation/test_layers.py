"""The layers of local processes stay apart, read from the source's import statements (every module,
lazy imports in functions included): the bottom layer (`processes/`) imports nothing of tinkerrpc's,
the engine and the service never import the harness (`local/`) above it, and the service restarts the
engine through the handle it was given."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tinkerrpc_server

pytestmark = pytest.mark.unit

PACKAGE = Path(tinkerrpc_server.__file__).parent
OURS = ("tinkerrpc_server", "tinkerrpc")


def _imports(path: Path) -> set[str]:
    """The absolute names of every module `path` imports (relative imports resolved)."""
    package = ".".join(("tinkerrpc_server", *path.relative_to(PACKAGE).parent.parts))
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                names.add(f"{base}.{node.module}" if node.module else base)
            else:
                assert node.module is not None
                names.add(node.module)
    return names


def _modules(room: str) -> list[Path]:
    found = sorted((PACKAGE / room).rglob("*.py"))
    assert found, f"no modules under {room}/"
    return found


def _importing(room: str, prefixes: tuple[str, ...]) -> dict[str, list[str]]:
    """Each module under `room` that imports a name starting with one of `prefixes`, and those names."""
    found = {}
    for path in _modules(room):
        names = sorted(name for name in _imports(path) if name.startswith(prefixes))
        if names:
            found[str(path.relative_to(PACKAGE))] = names
    return found


def test_the_reader_sees_imports_at_any_depth() -> None:
    # Lazy imports inside functions count: cli.py imports the harness only there.
    assert "tinkerrpc_server.local.launch" in _imports(PACKAGE / "cli.py")
    assert "tinkerrpc_server.processes.children" in _imports(PACKAGE / "local" / "launch.py")


def test_the_bottom_layer_imports_nothing_of_ours() -> None:
    own_layer = "tinkerrpc_server.processes"
    found = _importing("processes", OURS)
    beyond = {module: [n for n in names if not n.startswith(own_layer)] for module, names in found.items()}
    assert {module: names for module, names in beyond.items() if names} == {}


def test_neither_the_engine_nor_the_service_imports_the_harness() -> None:
    harness = ("tinkerrpc_server.local",)
    assert _importing("engine", harness) == {}
    assert _importing("service", harness) == {}
