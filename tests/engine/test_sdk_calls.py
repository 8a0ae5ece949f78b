"""The SDK probe's calls that the SDK-surface registry (tests/sdk_registry.py) cites as evidence, each a
test: made with the unmodified tinker SDK against a real engine, as a user makes it, and checked against
Tinker's semantics (bench/sdk_probe_core.py). A call the registry records as refused must be refused as
documented; every other one must work. So must the calls that await each `_async` variant."""

from __future__ import annotations

import pytest
import tinker
from sdk_registry import cited_calls

from bench import sdk_probe  # noqa: F401 - registers the calls
from bench.sdk_probe_core import CALLS, Probe, run_call
from tinkerrpc_server.local.stack import LocalEngine

pytestmark = pytest.mark.process

BY_SLUG = {c.slug: c for c in CALLS}
# The cited calls, and the calls that await every `_async` variant (a variant is its sync twin's row).
EXPECTED = cited_calls() | {c.slug: "works" for c in CALLS if c.slug.endswith("_async")}


@pytest.fixture(scope="module")
def probe(engine: LocalEngine, service: tinker.ServiceClient) -> Probe:
    return Probe(engine, service)


@pytest.mark.parametrize("slug", sorted(EXPECTED))
def test_sdk_call(probe: Probe, slug: str) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        verdict, detail = run_call(BY_SLUG[slug], probe)
    assert verdict == EXPECTED[slug], f"{BY_SLUG[slug].name}: {detail}"
