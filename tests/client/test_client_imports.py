"""The SDK's modules import each other without a circle.

A circle hidden by a lazy import (one inside a function, or under TYPE_CHECKING) still ties the two
modules together, so every import statement counts, wherever it stands (tests/import_graph.py).
"""

from __future__ import annotations

import pytest
from import_graph import find_cycle, import_graph

pytestmark = pytest.mark.unit


def test_the_graph_sees_every_kind_of_import() -> None:
    edges = import_graph("tinkerrpc").edges
    assert "tinkerrpc._types" in edges["tinkerrpc._convert"]
    assert "tinkerrpc.v1.types_pb2" in edges["tinkerrpc._calls"]


def test_the_sdk_has_no_import_circle() -> None:
    cycle = find_cycle(import_graph("tinkerrpc").edges)
    assert cycle is None, "import circle: " + " -> ".join(cycle or ())
