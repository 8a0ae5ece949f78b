"""The registry: each row of the tinker SDK's public surface (sdk_surface.py) -> what the engine does with it
and the tests that show it with the unmodified SDK against a real engine. The rows are written in
sdk_surface_rows.py (the clients' methods and options) and sdk_surface_types.py (the request types);
`registry()` reads both.

A row's tests are pytest node ids. `probe(...)` names calls of the SDK probe (bench/sdk_probe*.py) that
tests/engine/test_sdk_calls.py runs as tests: used where no dedicated test exercises the row. A new SDK
release's rows have no entry here until a test exercises them: tests/foundation/test_sdk_surface.py
fails until then.
"""

from __future__ import annotations

from sdk_surface import Entry

SDK = "tests/engine/test_engine_sdk.py::"
S038 = "tests/engine/test_engine_sdk_038.py::"
SAMPLING = "tests/engine/test_engine_sdk_038_sampling.py::"
LOSSES = "tests/engine/test_engine_sdk_038_losses.py::"
REST = "tests/engine/test_engine_sdk_038_rest.py::"
EXTERNAL = "tests/engine/test_engine_external_weights.py::"
MEMORY = "tests/engine/test_engine_memory.py::"
SNAPSHOTS = "tests/engine/test_engine_snapshots.py::"
PARITY = "tests/engine_core/test_tinker_parity.py::"
COOKBOOK = "tests/cookbook/test_cookbook_loops.py::"
PROBE_TEST = "tests/engine/test_sdk_calls.py::test_sdk_call"

REGISTRY: dict[str, Entry] = {}


def probe(*slugs: str) -> tuple[str, ...]:
    return tuple(f"{PROBE_TEST}[{slug}]" for slug in slugs)


def cited_calls() -> dict[str, str]:
    """slug -> status of the probe calls the registry cites (a call is cited with one status only)."""
    cited: dict[str, str] = {}
    for entry in registry().values():
        for test in entry.tests:
            if test.startswith(f"{PROBE_TEST}["):
                slug = test.removeprefix(f"{PROBE_TEST}[").removesuffix("]")
                assert cited.setdefault(slug, entry.status) == entry.status, (
                    f"{slug} cited as works and refused"
                )
                cited[slug] = entry.status
    return cited


def works(*tests: str | tuple[str, ...], note: str = "") -> Entry:
    return Entry("works", _flat(tests), note)


def refused(note: str, *tests: str | tuple[str, ...]) -> Entry:
    return Entry("refused", _flat(tests), note)


def _flat(tests: tuple[str | tuple[str, ...], ...]) -> tuple[str, ...]:
    return tuple(t for item in tests for t in ((item,) if isinstance(item, str) else item))


def add(entry: Entry, *rows: str) -> None:
    for row in rows:
        assert row not in REGISTRY, f"{row} has two entries"
        REGISTRY[row] = entry


def method(name: str, names: str, entry: Entry) -> None:
    """`name` and each of its space-separated options (or fields), all shown by the same tests."""
    add(entry, name)
    options(name, names, entry)


def options(name: str, names: str, entry: Entry) -> None:
    """Options of `name` only: a method's (`name(option)`) or a client's or type's fields."""
    dotted = (
        name[0].isupper() and "." not in name and name not in ("ServiceClient", "RestClient", "AdminClient")
    )
    add(entry, *(f"{name}.{n}" if dotted else f"{name}({n})" for n in names.split()))


def values(row: str, literals: str, entry: Entry) -> None:
    """Each value of a Literal option: `row` is `Client.method(param` or `Type.field`."""
    close = ")" if "(" in row else ""
    parsed = [int(v) if v.isdigit() else v for v in literals.split()]
    add(entry, *(f"{row}={value!r}{close}" for value in parsed))


def registry() -> dict[str, Entry]:
    import sdk_surface_rows  # noqa: F401 - each adds its rows
    import sdk_surface_types  # noqa: F401

    return REGISTRY
