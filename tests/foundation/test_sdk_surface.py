"""The installed tinker SDK's whole public surface has a test against a real engine (issue 41).

tests/sdk_surface.py enumerates the surface by introspection: the public methods of ServiceClient,
TrainingClient, SamplingClient, RestClient and AdminClient (an `_async` variant is its sync twin's row),
their options and Literal values, and the fields of the request types they take. tests/sdk_registry.py
maps each row to the tests that exercise it. A new SDK release's new method, option, loss or field fails
`test_every_row_of_the_sdk_has_an_entry` until a test exercises it and the registry names that test.
"""

from __future__ import annotations

import inspect
import re
from functools import cache
from typing import Literal

import pytest
from sdk_registry import PROBE_TEST, cited_calls, registry
from sdk_surface import REPO, missing_tests, required_parameters, surface, sync_async_mismatches

from bench import sdk_probe  # noqa: F401 - registers the calls
from bench.sdk_probe_core import CALLS

pytestmark = pytest.mark.unit

ROWS = surface()
REGISTRY = registry()
REQUIRED = required_parameters()


def test_every_row_of_the_sdk_has_an_entry() -> None:
    missing = [row for row in ROWS if row not in REGISTRY]
    assert not missing, (
        f"{len(missing)} rows of the installed tinker SDK have no test against a real engine; write one "
        "and name it in tests/sdk_surface_rows.py or sdk_surface_types.py:\n" + "\n".join(missing)
    )


def test_no_entry_names_a_row_the_sdk_lacks() -> None:
    assert sorted(set(REGISTRY) - set(ROWS)) == []


def test_every_named_test_exists() -> None:
    named = {test for entry in REGISTRY.values() for test in entry.tests}
    assert missing_tests({test.split("[")[0] for test in named}) == []
    assert sorted(set(cited_calls()) - {c.slug for c in CALLS}) == []


def test_every_refusal_says_why_and_every_entry_names_a_test() -> None:
    assert [row for row, e in REGISTRY.items() if not e.tests] == []
    assert [row for row, e in REGISTRY.items() if e.status == "refused" and not e.note] == []


def test_sync_and_async_variants_take_the_same_options() -> None:
    assert sync_async_mismatches() == []


def _named(row: str) -> str:
    """What a test exercising the row must mention: its value, option, field, method or type."""
    if "=" in row:
        return row.rsplit("=", 1)[1].rstrip(")").strip("'")
    if row.endswith(")"):
        return row.rsplit("(", 1)[1].rstrip(")")
    return row.rsplit(".", 1)[-1]


@cache
def _evidence(test: str) -> str:
    """The source a test runs: its module's, or for a probe call its name and function's."""
    if test.startswith(f"{PROBE_TEST}["):
        slug = test.removeprefix(f"{PROBE_TEST}[").removesuffix("]")
        one = next(c for c in CALLS if c.slug == slug)
        return one.name + "\n" + inspect.getsource(one.run)
    return (REPO / test.split("::")[0]).read_text()


def test_each_entry_s_tests_mention_what_they_exercise() -> None:
    """A cheap guard against a row credited to a test that never touches it: every test an entry names
    mentions the row's method, option, value, type or field. A required parameter is exempt: every call
    of its method passes it, often positionally."""
    unmentioned = [
        f"{row}: {test}"
        for row, entry in REGISTRY.items()
        if row not in REQUIRED
        for test in entry.tests
        if not re.search(rf"\b{re.escape(_named(row))}\b", _evidence(test))
    ]
    assert unmentioned == []


def test_a_method_the_sdk_adds_is_rows_without_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the next release's additions look like to the tests above: a new method is a row with a row
    per option and per Literal value, none with an entry; an async twin taking other options is named."""
    import tinker

    def distill(self: object, teacher: str, mode: Literal["topk", "full"] = "topk") -> None: ...

    def distill_async(self: object, teacher: str) -> None: ...

    monkeypatch.setattr(tinker.TrainingClient, "distill", distill, raising=False)
    monkeypatch.setattr(tinker.TrainingClient, "distill_async", distill_async, raising=False)
    added = set(surface()) - set(ROWS)
    assert added == {
        "TrainingClient.distill",
        "TrainingClient.distill(teacher)",
        "TrainingClient.distill(mode)",
        "TrainingClient.distill(mode='topk')",
        "TrainingClient.distill(mode='full')",
    }
    assert not added & set(REGISTRY)
    assert sync_async_mismatches() == ["TrainingClient.distill"]
