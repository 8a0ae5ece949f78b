"""The SDK's modules import each other without a circle, and the package's public names load on first
use from the modules its type checkers' imports name.

A circle hidden by a lazy import (one inside a function, or under TYPE_CHECKING) still ties the two
modules together, so every import statement counts, wherever it stands (tests/import_graph.py).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
from import_graph import find_cycle, import_graph

import tinkerrpc

pytestmark = pytest.mark.unit


def test_the_graph_sees_every_kind_of_import() -> None:
    edges = import_graph("tinkerrpc").edges
    assert "tinkerrpc._types" in edges["tinkerrpc._convert"]
    assert "tinkerrpc.v1.types_pb2" in edges["tinkerrpc._calls"]


def test_the_sdk_has_no_import_circle() -> None:
    cycle = find_cycle(import_graph("tinkerrpc").edges)
    assert cycle is None, "import circle: " + " -> ".join(cycle or ())


def test_each_public_name_loads_from_the_module_its_type_checking_import_names() -> None:
    tree = ast.parse(Path(tinkerrpc.__file__ or "").read_text())
    guarded = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    imported = {
        alias.name: node.module
        for node in guarded.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert imported == tinkerrpc._MODULE_OF
    assert sorted(imported) == sorted(tinkerrpc.__all__)
    for name, module in imported.items():
        assert getattr(tinkerrpc, name) is getattr(importlib.import_module(module or ""), name)
    assert set(tinkerrpc.__all__) <= set(dir(tinkerrpc))
    with pytest.raises(AttributeError, match="no_such_name"):
        tinkerrpc.no_such_name  # noqa: B018
