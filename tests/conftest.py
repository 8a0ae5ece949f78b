"""Settings every test process shares, and the test tiers.

Every test carries exactly one tier, set once per module (`pytestmark = pytest.mark.unit`):

- `unit`: in this process only (no subprocess, no network install, no pretrained model), each module a
  few seconds at most: `pytest -m unit` is the developer loop.
- `process`: real processes on loopback (`tinkerrpc serve`, the engine, the sidecar, children, CLIs), or
  in-process work too slow for the developer loop (the pretrained SmolLM2's conversion and parity).
- `ecosystem`: other projects' code driving ours: ART, tinker-cookbook's loops, verifiers, litellm,
  langchain, the Agents SDK, Node, Chromium, the benchmark harness.

A test with no tier or with two fails the collection of its module, whatever `-m` selects: a test
without one would otherwise silently leave every tiered run.
"""

import os
from collections.abc import Iterator

import pytest

# Tests run torch in-process beside server and engine processes on few cores: spinning OpenMP
# workers would make every step many times slower (see tinkerrpc_server.settings; the tests keep the
# workers from spinning at all, the safest on a busy CI machine). Set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TINKER_TELEMETRY", "0")

TIERS = {
    "unit": "in-process only, fast: the developer loop (`pytest -m unit`)",
    "process": "real processes on loopback (serve, engine, sidecar, CLIs) or slow in-process work",
    "ecosystem": "other projects driving ours: ART, cookbook loops, verifiers, agent libraries, Node, Chromium",
}


def pytest_configure(config: pytest.Config) -> None:
    for tier, meaning in TIERS.items():
        config.addinivalue_line("markers", f"{tier}: {meaning}")


@pytest.hookimpl(wrapper=True)
def pytest_pycollect_makeitem(
    collector: pytest.Module | pytest.Class, name: str, obj: object
) -> Iterator[object]:
    """A test with no tier or two is an error collecting its module: the run stops whatever `-m`
    selects, with or without xdist, and names the test."""
    made = yield
    for item in made if isinstance(made, list) else [made]:
        if isinstance(item, pytest.Item):
            tiers = sorted({mark.name for mark in item.iter_markers() if mark.name in TIERS})
            if len(tiers) != 1:
                raise collector.CollectError(
                    f"{item.nodeid} carries {' and '.join(tiers) or 'no tier'}: every test carries exactly "
                    "one, set at module level (`pytestmark = pytest.mark.unit`, `process` or `ecosystem`)"
                )
    return made
