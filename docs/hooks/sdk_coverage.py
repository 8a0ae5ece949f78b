"""MkDocs hook: the Tinker SDK coverage table, written at build time from the SDK surface registry.

tests/sdk_surface.py enumerates the installed tinker SDK's public surface by introspection and
tests/sdk_registry.py says, for each row, whether the engine answers it or refuses it (and why) and which
tests show it; tests/foundation/test_sdk_surface.py fails when a row has no entry. A page holding the
placeholder below gets the table in its place, so the page lists exactly what the installed SDK offers
and what the tests show. The build fails when the registry cannot be read.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from itertools import groupby
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[2] / "tests"
PLACEHOLDER = "<!-- sdk-coverage -->"


def _group(row: str) -> str:
    """The method (`Client.method`), client constructor (`Client`) or request type (`Type`) of a row."""
    if "(" in row:
        return row.split("(", 1)[0]
    if row.split(".", 1)[0].endswith("Client"):
        return row
    return row.split(".", 1)[0]


def _option(row: str, group: str) -> str:
    return row.removeprefix(group).removeprefix(".").removeprefix("(").removesuffix(")")


def _test_name(node_id: str) -> str:
    path, _, name = node_id.partition("::")
    return f"`{Path(path).name}::{name}`"


def _status(entry: Any) -> str:
    text = "works" if entry.status == "works" else "**refused**"
    return f"{text}: {entry.note}" if entry.note else text


def _table_rows(rows: list[str], registry: dict[str, Any]) -> Iterator[str]:
    """One line per run of a method's (or type's) rows that share an entry: the same status and tests."""
    for group, owned in groupby(rows, key=_group):
        for _, same in groupby(owned, key=lambda r: registry[r]):
            same_rows = list(same)
            entry = registry[same_rows[0]]
            named = ", ".join(f"`{o}`" for o in (_option(r, group) for r in same_rows) if o)
            what = f"`{group}`" + (f": {named}" if named else "")
            tests = "<br>".join(_test_name(t) for t in entry.tests)
            yield f"| {what} | {_status(entry)} | {tests} |"


def coverage_markdown() -> str:
    sys.path.insert(0, str(TESTS))
    try:
        import tinker
        from sdk_registry import registry
        from sdk_surface import surface

        rows, entries = surface(), registry()
    finally:
        sys.path.remove(str(TESTS))
    missing = [r for r in rows if r not in entries]
    if missing:
        raise RuntimeError(f"SDK rows without a registry entry: {missing}")
    refused = sum(entries[r].status == "refused" for r in rows)
    lines = [
        f"tinker {tinker.__version__}: {len(rows)} rows (methods, options, option values and request-type "
        f"fields), {len(rows) - refused} answered with Tinker's semantics, {refused} refused as documented.",
    ]
    for section, in_section in groupby(rows, key=_section):
        lines += ["", f"### {section}", "", "| Call, option or field | Engine | Shown by |", "|---|---|---|"]
        lines += _table_rows(list(in_section), entries)
    return "\n".join(lines)


def _section(row: str) -> str:
    client = row.split(".", 1)[0].split("(", 1)[0]
    return client if client.endswith("Client") else "Request types"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if PLACEHOLDER in markdown:
        markdown = markdown.replace(PLACEHOLDER, coverage_markdown())
    return markdown
