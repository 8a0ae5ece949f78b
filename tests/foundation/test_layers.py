"""Every layer rule the README states, checked on the import graph of the source (tests/import_graph.py):

- `processes/` imports nothing of ours;
- the engine never imports the service or `local/` (nor the sidecar, which sits above the service);
- the service reaches the engine only through the `tinker` SDK: it imports nothing of `engine/`, and
  never `local/`, so it restarts the engine only through the backend it was given;
- the sidecar reaches the service only through the gRPC client: nothing of `service/` or `engine/`;
- the SDK (`tinkerrpc`) never imports `tinkerrpc_server`, torch, tinker or fastapi;
- no import cycle among `tinkerrpc_server`'s modules.

A rule holds for what a layer reaches, not only what it names: a layer importing a module of ours that
imports a forbidden one breaks the rule as surely, and the failure shows the chain. Every import
statement counts, wherever it stands, cycles included: a lazy import in a function defers loading, not
the dependency (the two modules still change together, and a cycle closed lazily still runs the
half-initialised module's code), and the tree has none to excuse. The generated code
(`client/tinkerrpc/v1/`, never edited) is checked against protos/ by tests/foundation/test_packaging.py.
"""

from __future__ import annotations

import pytest
from import_graph import ImportGraph, find_cycle, import_graph

pytestmark = pytest.mark.unit

SERVER = "tinkerrpc_server"
SDK = "tinkerrpc"

# The layer (a module prefix) and the prefixes of ours it must never reach, directly or through others.
LAYER_RULES = {
    "processes/ imports nothing of ours": (f"{SERVER}.processes", (SERVER, SDK)),
    "the engine never imports the service, the sidecar or local/": (
        f"{SERVER}.engine",
        (f"{SERVER}.service", f"{SERVER}.sidecar", f"{SERVER}.local"),
    ),
    "the service reaches the engine only through the tinker SDK and never imports local/": (
        f"{SERVER}.service",
        (f"{SERVER}.engine", f"{SERVER}.sidecar", f"{SERVER}.local"),
    ),
    "the sidecar reaches the service only through the gRPC client": (
        f"{SERVER}.sidecar",
        (f"{SERVER}.service", f"{SERVER}.engine", f"{SERVER}.local"),
    ),
    "the SDK never imports the server": (SDK, (SERVER,)),
}
SDK_NEVER_IMPORTS = ("torch", "tinker", "fastapi")


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == prefix or name.startswith(f"{prefix}.") for prefix in prefixes)


def graph() -> ImportGraph:
    return import_graph(SERVER, SDK)


def test_the_graph_sees_lazy_relative_and_transitive_imports() -> None:
    # cli.py imports the harness only inside a function; the harness imports the bottom layer.
    assert "tinkerrpc_server.local.launch" in graph().edges["tinkerrpc_server.cli"]
    assert "tinkerrpc_server.processes.children" in graph().edges["tinkerrpc_server.local.launch"]
    reached = graph().reached("tinkerrpc_server.cli")
    assert reached["tinkerrpc_server.processes.children"][0] == "tinkerrpc_server.cli"
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("rule", LAYER_RULES)
def test_each_layer_reaches_only_what_the_readme_allows(rule: str) -> None:
    layer, forbidden = LAYER_RULES[rule]
    modules = [name for name in graph().paths if _within(name, (layer,))]
    assert modules, f"no modules under {layer}"
    broken = {
        " -> ".join(chain)
        for module in modules
        for reached, chain in graph().reached(module).items()
        if _within(reached, forbidden) and not _within(reached, (layer,))
    }
    assert sorted(broken) == []


def test_the_sdk_imports_no_torch_tinker_or_fastapi() -> None:
    found = {
        name: sorted(n for n in names if _within(n, SDK_NEVER_IMPORTS))
        for name, names in graph().names.items()
        if _within(name, (SDK,))
    }
    assert {name: names for name, names in found.items() if names} == {}


def test_the_server_has_no_import_cycle() -> None:
    server = {name: edges for name, edges in graph().edges.items() if _within(name, (SERVER,))}
    cycle = find_cycle({name: {e for e in edges if e in server} for name, edges in server.items()})
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())
