"""A real engine process on 127.0.0.1 per test module, driven through the real tinker SDK."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker
from engine_proc import start_engine
from tinker.lib.base_url import resolve_base_url
from tinker.lib.internal_client_holder import InternalClientHolder

from tinkerrpc_server.local.stack import LocalEngine


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LocalEngine]:
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    work = tmp_path_factory.mktemp("engine")
    running = start_engine(work / "data", model_dir, work / "engine.log")
    yield running
    assert running.stop() == 0, running.log()[-3000:]
    assert not loops_outliving(running.base_url), "a client of this module's engine was left open"


def loops_outliving(base_url: str, wait: float = 5.0) -> list[str]:
    """The SDK clients in this process still heartbeating a session to `base_url`, or refreshing a JWT
    from it, `wait` seconds after their engine stopped (closing one stops its loops on the SDK's event
    loop, a moment later). A client left open warns every 10 s (the heartbeat) or at its next refresh
    for the rest of the test run."""
    deadline, url = time.monotonic() + wait, resolve_base_url(base_url)
    while True:
        live = [
            f"{name} of {holder.get_session_id() if name == 'heartbeat' else 'a REST client'}"
            for holder in gc.get_objects()
            if isinstance(holder, InternalClientHolder) and holder._base_url == url
            for name, task in (
                ("heartbeat", holder._session_heartbeat_task),
                ("JWT refresh", getattr(getattr(holder, "_default_auth", None), "_refresh_task", None)),
            )
            if task is not None and not task.done()
        ]
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(0.2)


@pytest.fixture(scope="module")
def service(engine: LocalEngine) -> Iterator[tinker.ServiceClient]:
    # Closed while its engine still runs: an open session keeps heartbeating (and warning) until exit.
    with engine.service_client() as client:
        yield client
